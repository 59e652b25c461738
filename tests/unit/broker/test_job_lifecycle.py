"""JobService: the lifecycle of DESIGN §2 against a real (SQLite) repository."""
import pytest

from broker.errors import IdempotencyConflict, InvalidInput, InvalidRequest, UnknownPlugin
from broker.jobs.errors import JobNotCancellable, JobNotFound, ReceiptRefused
from broker.jobs.model import JobState
from sdk.protocol.canonical import canonical_bytes, loads, sha256_hex
from sdk.protocol.envelope import make_receipt
from sdk.protocol.signing import KeyPair

from broker_fixtures import RecordingSession, dispatcher_for, make_world
from broker.api.job_request import job_request


@pytest.fixture
def world(tmp_path):
    engine, auth, jobs, clock = make_world(f"sqlite:///{tmp_path / 'b.db'}", tmp_path)
    _, client = auth.create_account_with_key("client")
    _, provider_acct = auth.create_account_with_key("provider")
    yield jobs, clock, client, provider_acct
    engine.dispose()


def _session(key: KeyPair, pid="prov-1"):
    return RecordingSession(provider_id=pid, public_key=key.public_key_hex,
                            account_id="acct", plugins={"echo@1.0.0": ""})


def _provider(jobs, pid="prov-1"):
    """A dispatcher with one provider session (serving echo) registered: (session, key, d)."""
    key = KeyPair.generate()
    s = _session(key, pid)
    d = dispatcher_for(jobs)
    d.register(s)
    return s, key, d


def _matched(world, inputs=None, pid="prov-1"):
    """One echo job submitted and matched to a registered provider session ``pid``:
    (job, session, key, dispatcher)."""
    jobs, _, client, _ = world
    s, key, d = _provider(jobs, pid)
    job, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": inputs or {}}, jobs.catalog))
    assert d.match_once() == 1
    return job, s, key, d


def _finish(jobs, job, session, key: KeyPair, data=b'{"ok":true}'):
    env_bytes, _ = session.sent[-1]
    env = loads(env_bytes)
    sha = jobs.store_output(session.provider_id, job.id, env["attempt"], data, sha256_hex(data))
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha, "media_type": "application/json",
                                 "size": len(data)}], work_units=1.0, timings_ms={"run": 1})
    return rec, canonical_bytes(rec), key.sign("receipt", rec)


def test_submit_match_run_settle(world):
    jobs, clock, client, _ = world
    s, key, d = _provider(jobs)
    job, created = jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "hi"}}, jobs.catalog))
    assert created and job.state == JobState.QUEUED and job.inputs["sleep_ms"] == 0
    assert d.match_once() == 1 and len(s.sent) == 1
    jobs.accepted(s.provider_id, job.id, 0)
    jobs.progress(s.provider_id, job.id, 0, 1, 2)
    _, blob, sig = _finish(jobs, job, s, key)
    settled = jobs.receipt(s.provider_id, key.public_key_hex, blob, sig)
    assert settled.state == JobState.SETTLED
    kinds = [e.kind for e in jobs.events(client, job.id)]
    assert kinds == ["queued", "assigned", "running", "progress", "submitted", "done"]
    # The same receipt again (a reconnecting agent) is accepted once, changes nothing.
    assert jobs.receipt(s.provider_id, key.public_key_hex, blob, sig).state == JobState.SETTLED
    assert [e.kind for e in jobs.events(client, job.id)] == kinds
    out, data = jobs.output(client, job.id, 0)
    assert data == b'{"ok":true}' and out.media_type == "application/json"
    assert s.active == set()


def test_wait_returns_the_job_when_it_ends_or_as_it_is_at_the_deadline(world):
    import threading
    import time

    jobs, _, client, _ = world
    s, key, d = _provider(jobs)
    job, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, jobs.catalog))
    got = {}

    def waiter(name, timeout_s):
        got[name] = jobs.wait(client, job.id, timeout_s)

    # Woken by the assignment (not an end): keeps waiting, then returns the job as it is.
    t = threading.Thread(target=waiter, args=("deadline", 0.5))
    t.start()
    time.sleep(0.1)
    d.match_once()
    t.join(5)
    assert got["deadline"].state == JobState.MATCHED
    # Woken by "running" (keeps waiting), then by the settlement (returns at once).
    t = threading.Thread(target=waiter, args=("end", 30))
    t.start()
    time.sleep(0.1)
    jobs.accepted(s.provider_id, job.id, 0)
    _, blob, sig = _finish(jobs, job, s, key)
    started = time.monotonic()
    jobs.receipt(s.provider_id, key.public_key_hex, blob, sig)
    t.join(5)
    assert got["end"].state == JobState.SETTLED and time.monotonic() - started < 5


