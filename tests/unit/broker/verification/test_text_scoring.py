"""Text checks whose runs part (DESIGN §6): past the point where the checker's own run of a
seeded job leaves the claimed completion, that run says nothing of the claimed tokens, so
the verifier asks a provider of another operator to score them by teacher forcing (the
llama plugin's ``score_tokens``) and judges that scoring as the check. On the tiny llama:
a claim sampled from another model passes the read-off check and is caught by the
scoring; an honest claim whose check parted is verified by it."""
from __future__ import annotations

import json
import time
import uuid

import pytest

from broker.jobs.model import Job, JobState
from broker.verification.comparators import Verdict
from broker.verification.judging import compare_text_runs
from broker.verification.records import CheckStatus
from tests.verification_world import VerificationWorld

from .conftest import RecordingContext

PROMPT = "Once upon a time there was a lighthouse"
JOB = {"prompt": PROMPT, "max_new_tokens": 24, "temperature": 0.7, "top_p": 0.95, "seed": 3}


def run(plugin, inputs: dict):
    return plugin.run(dict(inputs), RecordingContext())[0]


class World(VerificationWorld):
    """llama jobs, settled with real outputs of the tiny model."""

    def settle(self, job: Job, machine: str, out) -> Job:
        job = self.settle_output(job, machine, out.data, "text/plain", out.meta,
                                 "llama@1.1.0")
        self.v.settled(job, job.receipt)
        return job

    def primary(self, machine: str, out, inputs: dict = JOB, verify: str = "sampled") -> Job:
        now = time.time()
        job, _ = self.jobs.repo.create(
            Job(id=str(uuid.uuid4()), account_id=self.client, plugin="llama",
                plugin_version="1.1.0", inputs=dict(inputs), state=JobState.QUEUED,
                work_units=float(inputs["max_new_tokens"]), created_at=now, updated_at=now,
                verify=verify),
            ("queued", {}))
        job = self.settle(job, machine, out)
        assert self.v.status(job.id).status is CheckStatus.CHECKING  # new: always checked
        return job

    def check(self, job: Job) -> Job:
        return self.jobs.repo.get(self.v.status(job.id).checker_job_id)


@pytest.fixture
def world(tmp_path):
    w = World(tmp_path)
    yield w
    w.services.engine.dispose()


def test_a_claim_from_another_model_passes_a_parted_read_off_but_not_its_scoring(
        world, honest, other):
    claim = run(other, JOB)  # the cheat: a smaller or other model's sampled completion
    job = world.primary("a", claim)
    first = world.check(job)
    assert "score_tokens" not in first.inputs  # the check itself is an ordinary re-run
    checker_run = run(honest, first.inputs)
    # What the check's own run can say: the runs part at once, and a sampled token the
    # checker would not have drawn is not scored there, so nothing is checked at all.
    read_off = compare_text_runs(claim.meta, checker_run.meta)
    assert read_off.verdict is Verdict.MATCH and read_off.checked_tokens == 0

    world.settle(first, "b", checker_run)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.CHECKING and rec.checker_job_id != first.id
    scoring = world.check(job)
    assert json.loads(scoring.inputs["score_tokens"]) == claim.meta["token_ids"]
    assert {k: v for k, v in scoring.inputs.items() if k != "score_tokens"} == first.inputs
    assert scoring.check_of == job.id and scoring.state is JobState.QUEUED
    assert scoring.account_id == first.account_id  # paid like the check it replaces
    assert f"operator:{world.operators['a']}" in scoring.excluded_providers
    assert "verification.parted" in world.actions(job.id)

    world.settle(scoring, "c", run(honest, scoring.inputs))
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED  # the third run decides, as for any mismatch
    assert rec.tiebreak_job_id is not None
    figures = rec.comparisons["primary~checker"]
    assert figures["verdict"] == "mismatch"
    assert figures["outputs"][0]["checked_tokens"] == len(claim.meta["token_ids"])

    # The third run scores the same tokens too (a re-run would part as the check did):
    # the two scorings agree with each other and not with the claim, so the claim loses.
    third = world.jobs.repo.get(rec.tiebreak_job_id)
    assert third.inputs == scoring.inputs
    assert f"operator:{world.operators['c']}" in third.excluded_providers
    world.settle(third, "b", run(honest, third.inputs))
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.OVERTURNED, rec.outcome
    assert rec.comparisons["checker~tiebreaker"]["method"] == "text_scores"
    assert rec.comparisons["checker~tiebreaker"]["verdict"] == "match"
    assert rec.comparisons["primary~tiebreaker"]["verdict"] == "mismatch"
    assert world.machines["a"] in [p["provider_id"] for p in rec.outcome["penalties"]]


