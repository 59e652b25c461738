"""Argument building and policy checks of the sandbox: no bubblewrap needed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from provider_agent.sandbox import SandboxPolicy, SandboxPolicyError, gpu_device_args
from provider_agent.sandbox.bwrap import BwrapFds, build_command
from provider_agent.sandbox.cgroups import CgroupLayout

FDS = BwrapFds(seccomp=10, passwd=11, group=12)


@pytest.fixture
def fake_dev(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (dev / name).touch()
    return dev


def _pairs(args: list[str], flag: str) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == flag]


def test_gpu_args_bind_only_assigned_gpus_and_shared_nodes(fake_dev):
    args = gpu_device_args([1], dev_root=fake_dev)
    binds = _pairs(args, "--dev-bind")
    assert (str(fake_dev / "nvidia1"), "/dev/nvidia1") in binds
    assert not any(dst in ("/dev/nvidia0", "/dev/nvidia2") for _, dst in binds)
    # nvidia-uvm-tools is absent from the fake /dev, so it is skipped
    assert [dst for _, dst in binds] == ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                         "/dev/nvidia-modeset"]


def test_gpu_args_several_gpus_and_none(fake_dev):
    dsts = [d for _, d in _pairs(gpu_device_args([2, 0], dev_root=fake_dev), "--dev-bind")]
    assert dsts[:2] == ["/dev/nvidia0", "/dev/nvidia2"]
    assert gpu_device_args([], dev_root=fake_dev) == []


def test_gpu_args_missing_node_says_what_to_check(fake_dev):
    with pytest.raises(SandboxPolicyError, match=r"GPU 7 .*nvidia-smi"):
        gpu_device_args([7], dev_root=fake_dev)


def test_no_sys_and_no_gpu_nodes_without_gpus(tmp_path):
    policy = SandboxPolicy(python_prefixes=[tmp_path], ro_paths=[])
    cmd = build_command(policy, ["python"], FDS)
    assert "/sys" not in cmd
    assert not any("nvidia" in a for a in cmd)


def test_command_has_isolation_flags_and_ends_with_argv(tmp_path):
    policy = SandboxPolicy(python_prefixes=[tmp_path], ro_paths=[], env={"A": "1"})
    cmd = build_command(policy, ["python", "-c", "pass"], FDS, as_root=True)
    for flag in ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                 "--die-with-parent", "--new-session", "--clearenv"):
        assert flag in cmd
    assert cmd[cmd.index("--cap-drop") + 1] == "ALL"
    assert cmd[cmd.index("--seccomp") + 1] == "10"
    assert cmd[-4:] == ["--", "python", "-c", "pass"]
    assert ("A", "1") in _pairs(cmd, "--setenv")
    # writable places are size-capped tmpfs
    i = cmd.index("/scratch")
    assert cmd[i - 1] == "--tmpfs" and cmd[i - 5:i - 3] == ["--size", str(1024 << 20)]


def test_hidden_path_inside_a_bound_tree_is_covered(tmp_path):
    project = tmp_path / "proj"
    config = project / "config"
    config.mkdir(parents=True)
    key = project / "identity.key"
    key.write_text("secret")
    policy = SandboxPolicy(python_prefixes=[], ro_paths=[project], hide_paths=[config, key])
    cmd = build_command(policy, ["x"], FDS)
    i_bind = cmd.index(str(project))
    assert cmd[cmd.index(str(config)) - 1] == "--tmpfs" and cmd.index(str(config)) > i_bind
    assert (("/dev/null", str(key))) in _pairs(cmd, "--ro-bind")


def test_bind_inside_hidden_home_stays_visible(tmp_path):
    home = tmp_path / "home"
    venv = home / ".venv"
    venv.mkdir(parents=True)
    policy = SandboxPolicy(python_prefixes=[venv], ro_paths=[], hide_paths=[home])
    cmd = build_command(policy, ["x"], FDS)
    assert (str(venv), str(venv)) in _pairs(cmd, "--ro-bind")
    assert str(home) not in cmd  # home is never bound, so nothing to cover


def test_policy_rejects_contradictions_and_bad_values(tmp_path):
    with pytest.raises(SandboxPolicyError, match="both bound"):
        build_command(SandboxPolicy([], [tmp_path], hide_paths=[tmp_path]), ["x"], FDS)
    with pytest.raises(SandboxPolicyError, match="does not exist"):
        build_command(SandboxPolicy([], [tmp_path / "nope"]), ["x"], FDS)
    with pytest.raises(SandboxPolicyError, match="pids_limit"):
        SandboxPolicy([], [], pids_limit=0)
    with pytest.raises(SandboxPolicyError, match="absolute"):
        SandboxPolicy([Path("rel")], [])


def test_cgroup_layout_reads_v1_and_v2(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    root = tmp_path / "cg"
    (root / "unified" / "user.slice").mkdir(parents=True)
    (root / "unified" / "user.slice" / "cgroup.controllers").write_text("cpu memory pids\n")
    (proc / "mountinfo").write_text(
        f"35 31 0:32 / {root}/memory rw - cgroup cgroup rw,memory\n"
        f"39 31 0:36 / {root}/pids rw - cgroup cgroup rw,pids\n"
        f"41 31 0:38 / {root}/unified rw - cgroup2 cgroup2 rw\n")
    (proc / "cgroup").write_text("8:pids:/a\n4:memory:/b/c\n0::/user.slice\n")
    layout = CgroupLayout.detect(proc)
    assert layout.v1_dirs == {"memory": root / "memory/b/c", "pids": root / "pids/a"}
    assert layout.v2_dir == root / "unified/user.slice"


# ---- what a plugin may see of the kernel -------------------------------------------------

def test_kernel_settings_are_read_only_and_runtime_masked_entries_empty(tmp_path):
    from provider_agent.sandbox.bwrap import MASKED_PATHS, READONLY_PATHS

    cmd = build_command(SandboxPolicy(python_prefixes=[tmp_path], ro_paths=[]), ["x"], FDS)
    after_proc = cmd[cmd.index("--proc"):cmd.index("--dev")]
    binds = _pairs(after_proc, "--ro-bind")
    assert ("/proc/sys", "/proc/sys") in binds  # the one a plugin wrote core_pattern through
    for path in READONLY_PATHS:
        assert ((path, path) in binds) == os.path.lexists(path), path
    for path in (p for p in MASKED_PATHS if p.startswith("/proc/") and os.path.lexists(p)):
        if os.path.isdir(path):
            assert any(after_proc[i:i + 4] == ["--tmpfs", path, "--remount-ro", path]
                       for i in range(len(after_proc))), path
        else:
            assert ("/dev/null", path) in binds, path
    assert not any(p.startswith("/sys/") for p in after_proc)  # /sys is bound for GPUs only


# ---- the host user of a root agent -------------------------------------------------------

def test_the_sandbox_user_is_never_root_and_resolves_from_names_and_numbers():
    from provider_agent.sandbox import SandboxUser

    default = SandboxUser.resolve("")
    assert default.uid != 0 and default.gid != 0 and 0 not in default.groups
    numeric = SandboxUser.resolve("4242:4343")
    assert (numeric.uid, numeric.gid) == (4242, 4343)
    with pytest.raises(SandboxPolicyError, match="must not be root"):
        SandboxUser.resolve("0")
    with pytest.raises(SandboxPolicyError, match="must not be root"):
        SandboxUser.resolve("4242:0")
    with pytest.raises(SandboxPolicyError, match="not a user on this machine.*useradd"):
        SandboxUser.resolve("no-such-sparecycles-user")


@pytest.fixture
def tree():
    """A folder tree anyone may enter (pytest's own tmp dir is 0700 for its user), removed
    after the test."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="sc-stage-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    for folder, dirs, _ in os.walk(base):
        for d in dirs:
            (Path(folder) / d).chmod(0o755)
    shutil.rmtree(base)


def test_staging_makes_exactly_the_bound_paths_reachable_to_the_sandbox_user(tree):
    from provider_agent.sandbox import SandboxUser
    from provider_agent.sandbox.hostuser import StageOp, staging_plan

    stranger = SandboxUser(4242, 4242, (4242,), "stranger")  # owns nothing here
    (tree / "open" / "lib").mkdir(parents=True)
    (tree / "open" / "private" / "weights").mkdir(parents=True)
    (tree / "locked" / "venv").mkdir(parents=True)
    (tree / "locked" / "other").mkdir()
    (tree / "locked" / "plugin.py").write_text("")
    (tree / "locked").chmod(0o700)                 # like /root
    (tree / "open" / "private").chmod(0o700)       # a 0700 folder inside a bound one
    sources = [str(tree / "open"), str(tree / "open" / "lib"),
               str(tree / "open" / "private" / "weights"), str(tree / "locked" / "venv"),
               str(tree / "locked" / "plugin.py")]
    plan = staging_plan(sources, stranger)
    assert plan == [StageOp("cover", str(tree / "locked")),
                    StageOp("expose", str(tree / "locked" / "plugin.py")),
                    StageOp("expose", str(tree / "locked" / "venv")),
                    StageOp("cover", str(tree / "open" / "private")),
                    StageOp("expose", str(tree / "open" / "private" / "weights"))]
    # locked/other is not exposed: covered, it is out of the user's (and the sandbox's) reach
    assert staging_plan([str(tree / "open" / "lib")], stranger) == []


def test_a_bound_path_the_sandbox_user_cannot_read_is_refused_saying_what_to_do(tree):
    from provider_agent.sandbox import SandboxUser
    from provider_agent.sandbox.bwrap import dropping_command

    stranger = SandboxUser(4242, 4242, (4242,), "stranger")
    weights = tree / "weights"
    weights.mkdir()
    weights.chmod(0o700)
    cmd = ["bwrap", "--ro-bind", str(weights), str(weights), "--", "python"]
    with pytest.raises(SandboxPolicyError, match=r"stranger \(4242:4242\), which could not use "
                                                 r".*weights \(0700.*chmod -R o\+rX"):
        dropping_command(cmd, stranger)
    weights.chmod(0o755)
    model = weights / "unet" / "model.safetensors"   # safetensors writes 0600
    model.parent.mkdir()
    model.write_text("")
    model.chmod(0o600)
    with pytest.raises(SandboxPolicyError, match=r"unet/model.safetensors \(0600"):
        dropping_command(cmd, stranger, deep=[str(weights)])
    dropping_command(cmd, stranger, deep=[str(weights)], hidden=[str(model.parent)])
    model.chmod(0o644)
    wrapped = dropping_command(cmd, stranger, deep=[str(weights)])
    assert wrapped[1:3] == ["-I", "-S"] and wrapped[3].endswith("drop_to_user.py")
    import json
    spec = json.loads(wrapped[4])
    assert (spec["uid"], spec["gid"], spec["argv"]) == (4242, 4242, cmd)


def test_gpu_nodes_must_be_read_write_for_the_sandbox_user(fake_dev):
    """NVIDIA's nodes are 0666 by default; a 0660 node works only for a user in its
    group (the sandbox user's supplementary groups go with it)."""
    from provider_agent.sandbox import SandboxUser
    from provider_agent.sandbox.bwrap import dropping_command

    node = fake_dev / "nvidia0"
    cmd = ["bwrap", *gpu_device_args([0], dev_root=fake_dev), "--", "python"]
    stranger = SandboxUser(4242, 4242, (4242,), "stranger")
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (fake_dev / name).chmod(0o666)
    node.chmod(0o660)
    if node.stat().st_gid == 0:   # made by root: give it a group the user may join
        os.chown(node, -1, 4343)
    with pytest.raises(SandboxPolicyError, match=r"nvidia0 \(0660.*GPU nodes rw"):
        dropping_command(cmd, stranger)
    in_group = SandboxUser(4242, 4242, (4242, node.stat().st_gid), "in-group")
    dropping_command(cmd, in_group)
    node.chmod(0o666)
    dropping_command(cmd, stranger)


# ---- limits of the agent as a whole (fake cgroup trees: no root needed) --------------------

def _fake_v2(root: Path) -> Path:
    base = root / "user.slice"
    base.mkdir(parents=True)
    (base / "cgroup.controllers").write_text("cpu memory pids\n")
    (base / "cgroup.subtree_control").write_text("")
    (base / "cgroup.procs").write_text("")
    return base


def test_cgroup_v2_agent_group_holds_the_budget_and_the_cpu_and_hosts_are_its_children(
        tmp_path):
    from provider_agent.sandbox.cgroups import AgentCgroupV2, make_agent_limits

    proc = tmp_path / "proc"
    proc.mkdir()
    base = _fake_v2(tmp_path / "unified")
    (proc / "mountinfo").write_text(f"41 31 0:38 / {tmp_path / 'unified'} rw - cgroup2 "
                                    "cgroup2 rw\n")
    (proc / "cgroup").write_text("0::/user.slice\n")
    layout = CgroupLayout.detect(proc)
    assert layout.v2_controllers == {"cpu", "memory", "pids"}
    agent = make_agent_limits("4242-0", 2048, 1.5, layout=layout)
    assert isinstance(agent, AgentCgroupV2)
    group = base / "sparecycles-4242-0"
    assert agent.dirs == {"memory": group, "pids": group, "cpu": group}
    assert {"+memory", "+pids", "+cpu"} <= set((base / "cgroup.subtree_control")
                                               .read_text().split())
    assert (group / "memory.max").read_text() == str(2048 << 20)
    assert (group / "cpu.max").read_text() == "150000 100000"
    assert set((group / "cgroup.subtree_control").read_text().split()) == \
        {"+memory", "+pids", "+cpu"}
    assert agent.enforcement == {"memory": "cgroup v2: 2048 MiB for all hosts",
                                 "cpu": "cgroup v2: 1.5 cores"}
    host = agent.sandbox("host-1", 2048, 64)
    assert host.path == group / "sandbox-host-1"
    assert (host.path / "memory.max").read_text() == str(2048 << 20)
    assert (host.path / "pids.max").read_text() == "64"
    host.attach(4321)
    assert (host.path / "cgroup.procs").read_text() == "4321"
    # A tree that does not delegate the cpu controller: memory still, CPU said to be none.
    base2 = _fake_v2(tmp_path / "other")
    (base2 / "cgroup.controllers").write_text("memory pids\n")
    no_cpu = AgentCgroupV2(base2, "4242-1", 512, 1.0, {"memory", "pids"})
    assert no_cpu.enforcement["cpu"].startswith("none: the cpu controller is not delegated")
    assert not (base2 / "sparecycles-4242-1" / "cpu.max").exists()


def test_cgroup_v1_agent_group_holds_the_budget_and_the_cpu_quota(tmp_path):
    from provider_agent.sandbox.cgroups import AgentCgroupV1

    own = {ctl: tmp_path / ctl / "a" for ctl in ("memory", "pids", "cpu")}
    for d in own.values():
        d.mkdir(parents=True)
    agent = AgentCgroupV1(own, "4242-0", 512, 0.5)
    mem = own["memory"] / "sparecycles" / "agent-4242-0"
    cpu = own["cpu"] / "sparecycles" / "agent-4242-0"
    assert agent.dirs == {"memory": mem, "pids": own["pids"] / "sparecycles" / "agent-4242-0",
                          "cpu": cpu}
    assert (mem / "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "50000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert agent.enforcement == {"memory": "cgroup v1: 512 MiB for all hosts",
                                 "cpu": "cgroup v1: 0.5 cores"}
    host = agent.sandbox("host-1", 512, 64)
    assert host.dirs == {"memory": mem / "host-1", "pids": agent.dirs["pids"] / "host-1",
                         "cpu": cpu / "host-1"}
    host.attach(4321)
    assert all((d / "cgroup.procs").read_text() == "4321" for d in host.dirs.values())


def test_without_cgroups_the_agents_budget_is_held_by_one_watchdog_for_all_hosts():
    """The fallback: each of two hosts stays under its own limit; together they go over
    the budget, and the larger is killed and reported as a memory breach."""
    import subprocess
    import sys
    import time

    from provider_agent.sandbox.cgroups import AgentWatchdog

    agent = AgentWatchdog(96, 1.0)
    assert agent.enforcement == {
        "memory": "watchdog: 96 MiB for all hosts",
        "cpu": "none: no writable cpu cgroup (run the agent as root or in a delegated cgroup)"}
    agent.budget_watchdog.interval_s = 0.02
    hold = "import sys\nx = b'x' * ({} << 20)\nprint('held', flush=True)\nsys.stdin.read()"
    procs, hosts = [], []
    try:
        for mb in (40, 60):
            proc = subprocess.Popen([sys.executable, "-c", hold.format(mb)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline() == "held\n"
            host = agent.sandbox(f"h{mb}", 90, 64)  # each alone is within its own limit
            host.start(proc.pid)
            procs.append(proc)
            hosts.append(host)
        deadline = time.monotonic() + 20
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert procs[1].returncode == -9 and procs[0].poll() is None
        assert [h.breached() for h in hosts] == [None, "memory"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for host in hosts:
            host.remove()
        agent.remove()


# ---- a fresh scratch for every job ---------------------------------------------------------

def test_after_a_job_the_writable_places_are_as_setup_left_them(tmp_path):
    from provider_agent.host.main import ScratchCleaner

    scratch, tmp = tmp_path / "scratch", tmp_path / "tmp"
    (scratch / "cache").mkdir(parents=True)
    tmp.mkdir()
    (scratch / "cache" / "model.bin").write_text("from setup")      # setup() leaves these
    (tmp / "setup.txt").write_text("from setup")
    cleaner = ScratchCleaner([str(scratch), str(tmp)])
    # A job: new files and folders (one it made unreadable), a file added to setup's
    # folder, a setup file changed, a file kept open after its name is gone.
    (scratch / "out.png").write_text("client A")
    (tmp / "d" / "e").mkdir(parents=True)
    (tmp / "d" / "e" / "f.txt").write_text("client A")
    (tmp / "d").chmod(0)
    (scratch / "cache" / "new.bin").write_text("client A")
    with open(tmp / "setup.txt", "a") as f:
        f.write("client A")
    held = open(tmp / "held.txt", "w+")
    held.write("client A")
    held.flush()
    os.unlink(held.name)
    try:
        assert cleaner.clean() >= 6
        assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
            "scratch", "scratch/cache", "scratch/cache/model.bin", "tmp"]
        assert (scratch / "cache" / "model.bin").read_text() == "from setup"
        held.seek(0)
        assert held.read() == ""  # what the job wrote is gone, even through its descriptor
        assert cleaner.clean() == 0  # nothing more to do
    finally:
        held.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_the_cleaner_leaves_a_bind_below_a_writable_place_alone(tmp_path):
    """A checkout (and its venv) below /tmp is bound into the sandbox's own /tmp: the
    cleaner walks only the tmpfs itself, never the tens of thousands of files of a bind
    (that walk took seconds after every job, past the next job's wall clock)."""
    import subprocess

    from provider_agent.host.main import ScratchCleaner

    tmp = tmp_path / "tmp"
    bound = tmp / "checkout"
    bound.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(bound)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (bound / "module.py").write_text("bound")
        cleaner = ScratchCleaner([str(tmp)])
        assert not any(p.startswith(str(bound) + "/") for p in cleaner.keep)
        (bound / "changed-outside.py").write_text("the host's, not a job's")
        (tmp / "job.txt").write_text("client A")
        assert cleaner.clean() == 1
        assert sorted(p.name for p in bound.iterdir()) == ["changed-outside.py", "module.py"]
    finally:
        subprocess.run(["umount", str(bound)], check=True)
