"""Replays of a submit: one answers the first job and writes nothing, replays racing their
first request all answer it and hold once (on SQLite's group commit the first request's row
may be written and not yet committed when the second meets it: it used to answer 500), a
refused submit leaves nothing behind. SQLite and PostgreSQL, through the real wiring."""
import threading

import pytest

from broker.api.job_request import job_request
from broker.billing.errors import InsufficientCredits
from broker.ledger.model import AccountKind

from broker_fixtures import echo_world

MICRO = 1_000_000
HELD = AccountKind.CLIENT_HELD
BODY = {"plugin": "echo", "inputs": {"text": "x"}}  # 0.25 credit held


@pytest.fixture
def world(tmp_path, db_url):
    services, client, *_ = echo_world(tmp_path, db_url=db_url)
    yield services, client
    services.engine.dispose()


def _submit(services, client, body=BODY, key=None):
    return services.jobs.submit(client, job_request(body, services.jobs.catalog),
                                idempotency_key=key)


def _held(services, client):
    return services.ledger.balances(client.account_id).get(HELD, 0)


def test_plain_submits_hold_what_they_cost(world):
    services, client = world
    services.payments.grant(client.account_id, MICRO, by="test")
    job, created = _submit(services, client)
    jobs, created_many = services.jobs.submit_many(
        client, [job_request(BODY, services.jobs.catalog)] * 2)
    assert created and created_many and len(jobs) == 2
    assert _held(services, client) == 750_000
    assert services.ledger.verify().ok and services.audit.verify().ok


def test_a_replay_answers_the_first_job_and_writes_nothing(world):
    services, client = world
    services.payments.grant(client.account_id, MICRO, by="test")
    first, created = _submit(services, client, key="k1")
    entries = len(services.audit.search(limit=100))
    again, created_again = _submit(services, client, key="k1")
    assert created and not created_again and again.id == first.id
    assert again.hold_id == first.hold_id and _held(services, client) == 250_000
    assert len(services.audit.search(limit=100)) == entries
    assert services.ledger.verify().ok and services.audit.verify().ok


def _race(n: int, submit) -> list:
    """``submit()`` from ``n`` threads released at once: every answer (any error fails)."""
    answers, errors = [], []
    start = threading.Barrier(n)

    def run():
        start.wait()
        try:
            answers.append(submit())
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(answers) == n
    return answers


def test_replays_racing_each_other_hold_once(world):
    services, client = world
    services.payments.grant(client.account_id, MICRO, by="test")
    answers = _race(6, lambda: _submit(services, client, key="race"))
    assert len({job.id for job, _ in answers}) == 1
    assert sum(created for _, created in answers) == 1
    assert _held(services, client) == 250_000
    assert services.ledger.verify().ok and services.audit.verify().ok


def test_a_refused_submit_of_a_client_with_no_ledger_account_leaves_nothing(world):
    services, _ = world
    _, newcomer = services.auth.create_account_with_key("client")  # never funded
    with pytest.raises(InsufficientCredits):
        _submit(services, newcomer)
    assert services.jobs.repo.list_for_account(newcomer.account_id) == []
    assert _held(services, newcomer) == 0
    assert services.ledger.verify().ok and services.audit.verify().ok


def test_bulk_replays_racing_each_other_hold_once(world):
    services, client = world
    services.payments.grant(client.account_id, MICRO, by="test")
    answers = _race(4, lambda: services.jobs.submit_many(
        client, [job_request(BODY, services.jobs.catalog)] * 2, idempotency_key="bulk"))
    assert len({tuple(j.id for j in jobs) for jobs, _ in answers}) == 1
    assert sum(created for _, created in answers) == 1
    assert _held(services, client) == 500_000
    assert services.ledger.verify().ok and services.audit.verify().ok