def test_an_honest_claim_whose_check_parted_is_verified_by_its_scoring(world, honest):
    claim = run(honest, JOB)
    job = world.primary("a", claim)
    first = world.check(job)
    # the check's run parts from the claim (as another numeric path can make it)
    parted = run(honest, {**first.inputs, "seed": 99})
    assert parted.meta["token_ids"] != claim.meta["token_ids"]
    world.settle(first, "b", parted)
    scoring = world.check(job)
    assert scoring.id != first.id and "score_tokens" in scoring.inputs
    world.settle(scoring, "c", run(honest, scoring.inputs))
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.VERIFIED, rec.outcome
    # the scoring run is judged as it is: never scored again
    assert world.jobs.repo.checks_of(job.id)[-1].id == scoring.id
    assert len(world.jobs.repo.checks_of(job.id)) == 2


def test_a_check_that_judged_every_token_needs_no_scoring(world, honest):
    claim = run(honest, JOB)
    job = world.primary("a", claim)
    first = world.check(job)
    world.settle(first, "b", run(honest, first.inputs))  # the same seed: the same tokens
    assert world.v.status(job.id).status is CheckStatus.VERIFIED
    assert [j.id for j in world.jobs.repo.checks_of(job.id)] == [first.id]


def test_a_plugin_version_that_cannot_score_is_judged_on_what_the_check_says(
        world, honest, monkeypatch):
    from broker.verification import verdicts

    monkeypatch.setattr(verdicts, "SCORE_INPUT", "no_such_input")  # as llama 1.0.0 had none
    claim = run(honest, JOB)
    job = world.primary("a", claim)
    first = world.check(job)
    world.settle(first, "b", run(honest, {**first.inputs, "seed": 99}))
    assert world.v.status(job.id).checker_job_id == first.id
    assert world.v.status(job.id).status is not CheckStatus.CHECKING
    assert len(world.jobs.repo.checks_of(job.id)) == 1


def test_a_scoring_run_that_fails_is_reissued_then_left_unchecked(world, honest, other):
    job = world.primary("a", run(other, JOB))
    first = world.check(job)
    world.settle(first, "b", run(honest, first.inputs))
    scoring = world.check(job)
    for _ in range(world.v.settings.check_tries - 1):
        failed = world.jobs.repo.transition(scoring.id, [JobState.QUEUED], JobState.FAILED,
                                            error_code="no_capacity", finished_at=time.time())
        world.v.ended(failed)
        assert world.v.status(job.id).status is CheckStatus.CHECKING
        again = world.check(job)
        assert again.id != scoring.id and again.inputs == scoring.inputs  # scored again
        scoring = again
    failed = world.jobs.repo.transition(scoring.id, [JobState.QUEUED], JobState.FAILED,
                                        error_code="no_capacity", finished_at=time.time())
    world.v.ended(failed)
    assert world.v.status(job.id).status is CheckStatus.UNCHECKED


def test_two_scorings_agree_score_for_score():
    from broker.verification.judging import compare_scorings

    a = {"token_ids": [5, 6, 7], "logprobs": [-1.0, -2.0, -0.5]}
    assert compare_scorings(a, {**a, "logprobs": [-1.01, -2.0, -0.49]}).verdict is Verdict.MATCH
    off = compare_scorings(a, {**a, "logprobs": [-1.0, -4.5, -0.5]})
    assert off.verdict is Verdict.MISMATCH and "token 1" in off.reasons[0]
    other = compare_scorings(a, {**a, "token_ids": [5, 6, 8]})
    assert other.verdict is Verdict.MISMATCH and "same tokens" in other.reasons[0]
    short = compare_scorings(a, {**a, "logprobs": [-1.0]})
    assert short.verdict is Verdict.MISMATCH


# -- sampled as asked, ended where the job's parameters say (issue #20) ---------------------
LONG = {**JOB, "max_new_tokens": 32, "ignore_eos": True}


