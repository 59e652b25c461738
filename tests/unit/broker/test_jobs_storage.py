"""SqlJobRepository and the migrations, on SQLite and PostgreSQL."""
import uuid

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import broker.storage.all_models  # noqa: F401
from broker.jobs.model import Job, JobOutput, JobState
from broker.storage.base import Base, make_engine
from broker.storage.jobs_sql import SqlJobRepository
from broker.storage.migrate import downgrade, upgrade
from sqlalchemy.orm import sessionmaker

from broker_fixtures import FakeClock


@pytest.fixture
def repo(db_url):
    engine = make_engine(db_url)
    upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    from broker.storage.accounts_sql import SqlAccountRepository

    SqlAccountRepository(sessions).create_account("acct", "a", "client", 0)
    clock = FakeClock()
    yield SqlJobRepository(sessions, clock=clock), clock
    engine.dispose()


def test_migrations_match_the_models_and_downgrade(db_url):
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    downgrade(engine, "base")
    upgrade(engine)
    engine.dispose()


def _job(key=None, **kw):
    return Job(id=str(uuid.uuid4()), account_id="acct", plugin="echo", plugin_version="1.0.0",
               inputs={"text": "x"}, state=JobState.QUEUED, idempotency_key=key,
               request_hash="h", created_at=1.0, updated_at=1.0, **kw)


def test_create_is_idempotent_per_account_key(repo):
    r, _ = repo
    first, created = r.create(_job("k1"), ("queued", {}))
    again, created2 = r.create(_job("k1"), ("queued", {}))
    assert created and not created2 and again.id == first.id
    assert [e.kind for e in r.events_after(first.id, 0)] == ["queued"]


def test_transition_is_conditional_and_appends_its_event(repo):
    r, _ = repo
    job, _ = r.create(_job(), ("queued", {}))
    moved = r.transition(job.id, [JobState.QUEUED], JobState.MATCHED, expect_attempt=0,
                         provider_id="p1", lease_expires_at=5.0, event=("assigned", {"p": 1}))
    assert moved.state == JobState.MATCHED and moved.provider_id == "p1"
    # A second, racing transition from QUEUED loses and writes nothing.
    assert r.transition(job.id, [JobState.QUEUED], JobState.MATCHED, provider_id="p2",
                        event=("assigned", {"p": 2})) is None
    assert r.transition(job.id, [JobState.MATCHED], JobState.RUNNING,
                        expect_provider="p2") is None
    assert [e.kind for e in r.events_after(job.id, 0)] == ["queued", "assigned"]
    assert r.get(job.id).provider_id == "p1"


@pytest.mark.parametrize("returning", [True, False])
def test_transition_returns_the_new_row_with_or_without_returning(repo, returning):
    """UPDATE … RETURNING where the database has it, a SELECT after the UPDATE elsewhere:
    the same job either way; and a field that names no column fails loudly."""
    r, _ = repo
    r._returning = returning and r._returning
    job, _ = r.create(_job(), ("queued", {}))
    moved = r.transition(job.id, [JobState.QUEUED], JobState.MATCHED, expect_attempt=0,
                         provider_id="p1", envelope={"a": [1, 2]}, excluded_providers=["x"],
                         event=("assigned", {}))
    assert moved == r.get(job.id)
    assert r.lease_of(job.id) == (JobState.MATCHED, "p1", 0)
    assert r.lease_of(str(uuid.uuid4())) is None
    assert moved.envelope == {"a": [1, 2]} and moved.excluded_providers == ["x"]
    assert r.transition(job.id, [JobState.QUEUED], JobState.MATCHED) is None
    with pytest.raises(TypeError):
        r.transition(job.id, [JobState.MATCHED], JobState.RUNNING, provder_id="typo")
    assert r.get(job.id).state == JobState.MATCHED


def test_events_and_replaced_outputs(repo):
    r, _ = repo
    job, _ = r.create(_job(), ("queued", {}))
    first = r.add_event(job.id, "progress", {"step": 1}, progress_step=1, progress_total=4)
    second = r.add_event(job.id, "token", {"text": "a"})
    assert isinstance(first, int) and second > first
    assert (r.get(job.id).progress_step, r.get(job.id).progress_total) == (1, 4)
    assert [e.id for e in r.events_after(job.id, first)] == [second]
    assert r.events_after(job.id, 0, limit=1)[0].kind == "queued"
    r.transition(job.id, [JobState.QUEUED], JobState.SETTLED,
                 outputs=[JobOutput(job.id, 0, "a" * 64, "image/png", 10)])
    new = [JobOutput(job.id, 0, "b" * 64, "image/png", 11),
           JobOutput(job.id, 1, "c" * 64, "image/png", 12)]
    r.replace_outputs(job.id, new, ("overturned", {}))
    assert r.outputs(job.id) == new
    assert r.events_after(job.id, second)[-1].kind == "overturned"
    # a client resuming past every id there can be (Last-Event-ID up to 2^63 - 1) gets none,
    # on PostgreSQL too, whose 32-bit INTEGER column refuses a larger parameter
    for after in (2**31 - 1, 2**31, 2**63 - 1):
        assert r.events_after(job.id, after) == []


def test_leases_expire_and_extend(repo):
    r, clock = repo
    job, _ = r.create(_job(), ("queued", {}))
    r.transition(job.id, [JobState.QUEUED], JobState.MATCHED, provider_id="p1",
                 lease_expires_at=clock() + 10)
    assert r.expired_leases(clock() + 5) == []
    assert r.extend_leases("p1", [job.id], clock() + 20) == 1
    assert r.extend_leases("p2", [job.id], clock() + 99) == 0
    assert [j.id for j in r.expired_leases(clock() + 21)] == [job.id]
    assert [j.id for j in r.leased_to("p1")] == [job.id]


def test_outputs_are_saved_with_the_settling_transition(repo):
    r, _ = repo
    job, _ = r.create(_job(), ("queued", {}))
    outs = [JobOutput(job.id, 0, "a" * 64, "image/png", 10)]
    settled = r.transition(job.id, [JobState.QUEUED], JobState.SETTLED, outputs=outs,
                           events=[("submitted", {}), ("done", {})])
    assert settled.state == JobState.SETTLED and r.outputs(job.id) == outs
    assert [e.kind for e in r.events_after(job.id, 0)] == ["queued", "submitted", "done"]
    assert r.counts_by_state() == {"settled": 1}
