"""A hostile plugin against the real sandbox, through a real agent and a live broker.

One broker and one sandboxed agent (echo + the hostile test plugin, 2 slots) serve the
whole module, so every test also shows that the agent survived the attacks before it.
Each attack runs as a client's job; a refused attack ends the job failed with the
plugin's ``attack_refused`` and the errors it hit, a broken limit ends it failed with the
host's code. After each, a benign job on the same (restarted, if need be) host succeeds.

The broker runs with ``max_attempts=1`` so that a retryable failure (the host died or
broke a limit) ends the job at once as ``attempts_exhausted`` naming the agent's code,
instead of waiting in the queue for another provider.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from plugins import BUILTIN_DIR, builtin_plugin_dir
from provider_agent.agent import Agent
from provider_agent.config import (AgentConfig, config_dir, config_path, identity_path,
                                   load_identity, save_config)
from provider_agent.host.manager import PluginHost
from provider_agent.launch import host_launcher
from provider_agent.sandbox import Sandbox
from sdk import Client, JobFailedError, JobTimeoutError

from tests.integration.conftest import LiveBroker

_ok, _reason = Sandbox.available()
if not _ok and os.environ.get("SPARECYCLES_REQUIRE_SANDBOX") == "1":
    raise RuntimeError(f"the sandbox is required here but unavailable: {_reason}")
pytestmark = pytest.mark.skipif(not _ok, reason=f"sandbox unavailable: {_reason}")

PROJECT = Path(__file__).resolve().parents[2]
FIXTURE_PLUGINS = PROJECT / "tests" / "fixtures" / "plugins"
MEMORY_LIMIT_MB = 256
PIDS_LIMIT = 64


def _weights_and_registry(tmp: Path) -> tuple[dict[str, str], Path]:
    """A weights folder per plugin (with adapters beside it), and a registry cache holding
    adapters of both: what each plugin's host may, and may not, see of the other's."""
    root, registry = tmp / "weights", tmp / "registry"
    for plugin in ("echo", "hostile"):
        (root / plugin).mkdir(parents=True)
        (root / plugin / "model.safetensors").write_text(f"the weights of {plugin}")
        (root / "adapters" / plugin / f"{plugin}-style").mkdir(parents=True)
        (registry / "adapters" / plugin / f"{plugin}-film@1").mkdir(parents=True)
    return {p: str(root / p) for p in ("echo", "hostile")}, registry


def _start_agent(broker, home: Path, *, sandboxed: bool, name: str,
                 plugins=("echo", "hostile"), weights: dict | None = None,
                 registry: Path | None = None) -> tuple[Agent, threading.Thread]:
    cfg = AgentConfig(broker=broker.grpc, api_key=broker.key("provider"), name=name, slots=2,
                      plugins=list(plugins), device="cpu",
                      weights={p: w for p, w in (weights or {}).items() if p in plugins})
    save_config(cfg, home)                       # the files a plugin must not read
    identity = load_identity(home)
    folders = {"echo": builtin_plugin_dir("echo"), "hostile": FIXTURE_PLUGINS / "hostile"}
    plugin_dirs = {p: folders[p] for p in plugins}
    launcher = host_launcher(sandboxed=sandboxed, home=home, cfg=cfg,
                             memory_limit_mb=MEMORY_LIMIT_MB, pids_limit=PIDS_LIMIT,
                             registry_root=registry)
    agent = Agent(cfg, identity, plugin_dirs=plugin_dirs, sandboxed=sandboxed,
                  launcher=launcher, home=home)
    thread = threading.Thread(target=agent.run, daemon=True, name=f"agent-{name}")
    thread.start()
    deadline = time.monotonic() + 30
    while not agent.provider_id and time.monotonic() < deadline:
        time.sleep(0.02)
    assert agent.provider_id, "agent did not connect"
    return agent, thread


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sandbox-hostile")
    broker = LiveBroker(tmp, plugin_dirs=[BUILTIN_DIR, FIXTURE_PLUGINS], max_attempts=1)
    home = tmp / "agent-home"
    home.mkdir()
    weights, registry = _weights_and_registry(tmp)
    agent, thread = _start_agent(broker, home, sandboxed=True, name="sandboxed",
                                 weights=weights, registry=registry)
    client = Client(broker.url, broker.key("client"))  # a funded client (dev funding)
    yield SimpleNamespace(broker=broker, agent=agent, thread=thread, client=client, home=home,
                          tmp=tmp, weights=weights, registry=registry)
    client.close()
    agent.stop()
    thread.join(10)
    broker.stop()


def run_job(env, plugin="hostile", timeout=30.0, **inputs) -> dict:
    """Submit a job as a client; return the job JSON the client ends with, plus
    ``output`` (the first JSON output) when it settled and ``elapsed_s``."""
    t0 = time.monotonic()
    job = env.client.jobs.create(plugin, **inputs)
    try:
        output = job.wait(timeout).json[0]
    except JobTimeoutError:
        raise
    except JobFailedError as exc:
        return {**exc.job.data, "elapsed_s": time.monotonic() - t0}
    return {**job.data, "output": output, "elapsed_s": time.monotonic() - t0}


def assert_refused(job: dict, *fragments: str) -> str:
    assert job["state"] == "failed", f"the attack was not refused: {job.get('output')}"
    assert job["error"]["code"] == "attack_refused", job["error"]
    message = job["error"]["message"]
    for fragment in fragments:
        assert fragment in message, message
    return message


def assert_still_serving(env) -> None:
    """The agent is up, connected, and the hostile plugin's host runs a benign job."""
    assert env.thread.is_alive() and env.agent.provider_id
    job = run_job(env, attack="none")
    assert job["state"] == "settled", job.get("error")
    assert job["output"] == {"ok": True, "job_id": job["id"]}