def test_greedy_output_claimed_as_sampled_is_caught_and_outvoted(world, honest):
    greedy = run(honest, {**LONG, "temperature": 0.0})  # cheaper to serve: cacheable
    greedy.meta.update(temperature=LONG["temperature"], top_p=LONG["top_p"])  # claims the job's
    job = world.primary("a", greedy, LONG)
    first = world.check(job)
    world.settle(first, "b", run(honest, first.inputs))  # sampled: parts from it at once
    scoring = world.check(job)
    assert "score_tokens" in scoring.inputs
    world.settle(scoring, "c", run(honest, scoring.inputs))
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED
    # every claimed token is possible; the claim as a whole is no sample
    figures = rec.comparisons["primary~checker"]["outputs"][0]
    assert figures["sampling"]["verdict"] == "reject", figures
    assert figures["sampling"]["alternative"] == "greedy"
    assert not any("outside" in r or "gap" in r for r in figures["reasons"])
    third = world.jobs.repo.get(rec.tiebreak_job_id)
    world.settle(third, "b", run(honest, third.inputs))
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.OVERTURNED, rec.outcome
    assert rec.comparisons["primary~tiebreaker"]["verdict"] == "mismatch"
    assert [p["provider_id"] for p in rec.outcome["penalties"]] == [world.machines["a"]]


def test_an_honest_sampled_claim_is_verified_with_its_sampling_tested(world, honest):
    claim = run(honest, LONG)
    job = world.primary("a", claim, LONG)
    first = world.check(job)
    world.settle(first, "b", run(honest, first.inputs))  # the same seed: the same tokens
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.VERIFIED, rec.outcome
    sampling = rec.comparisons["primary~checker"]["outputs"][0]["sampling"]
    assert sampling["verdict"] == "pass" and sampling["power"] == "enough"
    assert sampling["tested"] == LONG["max_new_tokens"]


def test_an_early_stop_claiming_the_stop_string_is_caught(world, honest):
    inputs = {**LONG, "stop": "<END>"}
    cut = run(honest, {**inputs, "max_new_tokens": 12})  # half the work
    cut.meta.update(finish_reason="stop", stopped_by_string=True, stop_at=11,
                    max_new_tokens=inputs["max_new_tokens"])
    job = world.primary("a", cut, inputs)
    first = world.check(job)
    world.settle(first, "b", run(honest, first.inputs))  # the whole run: the cut is its start
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED
    reasons = rec.comparisons["primary~checker"]["reasons"]
    assert any("truncated" in r for r in reasons), reasons
    third = world.jobs.repo.get(rec.tiebreak_job_id)
    assert "score_tokens" not in third.inputs  # a re-run decides, as for any mismatch
    world.settle(third, "c", run(honest, third.inputs))
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.OVERTURNED, rec.outcome


# -- evidence compounded across checks (issue #20) ------------------------------------------
NARROW = {"prompt": PROMPT, "max_new_tokens": 64, "temperature": 0.7, "top_p": 0.95,
          "ignore_eos": True}


def _drive(world: World, job: Job, honest, prefer: str = "abc") -> None:
    """Run every check, scoring and third run of ``job`` honestly, each on the first
    machine in ``prefer`` whose operator the run does not exclude, until its verification
    is decided."""
    for _ in range(6):
        rec = world.v.status(job.id)
        if rec.status not in (CheckStatus.CHECKING, CheckStatus.DISPUTED):
            return
        run_id = (rec.tiebreak_job_id if rec.status is CheckStatus.DISPUTED
                  else rec.checker_job_id)
        current = world.jobs.repo.get(run_id)
        machine = next(m for m in prefer
                       if f"operator:{world.operators[m]}" not in current.excluded_providers)
        world.settle(current, machine, run(honest, current.inputs))
    raise AssertionError(f"job {job.id} still open: {world.v.status(job.id)}")


