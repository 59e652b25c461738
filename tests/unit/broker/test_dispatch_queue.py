"""The dispatcher's in-memory queue: the database stays the truth."""
import pytest

from sdk.protocol.signing import KeyPair

from broker_fixtures import RecordingSession, dispatcher_for, make_world
from broker.api.job_request import job_request


@pytest.fixture
def world(tmp_path):
    engine, auth, jobs, _ = make_world(f"sqlite:///{tmp_path / 'b.db'}", tmp_path)
    _, client = auth.create_account_with_key("client")
    yield jobs, client
    engine.dispose()


def _session(plugins, pid="prov-1"):
    return RecordingSession(provider_id=pid, public_key=KeyPair.generate().public_key_hex,
                            account_id="acct", plugins=plugins, slots=4)


def test_a_job_cancelled_while_queued_leaves_the_memory_queue(world):
    jobs, client = world
    d = dispatcher_for(jobs, reap_interval_s=0.0)  # re-read the database on every pass
    d.register(_session({"other@1.0.0": ""}))   # connected, but serves no echo
    job, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, jobs.catalog))
    assert d.match_once() == 0 and job.id in d._pending and d._backlog
    jobs.cancel(client, job.id)
    for _ in range(2):
        assert d.match_once() == 0
    assert job.id not in d._pending
    assert not d._backlog  # a new job may be handed out directly again


def test_a_job_queued_during_the_database_read_is_kept(world):
    jobs, client = world
    d = dispatcher_for(jobs, reap_interval_s=0.0)
    d.register(_session({"other@1.0.0": ""}))
    late = []
    read = jobs.queued

    def queued_while_another_arrives(limit):
        rows = read(limit)  # the read sees the queue before the next job exists
        if not late:
            late.append(jobs.submit(client, job_request({"plugin": "echo", "inputs": {}}, jobs.catalog))[0])
        return rows

    jobs.queued = queued_while_another_arrives
    d.match_once()
    assert late and late[0].id in d._pending


def test_siblings_of_a_split_that_did_not_fit_stay_queued(world):
    jobs, client = world
    d = dispatcher_for(jobs, reap_interval_s=60.0)  # memory only, after the first read
    s = _session({"echo@1.0.0": ""})
    s.slots = 2
    d.register(s)
    first, _ = jobs.submit(client, job_request({"plugin": "echo", "inputs": {}, "n": 3}, jobs.catalog))
    for _ in range(3):
        d.match_once()
    assert len(s.sent) == 2
    left = [j for j in jobs.batch(client, first.batch_id) if j.state.value == "queued"]
    assert len(left) == 1 and left[0].id in d._pending


def test_every_job_of_a_bulk_request_is_placed_from_its_one_wake_up(world):
    """A bulk submit wakes the dispatcher once with all of its independent jobs: none is
    dropped for the first one's quick placement, and every one is placed."""
    jobs, client = world
    d = dispatcher_for(jobs, reap_interval_s=60.0)  # memory only, after the first read
    s = _session({"echo@1.0.0": ""})
    d.register(s)
    d.match_once()  # the first read of the (empty) queue
    assert not d._backlog  # a single job would now be placed from the submitting thread
    made, _ = jobs.submit_many(client, [job_request({"plugin": "echo", "inputs": {"text": t}},
                                                    jobs.catalog) for t in "abc"])
    assert all(j.id in d._pending for j in made)
    for _ in range(3):
        d.match_once()
    assert len(s.sent) == 3
    assert {jobs.repo.get(j.id).state.value for j in made} == {"matched"}
