"""Checkpoints through the real wiring (SQLite): upload, resume envelope, fetch, the payment
split between the providers of a moved job, stalls taken back, refusals."""
import json

import pytest

from broker.jobs.errors import ReceiptRefused
from broker.jobs.model import JobState
from broker.jobs.stalls import StallSettings, StallWatch
from broker.ledger.model import AccountKind
from broker.services import build_services
from broker.settings import Settings
from broker.storage.checkpoints_sql import leased_jobs
from sdk.protocol.canonical import canonical_bytes, loads, sha256_hex
from sdk.protocol.envelope import make_receipt
from sdk.protocol.signing import KeyPair

from broker_fixtures import RecordingSession
from broker.api.job_request import job_request

MICRO = 1_000_000
C, P = AccountKind.CLIENT_AVAILABLE, AccountKind.PROVIDER_VESTING


@pytest.fixture
def world(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0,
                                       checkpoint_every_steps=2))
    _, client = services.auth.create_account_with_key("client")
    services.payments.grant(client.account_id, 10 * MICRO, by="test")
    services.pricing.set_price("echo", {"reserve_micro_per_unit": 250_000, "fee_bps": 1_000,
                                        "min_charge_micro": 100_000, "vesting_window_s": 3600},
                               by="test")
    agents = []
    for name in ("first", "second"):
        _, acct = services.auth.create_account_with_key("provider")
        key = KeyPair.generate()
        # connected as the gateway records it (advertising echo), so jobs are admitted
        provider = services.providers.connect(acct, key.public_key_hex, name, sandboxed=True,
                                              hardware={}, plugins=[{
                                                  "name": "echo", "version": "1.0.0",
                                                  "weights_digest": "", "warm": True}])
        agents.append((RecordingSession(provider_id=provider.id, public_key=key.public_key_hex,
                                        account_id=acct.account_id,
                                        plugins={"echo@1.0.0": ""}), key, acct))
    yield services, client, agents
    services.engine.dispose()


def _assign(services, session):
    services.dispatcher.register(session)
    try:
        assert services.dispatcher.match_once() == 1
    finally:
        services.dispatcher.unregister(session)
    env_bytes, _ = session.sent[-1]
    env = loads(env_bytes)
    services.jobs.accepted(session.provider_id, env["job_id"], env["attempt"])
    return env, env_bytes


def _finish(services, session, key, env, env_bytes, work_units):
    data = b'{"ok":true}'
    sha = services.jobs.store_output(session.provider_id, env["job_id"], env["attempt"], data,
                                     sha256_hex(data))
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha, "media_type": "application/json",
                                 "size": len(data)}], work_units=work_units, timings_ms={"run": 1})
    signed = (canonical_bytes(rec), key.sign("receipt", rec))
    return services.jobs.receipt(session.provider_id, key.public_key_hex, *signed), signed


def _ckpt(step):
    return json.dumps({"echo_step": step}).encode()


def test_moved_job_resumes_and_each_provider_is_paid_its_steps(world):
    services, client, [(s1, k1, a1), (s2, k2, a2)] = world
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 3000, "steps": 10}}, services.jobs.catalog))
    env, _ = _assign(services, s1)
    assert env["checkpoint_every"] == 2 and "resume" not in env
    cp = services.jobs.checkpoints
    for step in (2, 4, 4, 2):                       # repeats and a late older one: no effect
        cp.upload(s1.provider_id, job.id, 0, step, 10, _ckpt(step), sha256_hex(_ckpt(step)))
    events = [e for e in services.jobs.repo.events_after(job.id, 0) if e.kind == "checkpoint"]
    assert [e.data["step"] for e in events] == [2, 4]
    services.jobs.failed(s1.provider_id, job.id, 0, "host_died", "gone", retryable=True)

    env2, env2_bytes = _assign(services, s2)
    assert env2["attempt"] == 1
    assert env2["resume"] == {"sha256": sha256_hex(_ckpt(4)), "step": 4, "total": 10}
    assert cp.fetch(s2.provider_id, job.id, 1, env2["resume"]["sha256"]) == _ckpt(4)
    with pytest.raises(ReceiptRefused):             # only the holder of the attempt may fetch
        cp.fetch(s1.provider_id, job.id, 1, env2["resume"]["sha256"])
    settled, signed = _finish(services, s2, k2, env2, env2_bytes, work_units=4)
    assert settled.state is JobState.SETTLED
    # 4 units × 250,000 = 1,000,000: 4/10 to the first (400,000 - 10 % fee), 6/10 to the second.
    assert services.ledger.balances(a1.account_id)[P] == 360_000
    assert services.ledger.balances(a2.account_id)[P] == 540_000
    assert services.ledger.balances(client.account_id)[C] == 10 * MICRO - 1_000_000
    assert services.ledger.balances(client.account_id).get(AccountKind.CLIENT_HELD, 0) == 0
    assert services.ledger.verify().ok
    # A re-sent receipt settles nothing twice.
    services.jobs.receipt(s2.provider_id, k2.public_key_hex, *signed)
    assert services.ledger.balances(a1.account_id)[P] == 360_000
    assert services.ledger.balances(client.account_id)[C] == 10 * MICRO - 1_000_000


