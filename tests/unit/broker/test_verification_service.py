"""VerificationService against real storage (SQLite and PostgreSQL), with runs settled by
hand (no agents): what a failed step leaves behind and how the sweep finishes it, and the
sweep's queries (DESIGN §6)."""
from __future__ import annotations

import time
import uuid

import pytest

from broker.billing.errors import InsufficientCredits
from broker.jobs.model import Job, JobState
from broker.ledger import errors as lerr
from broker.ledger.model import AccountKind
from broker.ledger.seeding import seed_earned
from broker.verification.outcomes import Role
from broker.verification.records import CheckStatus
from broker.verification.runs import CHECK_ACCOUNT
from tests.verification_world import HW, VerificationWorld

GOOD, BAD = b'{"text": "the truth"}', b'{"text": "made up"}'


class World(VerificationWorld):
    """Echo jobs, whose outputs are judged byte for byte."""

    def settle(self, job: Job, machine: str, data: bytes) -> Job:
        """``job`` (queued, or new) settled by ``machine`` with the one output ``data``."""
        return self.settle_output(job, machine, data, "application/json", {}, "echo@1.0.0")

    def primary(self, machine: str = "a", data: bytes = GOOD) -> Job:
        now = time.time()
        job, _ = self.jobs.repo.create(
            Job(id=str(uuid.uuid4()), account_id=self.client, plugin="echo",
                plugin_version="1.0.0", inputs={"text": "the truth"}, state=JobState.QUEUED,
                work_units=1.0, created_at=now, updated_at=now),
            ("queued", {}))
        return self.settle(job, machine, data)

    def checked(self, machine: str = "a", data: bytes = GOOD) -> Job:
        """A settled job of ``machine``, drawn for a check (new providers always are)."""
        job = self.primary(machine, data)
        self.v.settled(job, job.receipt)
        assert self.v.status(job.id).status is CheckStatus.CHECKING
        return job

    def check_of(self, job: Job, role: Role = Role.CHECKER) -> Job:
        rec = self.v.status(job.id)
        return self.jobs.repo.get(rec.checker_job_id if role is Role.CHECKER
                                  else rec.tiebreak_job_id)

    def sweep(self) -> int:
        time.sleep(0.01)  # the records' last change lies before the sweep's "now"
        return self.v.sweep(settle_grace_s=0.0)


@pytest.fixture
def world(tmp_path, db_url):
    """On SQLite and on PostgreSQL (the sweep's queries differ by dialect)."""
    w = World(tmp_path, db_url)
    yield w
    w.services.engine.dispose()


def _disputed(world: World) -> tuple[Job, Job]:
    """a's wrong answer checked by b: disputed; returns (primary, checker)."""
    job = world.checked("a", BAD)
    checker = world.settle(world.check_of(job), "b", GOOD)
    world.v.settled(checker, checker.receipt)
    assert world.v.status(job.id).status is CheckStatus.DISPUTED
    return job, checker


