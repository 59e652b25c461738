"""θ is timed by the broker (issue #20): a receipt that claims ten times the work units in a
millisecond is measured by what the broker saw — the units it computed for the inputs,
from sending the assignment to the receipt's arrival — and so does not win the auction."""
import time

import pytest

from broker.market.throughput import timed_sample
from broker.services import build_services
from broker.settings import Settings
from sdk.protocol.canonical import canonical_bytes, loads, sha256_hex
from sdk.protocol.envelope import make_receipt
from sdk.protocol.signing import KeyPair

from broker_fixtures import RecordingSession
from broker.api.job_request import job_request
from broker.jobs.presence import Offer


@pytest.fixture
def services(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0,
                                       verification=False))
    yield services
    services.engine.dispose()


def _provider(services, name):
    _, acct = services.auth.create_account_with_key("provider")
    key = KeyPair.generate()
    p = services.providers.connect(acct, key.public_key_hex, name, sandboxed=True,
                                   hardware={}, plugins=[])
    session = RecordingSession(provider_id=p.id, public_key=key.public_key_hex,
                               account_id=acct.account_id, plugins={"echo@1.0.0": ""},
                               offer=Offer(asks=(("echo", 500),)))
    services.dispatcher.register(session)  # the market hears of it, with its ask
    return session, key


def _matched(services, job):
    """``job`` once leased (by this call or by the dispatcher's own thread)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        services.dispatcher.match_once()
        job = services.jobs.repo.get(job.id)
        if job.provider_id is not None:
            return job
        time.sleep(0.01)
    pytest.fail(f"job {job.id} was never assigned")


def _run(services, session, key, *, seen_s, work_units=None, run_ms=None):
    """The job just sent to ``session`` answered ``seen_s`` after the broker sent it, with a
    receipt claiming ``work_units`` (default: the job's) and ``run_ms``."""
    env_bytes, _ = session.sent[-1]
    env = loads(env_bytes)
    job = services.jobs.repo.get(env["job_id"])
    data = b'{"ok":true}'
    sha = services.jobs.store_output(session.provider_id, job.id, env["attempt"], data,
                                     sha256_hex(data))
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha, "media_type": "application/json",
                                 "size": len(data)}],
                       work_units=job.work_units if work_units is None else work_units,
                       timings_ms={"run": int(seen_s * 1000) if run_ms is None else run_ms})
    return services.jobs.receipt(session.provider_id, key.public_key_hex, canonical_bytes(rec),
                                 key.sign("receipt", rec), received_at=job.matched_at + seen_s)


def test_inflated_units_in_a_millisecond_measure_what_the_broker_saw_and_lose(services):
    _, client = services.auth.create_account_with_key("client")
    services.payments.grant(client.account_id, 100_000_000, by="test")
    cheat, cheat_key = _provider(services, "cheat")
    # Cold market: the only provider gets the first job. It takes 2 s as the broker sees
    # it (2 work units), and its receipt claims 20 units in 1 ms.
    first, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {"sleep_ms": 1000}}, services.jobs.catalog))
    assert _matched(services, first).provider_id == cheat.provider_id
    _run(services, cheat, cheat_key, seen_s=2.0, work_units=20.0, run_ms=1)
    theta, measured = services.market.theta(cheat.provider_id, "echo")
    assert measured and theta == pytest.approx(1.0)  # 2 units / 2 s, not 20 / 0.001 s
    # An honest provider, measured at 2 units/s on its own job, now wins at the same ask.
    honest, honest_key = _provider(services, "honest")
    services.market.observe(honest.provider_id, "echo", 2.0, 1000.0)
    for _ in range(3):
        job, _ = services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {"sleep_ms": 1000}}, services.jobs.catalog))
        assert _matched(services, job).provider_id == honest.provider_id
        _run(services, honest, honest_key, seen_s=1.0)


def test_the_agents_queue_is_deducted_only_within_its_bound():
    rec = {"work_units": 4.0, "timings_ms": {"run": 1, "queue": 600}}
    assert timed_sample(rec, 4.0, 100.0, 101.0) == (4.0, 500.0)   # 600 ms claimed: 500 kept
    assert timed_sample({"timings_ms": {"queue": 200}}, 4.0, 100.0, 101.0) == (4.0, 800.0)
    assert timed_sample({"work_units": 2.0}, 4.0, 100.0, 101.0) == (2.0, 1000.0)  # fewer: used
    assert timed_sample({"work_units": 40.0}, 4.0, 100.0, 101.0) == (4.0, 1000.0)  # more: not
    assert timed_sample({"timings_ms": {"queue": "x"}, "work_units": True}, 4.0,
                        100.0, 100.5) == (4.0, 500.0)
    assert timed_sample({}, 4.0, None, 101.0) is None          # never sent by the broker
    assert timed_sample({}, 4.0, 102.0, 101.0) is None         # arrived before it was sent
