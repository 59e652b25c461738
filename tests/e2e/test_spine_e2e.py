"""The spine end to end: real broker and agent processes, real SD 1.5 on tiny weights."""
import hashlib
import shutil
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sdk import Client
from sdk.localnet import cli

SANDBOX = shutil.which("bwrap") is not None

pytestmark = [pytest.mark.e2e, pytest.mark.localnet(lease_timeout_s=3)]


def _png_sha(result) -> str:
    return hashlib.sha256(result.output_bytes(0)).hexdigest()


def test_twenty_jobs_two_agents_and_a_killed_agent(localnet, tiny_weights):
    localnet.start_broker()
    provider_key = localnet.create_key("provider")
    client_key = localnet.create_key("client")
    for name in ("alpha", "beta"):
        localnet.start_agent(name, provider_key, plugins="sd15,echo", weights_dir=tiny_weights,
                             sandbox=SANDBOX)
    localnet.wait_for_providers(2)
    client = Client(localnet.url, client_key)

    # 20 jobs, seeds repeating so that every seed runs twice (usually on both agents).
    def run(i):
        r = client.generate("sd15", prompt="a red cube", seed=i % 10, steps=4, width=64,
                            height=64, timeout=240)
        return i % 10, _png_sha(r), r.job.data["provider_id"], r.images[0].size

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(20)))
    assert len(results) == 20
    by_seed: dict[int, set] = {}
    for seed, sha, _provider, size in results:
        assert size == (64, 64)
        by_seed.setdefault(seed, set()).add(sha)
    assert all(len(shas) == 1 for shas in by_seed.values()), "same seed, different bytes"
    assert len({sha for shas in by_seed.values() for sha in shas}) == 10
    assert len({p for *_, p, _ in results}) == 2, "both agents should have served jobs"

    # The command-line client gives the same bytes as the SDK for the same inputs.
    out = localnet.workdir / "cli.png"
    cli_run = subprocess.run(cli("generate", "sd15", "--prompt", "a red cube", "--seed", "4",
                                 "--steps", "4", "--width", "64", "--height", "64",
                                 "--out", str(out)),
                             env={**os.environ, "SPARECYCLES_URL": localnet.url,
                                  "SPARECYCLES_API_KEY": client_key},
                             capture_output=True, text=True, timeout=240)
    assert cli_run.returncode == 0, cli_run.stderr
    assert hashlib.sha256(out.read_bytes()).hexdigest() in by_seed[4]

    # Kill the agent running a long job mid-way: the job must finish on the other one.
    job = client.jobs.create("sd15", prompt="a blue sphere", seed=3, steps=30, width=64,
                             height=64)
    deadline = time.monotonic() + 60
    for ev in job.events():
        if ev.kind == "progress" and ev.data["step"] >= 2:
            break
        assert time.monotonic() < deadline
    victim_id = job.refresh().data["provider_id"]
    victim = next(a for a in localnet.agents if victim_id in a.log_path.read_text())
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    result = job.wait(timeout=240)
    assert result.job.data["attempt"] == 1
    assert result.job.data["provider_id"] != victim_id
    kinds = [e.kind for e in client.jobs.get(job.id).events()]
    assert "requeued" in kinds and kinds[-1] == "done"
    client.close()


def test_sigterm_drains_the_running_job(localnet, tiny_weights):
    localnet.start_broker()
    provider_key = localnet.create_key("provider")
    client = Client(localnet.url, localnet.create_key("client"))
    agent = localnet.start_agent("solo", provider_key, plugins="echo", sandbox=SANDBOX)
    localnet.wait_for_providers(1)
    job = client.jobs.create("echo", text="finish me", sleep_ms=1500, steps=15)
    for ev in job.events():
        if ev.kind == "progress":
            break
    agent.proc.send_signal(signal.SIGTERM)
    result = job.wait(timeout=30)
    assert result.json[0]["text"] == "finish me" and result.job.data["attempt"] == 0
    assert agent.proc.wait(30) == 0
    client.close()


@pytest.mark.localnet(lease_timeout_s=15)
def test_broker_killed_mid_job_resumes_and_accepts_the_receipt_once(localnet):
    localnet.start_broker()
    provider_key = localnet.create_key("provider")
    client_key = localnet.create_key("client")
    localnet.start_agent("solo", provider_key, plugins="echo", sandbox=SANDBOX)
    localnet.wait_for_providers(1)
    with Client(localnet.url, client_key) as client:
        job = client.jobs.create("echo", text="outlive the broker", sleep_ms=3000, steps=30)
        for ev in job.events():
            if ev.kind == "progress":
                break
    localnet.restart_broker(hard=True)          # SIGKILL, then start on the same ports
    with Client(localnet.url, client_key) as client:
        result = client.jobs.get(job.id).wait(timeout=60)
        assert result.json[0]["text"] == "outlive the broker"
        assert result.job.data["attempt"] == 0   # same provider, not requeued
        kinds = [e.kind for e in client.jobs.get(job.id).events()]
        assert kinds.count("done") == 1 and "requeued" not in kinds


def test_second_signal_gives_the_job_back(localnet):
    localnet.start_broker()
    provider_key = localnet.create_key("provider")
    client = Client(localnet.url, localnet.create_key("client"))
    quitter = localnet.start_agent("quitter", provider_key, plugins="echo", sandbox=SANDBOX)
    localnet.wait_for_providers(1)
    job = client.jobs.create("echo", text="hand me over", sleep_ms=20000, steps=200)
    for ev in job.events():
        if ev.kind == "progress":
            break
    quitter.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    quitter.proc.send_signal(signal.SIGTERM)
    quitter.proc.wait(30)
    deadline = time.monotonic() + 10
    while job.refresh().state != "queued":       # given back: requeued at once, no lease wait
        assert time.monotonic() < deadline, job.data
        time.sleep(0.1)
    assert job.data["attempt"] == 1
    localnet.start_agent("taker", provider_key, plugins="echo", sandbox=SANDBOX)
    job.cancel()
    client.close()
