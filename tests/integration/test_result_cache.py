"""The result cache (issue #24): opt-in per job; a job matching a settled and verified job is
answered from its outputs, byte-identical, at the admin's cache price, with no agent involved;
a miss runs as before."""
from __future__ import annotations

import pytest

from sdk import Client
from tests.integration.conftest import LiveBroker, agent_starter


@pytest.fixture
def vbroker(tmp_path):
    b = LiveBroker(tmp_path, verification=True, check_delay_max_s=0.0)
    yield b
    b.stop()


def _vesting(broker, agent) -> int:
    from broker.ledger.model import AccountId, AccountKind

    owner = broker.services.providers.owner_of(agent.provider_id)
    return broker.services.ledger.balance(AccountId(AccountKind.PROVIDER_VESTING, owner))


def test_a_hit_is_the_verified_jobs_bytes_without_an_agent_and_a_miss_runs(vbroker):
    svc = vbroker.services
    svc.pricing.set_price("echo", {"cache_price_micro": 5_000}, by="test")
    start, stop_all = agent_starter(vbroker)
    client = Client(vbroker.url, vbroker.key("client"))
    try:
        agents = [start("first"), start("second")]  # two operators: the run and its check
        source = client.generate("echo", text="cache me", cache=True, timeout=30)
        assert source.wait_verified(timeout=30) == "verified"
        assert source.job.data["cache"] == {"hit": False, "cached_from": None}
    finally:
        stop_all()  # no agent from here on
    provider = next(a for a in agents if a.provider_id == source.job.data["provider_id"])
    vesting_before = _vesting(vbroker, provider)
    paid_before = client.account()["available_micro"]

    hit = client.generate("echo", text="cache me", cache=True, timeout=10)
    assert hit.job.data["state"] == "settled"
    assert hit.job.data["cache"] == {"hit": True, "cached_from": source.job.id}
    assert hit.job.id != source.job.id
    assert hit.output_bytes(0) == source.output_bytes(0)  # byte-identical
    assert hit.outputs[0]["sha256"] == source.outputs[0]["sha256"]
    assert hit.job.data["provider_id"] == source.job.data["provider_id"]
    # The admin's cache price, once: the platform's fee from it, the rest to the provider
    # whose verified run was served.
    assert paid_before - client.account()["available_micro"] == 5_000
    fee = svc.pricing.price("echo").fee_of(5_000)
    assert _vesting(vbroker, provider) - vesting_before == 5_000 - fee
    kinds = [e.kind for e in svc.jobs.repo.events_after(hit.job.id, 0)]
    assert kinds == ["queued", "assigned", "done"]
    assert svc.verification.status(hit.job.id) is None  # nothing ran: nothing to check
    assert hit.verification == "verified"  # its outputs are the verified run's

    # Not opted in: the same inputs are run, not answered (it waits for an agent).
    plain = client.jobs.create("echo", text="cache me")
    miss = client.jobs.create("echo", text="not cached yet", terms={"cache": True})
    assert plain.refresh().state == "queued" and miss.refresh().state == "queued"
    start, stop_all = agent_starter(vbroker)
    try:
        start("third")
        assert plain.wait(timeout=30).job.data["state"] == "settled"
        done = miss.wait(timeout=30)
        assert done.job.data["cache"] == {"hit": False, "cached_from": None}
        assert b"not cached yet" in done.output_bytes(0)
    finally:
        stop_all()


def test_an_unverified_job_is_not_served_from_the_cache(tmp_path):
    b = LiveBroker(tmp_path)  # verification off: nothing is ever verified
    start, stop_all = agent_starter(b)
    try:
        start("a")
        client = Client(b.url, b.key("client"))
        client.generate("echo", text="unchecked", cache=True, timeout=30)
        again = client.generate("echo", text="unchecked", cache=True, timeout=30)
        assert again.job.data["cache"]["hit"] is False  # it ran
    finally:
        stop_all()
        b.stop()


@pytest.mark.parametrize("extra, field, says", [
    ({"cache": "yes"}, "cache", "use true"),
    ({"cache": True, "n": 2}, "cache", "single jobs"),
])
def test_a_bad_cache_field_is_refused_with_what_is_allowed(live_broker, extra, field, says):
    import httpx

    from tests.integration.conftest import seen_provider

    seen_provider(live_broker.services)
    r = httpx.post(f"{live_broker.url}/v1/jobs", json={"plugin": "echo", "inputs": {}, **extra},
                   headers={"Authorization": f"Bearer {live_broker.key('client')}"})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and says in r.json()["detail"]
