"""Resume from a checkpoint end to end: an agent SIGKILLed mid-denoise, the job finished by
another agent from the last checkpoint, the image equal to an uninterrupted run's bytes,
and each provider paid for the steps it did while the client pays once."""
import hashlib
import math
import shutil
import os
import signal
import time
from fractions import Fraction

import pytest

from sdk import Client

SANDBOX = shutil.which("bwrap") is not None

STEPS, EVERY = 20, 4
pytestmark = [pytest.mark.e2e,
              pytest.mark.localnet(lease_timeout_s=3,
                                   env={"SPARECYCLES_CHECKPOINT_EVERY_STEPS": str(EVERY)})]
INPUTS = dict(prompt="a lighthouse at dusk", seed=7, steps=STEPS, width=128, height=128,
              scheduler="dpmpp_2m")


def _broker_view(localnet):
    """The broker's own services on its database (read-only use, same process as the test)."""
    from broker.services import build_services
    from broker.settings import Settings

    return build_services(Settings.from_env(data_dir=localnet.data_dir), migrate=False)


def test_killed_agent_job_resumes_elsewhere_byte_identical_and_paid_in_parts(localnet,
                                                                          tiny_weights):
    localnet.start_broker()
    keys = {name: localnet.create_key("provider", name) for name in ("alpha", "beta")}
    client_key = localnet.create_key("client", credits="1000")
    agents = {name: localnet.start_agent(name, key, plugins="sd15", weights_dir=tiny_weights,
                                         sandbox=SANDBOX) for name, key in keys.items()}
    localnet.wait_for_providers(2)
    client = Client(localnet.url, client_key)
    before = client.account()["available_micro"]

    job = client.jobs.create("sd15", **INPUTS)
    deadline = time.monotonic() + 120
    for ev in job.events():
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        if ev.kind == "checkpoint":
            break
    victim_id = job.refresh().data["provider_id"]
    victim = next(n for n, a in agents.items() if victim_id in a.log_path.read_text())
    os.kill(agents[victim].proc.pid, signal.SIGKILL)
    agents[victim].proc.wait(10)
    result = job.wait(timeout=240)
    survivor = next(n for n in agents if n != victim)
    assert result.job.data["state"] == "settled" and result.job.data["attempt"] == 1
    assert result.job.data["provider_id"] != victim_id
    events = list(client.jobs.get(job.id).events())
    kinds = [e.kind for e in events]
    assert kinds.count("done") == 1 and "requeued" in kinds
    k = max(e.data["step"] for e in events
            if e.kind == "checkpoint" and e.data["attempt"] == 0)
    assert 0 < k < STEPS and k % EVERY == 0
    resumed = result.output_bytes(0)

    # Money: the victim earned k/n of the job, the survivor (n-k)/n; the client paid once.
    view = _broker_view(localnet)
    try:
        done = view.jobs.repo.get(job.id)
        assert done.envelope["resume"]["step"] == k
        price = view.pricing.price("sd15")
        rate = view.billing.rate_of(done)
        units = Fraction(str(done.work_units))
        first = math.floor(rate * units * Fraction(k, STEPS))
        second = math.floor(rate * units * Fraction(STEPS - k, STEPS))
        vesting = {n: Client(localnet.url, keys[n]).account()["vesting_micro"] for n in keys}
        assert vesting[victim] == first - price.fee_of(first)
        assert vesting[survivor] == second - price.fee_of(second)
        acct = client.account()
        assert acct["held_micro"] == 0
        assert before - acct["available_micro"] == first + second
        assert view.ledger.verify().ok
    finally:
        view.close()

    # The same job uninterrupted, on the survivor: the very same bytes.
    again = client.jobs.create("sd15", **INPUTS).wait(timeout=240)
    assert again.job.data["attempt"] == 0
    assert hashlib.sha256(again.output_bytes(0)).hexdigest() == \
        hashlib.sha256(resumed).hexdigest()
    client.close()