def test_wait_on_a_copy_from_before_the_job_ended_returns_the_end_at_once(world):
    """POST /v1/jobs with Prefer: wait hands ``wait`` its copy from submit; a fast job can
    end before ``wait`` starts, and no later notification comes to say so."""
    import time

    jobs, _, client, _ = world
    s, key, d = _provider(jobs)
    job, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, jobs.catalog))
    d.match_once()
    jobs.accepted(s.provider_id, job.id, 0)
    _, blob, sig = _finish(jobs, job, s, key)
    jobs.receipt(s.provider_id, key.public_key_hex, blob, sig)
    started = time.monotonic()
    got = jobs.wait(client, job.id, 30, job=job)  # ``job`` still says queued
    assert got.state == JobState.SETTLED
    assert time.monotonic() - started < 4  # not a 5 s quiet slice, then a re-read


def test_forged_receipt_is_refused_and_moves_nothing(world):
    jobs, _, client, _ = world
    job, s, key, _ = _matched(world)
    rec, blob, _sig = _finish(jobs, job, s, key)
    thief = KeyPair.generate()
    with pytest.raises(ReceiptRefused) as exc:
        jobs.receipt(s.provider_id, key.public_key_hex, blob, thief.sign("receipt", rec))
    assert exc.value.code == "bad_signature"
    # A valid signature by another provider for a job it does not hold.
    other = {**rec, "provider": thief.public_key_hex}
    with pytest.raises(ReceiptRefused) as exc:
        jobs.receipt("prov-2", thief.public_key_hex, canonical_bytes(other),
                     thief.sign("receipt", other))
    assert exc.value.code == "not_your_job"
    assert jobs.get(client, job.id).state == JobState.MATCHED


def test_expired_lease_requeues_to_another_provider_then_fails(world):
    jobs, clock, client, _ = world
    job, s1, _, d = _matched(world, pid="p1")
    d.register(_session(KeyPair.generate(), "p2"))
    clock.advance(11)
    assert [j.state for j in jobs.reap_expired()] == [JobState.QUEUED]
    assert s1.cancels and s1.active == set()
    d.match_once()
    again = jobs.get(client, job.id)
    assert again.attempt == 1 and again.provider_id == "p2"   # p1 failed it: p2 preferred
    # Late messages from p1 about attempt 0 move nothing: the job moved on.
    jobs.accepted("p1", job.id, 0)
    assert jobs.get(client, job.id).provider_id == "p2"
    with pytest.raises(ReceiptRefused, match="not leased to you"):
        jobs.progress("p1", job.id, 0, 1, 1)
    clock.advance(11)
    jobs.reap_expired()
    d.match_once()
    clock.advance(11)
    jobs.reap_expired()
    final = jobs.get(client, job.id)
    assert final.state == JobState.FAILED and final.error_code == "attempts_exhausted"


def test_give_back_requeues_without_using_an_attempt(world):
    jobs, _, client, _ = world
    job, s, _, _ = _matched(world)
    moved = jobs.give_back(s.provider_id, job.id, 0, "operator stopped the agent")
    assert moved.state == JobState.QUEUED and moved.attempt == 1 and moved.max_attempts == 3


def test_cancel_running_job_tells_the_agent(world):
    jobs, _, client, _ = world
    job, s, _, _ = _matched(world, {"sleep_ms": 1000})
    cancelled = jobs.cancel(client, job.id)
    assert cancelled.state == JobState.CANCELLED and s.cancels[0][0] == job.id
    assert jobs.cancel(client, job.id).state == JobState.CANCELLED  # idempotent


def test_settled_job_cannot_be_cancelled(world):
    jobs, _, client, _ = world
    job, s, key, _ = _matched(world)
    _, blob, sig = _finish(jobs, job, s, key)
    jobs.receipt(s.provider_id, key.public_key_hex, blob, sig)
    with pytest.raises(JobNotCancellable, match="already settled"):
        jobs.cancel(client, job.id)