def test_checkpoints_of_jobs_one_does_not_hold_or_bad_steps_are_refused(world):
    services, client, [(s1, k1, a1), (s2, *_)] = world
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 100, "steps": 10}}, services.jobs.catalog))
    _assign(services, s1)
    cp = services.jobs.checkpoints
    with pytest.raises(ReceiptRefused, match="not leased"):
        cp.upload(s2.provider_id, job.id, 0, 2, 10, _ckpt(2), "")
    with pytest.raises(ReceiptRefused):
        cp.upload(s1.provider_id, job.id, 0, 11, 10, _ckpt(11), "")
    with pytest.raises(ReceiptRefused, match="hashes"):
        cp.upload(s1.provider_id, job.id, 0, 2, 10, _ckpt(2), "0" * 64)


def test_short_jobs_never_checkpoint(world):
    services, client, [(s1, *_), _] = world
    services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {"sleep_ms": 100, "steps": 3}}, services.jobs.catalog))
    env, _ = _assign(services, s1)
    assert "checkpoint_every" not in env


def test_a_job_running_far_past_its_bound_is_taken_back(world):
    services, client, [(s1, *_), _] = world
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 100, "steps": 10}}, services.jobs.catalog))
    _assign(services, s1)
    now = [services.jobs.repo.get(job.id).matched_at]
    watch = StallWatch(lambda j: 120.0, lambda j: None, settings=StallSettings(factor=1.5),
                       clock=lambda: now[0],
                       leased=lambda: leased_jobs(services.jobs.repo.sessions))
    assert watch.reap(services.jobs) == []
    now[0] += 1.5 * 120 + services.jobs.settings.lease_timeout_s + 1
    [moved] = watch.reap(services.jobs)
    assert moved.state is JobState.QUEUED and moved.attempt == 1
    assert s1.provider_id in moved.excluded_providers


def test_progress_is_idempotent_and_only_moves_forward(world):
    services, client, [(s1, *_), _] = world
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 100, "steps": 10}}, services.jobs.catalog))
    _assign(services, s1)
    for step in (1, 2, 2, 1, 3, 3):                 # re-sent and late reports
        services.jobs.progress(s1.provider_id, job.id, 0, step, 10)
    steps = [e.data["step"] for e in services.jobs.repo.events_after(job.id, 0)
             if e.kind == "progress"]
    assert steps == [1, 2, 3]
    assert services.jobs.repo.get(job.id).progress_step == 3


def test_cancel_after_a_resume_pays_each_provider_its_steps(world):
    services, client, [(s1, k1, a1), (s2, k2, a2)] = world
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 3000, "steps": 10}}, services.jobs.catalog))
    _assign(services, s1)
    cp = services.jobs.checkpoints
    cp.upload(s1.provider_id, job.id, 0, 4, 10, _ckpt(4), "")
    services.jobs.failed(s1.provider_id, job.id, 0, "host_died", "gone", retryable=True)
    _assign(services, s2)
    services.jobs.progress(s2.provider_id, job.id, 1, 9, 10)  # claimed: never paid
    cp.upload(s2.provider_id, job.id, 1, 7, 10, _ckpt(7), "")  # shown: paid
    services.jobs.cancel(client, job.id)
    # 4 units × 250,000: the first did 4/10, the second 3/10 (7 - 4); fee 10 % of each.
    assert services.ledger.balances(a1.account_id)[P] == 360_000
    assert services.ledger.balances(a2.account_id)[P] == 270_000
    assert services.ledger.balances(client.account_id)[C] == 10 * MICRO - 700_000
    assert services.ledger.verify().ok


def test_cancel_while_requeued_pays_the_checkpointed_steps_only(world):
    services, client, [(s1, k1, a1), _] = world
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 3000, "steps": 10}}, services.jobs.catalog))
    _assign(services, s1)
    services.jobs.checkpoints.upload(s1.provider_id, job.id, 0, 6, 10, _ckpt(6), "")
    services.jobs.failed(s1.provider_id, job.id, 0, "host_died", "gone", retryable=True)
    services.jobs.cancel(client, job.id)
    assert services.ledger.balances(a1.account_id)[P] == 540_000
    assert services.ledger.balances(client.account_id)[C] == 10 * MICRO - 600_000
    assert services.ledger.verify().ok


def test_the_stall_bound_follows_the_expected_duration_when_it_is_longer():
    watch = StallWatch(lambda j: 120.0, lambda j: 1000.0 if j == "slow" else None,
                       settings=StallSettings(factor=1.5))
    assert watch.bound_s("slow", lease_timeout_s=10) == 1.5 * 1000 + 10
    assert watch.bound_s("fast", lease_timeout_s=10) == 1.5 * 120 + 10


