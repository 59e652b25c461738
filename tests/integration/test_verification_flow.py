"""Verification by spot redundancy through a real broker and in-process agents (DESIGN §6):
a new provider's job is re-run on another operator's agent; agreement verifies it; a
cheater is outvoted 2 to 1, refunded to the client, slashed, and its CV reset."""
from __future__ import annotations

import time
import uuid

import pytest

from broker.ledger.model import AccountId, AccountKind
from broker.ledger.seeding import seed_earned
from broker.verification.records import CheckStatus
from sdk import Client
from sdk.errors import APIError, ConflictError, InsufficientCreditsError

from tests.integration.conftest import LiveBroker, agent_starter


@pytest.fixture
def vbroker(tmp_path):
    b = LiveBroker(tmp_path, verification=True, check_delay_max_s=0.0)
    yield b
    b.stop()


@pytest.fixture
def agents(vbroker):
    start, stop_all = agent_starter(vbroker)
    yield start
    stop_all()


def test_a_new_providers_job_is_checked_on_another_operator_and_verified(vbroker, agents):
    svc = vbroker.services
    first = agents("first")
    client = Client(vbroker.url, vbroker.key("client"))
    result = client.generate("echo", text="check me", timeout=30)
    assert result.job.data["provider_id"] == first.provider_id
    assert result.verification == "checking"  # new providers are always checked
    second = agents("second")  # the only other operator: the check must go there

    assert result.wait_verified(timeout=30) == "verified"
    checks = svc.jobs.repo.checks_of(result.job.id)
    assert len(checks) == 1 and checks[0].state.value == "settled"
    assert checks[0].provider_id == second.provider_id
    assert checks[0].inputs == result.job.data["inputs"]
    v = svc.verification.status(result.job.id)
    assert v.comparisons["primary~checker"]["verdict"] == "match"
    for agent in (first, second):  # both runs count as one valid check
        assert svc.verification.repo.standing(agent.provider_id, "echo",
                                              v.hardware_class).consecutive_valid == 1
    # The platform paid the checker: its verification account is down by that run's cost.
    spent = svc.ledger.balance(AccountId.platform(AccountKind.PLATFORM_VERIFICATION))
    assert spent < 0
    actions = {e.action for e in svc.audit.search(subject=f"job:{result.job.id}")}
    assert {"verification.sampled", "verification.checker_queued", "verification.compared",
            "verification.outcome"} <= actions
    events = [e.kind for e in svc.jobs.repo.events_after(result.job.id, 0)]
    assert events.count("verification") == 2


def _shape(value):
    """A document's shape: its keys and value types, recursively (values dropped)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def test_a_check_job_and_a_normal_job_look_the_same_on_the_wire(vbroker, agents):
    """What an agent receives for a check (the signed envelope) has exactly the fields and
    shapes of a client's job: nothing says "check"; the id is a fresh random uuid."""
    svc = vbroker.services
    agents("a")
    client = Client(vbroker.url, vbroker.key("client"))
    result = client.generate("echo", text="same shape", timeout=30)
    agents("b")
    result.wait_verified(timeout=30)
    primary = svc.jobs.repo.get(result.job.id)
    check = svc.jobs.repo.checks_of(primary.id)[0]
    assert _shape(check.envelope) == _shape(primary.envelope)
    assert set(check.envelope) == set(primary.envelope)
    # The same inputs, each sealed to its own provider (a check looks like any job).
    assert check.inputs == primary.inputs
    assert "inputs" not in check.envelope
    assert check.envelope["sealed_inputs"] != primary.envelope["sealed_inputs"]
    assert check.envelope["attempt"] == primary.envelope["attempt"] == 0
    assert uuid.UUID(check.id).version == 4 and check.id != primary.id
    # the client's job id, derived from its Idempotency-Key, is shaped as a random one too
    assert primary.idempotency_key and uuid.UUID(primary.id).version == 4
    assert primary.id not in repr(check.envelope)