# ---- network ---------------------------------------------------------------------------

def test_connect_to_the_brokers_own_ports_fails_at_once(env):
    b = env.broker.server
    job = run_job(env, attack="connect",
                  target=f"127.0.0.1:{b.grpc_port},127.0.0.1:{b.http_port}")
    message = assert_refused(job, f"127.0.0.1:{b.grpc_port} PermissionError EPERM",
                             f"127.0.0.1:{b.http_port} PermissionError EPERM",
                             f"::1:{b.grpc_port} PermissionError EPERM")
    assert "after 0 ms" in message  # refused at once, not timed out
    assert_still_serving(env)


def test_connect_to_an_outside_address_fails_at_once(env):
    job = run_job(env, attack="connect", target="1.1.1.1:443,93.184.216.34:80")
    message = assert_refused(job, "1.1.1.1:443 PermissionError EPERM",
                             "udp 1.1.1.1:443 PermissionError",
                             "93.184.216.34:80 PermissionError EPERM")
    assert "after 0 ms" in message  # refused at once, not timed out
    assert_still_serving(env)


def test_resolving_a_host_name_fails(env):
    job = run_job(env, attack="resolve", target="example.com,pypi.org,localhost")
    assert_refused(job, "example.com gaierror", "pypi.org gaierror", "localhost gaierror")
    assert_still_serving(env)


# ---- files -----------------------------------------------------------------------------

def test_the_agents_identity_key_and_config_are_invisible(env):
    secrets = [identity_path(env.home), config_path(env.home)]
    assert all(p.exists() for p in secrets)      # they are there, outside the sandbox
    targets = [*secrets, env.home, config_dir()]
    job = run_job(env, attack="read", target=",".join(map(str, targets)))
    assert_refused(job, *(f"{p} FileNotFoundError ENOENT" for p in targets))
    assert_still_serving(env)


def test_writing_outside_the_scratch_fails_and_leaves_no_file(env):
    targets = [env.home / "pwned", Path(sys.prefix) / "pwned"]
    refused = [f"{env.home / 'pwned'} FileNotFoundError",
               f"{Path(sys.prefix) / 'pwned'} OSError EROFS"]
    # The folders leading to a bound path are made in the sandbox's root (read-only), or,
    # for a checkout below /tmp, in the sandbox's own /tmp, which is its scratch: a write
    # there is no write to the host (the next test job would not see it either).
    if not PROJECT.is_relative_to("/tmp"):
        targets.append(PROJECT / "pwned-by-hostile")
        refused.append(f"{PROJECT / 'pwned-by-hostile'} OSError EROFS")
    job = run_job(env, attack="write", target=",".join(map(str, targets)))
    assert_refused(job, *refused, "hostile/pwned OSError EROFS", "/usr/pwned OSError EROFS")
    assert not any(p.exists() for p in [*targets, PROJECT / "pwned-by-hostile"])
    assert not (FIXTURE_PLUGINS / "hostile" / "pwned").exists()
    assert_still_serving(env)


