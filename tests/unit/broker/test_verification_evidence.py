"""Evidence verification keeps across checks (issue #20), on SQLite and PostgreSQL: each
provider's sampled-text e-process per plugin and its recent canaries, answered or not.
Both are one record for every replica and survive a restart; a canary not answered counts
against its provider beyond one excused miss in its last eight, as a wrong answer does
(CV reset, quota cut), never against its stake."""
from __future__ import annotations

import math

import pytest

from broker.ledger.model import AccountKind
from broker.services import build_services
from broker.settings import Settings
from broker.verification.records import CheckStatus, Verification
from broker.verification.sampled_text import SamplingState
from tests.verification_world import HW, VerificationWorld


@pytest.fixture
def world(tmp_path, db_url):
    w = VerificationWorld(tmp_path, db_url)
    yield w
    w.services.engine.dispose()


def _restarted(world: VerificationWorld, tmp_path, db_url):
    """Another broker (a restart, or a second replica) on the same database."""
    services = build_services(Settings(data_dir=tmp_path, db_url=db_url,
                                       maintenance_interval_s=0, check_delay_max_s=0.0))
    services.verification.close()
    return services


def test_sampled_text_evidence_compounds_once_per_step_and_survives_a_restart(
        world, tmp_path, db_url):
    repo, a = world.v.repo, world.machines["a"]
    assert repo.sampling_state(a, "llama", "op-x") == SamplingState()
    want = SamplingState().after(12.0).after(11.0)
    repo.add_sampling_evidence(a, "llama", "op-x", 12.0)
    got = repo.add_sampling_evidence(a, "llama", "op-x", 11.0)
    assert got.checks == 2 and math.isclose(got.log_m, want.log_m)
    # per plugin: another plugin's evidence is its own
    assert repo.sampling_state(a, "sd15", "op-x") == SamplingState()
    repo.add_sampling_evidence(a, "llama", "op-z", 3.0)
    other = _restarted(world, tmp_path, db_url)
    try:
        seen = other.verification.repo.sampling_state(a, "llama", "op-x")
        assert seen.checks == 2 and math.isclose(seen.log_m, want.log_m)
        other.verification.repo.close_sampling_evidence(a, "llama")
    finally:
        other.engine.dispose()
    # a slash closes every witness's process
    assert repo.sampling_state(a, "llama", "op-x") == SamplingState()
    assert repo.sampling_state(a, "llama", "op-z") == SamplingState()


def test_one_operators_word_raises_only_its_own_evidence(world):
    """A checker's scores give its e-values and the broker cannot recompute them: an operator
    that inflated them against an honest provider, past the reject bound, must not lend that
    to another operator's run (a dispute's third run is judged on its own operator's
    evidence), or compounding would frame the honest provider on one liar's word."""
    repo, a = world.v.repo, world.machines["a"]
    for _ in range(3):
        repo.add_sampling_evidence(a, "llama", "liar", 10.9)  # just under doubt, each time
    assert repo.sampling_state(a, "llama", "liar").log_m > 20.7
    assert repo.sampling_state(a, "llama", "honest-third") == SamplingState()


def test_a_step_marked_done_on_its_record_is_not_compounded_twice(world):
    """Re-applying a judged record's effects (the sweep after a crash) adds its claim's
    e-value once."""
    repo, a = world.v.repo, world.machines["a"]
    repo.add(Verification(job_id="job-1", plugin="llama", provider_id=a, hardware_class=HW,
                          status=CheckStatus.CHECKING, p=1.0, reason="new", draw=0.0,
                          outcome={"applied": False}))
    first = repo.add_sampling_evidence(a, "llama", "op-x", 5.0, once=("job-1", "sampling:x"))
    again = repo.add_sampling_evidence(a, "llama", "op-x", 5.0, once=("job-1", "sampling:x"))
    assert first == again and first.checks == 1
    assert "sampling:x" in repo.get("job-1").outcome["done"]


def test_canary_misses_beyond_one_in_eight_count_as_wrong_answers(world, tmp_path, db_url):
    v, a = world.v, world.machines["a"]
    owner = world.operators["a"]
    stake_before = world.services.ledger.balances(owner).get(AccountKind.PROVIDER_STAKE, 0)
    inputs = {"prompt": "a lighthouse"}
    # one miss (a crash): excused, the standing untouched
    assert v.canary_unanswered(a, "sd15", "1.1.0", None, "no receipt within 120 s") == "excused"
    st = v.repo.standing(a, "sd15", HW)
    assert (st.failures, st.quota_factor) == (0, 1.0)
    for _ in range(6):  # answered canaries do not wipe the miss from the window of eight
        v.canary_answer(a, "sd15", "1.1.0", inputs, {"outputs": []})
    # a second miss within its last eight: a failed check, as a wrong answer is
    assert v.canary_unanswered(a, "sd15", "1.1.0", None, "failed or given back") == "failed"
    st = v.repo.standing(a, "sd15", HW)
    assert (st.consecutive_valid, st.failures, st.quota_factor) == (0, 1, 0.5)
    assert world.services.ledger.balances(owner).get(AccountKind.PROVIDER_STAKE, 0) == \
        stake_before  # never the stake
    actions = [e.action for e in world.services.audit.search(subject=f"provider:{a}")]
    assert actions.count("verification.canary_unanswered") == 2
    # the window is the database's: a restarted broker (or another replica) sees it
    other = _restarted(world, tmp_path, db_url)
    try:
        assert other.verification.canary_unanswered(a, "sd15", "1.1.0", None,
                                                    "no receipt") == "failed"
        assert other.verification.repo.standing(a, "sd15", HW).failures == 2
    finally:
        other.engine.dispose()
    # eight answered canaries later the misses are out of the window: one is excused again
    for _ in range(8):
        v.canary_answer(a, "sd15", "1.1.0", inputs, {"outputs": []})
    assert v.canary_unanswered(a, "sd15", "1.1.0", None, "no receipt") == "excused"
    # another plugin keeps its own window
    assert v.canary_unanswered(a, "llama", "1.1.0", None, "no receipt") == "excused"


def test_canaries_given_back_for_the_owner_have_an_allowance_of_their_own(world):
    """An agent that could tell canaries would say its owner came back around each one
    (idle-only mode) and give it back: counted apart, two of the last eight excused, the
    third a failed check; the misses' allowance is untouched by them."""
    v, a = world.v, world.machines["a"]
    why = "given back for its owner"
    assert [v.canary_unanswered(a, "sd15", "1.1.0", None, why, away=True)
            for _ in range(3)] == ["excused", "excused", "failed"]
    assert v.repo.standing(a, "sd15", HW).failures == 1
    assert v.canary_unanswered(a, "sd15", "1.1.0", None, "no receipt") == "excused"
    entries = world.services.audit.search(subject=f"provider:{a}")
    assert sorted(e.data["away"] for e in entries
                  if e.action == "verification.canary_unanswered") == [False] + [True] * 3
