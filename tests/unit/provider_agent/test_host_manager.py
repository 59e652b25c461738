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
    def launch(argv):
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
    def launch(argv):
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


def test_the_sandbox_read_only_paths_are_the_same_for_the_cli_and_the_agent(tmp_path,
                                                                          monkeypatch):
    from types import SimpleNamespace

    from provider_agent import launch
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from sdk.protocol.signing import KeyPair

    installer = SimpleNamespace(root=tmp_path / "cache")
    cheat = SimpleNamespace(extra_ro_paths=lambda: [tmp_path / "other-weights"],
                            announce=lambda: None, weights_for=lambda output, honest: honest)
    want = [ECHO, tmp_path / "cache", tmp_path / "other-weights"]
    assert launch.sandbox_ro_paths({"echo": ECHO}, installer, cheat) == want
    assert launch.sandbox_ro_paths({"echo": ECHO}) == [ECHO]
    asked = []
    monkeypatch.setattr(launch, "host_launcher", lambda **kw: asked.append(kw["plugin_dirs"]))
    Agent(AgentConfig(api_key="k", plugins=["echo"], device="cpu"), KeyPair.generate(),
          plugin_dirs={"echo": ECHO}, sandboxed=True, installer=installer, cheat=cheat)
    assert asked == [want]  # the agent's own launcher (none given) binds the cache too


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
    from provider_agent.sandbox.cgroups import CgroupV1Limits

    stale = tmp_path / "sparecycles" / "host-42-0"
    stale.mkdir(parents=True)
    assert CgroupV1Limits._mkdir(tmp_path, "host-42-0") == stale and stale.is_dir()
