"""A slot's worker survives an unexpected error while preparing or running a job: that job
fails (retryable, code agent_error) and the worker goes on taking jobs."""
import queue
import threading
import time

from plugins import builtin_plugin_dir
from provider_agent.agent import Agent, RunningJob
from provider_agent.config import AgentConfig
from sdk.protocol.signing import KeyPair


def _agent():
    cfg = AgentConfig(api_key="k", plugins=["echo"], device="cpu")
    agent = Agent(cfg, KeyPair.generate(), plugin_dirs={"echo": builtin_plugin_dir("echo")},
                  sandboxed=False)
    agent._outq = queue.Queue()
    return agent


def _queue(agent, job_id):
    env = {"job_id": job_id, "attempt": 2, "plugin": "echo", "inputs": {}}
    with agent._lock:
        agent.running[job_id] = RunningJob(env, b"")
    agent.jobs.put(job_id)


def test_an_unexpected_error_fails_the_job_and_the_worker_keeps_serving(monkeypatch):
    agent = _agent()
    ran = []

    def prepare(job_id, rj):
        if job_id == "boom":
            raise KeyError("installer index")  # e.g. from the installer, not an InstallError
        return True

    def run(job_id, rj):
        if job_id == "crash":
            raise RuntimeError("unexpected in the run path")
        ran.append(job_id)

    monkeypatch.setattr(agent, "_prepare_job", prepare)
    monkeypatch.setattr(agent, "_run_job", run)
    worker = threading.Thread(target=agent._worker, daemon=True)
    worker.start()
    try:
        for job_id in ("boom", "crash", "fine"):
            _queue(agent, job_id)
        deadline = time.monotonic() + 10
        while "fine" not in ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["fine"] and worker.is_alive()
        failed = [agent._outq.get_nowait().failed for _ in range(2)]
        assert [(f.job_id, f.attempt, f.code, f.retryable) for f in failed] == [
            ("boom", 2, "agent_error", True), ("crash", 2, "agent_error", True)]
        assert "KeyError" in failed[0].message and "unexpected in the run path" in failed[1].message
        assert agent.running == {}
    finally:
        agent._stop.set()
        worker.join(5)
