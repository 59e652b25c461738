"""Argument building and policy checks of the sandbox: no bubblewrap needed."""
from __future__ import annotations

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
