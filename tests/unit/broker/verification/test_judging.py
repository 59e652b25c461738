"""judging: which comparator two runs of one pinned job go to, and the text re-scoring read
off the checker's own run (teacher-forced along the common prefix, top-k where the runs
part)."""
import math

from broker.verification.comparators import ReproClass, Verdict
from broker.verification.judging import (Run, RunOutput, StoredJudgement, judge,
                                         rescore_from_rerun, repro_of)

CLASS = ReproClass("cpu:x86_64:threads=1", "float32", "llama@1.0.0+ab")
EOS = 2


def _meta(tokens, lps, *, finish="length", max_new=None, temperature=0.0, tops=None):
    scores = []
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        top = (tops or {}).get(i) or [[t, lp, 1.0], [7, lp - 3.0, 0.0]]
        scores.append({"top": top, "eos_lp": -9.0, "eos_p": 0.0, "mass_above": 0.0})
    return {"token_ids": tokens, "logprobs": lps, "scores": scores, "eos_ids": [EOS],
            "finish_reason": finish, "max_new_tokens": max_new or len(tokens),
            "temperature": temperature, "top_p": 1.0, "stopped_by_string": False}


def _run(meta):
    return Run((RunOutput(b"text", "text/plain", meta),), CLASS)


def test_identical_runs_match_and_every_token_is_checked():
    m = _meta([5, 6, 9, 11], [-0.1, -0.2, -0.3, -0.4])
    j = judge("text", _run(m), _run(m))
    assert j.verdict is Verdict.MATCH
    assert j.figures()["outputs"][0]["checked_tokens"] == 4


def test_an_honest_parting_at_a_near_tie_is_not_a_mismatch():
    claim = _meta([5, 6, 8, 3], [-0.1, -0.2, -0.70, -0.5])
    # the checker took 9 at position 2 where 8 was a near tie (0.01 nats apart)
    check = _meta([5, 6, 9, 4], [-0.1, -0.2, -0.69, -0.6],
                  tops={2: [[9, -0.69, 0.5], [8, -0.70, 0.5]]})
    j = judge("text", _run(claim), _run(check))
    assert j.verdict is Verdict.MATCH
    assert j.figures()["outputs"][0]["checked_tokens"] == 3


def test_a_token_the_checker_does_not_rank_is_a_mismatch():
    claim = _meta([5, 99, 98, 97], [-0.1, -0.2, -0.2, -0.2])  # another model's tokens
    check = _meta([5, 6, 9, 11], [-0.1, -0.2, -0.3, -0.4])
    assert judge("text", _run(claim), _run(check)).verdict is Verdict.MISMATCH


def test_truncated_and_padded_claims_are_mismatches():
    check = _meta([5, 6, 9, 11], [-0.1, -0.2, -0.3, -0.4])
    truncated = _meta([5, 6], [-0.1, -0.2], max_new=4)
    assert judge("text", _run(truncated), _run(check)).verdict is Verdict.MISMATCH
    padded = _meta([5, 6, 9, 11, 12, 13], [-0.1, -0.2, -0.3, -0.4, -1, -1], max_new=4)
    assert judge("text", _run(padded), _run(check)).verdict is Verdict.MISMATCH


def test_null_scores_from_an_old_checkpoint_are_not_rescored():
    m = _meta([5, 6], [-0.1, -0.2])
    m["scores"][0] = None
    rescore, checked = rescore_from_rerun([5, 6], [-0.1, -0.2], m)
    assert checked == 1 and len(rescore.tokens) == 2


def test_exact_outputs_and_counts():
    a = Run((RunOutput(b'{"text": "x"}', "application/json"),), CLASS)
    b = Run((RunOutput(b'{"text": "y"}', "application/json"),), CLASS)
    assert judge("json", a, a).verdict is Verdict.MATCH
    assert judge("json", a, b).verdict is Verdict.MISMATCH
    assert judge("json", a, Run((), CLASS)).verdict is Verdict.MISMATCH


def test_stored_judgements_and_repro_of_a_receipt():
    j = StoredJudgement.of({"verdict": "tiebreak", "method": "image"})
    assert j.verdict is Verdict.TIEBREAK and j.figures()["method"] == "image"
    assert repro_of({"repro": {"hardware_class": "h", "dtype": "d", "plugin_build": "b"}}) \
        == ReproClass("h", "d", "b")
    assert repro_of(None) == ReproClass("unknown", "unknown", "unknown")