@pytest.mark.parametrize("body,error,field", [
    ({"plugin": "nope"}, UnknownPlugin, "plugin"),
    ({"plugin": "echo", "version": "9.9.9"}, UnknownPlugin, "version"),
    ({"plugin": "echo", "inputs": {"sleep_ms": -1}}, InvalidInput, "inputs.sleep_ms"),
    ({"plugin": "echo", "inputs": {"text": 3}}, InvalidInput, "inputs.text"),
    ({"plugin": "echo", "inputs": {"bogus": 1}}, InvalidInput, "inputs.bogus"),
    ({"plugin": "echo", "colour": "red"}, InvalidRequest, "colour"),
    (["not", "an", "object"], InvalidRequest, None),
])
def test_bad_requests_create_no_job(world, body, error, field):
    jobs, _, client, _ = world
    with pytest.raises(error) as exc:
        jobs.submit(client, job_request(body, jobs.catalog))
    assert exc.value.field == field
    assert jobs.repo.counts_by_state() == {}


def test_idempotency_key(world):
    jobs, _, client, _ = world
    a, created = jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "a"}}, jobs.catalog), "key-1")
    b, created2 = jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "a"}}, jobs.catalog), "key-1")
    assert created and not created2 and a.id == b.id
    with pytest.raises(IdempotencyConflict):
        jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "b"}}, jobs.catalog), "key-1")
    assert jobs.repo.counts_by_state() == {"queued": 1}


def test_jobs_are_private_to_their_account(world):
    jobs, _, client, provider = world
    job, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, jobs.catalog))
    with pytest.raises(JobNotFound):
        jobs.get(provider, job.id)
    with pytest.raises(JobNotFound):
        jobs.get(client, "not-a-uuid")


@pytest.mark.parametrize("bad,why,code", [
    ({"index": 0, "sha256": "f" * 64, "media_type": "image/png", "size": 1, "meta": ["x"]},
     "meta must be an object", "malformed_receipt"),
    ({"index": 1, "sha256": "f" * 64, "media_type": "image/png", "size": 1}, "index must be 0",
     "malformed_receipt"),
    ({"index": 0, "sha256": "zz", "media_type": "image/png", "size": 1}, "sha256",
     "malformed_receipt"),
    ({"index": 0, "sha256": "f" * 64, "media_type": "png", "size": 1}, "media_type",
     "malformed_receipt"),
    ({"index": 0, "sha256": "f" * 64, "media_type": "image/png", "size": -1}, "size",
     "malformed_receipt"),
    ("not an object", "not an object", "malformed_receipt"),
    # well formed, but names an output that was never uploaded
    ({"index": 0, "sha256": "f" * 64, "media_type": "image/png", "size": 1}, "not uploaded",
     "output_missing"),
])
def test_a_bad_receipt_is_refused_and_the_job_keeps_its_lease(world, bad, why, code):
    """Every byte of a receipt is the provider's: what the broker and verification read
    must have the documented shape, and every output it names must have been uploaded, or
    the receipt is refused (nothing settles)."""
    jobs, _, _, _ = world
    job, s, key, _ = _matched(world)
    env_bytes, _ = s.sent[-1]
    env = loads(env_bytes)
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[bad], work_units=1, timings_ms={})
    with pytest.raises(ReceiptRefused, match=why) as err:
        jobs.receipt(s.provider_id, key.public_key_hex, canonical_bytes(rec),
                     key.sign("receipt", rec))
    assert err.value.code == code
    assert jobs.repo.get(job.id).state.value == "matched"


def test_a_provider_that_needs_no_download_is_preferred_then_any_other(world):
    """The marketplace's warm preference: a job naming an adapter goes to a provider that
    has it installed; when none is free, to one that must download it first."""
    jobs, _, client, _ = world
    cold, warm = _session(KeyPair.generate(), "cold"), _session(KeyPair.generate(), "warm")
    d = dispatcher_for(jobs)
    d.needs_download = lambda pid, job: pid == "cold" and job.inputs.get("text") == "ink"
    d.register(cold)
    d.register(warm)
    first, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "ink"}}, jobs.catalog))
    d.match_once()
    assert jobs.repo.get(first.id).provider_id == "warm"
    second, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "ink"}}, jobs.catalog))
    d.match_once()
    assert jobs.repo.get(second.id).provider_id == "cold"  # the warm one is busy