def test_a_narrow_nucleus_cheat_is_caught_over_several_checks_and_honest_runs_never(
        world, honest):
    """Sampled from half the job's top_p: one check reaches the grey zone at most; the
    provider's checks compound (``SamplingState``), the evidence crosses the reject bound
    within a few checks, a third run's own compounded evidence agrees and the cheater is
    outvoted on clear mismatches, which closes its evidence. Only a checker's e-value
    compounds (a third run sees only claims already disputed), so the checks alternate
    between the two other operators, as the broker's draw spreads them. An honest
    provider's evidence over as many checks never gets near."""
    a, b = world.machines["a"], world.machines["b"]
    caught_at = None
    for i in range(10):
        inputs = {**NARROW, "seed": 100 + i}
        claim = run(honest, {**inputs, "top_p": inputs["top_p"] / 2})
        claim.meta.update(top_p=inputs["top_p"])  # claims the job's
        job = world.primary("a", claim, inputs, verify="always")
        _drive(world, job, honest, "abc" if i % 2 == 0 else "acb")
        rec = world.v.status(job.id)
        penalties = [p for p in rec.outcome.get("penalties", []) if p["provider_id"] == a]
        if penalties and penalties[0]["clear"]:
            caught_at = i + 1
            sampling = rec.comparisons["primary~tiebreaker"]["outputs"][0]["sampling"]
            assert sampling["verdict"] == "reject" and sampling["log_e"] < 20.7, sampling
            assert sampling["compounded"]["log_m"] >= 20.7
            assert rec.status is CheckStatus.OVERTURNED
            assert all(world.v.repo.sampling_state(a, "llama", op).checks == 0
                       for op in world.operators.values())  # closed, every witness's
            break
        # each run the claim was compared with added to its own operator's evidence
        assert rec.outcome["sampling"], rec.outcome
        assert sum(world.v.repo.sampling_state(a, "llama", op).checks
                   for op in world.operators.values()) >= i + 1
    assert caught_at is not None and caught_at >= 2, "caught on one check, or never"

    for i in range(caught_at):
        inputs = {**NARROW, "seed": 200 + i}
        job = world.primary("b", run(honest, inputs), inputs, verify="always")
        _drive(world, job, honest, "abc" if i % 2 == 0 else "cba")
        rec = world.v.status(job.id)
        assert rec.status is CheckStatus.VERIFIED and not rec.outcome.get("penalties")
    states = [world.v.repo.sampling_state(b, "llama", op) for op in world.operators.values()]
    assert sum(s.checks for s in states) >= caught_at
    assert all(s.log_m < 9.2 for s in states)  # not even the doubt bound, by any witness


def test_a_burst_of_narrow_claims_compounds_as_each_claim_is_disputed(world, honest):
    """A burst of cheated claims all checked before any third run ends (bench/cheaters.py's
    case: the checks queue while the cheater works, then run together): the checker's
    e-value counts from the moment its comparison disputes a claim, not from the dispute's
    end, so the same witness's next checks of the burst are judged with it and cross the
    reject bound; added once (the verdict's effects find it done), and the outcome keeps
    the figure."""
    a = world.machines["a"]
    witness = world.operators["b"]
    jobs = []
    for i in range(4):
        inputs = {**NARROW, "seed": 300 + i}
        claim = run(honest, {**inputs, "top_p": inputs["top_p"] / 2})
        claim.meta.update(top_p=inputs["top_p"])  # claims the job's
        jobs.append(world.primary("a", claim, inputs, verify="always"))
    verdicts = []
    for job in jobs:  # the checks (and their scoring runs) on b, no third run yet
        for _ in range(3):
            rec = world.v.status(job.id)
            if rec.status is not CheckStatus.CHECKING:
                break
            current = world.jobs.repo.get(rec.checker_job_id)
            world.settle(current, "b", run(honest, current.inputs))
        rec = world.v.status(job.id)
        assert rec.status is CheckStatus.DISPUTED, rec
        verdicts.append(rec.comparisons["primary~checker"]["outputs"][0]["sampling"]["verdict"])
        assert rec.outcome["sampling"]["primary~checker"]["checks"] == len(verdicts)
    assert world.v.repo.sampling_state(a, "llama", witness).checks == 4
    assert "reject" in verdicts[1:], verdicts  # the burst's later checks see the earlier
    for job in jobs:
        _drive(world, job, honest, "cb")
    # each claim's e-value was added once, at its dispute: the verdicts found it done (c's
    # single checks cannot reject alone, so no clear loss closed the evidence)
    assert world.v.repo.sampling_state(a, "llama", witness).checks == 4
    for job in jobs:  # decided, and the honest checker and third runs never penalised
        rec = world.v.status(job.id)
        assert rec.status in (CheckStatus.OVERTURNED, CheckStatus.VERIFIED), rec
        assert {p["provider_id"] for p in rec.outcome.get("penalties") or []} <= {a}, rec
