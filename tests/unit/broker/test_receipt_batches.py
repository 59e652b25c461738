"""Receipts settled as a batch (issue #28): one transaction for the batch, each receipt judged
alone (its own signature, its own refusal), re-sent and moved ones judged as if they came
alone, and a batch whose transaction fails settled one at a time. Money and the audit
chain as for single receipts, through the real wiring (SQLite and PostgreSQL: the batch's
multi-row statements are PostgreSQL's)."""
import pytest

from broker.errors import BrokerError
from broker.ledger.model import AccountKind, HoldState
from broker.api.job_request import job_request
from sdk.protocol.canonical import canonical_bytes, loads, sha256_hex
from sdk.protocol.envelope import make_receipt
from sdk.protocol.signing import KeyPair

from broker_fixtures import echo_world

MICRO = 1_000_000
P = AccountKind.PROVIDER_VESTING


@pytest.fixture
def world(tmp_path, db_url):
    services, client, prov_acct, session, key = echo_world(tmp_path, slots=8, db_url=db_url)
    services.payments.grant(client.account_id, 10 * MICRO, by="test")
    yield services, client, prov_acct, session, key
    services.engine.dispose()


def _assigned(services, client, session, n):
    """``n`` jobs submitted and assigned to ``session``: [(job, envelope bytes)]."""
    jobs = [services.jobs.submit(client, job_request({"plugin": "echo", "inputs": {"text": str(i)}},
                                                     services.jobs.catalog))[0]
            for i in range(n)]
    services.dispatcher.match_once()
    by_id = {loads(env)["job_id"]: env for env, _ in session.sent}
    assert set(by_id) >= {j.id for j in jobs}
    return [(j, by_id[j.id]) for j in jobs]


def _item(key, env_bytes, data=b'{"ok":true}'):
    env = loads(env_bytes)
    rec = make_receipt(envelope=env, envelope_bytes=env_bytes, provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha256_hex(data),
                                 "media_type": "application/json", "size": len(data)}],
                       work_units=1, timings_ms={"run": 1})
    return (canonical_bytes(rec), key.sign("receipt", rec), [(data, sha256_hex(data))], None)


def _count_transactions(services, monkeypatch):
    """How many outermost atomic blocks the job repository opens."""
    from broker.storage import base
    count = {"n": 0}
    real = services.jobs.repo.atomic

    def counting():
        if base.current(services.engine) is None:
            count["n"] += 1
        return real()
    monkeypatch.setattr(services.jobs.repo, "atomic", counting)
    return count


def _all_settled_once(services, prov, jobs):
    for job in jobs:
        assert services.jobs.repo.get(job.id).state.value == "settled"
        assert services.ledger.get_hold(job.hold_id).state is HoldState.POSTED
    # 1 unit × 250,000 each, 10 % fee: 225,000 to the provider per job, each paid once
    assert services.ledger.balances(prov.account_id).get(P, 0) == 225_000 * len(jobs)
    assert services.ledger.verify().ok and services.audit.verify().ok


def test_a_batch_settles_in_one_transaction(world, monkeypatch):
    services, client, prov, session, key = world
    assigned = _assigned(services, client, session, 5)
    count = _count_transactions(services, monkeypatch)
    results = services.jobs.receipts(session.provider_id, key.public_key_hex,
                                     [_item(key, env) for _, env in assigned])
    assert [r.id for r in results] == [j.id for j, _ in assigned]
    assert all(r.state.value == "settled" for r in results)
    # one for the settlements with their posts and audit entries, then one per job for
    # verification's draw, after the commit, as when a job settles alone
    assert count["n"] == 1 + len(assigned)
    # every job of the batch was drawn for verification: a record each (a draw made inside
    # the batch's transaction could not write on SQLite, and the job went unchecked)
    assert all(services.verification.repo.get(j.id) is not None for j, _ in assigned)
    _all_settled_once(services, prov, [j for j, _ in assigned])
    assert session.free == session.slots  # every slot freed
    settled_audit = [e for e in services.audit.search(limit=100) if e.action == "ledger.post"]
    assert len(settled_audit) == 5  # one chained entry per job's post


def test_each_receipt_of_a_batch_is_judged_alone(world):
    services, client, prov, session, key = world
    assigned = _assigned(services, client, session, 4)
    items = [_item(key, env) for _, env in assigned]
    data, _, uploads, at = items[1]
    items[1] = (data, KeyPair.generate().sign("receipt", loads(data)), uploads, at)  # forged
    items.append(items[0])  # the same receipt twice: settled once, acked twice
    results = services.jobs.receipts(session.provider_id, key.public_key_hex, items)
    assert isinstance(results[1], BrokerError) and results[1].code == "bad_signature"
    for i in (0, 2, 3, 4):
        assert results[i].state.value == "settled", i
    assert results[4].id == results[0].id
    good = [assigned[i][0] for i in (0, 2, 3)]
    _all_settled_once(services, prov, good)
    assert services.jobs.repo.get(assigned[1][0].id).state.value in ("matched", "running")
    # The forged one's real receipt still settles later.
    again = services.jobs.receipts(session.provider_id, key.public_key_hex,
                                   [_item(key, assigned[1][1])])
    assert again[0].state.value == "settled"
    _all_settled_once(services, prov, [j for j, _ in assigned])