def test_a_cheater_is_outvoted_refunded_slashed_and_reset(vbroker, agents):
    svc = vbroker.services
    cheater = agents("cheater", cheat=lambda data: b'{"text": "made up"}')
    owner = svc.providers.owner_of(cheater.provider_id)
    ledger = svc.ledger
    seed_earned(svc.ledger, owner, 5_000_000)  # staked 5 credits it earned earlier

    client_key = vbroker.key("client")
    client = Client(vbroker.url, client_key)
    before = client.account()["available_micro"]
    result = client.generate("echo", text="the truth", timeout=30)
    assert result.json == [{"text": "made up"}]
    agents("honest-1")
    agents("honest-2")

    assert result.wait_verified(timeout=60) == "overturned"
    assert result.json == [{"text": "the truth"}]  # the majority's output replaces it
    v = svc.verification.status(result.job.id)
    assert v.comparisons["primary~checker"]["verdict"] == "mismatch"
    assert v.outcome["penalties"][0]["provider_id"] == cheater.provider_id
    standing = svc.verification.repo.standing(cheater.provider_id, "echo", v.hardware_class)
    assert standing.consecutive_valid == 0 and standing.failures == 1
    assert standing.quota_factor == 0.5
    assert ledger.balances(owner)[AccountKind.PROVIDER_STAKE] == 2_500_000  # half slashed
    assert client.account()["available_micro"] == before  # the job's charge came back
    disputes = svc.disputes.repo.list()
    assert [d.job_id for d in disputes] == [result.job.id]
    assert {s["verdict"] for s in disputes[0].sides} == {"majority", "minority"}
    minority = next(s for s in disputes[0].sides if s["verdict"] == "minority")
    assert svc.jobs.blobs.get(minority["sha256"]) == b'{"text": "made up"}'  # its own output
    # An admin who sides with the outvoted provider: its output stands again and its slash
    # is reversed (the refund already made stays made).
    svc.disputes.override(disputes[0].id, cheater.provider_id, "the prompt allowed it",
                          by="admin-1")
    assert result.wait_verified(timeout=10) == "verified"
    assert result.json == [{"text": "made up"}]
    assert ledger.balances(owner)[AccountKind.PROVIDER_STAKE] == 5_000_000
    assert svc.verification.status(result.job.id).outcome["admin"]["winner"] == \
        cheater.provider_id


def test_verify_always_is_paid_by_the_client_and_refused_when_short(vbroker, agents):
    svc = vbroker.services
    agents("a")
    agents("b")
    client = Client(vbroker.url, vbroker.key("client", credits=1000))
    result = client.generate("echo", text="twice", verify="always", timeout=30)
    assert result.wait_verified(timeout=30) == "verified"
    check = svc.jobs.repo.checks_of(result.job.id)[0]
    assert check.account_id == svc.jobs.repo.get(result.job.id).account_id  # client paid
    assert svc.verification.status(result.job.id).reason == "client_asked"
    # Enough for one run but not two: refused up front, nothing held.
    price = client.quote("echo", text="x")["max_micro"]
    poor_key = vbroker.key("client", credits=0)
    poor_id = svc.auth.authenticate(poor_key).account_id
    svc.payments.grant(poor_id, price, by="test")
    poor = Client(vbroker.url, poor_key)
    with pytest.raises(InsufficientCreditsError) as err:
        poor.generate("echo", text="x", verify="always", timeout=10)
    assert "short" in str(err.value)
    assert poor.account()["available_micro"] == price
    with pytest.raises(APIError) as err:
        client.generate("echo", text="x", verify="sometimes", timeout=10)
    assert "verify" in str(err.value) and "always" in str(err.value)
    assert CheckStatus.VERIFIED.value == result.verification


def test_providers_stake_and_the_minimum_stake_gates_dispatch(vbroker, agents):
    """A plugin's minimum stake (admin policy) keeps providers without it off its jobs;
    staking through the API lets them back in. Bad amounts are refused."""
    svc = vbroker.services
    key = vbroker.key("provider")
    owner = svc.auth.authenticate(key).account_id
    svc.admin.policies.set_policy("echo", {"min_stake_micro": 2_000_000}, by="test")
    seed_earned(svc.ledger, owner, 3_000_000, stake=False)  # earned, not yet staked
    agents("staker", key=key)
    client = Client(vbroker.url, vbroker.key("client"))
    job = client.jobs.create("echo", text="needs stake")
    time.sleep(1.0)
    assert job.refresh().state == "queued"  # no provider holds the minimum stake

    provider = Client(vbroker.url, key)
    with pytest.raises(APIError) as err:
        provider.stake(0)
    assert "amount_micro" in str(err.value)
    with pytest.raises(APIError):
        provider.stake(10_000_000)  # more than is available: refused, nothing moved
    assert provider.account()["stake_micro"] == 0
    assert provider.stake(2_000_000)["stake_micro"] == 2_000_000
    assert job.wait(timeout=30).json == [{"text": "needs stake"}]
    # its job is being checked (nobody else can, here): the stake stays until it is
    with pytest.raises(ConflictError, match="being checked"):
        provider.unstake(500_000)
    svc.verification.settings.check_timeout_s = 0.0
    _give_up_checks(svc, job.id)  # nobody else could check it: nothing open
    assert provider.unstake(500_000)["stake_micro"] == 1_500_000
    with pytest.raises(APIError):
        client.stake(1)  # a client key holds no stake


