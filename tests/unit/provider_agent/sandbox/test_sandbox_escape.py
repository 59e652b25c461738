"""Hostile snippets run through ``Sandbox.popen``: every escape attempt must fail.

Each test starts the venv's Python inside a real bubblewrap sandbox (skipped, with the
reason, where bubblewrap does not work).  Snippets print what they observed; the tests
assert on that, on exit codes and on ``limit_breached()``.
"""
from __future__ import annotations

import json
import errno
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from provider_agent.sandbox import Sandbox, SandboxPolicy, SandboxUser
from provider_agent.sandbox.cgroups import MemoryWatchdog, make_agent_limits, process_tree
from tests.sandbox_helpers import run_as_ordinary_user

_ok, _reason = Sandbox.available()
if not _ok and os.environ.get("SPARECYCLES_REQUIRE_SANDBOX") == "1":
    raise RuntimeError(f"the sandbox is required here but unavailable: {_reason}")
pytestmark = pytest.mark.skipif(not _ok, reason=f"sandbox unavailable: {_reason}")

PROJECT = Path(__file__).resolve().parents[4]


@pytest.fixture
def make_sandbox(tmp_path):
    """Build sandboxes over a fake project tree that holds a hidden agent config dir;
    everything made is cleaned up after the test."""
    project = tmp_path / "project"
    config = project / ".config" / "sparecycles"
    config.mkdir(parents=True)
    (config / "identity.key").write_text("IDENTITY-SECRET")
    (project / "plugin.py").write_text("VALUE = 42\n")
    made: list[Sandbox] = []

    def make(agent_limits=None, **kwargs) -> Sandbox:
        kwargs.setdefault("hide_paths", [config])
        kwargs.setdefault("memory_limit_mb", 512)
        kwargs.setdefault("pids_limit", 64)
        policy = SandboxPolicy.for_current_python([project], **kwargs)
        sb = Sandbox(policy, f"t-{uuid.uuid4().hex[:10]}", agent_limits=agent_limits)
        made.append(sb)
        return sb

    make.project = project
    make.config = config
    yield make
    for sb in made:
        sb.cleanup()


def run_in(sb: Sandbox, code: str, timeout_s: float = 30) -> tuple[int, dict | str, str]:
    """Run ``code`` in ``sb``; return (exit code, the JSON it printed last or raw stdout,
    stderr)."""
    proc = sb.popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout_s)
    lines = out.strip().splitlines()
    try:
        return proc.returncode, json.loads(lines[-1]), err
    except (IndexError, json.JSONDecodeError):
        return proc.returncode, out, err


ATTEMPT = """
import errno, json, os, socket, sys
def attempt(fn):
    try:
        r = fn()
        return {"ok": True, "value": repr(r)[:200]}
    except Exception as e:
        return {"ok": False, "error": type(e).__name__, "errno": getattr(e, "errno", None)}
"""


def test_benign_script_gives_same_output_inside_and_outside(make_sandbox):
    code = ("import hashlib, math; "
            "print(sum(range(10**5)), math.pi, hashlib.sha256(b'x').hexdigest())")
    outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    rc, out, _ = run_in(make_sandbox(), code)
    assert rc == 0 and out.strip() == outside.stdout.strip()


def test_rlimits_and_seccomp_are_in_force(make_sandbox):
    sb = make_sandbox(fsize_limit_mb=1, nofile_limit=100)
    rc, out, err = run_in(sb, ATTEMPT + """
import resource
status = open("/proc/self/status").read()
print(json.dumps({"nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "seccomp": status.split("Seccomp:")[1].split()[0],
                  "uid": os.getuid(),
                  "caps": status.split("CapEff:")[1].split()[0],
                  "big_file": attempt(lambda: open("/scratch/big", "wb").write(b"x" * (2 << 20))),
                  "fds": sorted(os.listdir("/proc/self/fd"))}))""")
    assert rc == 0, err
    assert out["nofile"] == [100, 100] and out["seccomp"] == "2"
    assert out["uid"] != 0 and int(out["caps"], 16) == 0
    assert out["big_file"]["errno"] == 27  # EFBIG
    assert out["fds"] == ["0", "1", "2", "3"]  # no agent descriptor leaks in (3: listdir)