def test_outputs_sent_with_the_receipt_are_stored_once_it_verifies(world):
    """Small outputs travel in the receipt's message: stored only after the signature and
    the lease check, and only ones the receipt names; a refused receipt stores nothing."""
    jobs, _, client, _ = world
    job, s, key, _ = _matched(world)
    env_bytes, _ = s.sent[-1]
    env = loads(env_bytes)
    data = b'{"inline":true}'
    sha = sha256_hex(data)
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha, "media_type": "application/json",
                                 "size": len(data)}], work_units=1.0, timings_ms={"run": 1})
    blob = canonical_bytes(rec)
    stray = b"not named by the receipt"
    with pytest.raises(ReceiptRefused) as exc:
        jobs.receipt(s.provider_id, key.public_key_hex, blob, key.sign("receipt", rec),
                     uploads=[(data, sha), (stray, sha256_hex(stray))])
    assert exc.value.code == "output_not_in_receipt"
    with pytest.raises(ReceiptRefused) as exc:  # forged: nothing is stored
        jobs.receipt(s.provider_id, key.public_key_hex, blob,
                     KeyPair.generate().sign("receipt", rec), uploads=[(data, sha)])
    assert exc.value.code == "bad_signature"
    assert not jobs.blobs.exists(sha256_hex(stray)) and not jobs.blobs.exists(sha)
    assert jobs.repo.get(job.id).state == JobState.MATCHED
    settled = jobs.receipt(s.provider_id, key.public_key_hex, blob, key.sign("receipt", rec),
                           uploads=[(data, sha)])
    assert settled.state == JobState.SETTLED
    assert jobs.output(client, job.id, 0)[1] == data


def _inline_receipt(session, key: KeyPair, data: bytes):
    env_bytes, _ = session.sent[-1]
    env = loads(env_bytes)
    sha = sha256_hex(data)
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha, "media_type": "application/json",
                                 "size": len(data)}], work_units=1.0, timings_ms={"run": 1})
    return canonical_bytes(rec), key.sign("receipt", rec), [(data, sha)]


def test_a_receipt_settles_on_the_lease_as_assigned_without_reading_the_job_back(world):
    jobs, _, client, _ = world
    job, s, key, _ = _matched(world)
    blob, sig, uploads = _inline_receipt(s, key, b'{"fast":true}')
    reads = []
    real_get = jobs.repo.get
    jobs.repo.get = lambda job_id: reads.append(job_id) or real_get(job_id)
    settled = jobs.receipt(s.provider_id, key.public_key_hex, blob, sig, uploads=uploads)
    assert settled.state == JobState.SETTLED and reads == []
    # Sent again (a reconnect): judged on the row, and idempotent.
    assert jobs.receipt(s.provider_id, key.public_key_hex, blob, sig).state == JobState.SETTLED
    assert reads == [job.id]
    assert jobs.output(client, job.id, 0)[1] == b'{"fast":true}'


def test_a_receipt_for_a_job_that_moved_since_it_was_assigned_is_judged_on_the_row(world):
    """The lease as assign() wrote it is out of date (the client cancelled): the receipt
    is refused as before, its outputs are not stored, and the job stays cancelled."""
    jobs, _, client, _ = world
    job, s, key, _ = _matched(world, {"sleep_ms": 1000})
    jobs.cancel(client, job.id)
    data = b'{"late":true}'
    blob, sig, uploads = _inline_receipt(s, key, data)
    with pytest.raises(ReceiptRefused) as exc:
        jobs.receipt(s.provider_id, key.public_key_hex, blob, sig, uploads=uploads)
    assert exc.value.code == "not_your_job"
    assert not jobs.blobs.exists(sha256_hex(data))
    assert jobs.get(client, job.id).state == JobState.CANCELLED


def test_a_late_receipt_for_an_earlier_attempt_is_refused(world):
    jobs, clock, client, _ = world
    job, s, key, d = _matched(world)
    blob, sig, uploads = _inline_receipt(s, key, b'{"attempt":0}')
    clock.advance(11)
    jobs.reap_expired()
    d.match_once()  # attempt 1, to the same provider (the only one)
    assert jobs.get(client, job.id).attempt == 1
    with pytest.raises(ReceiptRefused) as exc:
        jobs.receipt(s.provider_id, key.public_key_hex, blob, sig, uploads=uploads)
    assert exc.value.code == "not_your_job"
    assert jobs.get(client, job.id).state == JobState.MATCHED


def _machine(d, pid: str, operator: str) -> tuple[RecordingSession, KeyPair]:
    """A provider session ``pid`` of ``operator`` serving echo, registered with ``d``."""
    key = KeyPair.generate()
    s = RecordingSession(provider_id=pid, public_key=key.public_key_hex, account_id=operator,
                         plugins={"echo@1.0.0": ""})
    d.register(s)
    return s, key