def test_an_outcome_whose_effects_failed_midway_is_finished_by_the_sweep_once(world,
                                                                               monkeypatch):
    owner = world.operators["a"]
    seed_earned(world.services.ledger, owner, 4_000_000)
    job, checker = _disputed(world)
    tiebreak = world.settle(world.check_of(job, Role.TIEBREAKER), "c", GOOD)
    # The slash fails for a reason of the broker's (not the ledger refusing it): the
    # standings were counted, the rest is not done.
    real_slash = world.services.ledger.slash
    monkeypatch.setattr(world.services.ledger, "slash",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("db down")))
    world.v.settled(tiebreak, tiebreak.receipt)
    rec = world.v.status(job.id)
    # judged (overturned), not applied: the record stays open, its status unchanged
    assert rec.outcome["status"] == "overturned" and rec.outcome["applied"] is False
    assert rec.status is CheckStatus.DISPUTED
    assert world.v.repo.open_for([world.machines["a"]]) == 1  # its stake stays put
    assert world.services.ledger.balances(owner)[AccountKind.PROVIDER_STAKE] == 4_000_000
    assert world.jobs.repo.outputs(job.id)[0].sha256 == job.receipt["outputs"][0]["sha256"]
    assert world.services.disputes.repo.list() == []
    # ... and a second failure, in the dispute, after the slash and the outputs
    monkeypatch.setattr(world.services.ledger, "slash", real_slash)
    real_open = world.services.disputes.open
    monkeypatch.setattr(world.services.disputes, "open",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("db down")))
    world.sweep()
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED and rec.outcome["applied"] is False
    assert world.services.ledger.balances(owner)[AccountKind.PROVIDER_STAKE] == 2_000_000
    monkeypatch.setattr(world.services.disputes, "open", real_open)
    assert world.sweep() == 1
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.OVERTURNED
    assert rec.outcome["applied"] is True and "done" not in rec.outcome
    assert rec.outcome["penalties"][0]["slash_micro"] == 2_000_000
    assert rec.outcome["slash_transactions"][world.machines["a"]]
    # every effect once: standings, slash, outputs, audit, dispute, event
    cheat = world.v.repo.standing(world.machines["a"], "echo", HW)
    assert (cheat.checks, cheat.failures, cheat.quota_factor) == (1, 1, 0.5)
    for honest in "bc":
        s = world.v.repo.standing(world.machines[honest], "echo", HW)
        assert (s.checks, s.consecutive_valid) == (1, 1)
    assert world.services.ledger.balances(owner)[AccountKind.PROVIDER_STAKE] == 2_000_000
    assert world.jobs.blobs.get(world.jobs.repo.outputs(job.id)[0].sha256) == GOOD
    events = [e for e in world.jobs.repo.events_after(job.id, 0)]
    assert [e.kind for e in events].count("overturned") == 1
    assert [e.data.get("status") for e in events if e.kind == "verification"].count(
        "overturned") == 1
    assert len(world.services.disputes.repo.list()) == 1
    actions = world.actions(job.id)
    assert actions.count("verification.outcome") == 1
    assert actions.count("verification.penalty") == 1
    assert world.sweep() == 0  # nothing left half done


def test_a_clear_loser_gives_back_every_credit_not_vested_yet(world, monkeypatch):
    from broker.ledger.model import Splits

    ledger = world.services.ledger
    owner = world.operators["a"]
    seed_earned(ledger, owner, 4_000_000)  # staked: vested already, never clawed back
    client = "acct-earlier-client"
    ledger.open_client(client)
    ledger.deposit(client, 3_000_000, idempotency_key="earlier:deposit")
    holds = []
    for i, who in enumerate("aab"):  # earlier jobs paid into vesting: two of a's, one of b's
        hold = ledger.hold(client, 1_000_000, f"earlier-{i}", idempotency_key=f"earlier:{i}")
        ledger.post(hold.id, Splits(provider=world.operators[who], provider_micro=900_000,
                                    fee_micro=100_000), idempotency_key=f"earlier:post:{i}")
        holds.append(hold.id)
    assert ledger.balances(owner)[AccountKind.PROVIDER_VESTING] == 1_800_000
    job, _ = _disputed(world)
    tiebreak = world.settle(world.check_of(job, Role.TIEBREAKER), "c", GOOD)
    # the second claw-back refund fails for a reason of the broker's: the sweep finishes
    real_refund, calls = ledger.refund, []

    def flaky(*a, **k):
        calls.append(a)
        if len(calls) == 2:
            raise RuntimeError("db down")
        return real_refund(*a, **k)

    monkeypatch.setattr(ledger, "refund", flaky)
    world.v.settled(tiebreak, tiebreak.receipt)
    assert world.v.status(job.id).outcome["applied"] is False
    assert world.sweep() == 1
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.OVERTURNED and rec.outcome["penalties"][0]["claw_back"]
    assert ledger.balances(owner).get(AccountKind.PROVIDER_VESTING, 0) == 0
    assert ledger.balances(owner)[AccountKind.PROVIDER_STAKE] == 2_000_000  # half slashed
    # a's two jobs refunded in full to their client (fee included); b's stands
    assert ledger.balances(client)[AccountKind.CLIENT_AVAILABLE] == 2_000_000
    assert [ledger.get_hold(h).refund_transaction_id is not None for h in holds] == [
        True, True, False]
    assert world.actions(job.id).count("verification.claw_back") == 1
    assert world.sweep() == 0
    assert ledger.verify().ok


