"""judging: which comparator two runs of one pinned job go to, and the text re-scoring read
off the checker's own run (teacher-forced along the common prefix, top-k where the runs
part)."""
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