def test_another_jobs_scratch_cannot_be_read(env):
    planted = run_job(env, attack="plant")
    assert planted["state"] == "settled"
    earlier = planted["output"]["path"]          # an earlier job on this very host
    slow = env.client.jobs.create("echo", text="busy", sleep_ms=2000)
    deadline = time.monotonic() + 10
    while slow.refresh().state != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow.state == "running"
    other_host = f"/tmp/job-{slow.id}"           # a job running now, in the echo host
    on_disk = env.tmp / "other-job"              # another job's files on the provider
    on_disk.mkdir()
    (on_disk / "result.png").write_bytes(b"not yours")
    job = run_job(env, attack="read", target=f"{earlier},{other_host},{on_disk / 'result.png'}")
    assert_refused(job, f"{earlier} FileNotFoundError", f"{other_host} FileNotFoundError",
                   "result.png FileNotFoundError")
    assert slow.wait(10).json[0]["text"] == "busy"
    assert_still_serving(env)


def test_the_checkout_data_dirs_and_other_agents_homes_are_invisible(env, tmp_path,
                                                                     monkeypatch):
    """Only what a host imports of the checkout is bound: not the tests, not .git, not a
    data dir someone keeps in it; nor a broker's data dir or another agent's home where
    the defaults put them."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from broker.settings import Settings
    from sdk.demo import default_workdir

    broker_key = Settings().data_dir / "broker.key"         # the broker's default place
    other_home = default_workdir() / "agent-beta"            # the demo's other agent
    for secret in (broker_key, other_home / "identity.key"):
        secret.parent.mkdir(parents=True)
        secret.write_text("SECRET")
    in_checkout = PROJECT / ".sparecycles" / "broker.key"    # the old default data dir
    made = not in_checkout.parent.exists()
    in_checkout.parent.mkdir(exist_ok=True)
    planted = not in_checkout.exists()
    if planted:
        in_checkout.write_text("SECRET")
    try:
        targets = [broker_key, other_home, env.broker.settings.key_path,
                   env.broker.settings.data_dir, in_checkout, PROJECT / "tests" / "integration",
                   PROJECT / "tests" / "conftest.py", FIXTURE_PLUGINS / "swatch",
                   PROJECT / ".git", PROJECT / "broker", PROJECT / "README.md",
                   PROJECT / "plugins" / "echo", PROJECT / "provider_agent" / "config.py"]
        job = run_job(env, attack="read", target=",".join(map(str, targets)))
        assert_refused(job, *(f"{p} FileNotFoundError ENOENT" for p in targets))
    finally:
        if planted:
            in_checkout.unlink()
        if made:
            in_checkout.parent.rmdir()
    assert_still_serving(env)


def test_a_plugin_sees_its_own_weights_and_adapters_and_no_other_plugins(env):
    echo = Path(env.weights["echo"])
    mine = Path(env.weights["hostile"])
    targets = [echo, echo / "model.safetensors", echo.parent / "adapters" / "echo",
               env.registry / "adapters" / "echo",
               env.registry / "adapters" / "echo" / "echo-film@1"]
    job = run_job(env, attack="weights", target=",".join(map(str, targets)))
    assert_refused(job, *(f"{p} FileNotFoundError ENOENT" for p in targets),
                   "own weights list ['model.safetensors']")
    visible = [mine / "model.safetensors", mine.parent / "adapters" / "hostile",
               env.registry / "adapters" / "hostile"]
    job = run_job(env, attack="read", target=",".join(map(str, visible)))
    assert job["state"] == "settled" and len(job["output"]["escaped"]) == 3, job
    assert_still_serving(env)


def test_a_job_finds_nothing_an_earlier_job_of_another_client_left_behind(env):
    host = env.agent.plugins["hostile"].host
    warm_pid = host.proc.pid
    planted = run_job(env, attack="plant_all")               # client A's job
    assert planted["state"] == "settled", planted.get("error")
    left = planted["output"]
    assert left["mq"] == "EPERM" and left["shm"] >= 0     # POSIX queues are refused
    other = Client(env.broker.url, env.broker.key("client"))  # client B, the same warm host
    try:
        job = other.jobs.create("hostile", attack="hunt", target=f"SECRET-OF-{planted['id']}")
        with pytest.raises(JobFailedError) as exc:
            job.wait(30)
        error = exc.value.job.data["error"]
        assert error["code"] == "attack_refused" and "no trace of it" in error["message"], error
        job = other.jobs.create("hostile", attack="read", target=",".join(left["paths"]))
        with pytest.raises(JobFailedError) as exc:
            job.wait(30)
        for path in left["paths"]:
            assert f"{path} FileNotFoundError ENOENT" in exc.value.job.data["error"]["message"]
        # The file the lingering thread still holds open is there, and empty.
        job = other.jobs.create("hostile", attack="read", target=f"/proc/self/fd/{left['fd']}")
        assert job.wait(30).json[0] == {"escaped": [f"/proc/self/fd/{left['fd']}: b''"]}
    finally:
        other.close()
    assert host.proc.pid == warm_pid                      # no restart hid it
    assert_still_serving(env)


@pytest.fixture
def host_kernel():
    paths = ["/proc/sys/kernel/core_pattern", "/proc/sys/kernel/randomize_va_space"]
    before = {p: Path(p).read_text() for p in paths}
    yield before
    for path, value in before.items():
        if Path(path).read_text() != value:  # the test failed: put the host back
            Path(path).write_text(value)


def test_the_host_kernel_cannot_be_changed_and_the_host_runs_unprivileged(env, host_kernel):
    core, aslr = list(host_kernel)
    targets = [f"{core}=core.sparecycles-hostile-test", f"{aslr}={host_kernel[aslr].strip()}",
               "/proc/sys/vm/drop_caches=1", "/proc/sys/kernel/hostname=pwned",
               "/proc/sysrq-trigger"]
    job = run_job(env, attack="kernel", target=",".join(targets))
    assert_refused(job, core, aslr, "drop_caches", "hostname", "/proc/sysrq-trigger")
    assert {p: Path(p).read_text() for p in host_kernel} == host_kernel
    from provider_agent.sandbox.cgroups import process_tree

    for plugin, served in env.agent.plugins.items():
        for pid in process_tree(served.host.proc.pid):
            status = Path(f"/proc/{pid}/status").read_text()
            uids = status.split("Uid:")[1].split("\n")[0].split()
            assert "0" not in uids, f"{plugin} host process {pid} runs as host uid {uids}"
    assert_still_serving(env)


def test_all_hosts_of_the_agent_share_one_memory_budget_and_a_cpu_limit(env):
    """Read back from the live sandboxes' cgroups: each host's group is a child of the
    agent's, which holds the budget and the CPU quota."""
    from provider_agent.sandbox.cgroups import CgroupLayout

    limits = env.agent.launcher.limits
    if "memory" not in limits.dirs:
        pytest.skip(f"no writable memory cgroup here: {limits.enforcement}")
    agent_mem = limits.dirs["memory"]
    parents = set()
    for served in env.agent.plugins.values():
        layout = CgroupLayout.detect(Path(f"/proc/{served.host.proc.pid}"))
        own = layout.v2_dir or layout.v1_dirs["memory"]
        parents.add(own.parent)
        per_host = own / ("memory.max" if layout.v2_dir else "memory.limit_in_bytes")
        assert int(per_host.read_text()) <= MEMORY_LIMIT_MB << 20
    assert parents == {agent_mem}                             # one group for all hosts
    budget = agent_mem / ("memory.max" if (agent_mem / "memory.max").exists()
                          else "memory.limit_in_bytes")
    assert int(budget.read_text()) == MEMORY_LIMIT_MB << 20
    if "cpu" in limits.dirs:
        cpu = limits.dirs["cpu"]
        quota = ((cpu / "cpu.max").read_text().split()[0] if (cpu / "cpu.max").exists()
                 else (cpu / "cpu.cfs_quota_us").read_text().strip())
        assert int(quota) == (os.cpu_count() or 1) * 100_000  # default: every core