def _refused_once(world, counted: list):
    """Providers of two operators; an echo job assigned to one of them, which refuses its
    input (``bad_input``); failures that count go to ``counted``.
    Returns (job, the refusing session, the requeued job, {pid: (session, key)}, d)."""
    jobs, _, client, _ = world
    jobs.on_failure = lambda provider_id, plugin: counted.append(provider_id)
    d = dispatcher_for(jobs)
    machines = {pid: _machine(d, pid, op) for pid, op in (("a1", "op-a"), ("b1", "op-b"))}
    job, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, jobs.catalog))
    assert d.match_once() == 1
    first, _ = _holder(machines)
    moved = jobs.failed(first.provider_id, job.id, 0, "bad_input", "prompt too long", False)
    return job, first, moved, machines, d


def _holder(machines):
    held = [(s, key) for s, key in machines.values() if s.active]
    assert len(held) == 1
    return held[0]


def test_a_refused_input_goes_to_another_operator_and_a_second_refusal_fails_it(world):
    jobs = world[0]
    counted = []
    job, first, moved, machines, d = _refused_once(world, counted)
    assert moved.state is JobState.QUEUED and counted == []  # not the provider's fault yet
    # a machine of the refuser's operator that connects now never gets it
    twin, _ = _machine(d, first.provider_id[0] + "2", first.account_id)
    for _ in range(3):
        assert d.match_once() <= 1
    assert twin.sent == [] and len(first.sent) == 1
    second, _ = _holder(machines)
    assert second.account_id != first.account_id
    failed = jobs.failed(second.provider_id, job.id, 1, "bad_input", "prompt too long", False)
    assert failed.state is JobState.FAILED and failed.error_code == "bad_input"
    assert "two operators" in failed.error_message
    assert counted == []  # confirmed by two operators: the client's input, nobody's fault


def test_a_refusal_another_operator_proves_wrong_counts_against_the_refuser(world):
    jobs, _, client, _ = world
    counted = []
    job, first, _, machines, d = _refused_once(world, counted)
    d.match_once()
    second, key = _holder(machines)
    _, blob, sig = _finish(jobs, job, second, key)
    assert jobs.receipt(second.provider_id, key.public_key_hex, blob, sig).state is \
        JobState.SETTLED
    assert counted == [first.provider_id]
    requeued = [e for e in jobs.events(client, job.id) if e.kind == "requeued"]
    assert [(e.data["why"], e.data["provider_id"]) for e in requeued] == [
        ("input_disputed", first.provider_id)]


def test_with_one_operator_a_refused_input_fails_at_once_and_counts(world):
    jobs, _, client, _ = world
    counted = []
    jobs.on_failure = lambda provider_id, plugin: counted.append(provider_id)
    job, s, key, d = _matched(world)
    failed = jobs.failed(s.provider_id, job.id, 0, "bad_input", "prompt too long", False)
    assert failed.state is JobState.FAILED and failed.error_code == "bad_input"
    assert counted == [s.provider_id]  # nobody could confirm it: counted as any failure
    # other failures count as before, retryable or not
    job2, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "2"}}, jobs.catalog))
    d.match_once()
    assert jobs.failed(s.provider_id, job2.id, 0, "oom", "out of memory", True).state is \
        JobState.QUEUED
    assert counted == [s.provider_id, s.provider_id]


def test_the_broker_fixes_the_seed_of_a_job_whose_client_gave_none(world):
    """Issue #20: every run of a job (its provider, a check) gets the broker's seed, so a
    provider cannot return an image made with a seed of its choosing and have its check
    re-run with that one. A retry with the same idempotency key is the same job, seed and
    all; a client's own seed stands; a plugin without a seed input gets none."""
    jobs, _, client, _ = world
    body = {"plugin": "sd15", "inputs": {"prompt": "a lighthouse", "steps": 2}}
    first, created = jobs.submit(client, job_request(body, jobs.catalog), "unseeded-1")
    seed = first.inputs["seed"]
    assert created and isinstance(seed, int) and 0 <= seed <= 2**31
    again, created = jobs.submit(client, job_request(body, jobs.catalog), "unseeded-1")
    assert not created and again.id == first.id and again.inputs["seed"] == seed
    other, _ = jobs.submit(client, job_request(body, jobs.catalog))
    assert other.inputs["seed"] != seed  # drawn per job (a clash: 1 in 2**31)
    own, _ = jobs.submit(client, job_request({**body, "inputs": {**body["inputs"], "seed": 7}}, jobs.catalog))
    assert own.inputs["seed"] == 7
    split, _ = jobs.submit(client, job_request({**body, "n": 2}, jobs.catalog))
    siblings = jobs.batch(client, split.batch_id)
    assert [j.inputs["seed"] - siblings[0].inputs["seed"] for j in siblings] == [0, 1]
    echo, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": "hi"}}, jobs.catalog))
    assert "seed" not in echo.inputs
