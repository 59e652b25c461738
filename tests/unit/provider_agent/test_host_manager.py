"""PluginHost when the host process misbehaves while starting or between jobs.

Hosts here are plain subprocesses (the sandboxed paths are in
tests/integration/test_sandbox_hostile.py): what is checked is that every way of failing
becomes a ``HostError`` with a clear code (never a raw exception that would kill an agent
worker), and that the next job gets a fresh host.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from plugins import builtin_plugin_dir
from provider_agent.errors import HostError
from provider_agent.host.manager import PluginHost
from provider_agent.sandbox import SandboxUnavailable

ECHO = builtin_plugin_dir("echo")


def _python(code: str):
    def launch(argv, **_plugin):
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
    return launch


def test_a_host_that_exits_while_starting_is_host_died():
    host = PluginHost(ECHO, None, device="cpu", launcher=_python("raise SystemExit(7)"))
    with pytest.raises(HostError) as exc:
        host.start()
    assert exc.value.code == "host_died" and exc.value.retryable
    assert "exited" in str(exc.value) and not host.alive()


def test_a_host_that_never_gets_ready_is_start_timeout_and_is_killed():
    host = PluginHost(ECHO, None, device="cpu", launcher=_python("import time; time.sleep(60)"),
                      start_timeout_s=0.3)
    with pytest.raises(HostError) as exc:
        host.start()
    assert exc.value.code == "start_timeout" and "did not load within 0.3s" in str(exc.value)
    assert not host.alive()


def test_a_sandbox_that_cannot_start_is_host_start_failed():
    def launch(argv, **_plugin):
        raise SandboxUnavailable("bubblewrap is not installed")

    host = PluginHost(ECHO, None, device="cpu", launcher=launch)
    with pytest.raises(HostError) as exc:
        host.start()
    assert exc.value.code == "host_start_failed" and "bubblewrap" in str(exc.value)


def test_a_host_that_died_between_jobs_is_restarted_for_the_next_job():
    host = PluginHost(ECHO, None, device="cpu")
    host.start()
    try:
        first = host.proc.pid
        host.proc.kill()
        host.proc.wait()
        result = host.run("j1", {"text": "again", "sleep_ms": 0, "steps": 1}, wall_clock_s=10)
        assert b'"again"' in result.outputs[0].data and host.proc.pid != first
    finally:
        host.stop()


def test_a_host_that_writes_a_broken_frame_is_host_died():
    host = PluginHost(ECHO, None, device="cpu", launcher=_python(
        "import sys; sys.stdout.buffer.write(b'\\xff' * 8); sys.stdout.flush()"))
    with pytest.raises(HostError) as exc:
        host.start()
    assert exc.value.code == "host_died" and "too large" in str(exc.value)
    assert not host.alive()


def test_a_bug_in_the_agent_is_not_disguised_as_a_dead_host(monkeypatch):
    from provider_agent.host import manager

    def bug(self, timeout_s=None):
        raise KeyError("a coding bug")
    monkeypatch.setattr(manager.FrameReader, "next", bug)
    host = PluginHost(ECHO, None, device="cpu", launcher=_python("import time; time.sleep(30)"))
    try:
        with pytest.raises(KeyError):
            host.start()
    finally:
        host.kill()


def test_each_plugin_host_is_given_its_own_plugin_and_nothing_of_the_others(tmp_path,
                                                                            monkeypatch):
    from types import SimpleNamespace

    from provider_agent import launch
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from sdk.protocol.signing import KeyPair

    root = tmp_path / "weights"
    mine, theirs = root / "echo", root / "other"
    (mine / "adapters").mkdir(parents=True)
    theirs.mkdir()
    (root / "adapters" / "echo").mkdir(parents=True)        # adapters beside the weights
    (root / "adapters" / "other").mkdir(parents=True)
    own_adapter = tmp_path / "elsewhere" / "ink"            # an operator's own, linked in
    own_adapter.mkdir(parents=True)
    (mine / "adapters" / "ink").symlink_to(own_adapter)
    cache = tmp_path / "cache"
    (cache / "adapters" / "other" / "film@1").mkdir(parents=True)
    got = launch.plugin_ro_paths("echo", ECHO, mine, registry_root=cache)
    assert got == [ECHO.resolve(), mine, own_adapter, root / "adapters" / "echo",
                   cache / "adapters" / "echo"]
    assert (cache / "adapters" / "echo").is_dir()  # adapters installed later show up
    assert not any(p in (theirs, root, cache, root / "adapters" / "other") or
                   "other" in p.parts for p in got)
    # Host code: the host package, the plugin API, sdk/protocol; never the whole checkout.
    code = launch.host_code_paths()
    project = launch.PROJECT_ROOT
    assert project not in code and project / "plugins" not in code
    assert project / "provider_agent" / "host" in code and project / "plugins" / "api.py" in code
    assert not any(p.is_relative_to(project / "tests") or p.is_relative_to(project / "broker")
                   or p.is_relative_to(project / "plugins" / "echo") for p in code)

    # The agent hands its launcher the registry cache once, at construction; each host
    # then names its own plugin (and so its weights) when it starts.
    installer = SimpleNamespace(root=cache)
    asked = []
    monkeypatch.setattr(launch, "host_launcher", lambda **kw: asked.append(kw))
    Agent(AgentConfig(api_key="k", plugins=["echo"], device="cpu"), KeyPair.generate(),
          plugin_dirs={"echo": ECHO}, sandboxed=True, installer=installer)
    assert asked[0]["registry_root"] == cache
    started = []

    def launcher(argv, **plugin):
        started.append(plugin)
        raise SandboxUnavailable("recorded")

    with pytest.raises(HostError):
        PluginHost(ECHO, mine, device="cpu", launcher=launcher, name="echo").start()
    assert started == [{"plugin": "echo", "plugin_dir": ECHO, "weights_dir": mine}]


def test_gpu_nodes_follow_the_device(tmp_path, monkeypatch):
    from provider_agent.launch import gpu_indices_for

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_indices_for("cpu", tmp_path) == []
    assert gpu_indices_for("cuda:2", tmp_path) == [2]
    assert gpu_indices_for("auto", tmp_path) == []          # no GPU on this machine
    (tmp_path / "nvidia0").touch()
    assert gpu_indices_for("auto", tmp_path) == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert gpu_indices_for("cuda", tmp_path) == [1, 3]


def test_a_stale_cgroup_left_by_a_killed_agent_is_replaced(tmp_path):
    """An agent SIGKILLed before cleanup leaves host-<pid>-<n>; a later agent that gets
    the same pid must not fail to start its plugin host."""
    from provider_agent.sandbox.cgroups import _fresh_dir

    stale = tmp_path / "sparecycles" / "agent-42-0" / "host-42-0"
    stale.mkdir(parents=True)
    assert _fresh_dir(stale.parent, "host-42-0") == stale and stale.is_dir()
    assert _fresh_dir(tmp_path / "sparecycles", "agent-42-0") == stale.parent
    assert not stale.exists()  # its empty children went with it


def test_agent_wide_limits_come_from_agent_toml_and_bad_values_say_what_is_allowed(tmp_path):
    import os

    from provider_agent.config import AgentConfig, load_config, save_config
    from provider_agent.errors import ConfigError
    from provider_agent.launch import HostLauncher, host_launcher

    cfg = AgentConfig(api_key="k", memory_limit_mb=3000, cpu_cores=1.0, sandbox_user="")
    save_config(cfg, tmp_path)
    loaded = load_config(tmp_path)
    assert (loaded.memory_limit_mb, loaded.cpu_cores) == (3000, 1.0)
    loaded.check()
    cores = os.cpu_count() or 1
    for bad, says in ((dict(cpu_cores=cores + 1), f"this machine has {cores} core"),
                      (dict(cpu_cores=-1), "above 0"),
                      (dict(memory_limit_mb=-5), "a whole number"),
                      (dict(memory_limit_mb=1.5), "a whole number"),
                      (dict(sandbox_user=7), "as a string")):
        with pytest.raises(ConfigError, match=says):
            AgentConfig(api_key="k", **bad).check()
    with pytest.raises(ConfigError, match="at most"):
        HostLauncher(cpu_cores=cores * 2)
    defaults = HostLauncher()
    assert defaults.cpu_cores == cores and defaults.memory_limit_mb >= 2048
    assert "OMP_NUM_THREADS" not in defaults.env or "OMP_NUM_THREADS" in os.environ
    from provider_agent.sandbox import Sandbox

    if not Sandbox.available()[0]:
        return
    launcher = host_launcher(sandboxed=True, cfg=cfg, home=tmp_path)
    assert (launcher.memory_limit_mb, launcher.cpu_cores) == (3000, 1.0)
    if "OMP_NUM_THREADS" not in os.environ:  # torch then uses as many threads as cores
        assert launcher.env["OMP_NUM_THREADS"] == "1"