def test_the_maintenance_sweep_samples_a_job_settled_while_verification_was_down(vbroker,
                                                                                  agents):
    svc = vbroker.services
    agents("a")
    # verification hears of no settlement while this job settles (it is joined to the job
    # service's events: broker/services.py)
    svc.verification.settled = lambda job, receipt: None
    try:
        client = Client(vbroker.url, vbroker.key("client"))
        result = client.generate("echo", text="missed", timeout=30)
    finally:
        del svc.verification.settled  # as after a restart: the draw never happened
    assert svc.verification.status(result.job.id) is None
    assert svc.verification.sweep(settle_grace_s=0.0) == 1
    assert svc.verification.status(result.job.id).status == CheckStatus.CHECKING
    agents("b")
    assert result.wait_verified(timeout=30) == "verified"
    assert svc.verification.sweep(settle_grace_s=0.0) == 0  # nothing left half done


def test_a_job_pinned_to_other_weights_never_runs_on_an_agent_serving_others(vbroker, agents):
    svc = vbroker.services
    agents("a")
    client = Client(vbroker.url, vbroker.key("client"))
    with pytest.raises(APIError) as err:
        client.jobs.create("echo", text="x", terms={"weights_digest": "not-a-digest"})
    assert "weights_digest" in str(err.value) and "64" in str(err.value)
    pinned = client.jobs.create("echo", text="x", terms={"weights_digest": "ab" * 32})
    plain = client.jobs.create("echo", text="y")
    assert plain.wait(timeout=30).json == [{"text": "y"}]
    assert pinned.refresh().state == "queued"  # nobody serves those weights
    job = svc.jobs.repo.get(plain.id)
    assert job.envelope["weights_digest"] == ""  # echo has no weights: what it ran on
    pinned.cancel()


def test_a_check_no_other_operator_takes_is_given_up_and_its_hold_released(vbroker, agents):
    svc = vbroker.services
    agents("alone")
    client = Client(vbroker.url, vbroker.key("client"))
    result = client.generate("echo", text="nobody to check", timeout=30)
    assert result.verification == "checking"
    check = svc.jobs.repo.checks_of(result.job.id)[0]
    assert check.state.value == "queued"  # the only provider is the one it checks
    svc.verification.settings.check_timeout_s = 0.0
    _give_up_checks(svc, result.job.id)  # each try re-issued, until the tries run out
    assert result.wait_verified(timeout=10) == "unchecked"
    assert len(svc.jobs.repo.checks_of(result.job.id)) == svc.verification.settings.check_tries
    check = svc.jobs.repo.get(check.id)
    assert check.state.value == "failed" and check.error_code == "check_timeout"
    assert svc.ledger.get_hold(check.hold_id).state.value == "voided"


def test_a_check_never_runs_on_a_machine_the_checked_operator_connects_later(vbroker, agents):
    svc = vbroker.services
    operator_key = vbroker.key("provider")
    first = agents("first", key=operator_key)
    client = Client(vbroker.url, vbroker.key("client"))
    result = client.generate("echo", text="mine", timeout=30)
    assert result.job.data["provider_id"] == first.provider_id
    second_machine = agents("same-operator", key=operator_key)  # a new machine of it
    time.sleep(1.0)
    check = svc.jobs.repo.checks_of(result.job.id)[0]
    assert svc.jobs.repo.get(check.id).state.value == "queued"
    other = agents("other-operator")
    assert result.wait_verified(timeout=30) == "verified"
    assert svc.jobs.repo.get(check.id).provider_id == other.provider_id != \
        second_machine.provider_id


def _give_up_checks(svc, job_id: str) -> None:
    """Sweep until the job's check, re-issued after each try nobody took, is given up."""
    deadline = time.monotonic() + 20
    while svc.verification.status(job_id).status is CheckStatus.CHECKING:
        assert time.monotonic() < deadline, "the check was never given up"
        time.sleep(0.01)
        svc.verification.sweep(settle_grace_s=0.0)



def test_agents_on_one_machine_and_network_link_their_accounts_when_loopback_counts(tmp_path):
    """The gateway records each agent's network and machine fingerprint (broker.links);
    on loopback only with link_loopback (else every local agent would be linked)."""
    b = LiveBroker(tmp_path, verification=True, link_loopback=True)
    start, stop_all = agent_starter(b)
    try:
        one, two = start("one"), start("two")
        svc = b.services
        owners = [svc.providers.owner_of(a.provider_id) for a in (one, two)]
        assert owners[0] != owners[1]
        deadline = time.monotonic() + 10
        while not svc.links.linked(*owners) and time.monotonic() < deadline:
            time.sleep(0.05)
        why = svc.links.why(*owners)
        assert "network 127.0.0.0/24" in why
        from provider_agent.fingerprint import machine_fingerprint

        if machine_fingerprint():  # a machine id to read (containers may have none)
            assert any(w.startswith("hardware ") for w in why)
    finally:
        stop_all()
        b.stop()