def _sampled_score(top, own, *, lp_t, mass_above, nucleus_mass):
    """A sampled run's score of its own token ``own`` at a position whose raw top-5 is
    ``top`` ([token, logprob at T=1, share of the nucleus])."""
    return {"top": top, "eos_lp": -9.0, "eos_p": 0.0, "mass_above": mass_above,
            "near": [], "lp_t": lp_t, "mass_tied": math.exp(lp_t), "top_mass": 0.28,
            "nucleus_mass": nucleus_mass, "tilts": []}


def test_an_honest_parting_at_the_edge_of_the_nucleus_is_inside_it():
    """top_p 0.3 at T=1: the likeliest tokens A (0.28) and B (0.27) make the nucleus (B is
    in: only 0.28 is likelier). Another numeric path took B where the checker took A; the
    mass above B is 0.28, not the 0.51 its share of the nucleus above it adds up to."""
    lp = math.log
    top = [[10, lp(0.28), 0.509], [11, lp(0.27), 0.491], [12, lp(0.2), 0.0],
           [13, lp(0.1), 0.0], [14, lp(0.05), 0.0]]
    check = {**_meta([5, 10, 6], [-0.1, lp(0.28), -0.2], temperature=1.0), "top_p": 0.3}
    check["scores"][1] = _sampled_score(top, 10, lp_t=lp(0.28), mass_above=0.0,
                                        nucleus_mass=0.55)
    claim = {**_meta([5, 11, 7], [-0.1, lp(0.27), -0.3], temperature=1.0), "top_p": 0.3}
    rescore, _ = rescore_from_rerun(claim["token_ids"], claim["logprobs"], check)
    assert abs(rescore.tokens[1].mass_above - 0.28) < 1e-6
    j = judge("text", _run(claim), _run(check))
    assert j.verdict is Verdict.MATCH, j.reasons
    # a token past the nucleus at the parting still is: C has 0.55 above it
    off = {**claim, "token_ids": [5, 12, 7], "logprobs": [-0.1, lp(0.2), -0.3]}
    j = judge("text", _run(off), _run(check))
    assert j.verdict is Verdict.MISMATCH and "outside the top_p=0.3 nucleus" in j.reasons[0]


def test_under_ignore_eos_the_likeliest_token_is_the_likeliest_the_sampler_could_take():
    """Greedy with the end of sequence banned: where an eos id is the raw top, the claimed
    token (the likeliest one allowed) is no rank-1 pick of a greedy job."""
    m = _meta([5, 6], [-1.4, -0.3], tops={0: [[EOS, -0.4, 0.0], [5, -1.4, 1.0]]})
    m["ignore_eos"] = True
    assert judge("text", _run(m), _run(m)).verdict is Verdict.MATCH
    m["ignore_eos"] = False  # the eos was allowed: the greedy run should have ended there
    assert judge("text", _run(m), _run(m)).verdict is Verdict.MISMATCH


def test_the_jobs_own_parameters_judge_the_claim_not_the_meta():
    """The claim and the check both report max_new_tokens 4 and no stop string; the job
    (the broker's record) asked for 2 tokens: the claim is padded."""
    m = _meta([5, 6, 9, 11], [-0.1, -0.2, -0.3, -0.4])
    job = Run((RunOutput(b"text", "text/plain", m),), CLASS,
              inputs={"max_new_tokens": 2, "temperature": 0.0, "top_p": 1.0})
    j = judge("text", job, _run(m))
    assert j.verdict is Verdict.MISMATCH and "padded" in j.reasons[0]


def test_a_delivered_text_other_than_the_tokens_decoding_is_a_mismatch():
    m = _meta([5, 6, 9, 11], [-0.1, -0.2, -0.3, -0.4])
    other = Run((RunOutput(b"other text", "text/plain", m),), CLASS)
    j = judge("text", other, _run(m))
    assert j.verdict is Verdict.MISMATCH and "not the decoding" in j.reasons[0]
    # a check whose tokens differ cannot tell: it asks for a scoring run
    parted = _meta([5, 6, 9, 12], [-0.1, -0.2, -0.3, -0.41],
                   tops={3: [[12, -0.41, 1.0], [11, -0.4, 0.0]]})
    j = judge("text", other, _run(parted))
    assert j.figures()["outputs"][0]["text_checked"] is False