def test_a_receipt_for_a_job_that_moved_is_refused_and_the_rest_settle(world):
    services, client, prov, session, key = world
    assigned = _assigned(services, client, session, 3)
    services.jobs.cancel(client, assigned[2][0].id)
    results = services.jobs.receipts(session.provider_id, key.public_key_hex,
                                     [_item(key, env) for _, env in assigned])
    assert isinstance(results[2], BrokerError) and results[2].code == "not_your_job"
    _all_settled_once(services, prov, [assigned[0][0], assigned[1][0]])
    assert services.jobs.repo.get(assigned[2][0].id).state.value == "cancelled"


def test_a_batch_whose_transaction_fails_settles_one_at_a_time(world, monkeypatch):
    services, client, prov, session, key = world
    assigned = _assigned(services, client, session, 3)
    real_put, calls = services.jobs.blobs.put, {"n": 0}

    def put_failing_once(blob):  # the third settlement's output: the batch rolls back
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real_put(blob)
    monkeypatch.setattr(services.jobs.blobs, "put", put_failing_once)
    count = _count_transactions(services, monkeypatch)
    results = services.jobs.receipts(session.provider_id, key.public_key_hex,
                                     [_item(key, env) for _, env in assigned])
    assert all(r is not None and r.state.value == "settled" for r in results)
    # the batch (rolled back), then at least one per receipt
    assert count["n"] >= 1 + 3
    _all_settled_once(services, prov, [j for j, _ in assigned])


def test_a_failure_after_the_commit_for_one_job_does_not_stop_the_others(world, monkeypatch):
    services, client, prov, session, key = world
    assigned = _assigned(services, client, session, 3)
    first = assigned[0][0].id
    real_released, real_notify = services.jobs.job_events.released, services.jobs.hub.notify
    woken = []

    def released(provider_id, job_id):  # the dispatcher's bus down for the first job
        if job_id == first:
            raise ConnectionError("bus down")
        return real_released(provider_id, job_id)

    def notify(job_id, *args, **kwargs):  # and the hub failing for it too
        if job_id == first:
            raise RuntimeError("hub failed")
        woken.append(job_id)
        return real_notify(job_id, *args, **kwargs)
    monkeypatch.setattr(services.jobs.job_events, "released", released)
    monkeypatch.setattr(services.jobs.hub, "notify", notify)
    results = services.jobs.receipts(session.provider_id, key.public_key_hex,
                                     [_item(key, env) for _, env in assigned])
    # every receipt is answered (the batch's Ack comes), the settlements stand
    assert [r.state.value for r in results] == ["settled"] * 3
    _all_settled_once(services, prov, [j for j, _ in assigned])
    ids = {j.id for j, _ in assigned}  # (checks the draws queued are woken too: not these)
    assert set(woken) & ids == ids - {first}  # the others' clients woken
    assert session.free == session.slots - 1  # only the failed job's slot is still held


def test_an_unexpected_error_judging_one_receipt_sends_it_alone_and_the_batch_settles(
        world, monkeypatch):
    services, client, prov, session, key = world
    assigned = _assigned(services, client, session, 3)
    real_checked, calls = services.jobs._checked, {"n": 0}

    def checked_failing_once(*args, **kwargs):  # the second receipt's check, in the batch
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("blob store unreachable")
        return real_checked(*args, **kwargs)
    monkeypatch.setattr(services.jobs, "_checked", checked_failing_once)
    results = services.jobs.receipts(session.provider_id, key.public_key_hex,
                                     [_item(key, env) for _, env in assigned])
    assert [r.state.value for r in results] == ["settled"] * 3
    _all_settled_once(services, prov, [j for j, _ in assigned])
    assert session.free == session.slots


def test_a_batch_writes_each_jobs_events_and_outputs_and_posts_as_one_at_a_time_does(world):
    """The batch's events and outputs are written together, and its posts in one ledger
    call: each job ends with what it would have alone (its submitted and done events in
    order, its output, its own post), and a job whose post cannot join the others (its
    hold already resolved) gets its ledger_error while the others are paid."""
    services, client, prov, session, key = world
    assigned = _assigned(services, client, session, 4)
    services.ledger.void(assigned[3][0].hold_id, idempotency_key="test:void", reason="test")
    results = services.jobs.receipts(session.provider_id, key.public_key_hex,
                                     [_item(key, env) for _, env in assigned])
    assert all(r.state.value == "settled" for r in results)
    for job, _ in assigned:
        kinds = [e.kind for e in services.jobs.repo.events_after(job.id, 0)]
        ours = [k for k in kinds if k in ("submitted", "done", "ledger_error")]
        assert ours in (["submitted", "done"], ["submitted", "done", "ledger_error"]), kinds
        assert ("ledger_error" in kinds) == (job.id == assigned[3][0].id)
        assert [o.sha256 for o in services.jobs.repo.outputs(job.id)] == [
            sha256_hex(b'{"ok":true}')]
    _all_settled_once(services, prov, [j for j, _ in assigned[:3]])
    assert services.ledger.get_hold(assigned[3][0].hold_id).state is HoldState.VOIDED