def test_a_dispute_whose_done_mark_was_not_saved_is_not_opened_twice(world, monkeypatch):
    job, _ = _disputed(world)
    tiebreak = world.settle(world.check_of(job, Role.TIEBREAKER), "c", GOOD)
    real = world.v.repo.update

    def broken(job_id, expect, **fields):
        if "dispute" in ((fields.get("outcome") or {}).get("done") or []):
            raise RuntimeError("db down")  # the dispute was written; its mark is not
        return real(job_id, expect, **fields)
    monkeypatch.setattr(world.v.repo, "update", broken)
    world.v.settled(tiebreak, tiebreak.receipt)
    assert world.services.disputes.repo.list() == []  # rolled back with its mark
    assert "dispute.open" not in world.actions(job.id)
    monkeypatch.undo()
    assert world.sweep() == 1
    assert len(world.services.disputes.repo.list()) == 1
    assert world.actions(job.id).count("dispute.open") == 1
    assert world.v.status(job.id).outcome["applied"] is True


def test_a_failed_standing_write_is_not_counted_twice_when_reapplied(world, monkeypatch):
    job = world.checked("a")
    checker = world.settle(world.check_of(job), "b", GOOD)
    calls = []
    real = world.v.repo.record_check

    def flaky(*a, **k):
        calls.append(a[0])
        if len(calls) == 2:
            raise RuntimeError("db down")
        return real(*a, **k)
    monkeypatch.setattr(world.v.repo, "record_check", flaky)
    world.v.settled(checker, checker.receipt)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.CHECKING and rec.outcome["applied"] is False
    assert world.sweep() == 1
    assert world.v.status(job.id).status is CheckStatus.VERIFIED
    for name in "ab":
        s = world.v.repo.standing(world.machines[name], "echo", HW)
        assert (s.checks, s.consecutive_valid) == (1, 1)
    # counting is guarded in storage too: a step listed as done is not counted again
    again = real(world.machines["a"], "echo", HW, valid=True,
                 once=(job.id, f"credit:{world.machines['a']}"))
    assert again.checks == 1


def test_a_dispute_whose_third_run_was_not_queued_gets_one_from_the_sweep(world,
                                                                          monkeypatch):
    job = world.checked("a", BAD)
    checker = world.settle(world.check_of(job), "b", GOOD)
    real = world.jobs.submit_check
    monkeypatch.setattr(world.jobs, "submit_check",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("db down")))
    world.v.settled(checker, checker.receipt)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED and rec.tiebreak_job_id is None
    monkeypatch.setattr(world.jobs, "submit_check", real)
    assert world.sweep() == 1
    tiebreak = world.check_of(job, Role.TIEBREAKER)
    assert tiebreak is not None and tiebreak.state is JobState.QUEUED
    assert tiebreak.excluded_providers == sorted(
        [world.machines["a"], f"operator:{world.operators['a']}",
         f"operator:{world.operators['b']}"])
    assert world.sweep() == 0  # queued now: nothing to do until it runs or times out


def test_a_run_and_the_record_naming_it_commit_together(world, monkeypatch):
    job = world.primary("a")
    real = world.v.repo.update

    def broken(job_id, expect, **fields):
        if "checker_job_id" in fields:
            raise RuntimeError("db down")
        return real(job_id, expect, **fields)
    monkeypatch.setattr(world.v.repo, "update", broken)
    world.v.settled(job, job.receipt)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.CHECKING and rec.checker_job_id is None
    # the run (row and hold) went with the failed record update: nothing to orphan
    assert world.jobs.repo.checks_of(job.id) == []
    assert world.services.ledger.balances(CHECK_ACCOUNT).get(AccountKind.CLIENT_HELD, 0) == 0
    monkeypatch.undo()
    assert world.sweep() == 1
    assert len(world.jobs.repo.checks_of(job.id)) == 1
    assert world.check_of(job).id == world.jobs.repo.checks_of(job.id)[0].id