def test_an_ordinary_users_agent_keeps_the_same_promises(tmp_path):
    """The launcher of an agent that is not root: bwrap runs as that user (no drop), the
    cgroups are not writable (watchdog budget). One warm hostile host: it cannot change
    the kernel, sees its own weights only and none of the checkout, and a job finds
    nothing an earlier one left. Skipped, saying why, where an unprivileged user cannot
    run bubblewrap."""
    import json

    from tests.sandbox_helpers import run_as_ordinary_user

    weights, _ = _weights_and_registry(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    for path in [tmp_path, *tmp_path.rglob("*")]:  # the user's own files, as they would be
        path.chmod(0o755 if path.is_dir() else 0o644)
    targets = [weights["echo"], f"{weights['echo']}/model.safetensors",
               PROJECT / "tests" / "integration", PROJECT / ".git", PROJECT / "broker"]
    code = f"""
import json, os
from pathlib import Path
from provider_agent.errors import HostError
from provider_agent.host.manager import PluginHost
from provider_agent.launch import host_launcher
from provider_agent.sandbox import Sandbox
from provider_agent.sandbox.cgroups import process_tree
ok, why = Sandbox.available()
if not ok:
    print(json.dumps({{"unavailable": why}})); raise SystemExit(0)
launcher = host_launcher(sandboxed=True, home=Path({str(home)!r}), memory_limit_mb=256)
host = PluginHost(Path({str(FIXTURE_PLUGINS / "hostile")!r}), Path({weights["hostile"]!r}),
                  device="cpu", launcher=launcher, name="hostile")
host.start()
out = {{"agent_uid": os.getuid(), "enforcement": host.proc.sandbox.enforcement}}
def job(job_id, **inputs):
    try:
        return json.loads(host.run(job_id, inputs, wall_clock_s=10).outputs[0].data)
    except HostError as exc:
        return {{"refused": str(exc)}}
out["plant"] = job("job-a", attack="plant_all")
out["hunt"] = job("job-b", attack="hunt", target="SECRET-OF-job-a")
out["read"] = job("job-c", attack="weights", target={",".join(map(str, targets))!r})
out["kernel"] = job("job-d", attack="kernel", target="/proc/sys/kernel/core_pattern=core.x")
out["uids"] = [open(f"/proc/{{p}}/status").read().split("Uid:")[1].split()[:4]
               for p in process_tree(host.proc.pid)]
host.stop(); launcher.close()
print(json.dumps(out))
"""
    res = run_as_ordinary_user(code, reachable=[tmp_path])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "unavailable" in out:
        pytest.skip(f"an unprivileged user cannot run bubblewrap here: {out['unavailable']}")
    assert out["agent_uid"] != 0
    assert out["enforcement"]["user"] == f"host uid {out['agent_uid']}"
    assert out["enforcement"]["agent memory"].endswith("256 MiB for all hosts")
    assert all(int(u) == out["agent_uid"] for ids in out["uids"] for u in ids)
    assert out["plant"]["mq"] == "EPERM"
    assert "no trace of it" in out["hunt"]["refused"], out["hunt"]
    for target in targets:
        assert f"{target} FileNotFoundError ENOENT" in out["read"]["refused"], out["read"]
    assert "own weights list ['model.safetensors']" in out["read"]["refused"]
    assert "core_pattern" in out["kernel"]["refused"], out["kernel"]


# ---- limits ----------------------------------------------------------------------------

def test_fork_bomb_hits_the_pids_limit_and_the_children_are_killed(env):
    job = run_job(env, attack="fork")
    message = assert_refused(job, "BlockingIOError EAGAIN", "leftover process(es) were killed")
    forked = int(message.split("fork failed after ")[1].split()[0])
    assert 0 < forked < PIDS_LIMIT
    assert_still_serving(env)


def test_allocating_past_the_memory_budget_kills_the_host_and_fails_the_job(env):
    job = run_job(env, attack="memory")
    assert job["state"] == "failed"
    assert job["error"]["code"] == "attempts_exhausted"      # retryable: requeue path
    assert "last: memory_limit: plugin host hostile broke its memory limit" in \
        job["error"]["message"]
    assert_still_serving(env)


def test_sleeping_past_the_wall_clock_kills_the_host_and_fails_the_job(env):
    job = run_job(env, attack="sleep")
    assert job["state"] == "failed"
    assert "last: wall_clock_exceeded: the job ran longer than 3s" in job["error"]["message"]
    assert 3 <= job["elapsed_s"] < 15
    assert_still_serving(env)


def test_a_child_left_running_after_the_job_is_killed(env):
    job = run_job(env, attack="orphan")
    assert job["state"] == "failed"
    assert job["error"]["code"] == "stray_processes"
    assert "left 1 process(es) running after the job; they were killed" in \
        job["error"]["message"]
    alive = run_job(env, attack="orphan_alive")  # the next job on the same host looks
    assert_refused(alive, "is gone")
    assert_still_serving(env)


# ---- syscalls --------------------------------------------------------------------------

def test_ptrace_is_refused(env):
    job = run_job(env, attack="ptrace")
    assert_refused(job, "PTRACE_TRACEME: EPERM", "PTRACE_ATTACH to init: EPERM")
    assert_still_serving(env)


def test_mount_and_new_namespaces_are_refused(env):
    job = run_job(env, attack="mount")
    assert_refused(job, "mount tmpfs: EPERM", "unshare(user+mount ns): EPERM")
    assert_still_serving(env)


# ---- the host dies; benign output; --no-sandbox ----------------------------------------

def test_a_host_killed_mid_job_is_reported_restarted_and_serves_again(env):
    host = env.agent.plugins["hostile"].host
    old_pid = host.proc.pid
    slow = env.client.jobs.create("hostile", attack="sleep")
    deadline = time.monotonic() + 10
    while slow.refresh().state != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    host.proc.kill()                             # the sandbox's bwrap: the host dies with it
    with pytest.raises(JobFailedError) as exc:
        slow.wait(10)
    error = exc.value.job.data["error"]
    assert error["code"] == "attempts_exhausted"
    assert error["message"].startswith("gave up after 1 attempts; last: host_died: "
                                       "plugin host hostile exited")
    assert_still_serving(env)
    assert host.proc.pid != old_pid and host.alive()


def test_benign_plugin_output_is_the_same_inside_and_outside_the_sandbox(env):
    inputs = {"text": "héllo, sandbox", "sleep_ms": 20, "steps": 2}
    outputs = []
    for sandboxed in (False, True):
        launcher = host_launcher(sandboxed=sandboxed, home=env.home, memory_limit_mb=512)
        host = PluginHost(builtin_plugin_dir("echo"), None, device="cpu", launcher=launcher)
        host.start()
        try:
            result = host.run("same-job", inputs, wall_clock_s=10)
        finally:
            host.stop()
            if launcher is not None:
                launcher.close()
        outputs.append([(o.media_type, o.data) for o in result.outputs])
    assert outputs[0] == outputs[1]
    job = run_job(env, plugin="echo", text="through the agent")
    assert job["output"] == {"text": "through the agent"}


def test_the_broker_records_whether_each_agent_is_sandboxed(env):
    home = env.tmp / "unsandboxed-home"
    home.mkdir()
    plain, thread = _start_agent(env.broker, home, sandboxed=False, name="plain",
                                 plugins=["echo"])
    try:
        stored = {p.id: p.sandboxed for p in env.broker.services.providers.all()}
        assert stored[env.agent.provider_id] is True
        assert stored[plain.provider_id] is False
        # Clients see it on every job, whichever of the two agents ran it.
        for _ in range(4):
            job = run_job(env, plugin="echo", text="who ran me?")
            assert job["sandboxed"] is stored[job["provider_id"]]
    finally:
        plain.stop()
        thread.join(10)