def test_popen_refuses_settings_that_belong_to_the_policy(make_sandbox):
    from provider_agent.sandbox import SandboxError
    with pytest.raises(SandboxError, match="SandboxPolicy"):
        make_sandbox().popen([sys.executable, "-c", "pass"], env={"SECRET": "x"})


def test_cannot_reach_a_port_on_the_host_loopback(make_sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        rc, out, err = run_in(make_sandbox(), ATTEMPT + f"""
def go():
    s = socket.socket(); s.settimeout(2); s.connect(("127.0.0.1", {port})); return "connected"
print(json.dumps(attempt(go)))""")
        assert rc == 0, err
        assert out["ok"] is False and out["errno"] == 1  # EPERM: refused by seccomp
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever arrived
    finally:
        server.close()


def test_cannot_reach_an_outside_address_and_fails_at_once(make_sandbox):
    sb = make_sandbox()
    rc, out, err = run_in(sb, ATTEMPT + """
def go():
    s = socket.create_connection(("1.1.1.1", 443), timeout=5); return "connected"
print(json.dumps(attempt(go)))""")
    assert rc == 0, err
    assert out["ok"] is False
    # Refused by seccomp (EPERM), not a timeout: the connect never left the sandbox.
    assert (out["error"], out["errno"]) == ("PermissionError", errno.EPERM), out


def test_cannot_resolve_a_host_name(make_sandbox):
    rc, out, err = run_in(make_sandbox(), ATTEMPT + """
print(json.dumps(attempt(lambda: socket.getaddrinfo("example.com", 443))))""")
    assert rc == 0, err
    assert out["ok"] is False and out["error"] == "gaierror"


def test_socket_families_other_than_unix_are_refused_by_seccomp(make_sandbox):
    # In an empty network namespace socket(AF_INET) itself would succeed; EPERM at
    # creation shows the seccomp filter refused it, whatever the namespaces.
    rc, out, err = run_in(make_sandbox(), ATTEMPT + """
res = {name: attempt(lambda f=f, t=t: socket.socket(f, t).close())
       for name, f, t in [("inet", socket.AF_INET, socket.SOCK_STREAM),
                          ("inet6", socket.AF_INET6, socket.SOCK_DGRAM),
                          ("netlink", socket.AF_NETLINK, socket.SOCK_RAW),
                          ("packet", socket.AF_PACKET, socket.SOCK_RAW)]}
res["unix_pair"] = attempt(lambda: [s.close() for s in socket.socketpair()])
print(json.dumps(res))""")
    assert rc == 0, err
    for fam in ("inet", "inet6", "netlink", "packet"):
        assert out[fam] == {"ok": False, "error": "PermissionError", "errno": 1}, fam
    assert out["unix_pair"]["ok"] is True


def test_hidden_config_and_identity_key_are_invisible(make_sandbox):
    key = make_sandbox.config / "identity.key"
    rc, out, err = run_in(make_sandbox(), ATTEMPT + f"""
import pathlib
print(json.dumps({{
  "key": attempt(lambda: open({str(key)!r}).read()),
  "config_listing": attempt(lambda: os.listdir({str(key.parent)!r})),
  "plugin": attempt(lambda: open({str(make_sandbox.project / 'plugin.py')!r}).read()),
  "home": attempt(lambda: sorted(os.listdir({str(Path.home())!r}))),
  "environ": dict(os.environ),
}}))""")
    assert rc == 0, err
    assert out["key"]["ok"] is False
    assert out["config_listing"] == {"ok": True, "value": "[]"}
    assert out["plugin"]["ok"] is True  # the bound plugin folder itself is readable
    assert "IDENTITY-SECRET" not in json.dumps(out)
    # $HOME shows at most the directories leading to bound paths, never its own files
    visible_home = out["home"]["value"] if out["home"]["ok"] else "[]"
    for entry in os.listdir(Path.home()):
        if not any(str(p).startswith(str(Path.home() / entry))
                   for p in SandboxPolicy.current_python_prefixes() + [make_sandbox.project]):
            assert repr(entry) not in visible_home
    assert "HOME" not in out["environ"] and "PATH" not in out["environ"]


def test_writes_outside_scratch_fail(make_sandbox):
    target = make_sandbox.project / "planted.txt"
    rc, out, err = run_in(make_sandbox(), ATTEMPT + f"""
def write(p):
    return lambda: open(p, "w").write("x")
print(json.dumps({{"project": attempt(write({str(target)!r})),
                   "usr": attempt(write("/usr/planted")),
                   "root": attempt(write("/planted")),
                   "etc": attempt(write("/etc/passwd")),
                   "scratch": attempt(write("/scratch/ok")),
                   "tmp": attempt(write("/tmp/ok"))}}))""")
    assert rc == 0, err
    for place in ("project", "usr", "root", "etc"):
        assert out[place]["ok"] is False, place
    assert out["scratch"]["ok"] and out["tmp"]["ok"]
    assert not target.exists()


def test_cannot_read_another_sandboxs_scratch(make_sandbox):
    a = make_sandbox()
    pa = a.popen([sys.executable, "-c",
                  "open('/scratch/secret','w').write('A-SECRET'); print('ready', flush=True);"
                  "import sys; sys.stdin.read()"],
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert pa.stdout.readline().strip() == "ready"
    rc, out, err = run_in(make_sandbox(), ATTEMPT + """
print(json.dumps({"file": attempt(lambda: open("/scratch/secret").read()),
                  "procs": [p for p in os.listdir("/proc") if p.isdigit()]}))""")
    pa.stdin.close()
    assert rc == 0, err
    assert out["file"]["ok"] is False
    assert len(out["procs"]) <= 3  # only its own pid namespace: init + itself (+ a child)


def test_fork_bomb_hits_the_pids_limit(make_sandbox):
    sb = make_sandbox(pids_limit=24)
    rc, out, err = run_in(sb, """
import json, os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60); os._exit(0)
        n += 1
except OSError as e:
    print(json.dumps({"children": n, "errno": e.errno}))
""")
    assert rc == 0, err
    assert out["errno"] == 11 and out["children"] < 24  # EAGAIN
    sb.cleanup()  # the sleeping children die with the sandbox
    assert sb.limit_breached() == "pids"


def test_memory_past_the_budget_is_killed(make_sandbox):
    sb = make_sandbox(memory_limit_mb=64)
    rc, out, _ = run_in(sb, """
chunks = [bytearray(16 << 20) for _ in range(32)]
print("survived")""")
    assert rc != 0 and "survived" not in out
    assert sb.limit_breached() == "memory"


def test_memory_watchdog_kills_a_process_tree_above_budget():
    """The no-cgroup fallback, on a plain subprocess."""
    proc = subprocess.Popen([sys.executable, "-c",
                             "import time\nx=[]\nfor _ in range(40):\n"
                             " x.append(bytearray(8<<20)); time.sleep(0.02)\nprint('survived')"],
                            stdout=subprocess.PIPE, text=True)
    dog = MemoryWatchdog(limit_mb=48, interval_s=0.02)
    dog.start(proc.pid)
    out, _ = proc.communicate(timeout=30)
    dog.stop()
    assert proc.returncode == -9 and dog.fired and "survived" not in out


def test_cleanup_leaves_no_survivors(make_sandbox):
    marker = f"sparecycles-marker-{uuid.uuid4().hex}"
    sb = make_sandbox()
    proc = sb.popen([sys.executable, "-c", f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"],
                 start_new_session=True)
print("ready", flush=True); time.sleep(600)"""], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"

    def marked() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 10
    while not marked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(), "the detached child never started"
    sb.cleanup()
    assert marked() == [] and proc.poll() is not None


def test_ptrace_mount_and_kernel_interfaces_are_refused(make_sandbox):
    import pyseccomp
    names = ["ptrace", "mount", "umount2", "bpf", "perf_event_open", "userfaultfd", "keyctl",
             "add_key", "request_key", "kexec_load", "init_module", "finit_module",
             "delete_module", "unshare"]
    numbers = {n: pyseccomp.resolve_syscall(pyseccomp.system_arch(), n) for n in names}
    rc, out, err = run_in(make_sandbox(), f"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
res = {{}}
for name, nr in {numbers!r}.items():
    args = [ctypes.c_long(0)] * 5
    if name == "mount":
        args = [ctypes.c_char_p(b"none"), ctypes.c_char_p(b"/scratch"),
                ctypes.c_char_p(b"tmpfs"), ctypes.c_long(0), ctypes.c_long(0)]
    if name == "unshare":
        args = [ctypes.c_long(0x10000000)] + args[1:]  # CLONE_NEWUSER
    r = libc.syscall(ctypes.c_long(nr), *args)
    res[name] = [r, ctypes.get_errno()]
print(json.dumps(res))""")
    assert rc == 0, err
    for name in names:
        assert out[name] == [-1, 1], f"{name} was not refused with EPERM: {out[name]}"


def test_torch_imports_inside(make_sandbox):
    pytest.importorskip("torch")
    rc, out, err = run_in(make_sandbox(memory_limit_mb=2048), """
import json, torch
x = torch.arange(6.0).reshape(2, 3)
print(json.dumps({"sum": float((x @ x.T).sum()), "threads": torch.get_num_threads()}))
""", timeout_s=120)
    assert rc == 0, err[-2000:]
    assert out["sum"] == 83.0


# ---- the host's kernel and the host uid ------------------------------------------------

CORE_PATTERN = "/proc/sys/kernel/core_pattern"
ASLR = "/proc/sys/kernel/randomize_va_space"
MASKED = ["/proc/keys", "/proc/timer_list", "/proc/kcore", "/proc/sched_debug",
          "/proc/interrupts", "/proc/sysrq-trigger"]


@pytest.fixture
def host_kernel():
    """The host's values of what the attack writes; put back after the test if it ever
    changed them (the test then fails)."""
    before = {p: Path(p).read_text() for p in (CORE_PATTERN, ASLR)}
    yield before
    for path, value in before.items():
        if Path(path).read_text() != value:
            Path(path).write_text(value)


def kernel_attack(host_kernel) -> str:
    """Python that tries to change the host's kernel and read what runtimes mask, prints
    what it hit as JSON, then waits for its stdin to close (so the test can look at it
    from outside while it runs)."""
    writes = [[CORE_PATTERN, "core.sparecycles-sandbox-test\n"],
              [ASLR, host_kernel[ASLR]],           # the same value: any write is a hole
              ["/proc/sys/vm/drop_caches", "1"],
              ["/proc/sys/kernel/hostname", "pwned"],
              ["/proc/sysrq-trigger", ""]]           # opened for writing, nothing written
    return ATTEMPT + f"""
def write(path, value):
    def go():
        with open(path, "w") as f:
            f.write(value)
    return go
res = {{path: attempt(write(path, value)) for path, value in {writes!r}}}
for path in {MASKED!r}:
    res["read " + path] = attempt(lambda path=path: open(path, "rb").read(64))
res["uid_map"] = open("/proc/self/uid_map").read().split()
print(json.dumps(res), flush=True)
import sys
sys.stdin.read()
"""


def host_uids(root_pid: int) -> dict[int, list[int]]:
    """Real, effective, saved and filesystem uid of every process of a sandbox, as the
    host sees them (/proc/<pid>/status, read from outside)."""
    out = {}
    for pid in process_tree(root_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        out[pid] = [int(v) for v in status.split("Uid:")[1].split("\n")[0].split()]
    return out


def assert_kernel_untouched(out: dict, host_kernel: dict) -> None:
    for path in (CORE_PATTERN, ASLR, "/proc/sys/vm/drop_caches", "/proc/sys/kernel/hostname",
                 "/proc/sysrq-trigger"):
        assert out[path]["ok"] is False, f"{path} was writable from inside: {out[path]}"
    for path in MASKED:
        got = out["read " + path]
        assert got["ok"] is False or got["value"] == "b''", f"{path} is readable: {got}"
    assert {p: Path(p).read_text() for p in host_kernel} == host_kernel


def test_the_host_kernel_cannot_be_changed_and_no_sandbox_process_is_host_root(
        make_sandbox, host_kernel):
    sb = make_sandbox()
    proc = sb.popen([sys.executable, "-c", kernel_attack(host_kernel)], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        uids = host_uids(proc.pid)  # while it runs: bwrap, its init and the attacker
    finally:
        proc.stdin.close()
        proc.wait(30)
    out = json.loads(line)
    assert_kernel_untouched(out, host_kernel)
    assert len(uids) >= 3, uids
    for pid, ids in uids.items():
        assert 0 not in ids, f"sandbox process {pid} runs as host uid {ids}"
    if os.geteuid() == 0:  # as root: the sandbox user, never root
        assert {ids[0] for ids in uids.values()} == {SandboxUser.resolve().uid}


def test_as_an_ordinary_user_too_the_host_kernel_cannot_be_changed(host_kernel):
    code = f"""
import json, os, subprocess, sys
from provider_agent.sandbox import Sandbox, SandboxPolicy
from provider_agent.sandbox.cgroups import process_tree
ok, why = Sandbox.available()
if not ok:
    print(json.dumps({{"unavailable": why}})); sys.exit(0)
sb = Sandbox(SandboxPolicy.for_current_python([], memory_limit_mb=256), "ordinary-{uuid.uuid4().hex[:8]}")
proc = sb.popen([sys.executable, "-c", {kernel_attack(host_kernel)!r}], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True)
out = json.loads(proc.stdout.readline())
out["uids"] = {{pid: open(f"/proc/{{pid}}/status").read().split("Uid:")[1].split()[:4]
               for pid in process_tree(proc.pid)}}
out["agent_uid"] = os.getuid()
proc.stdin.close(); proc.wait(30); sb.cleanup()
print(json.dumps(out))
"""
    res = run_as_ordinary_user(code)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "unavailable" in out:
        pytest.skip(f"an unprivileged user cannot run bubblewrap here: {out['unavailable']}")
    assert out["agent_uid"] != 0
    assert_kernel_untouched(out, host_kernel)
    assert out["uids"] and all(int(u) == out["agent_uid"] for ids in out["uids"].values()
                                for u in ids), out["uids"]


# ---- limits of the agent as a whole ----------------------------------------------------

HOLD = """
import sys
held = b"x" * (120 << 20)   # every page touched
print("holding", flush=True)
sys.stdin.read()
"""


def _peak_bytes(agent) -> int | None:
    if "memory" not in agent.dirs:
        return None
    d = agent.dirs["memory"]
    for name in ("memory.max_usage_in_bytes", "memory.peak"):  # v1, v2
        if (d / name).exists():
            return int((d / name).read_text().split()[0])
    return None


def test_two_sandboxes_together_cannot_take_more_than_the_agents_memory_budget(make_sandbox):
    budget_mb = 200
    agent = make_agent_limits(f"t-{uuid.uuid4().hex[:10]}", budget_mb, None)
    boxes, procs = [], []
    try:
        for _ in range(2):  # each alone may take the whole budget; 2 x 120 MiB do not fit
            sb = make_sandbox(memory_limit_mb=budget_mb, agent_limits=agent)
            proc = sb.popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
            boxes.append(sb)
            procs.append(proc)
            proc.stdout.readline()  # "holding", or "" when it was the one killed
        for proc in procs:
            if proc.poll() is None:
                proc.stdin.close()
            proc.wait(30)
        codes = [p.returncode for p in procs]
        breaches = [sb.limit_breached() for sb in boxes]
        assert sorted(c == 0 for c in codes) == [False, True], (codes, breaches)
        assert breaches[codes.index(next(c for c in codes if c != 0))] == "memory"
        peak = _peak_bytes(agent)
        if peak is not None:  # a cgroup: the kernel never let the two exceed it together
            assert peak <= budget_mb << 20
    finally:
        for sb in boxes:
            sb.cleanup()
        agent.remove()


SPIN = """
import json, os, time
def spin(until):
    while time.monotonic() < until:
        pass
start = time.monotonic()
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        spin(start + 1.5)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
t = os.times()
print(json.dumps({"cpu_s": t.children_user + t.children_system,
                  "wall_s": time.monotonic() - start}))
"""


def test_the_agents_cpu_limit_holds_for_what_runs_in_a_sandbox(make_sandbox):
    agent = make_agent_limits(f"t-{uuid.uuid4().hex[:10]}", None, 0.1)
    try:
        if agent.enforcement["cpu"].startswith("none"):
            pytest.skip(f"no CPU limit on this machine: {agent.enforcement['cpu']}")
        d = agent.dirs["cpu"]
        if (d / "cpu.max").exists():  # v2
            assert (d / "cpu.max").read_text().split() == ["10000", "100000"]
        else:
            assert (d / "cpu.cfs_quota_us").read_text().strip() == "10000"
            assert (d / "cpu.cfs_period_us").read_text().strip() == "100000"
        sb = make_sandbox(agent_limits=agent)
        rc, out, err = run_in(sb, SPIN, timeout_s=120)
        assert rc == 0, err
        # Two busy processes for 1.5 s would take up to 3 s of CPU; a tenth of a core
        # allows ~0.15 s. CPU time, not wall time: a loaded machine only lowers it.
        assert out["cpu_s"] <= 0.25 * out["wall_s"], out
        sb.cleanup()
    finally:
        agent.remove()