def test_a_third_run_that_fails_to_queue_uses_up_no_try(world, monkeypatch):
    job, _ = _disputed(world)
    first = world.check_of(job, Role.TIEBREAKER)
    real = world.jobs.submit_check
    monkeypatch.setattr(world.jobs, "submit_check",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("db down")))
    world.jobs.give_up(first, "check_timeout", "nobody took it")  # the third run failed
    rec = world.v.status(job.id)
    assert rec.tiebreak_job_id == first.id and "tiebreak_tries" not in (rec.outcome or {})
    world.sweep()  # the same failure again: still no try counted
    assert "tiebreak_tries" not in (world.v.status(job.id).outcome or {})
    monkeypatch.setattr(world.jobs, "submit_check", real)
    assert world.sweep() == 1
    rec = world.v.status(job.id)
    assert rec.outcome["tiebreak_tries"] == 2 and rec.tiebreak_job_id != first.id
    assert world.check_of(job, Role.TIEBREAKER).state is JobState.QUEUED


def test_a_broker_side_read_error_leaves_the_check_open_not_a_mismatch(world, monkeypatch):
    job = world.checked("a")
    checker = world.settle(world.check_of(job), "b", GOOD)
    real = world.jobs.blobs.get
    monkeypatch.setattr(world.jobs.blobs, "get",
                        lambda key: (_ for _ in ()).throw(OSError("disk gone")))
    world.v.settled(checker, checker.receipt)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.CHECKING and not rec.comparisons
    assert world.v.repo.standing(world.machines["a"], "echo", HW).failures == 0
    reads = []
    monkeypatch.setattr(world.jobs.blobs, "get", lambda key: reads.append(key) or real(key))
    assert world.sweep() == 1
    assert world.v.status(job.id).status is CheckStatus.VERIFIED
    assert len(reads) == 2  # each run's output once


def test_a_third_run_reads_each_runs_outputs_once(world, monkeypatch):
    job, _ = _disputed(world)
    tiebreak = world.settle(world.check_of(job, Role.TIEBREAKER), "c", GOOD)
    real = world.jobs.blobs.get
    reads = []
    monkeypatch.setattr(world.jobs.blobs, "get", lambda key: reads.append(key) or real(key))
    world.v.settled(tiebreak, tiebreak.receipt)
    assert world.v.status(job.id).status is CheckStatus.OVERTURNED
    assert len(reads) == 3


def test_unreadable_provider_meta_is_a_mismatch(world):
    job = world.primary("a")
    receipt = {**job.receipt, "outputs": [{**job.receipt["outputs"][0], "index": "x"}]}
    job = world.jobs.repo.transition(job.id, [JobState.SETTLED], JobState.SETTLED,
                                     receipt=receipt)
    world.v.settled(job, job.receipt)
    checker = world.settle(world.check_of(job), "b", GOOD)
    world.v.settled(checker, checker.receipt)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED
    assert rec.comparisons["primary~checker"]["method"] == "unreadable"


def test_a_check_excludes_operators_not_each_of_their_machines(world):
    world.machine("a2", operator="a")
    job = world.checked("a")
    check = world.check_of(job)
    assert check.excluded_providers == sorted([world.machines["a"],
                                               f"operator:{world.operators['a']}"])


def test_only_a_short_client_balance_moves_a_check_to_the_platform(world, monkeypatch):
    job = world.primary("a")
    job = world.jobs.repo.transition(job.id, [JobState.SETTLED], JobState.SETTLED,
                                     verify="always")
    real = world.jobs.submit_check
    seen = []

    def short_then_real(primary, check_id, account, *a, **k):
        seen.append(account)
        if account != CHECK_ACCOUNT:
            raise InsufficientCredits(needed_micro=2, available_micro=1, how_to_fund="x")
        return real(primary, check_id, account, *a, **k)
    monkeypatch.setattr(world.jobs, "submit_check", short_then_real)
    world.v.settled(job, job.receipt)
    assert seen == [world.client, CHECK_ACCOUNT]
    assert world.check_of(job).account_id == CHECK_ACCOUNT
    # any other error is not the client being short: it is not moved to the platform
    other = world.primary("a")
    other = world.jobs.repo.transition(other.id, [JobState.SETTLED], JobState.SETTLED,
                                       verify="always")
    seen.clear()
    monkeypatch.setattr(world.jobs, "submit_check",
                        lambda primary, check_id, account, *a, **k:
                        seen.append(account) or (_ for _ in ()).throw(RuntimeError("db")))
    world.v.settled(other, other.receipt)
    assert seen == [world.client]
    assert world.v.status(other.id).checker_job_id is None