def _refusal(cp, session, job, step, total) -> ReceiptRefused:
    with pytest.raises(ReceiptRefused) as refused:
        cp.upload(session.provider_id, job.id, 0, step, total, _ckpt(step), "")
    return refused.value


def test_a_checkpoint_is_refused_unless_the_job_asked_for_it_at_its_own_step_count(world):
    """Issue #20: a checkpoint's step and total were the agent's word, and what a cancel
    or a resume pays follows them: a 10-step job's checkpoint claimed as step 1 of 1 was
    taken as all of it. The total must be the job's own step count, the step inside the
    attempt's part of it, and the job must have asked for checkpoints."""
    services, client, [(s1, *_), (s2, *_)] = world
    cp = services.jobs.checkpoints
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 100, "steps": 10}}, services.jobs.catalog))
    _assign(services, s1)
    for step, total, code in ((1, 1, "bad_checkpoint_total"), (2, 20, "bad_checkpoint_total"),
                              (10, 10, "bad_checkpoint_step"), (0, 10, "bad_checkpoint_step")):
        assert _refusal(cp, s1, job, step, total).code == code, (step, total)
    assert "runs 10 steps" in str(_refusal(cp, s1, job, 2, 20))
    assert cp.upload(s1.provider_id, job.id, 0, 2, 10, _ckpt(2), "") is not None
    # A job too short to checkpoint asked for none: none is kept.
    short, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                             "inputs": {"sleep_ms": 100, "steps": 3}}, services.jobs.catalog))
    env, _ = _assign(services, s2)
    assert env["job_id"] == short.id and "checkpoint_every" not in env
    with pytest.raises(ReceiptRefused) as refused:
        cp.upload(s2.provider_id, short.id, 0, 1, 3, _ckpt(1), "")
    assert refused.value.code == "checkpoint_not_asked"


def test_an_img2img_checkpoint_counts_the_steps_diffusers_runs(world):
    """Image-to-image runs min(int(steps × strength), steps) denoising steps, and its
    checkpoints say so: the broker computes that total from the job's inputs."""
    import time
    import uuid

    from broker.jobs.model import Job

    services, client, [(s1, k1, a1), _] = world
    version = services.catalog.get("sd15").version
    session = RecordingSession(provider_id=s1.provider_id, public_key=s1.public_key,
                               account_id=s1.account_id, plugins={f"sd15@{version}": ""})
    now = time.time()
    job, _ = services.jobs.repo.create(
        Job(id=str(uuid.uuid4()), account_id=client.account_id, plugin="sd15",
            plugin_version=version, state=JobState.QUEUED, created_at=now, updated_at=now,
            inputs={"prompt": "a boat", "steps": 30, "strength": 0.5, "init_image": "iVBO",
                    "seed": 1}), ("queued", {}))
    job = services.jobs.assign(job, session)
    assert job.envelope["checkpoint_every"] == 2
    cp = services.jobs.checkpoints
    with pytest.raises(ReceiptRefused) as refused:  # the txt2img count: not this run's
        cp.upload(s1.provider_id, job.id, 0, 4, 30, _ckpt(4), "")
    assert refused.value.code == "bad_checkpoint_total"
    assert cp.upload(s1.provider_id, job.id, 0, 4, 15, _ckpt(4), "") is not None
    with pytest.raises(ReceiptRefused):
        cp.upload(s1.provider_id, job.id, 0, 15, 15, _ckpt(15), "")


def test_a_checkpoint_kept_with_another_total_is_neither_resumed_nor_paid(world):
    """A checkpoint row with a total other than the job's (kept before the broker checked
    it) credits nothing: a cancel pays for none of it and a resume does not start there."""
    from broker.jobs.checkpoints import CheckpointRecord

    services, client, [(s1, k1, a1), (s2, *_)] = world
    job, _ = services.jobs.submit(client, job_request({"plugin": "echo",
                                           "inputs": {"sleep_ms": 3000, "steps": 10}}, services.jobs.catalog))
    _assign(services, s1)
    cp = services.jobs.checkpoints
    sha = services.jobs.blobs.put(_ckpt(1))
    cp.repo.save(CheckpointRecord(job_id=job.id, attempt=0, provider_id=s1.provider_id,
                                  base_step=0, step=1, total=1, sha256=sha, size=1,
                                  rate_micro_per_unit=None, created_at=0.0))
    assert services.jobs.shown_fraction(services.jobs.repo.get(job.id)) == 0
    services.jobs.failed(s1.provider_id, job.id, 0, "host_died", "gone", retryable=True)
    env2, _ = _assign(services, s2)
    assert "resume" not in env2
    services.jobs.cancel(client, job.id)
    assert services.ledger.balances(a1.account_id).get(P, 0) == 0
    assert services.ledger.verify().ok