def test_a_check_whose_dispatcher_wake_up_fails_is_still_submitted(world, monkeypatch):
    job = world.primary("a")

    def broken(job, siblings=None):
        raise RuntimeError("dispatcher down")
    monkeypatch.setattr(world.services.dispatcher, "queued", broken)
    check = world.jobs.submit_check(job, str(uuid.uuid4()), CHECK_ACCOUNT, job.inputs,
                                    [f"operator:{world.operators['a']}"],
                                    not_before=time.time())
    assert world.jobs.repo.get(check.id).state is JobState.QUEUED


def test_the_sweep_lists_only_open_records_it_can_act_on(world):
    repo, now = world.v.repo, time.time()
    running = world.checked("a")  # the oldest: its check is running
    world.jobs.repo.transition(world.check_of(running).id, [JobState.QUEUED],
                               JobState.RUNNING, provider_id=world.machines["b"])
    waiting = world.checked("a")  # queued, not for long
    done = world.checked("a")  # its check settled, not judged yet
    world.settle(world.check_of(done), "b", GOOD)
    time.sleep(0.01)
    listed = [v.job_id for v in repo.open_since(time.time(), limit=1,
                                                queued_before=now - 3600)]
    assert listed == [done.id]  # the in-progress ones do not keep it out of the window
    listed = {v.job_id for v in repo.open_since(time.time(), queued_before=time.time())}
    assert listed == {waiting.id, done.id}  # queued past the timeout: listed too


def test_undecided_returns_the_jobs_themselves(world):
    job = world.primary("a")
    found = world.v.repo.undecided(time.time() - 60, time.time() + 1)
    assert [j.id for j in found] == [job.id] and found[0].receipt == job.receipt


def test_a_lost_sampling_race_writes_no_second_sampled_entry(world, monkeypatch):
    job = world.primary("a")
    world.v.settled(job, job.receipt)
    monkeypatch.setattr(world.v.repo, "get", lambda job_id: None)  # as if it raced
    world.v._decide(job, job.receipt)
    assert world.actions(job.id).count("verification.sampled") == 1


def test_funding_a_check_treats_only_an_unknown_account_as_empty(world, monkeypatch):
    ledger = world.services.ledger
    deposits = []
    monkeypatch.setattr(ledger, "deposit", lambda *a, **k: deposits.append(a))
    monkeypatch.setattr(ledger, "balance",
                        lambda account: (_ for _ in ()).throw(lerr.LedgerBusy("busy")))
    with pytest.raises(lerr.LedgerBusy):
        world.v._fund("check-1", 500)
    assert deposits == []
    monkeypatch.setattr(ledger, "balance",
                        lambda account: (_ for _ in ()).throw(lerr.UnknownAccount(account)))
    world.v._fund("check-2", 500)
    assert deposits == [(CHECK_ACCOUNT, 500)]


def test_royalty_room_is_the_held_amount_stored_on_the_job(world, monkeypatch):
    billing = world.services.billing
    monkeypatch.setattr(billing, "royalty_of", lambda plugin, inputs, as_of: (("pub", 300),))
    monkeypatch.setattr(world.services.ledger, "get_hold",
                        lambda hold_id: pytest.fail("the hold is not read back"))
    job = Job(id="j", account_id=world.client, plugin="echo", plugin_version="1.0.0",
              inputs={}, state=JobState.SETTLED, hold_id="h", max_price_micro=1_000)
    assert billing.royalty_within_hold(job, 800, 100) == ([("pub", 200)], 0)


def test_a_check_is_judged_on_the_judging_worker_not_the_settling_thread(world, monkeypatch):
    """The thread that settles a check (an agent's stream) goes on at once; the judging
    worker compares the runs; a check the worker never judged is judged by the sweep."""
    import threading

    from broker.verification import verdicts as vs

    first, second = world.checked("a", GOOD), world.checked("a", GOOD)
    checks = [world.settle(world.check_of(first), "b", GOOD),
              world.settle(world.check_of(second), "c", GOOD)]
    started, release, judged_on = threading.Event(), threading.Event(), []
    real_judge = vs._judge

    def slow_judge(*a):
        judged_on.append(threading.current_thread().name)
        started.set()
        assert release.wait(10)
        return real_judge(*a)

    monkeypatch.setattr(vs, "_judge", slow_judge)
    world.v.judge_in_background()
    judges = world.v._judges
    for check in checks:  # each returns while the first judgement waits
        world.v.settled(check, check.receipt)
    assert started.wait(10)  # the worker is judging the first: the second waits its turn
    assert world.v.status(first.id).status is CheckStatus.CHECKING
    world.v.close()  # the broker stops: the second check is never judged by the worker
    release.set()
    judges.shutdown(wait=True)
    assert judged_on == ["judge_0"]
    assert world.v.status(first.id).status is CheckStatus.VERIFIED
    assert world.v.status(second.id).status is CheckStatus.CHECKING
    assert world.sweep() >= 1
    assert world.v.status(second.id).status is CheckStatus.VERIFIED
    assert judged_on[1:] == [threading.current_thread().name]


def test_a_check_settled_as_the_worker_stops_is_judged_at_once(world):
    job = world.checked("a", GOOD)
    checker = world.settle(world.check_of(job), "b", GOOD)
    world.v.judge_in_background()
    world.v._judges.shutdown()  # stopping: submit() refuses
    world.v.settled(checker, checker.receipt)
    assert world.v.status(job.id).status is CheckStatus.VERIFIED


def test_a_lost_job_whose_hold_a_claw_back_refunded_is_no_failed_refund(world):
    """A cheater's later jobs lose their checks after an earlier loss clawed their holds
    back: their client has the money already, so nothing failed."""
    from dataclasses import replace

    from broker.ledger.model import Splits

    ledger = world.services.ledger
    client = "acct-refunded-client"
    ledger.open_client(client)
    ledger.deposit(client, 1_000_000, idempotency_key="refunded:deposit")
    hold = ledger.hold(client, 1_000_000, "refunded-job", idempotency_key="refunded:hold")
    ledger.post(hold.id, Splits(provider=world.operators["a"], provider_micro=900_000,
                                fee_micro=100_000), idempotency_key="refunded:post")
    ledger.refund(hold.id, idempotency_key="refunded:claw", reason="clawed back")
    job = replace(world.primary("a"), hold_id=hold.id)
    world.v._refund(job, "outvoted", strict=True)
    assert "verification.refund_failed" not in world.actions(job.id)
    assert ledger.balances(client)[AccountKind.CLIENT_AVAILABLE] == 1_000_000  # once
    # a refusal for another reason (vested, say) is still recorded as a failure
    other = ledger.hold(client, 500_000, "other-job", idempotency_key="refunded:hold2")
    world.v._refund(replace(job, hold_id=other.id), "outvoted")  # pending: not refundable
    assert "verification.refund_failed" in world.actions(job.id)


def test_a_check_its_partner_fails_non_retryably_is_reissued_elsewhere(world):
    """Issue #20: the check partner failing the check "non-retryable" left the job
    unchecked for good; now the check goes to another operator, the failer's excluded."""
    job = world.checked("a", BAD)
    first = world.check_of(job)
    leased = world.jobs.repo.transition(first.id, [JobState.QUEUED], JobState.MATCHED,
                                        provider_id=world.machines["b"])
    world.jobs.failed(world.machines["b"], leased.id, 0, "oom", "out of memory",
                      retryable=False)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.CHECKING
    again = world.check_of(job)
    assert again.id != first.id and again.inputs == first.inputs
    assert f"operator:{world.operators['b']}" in again.excluded_providers
    assert f"operator:{world.operators['a']}" in again.excluded_providers
    assert "verification.check_reissued" in world.actions(job.id)
    checker = world.settle(again, "c", GOOD)
    world.v.settled(checker, checker.receipt)
    assert world.v.status(job.id).status is CheckStatus.DISPUTED  # c disagrees with a


def test_a_check_that_fails_on_every_try_leaves_the_output_unchecked(world):
    job = world.checked("a")
    seen = set()
    for _ in range(world.v.settings.check_tries):
        check = world.check_of(job)
        assert check.id not in seen
        seen.add(check.id)
        world.jobs.give_up(check, "check_timeout", "nobody took it")
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.UNCHECKED
    assert f"{world.v.settings.check_tries} tries" in rec.outcome["note"]
