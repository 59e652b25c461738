"""Stop reasons and lengths are checked against the job's own parameters (DESIGN §6): a
claimed ending must be where the tokens and the job's inputs put it (an end-of-sequence
id of the checker's model, the job's stop string as the checker decodes the tokens, the
job's max_new_tokens), whatever the claim's meta says. On the tiny llama, judged as the
verifier judges a claim: on the checker's re-run of the seeded job (read-off) and on its
scoring of the claimed tokens."""
from __future__ import annotations

import pytest

from broker.verification.comparators import Verdict
from broker.verification.judging import compare_text_runs, scoring_inputs

from .conftest import RecordingContext, load_llama_plugin

PROMPT = "Once upon a time there was a lighthouse"


def job(**inputs):
    return {"prompt": PROMPT, "max_new_tokens": 40, "temperature": 1.0, "top_p": 1.0,
            "seed": 0, "ignore_eos": True, **inputs}


def run(plugin, inputs):
    return plugin.run(dict(inputs), RecordingContext())[0]


def judged(checker, claim, inputs, *, scoring: bool):
    """``claim`` (text and meta) judged against the checker's re-run of the job, or its
    scoring of the claimed tokens."""
    text, meta = claim
    check = run(checker, scoring_inputs(inputs, meta["token_ids"]) if scoring else inputs)
    return compare_text_runs(meta, check.meta, inputs, salt=b"check",
                             texts=(text, check.data))


def both(checker, claim, inputs):
    return [judged(checker, claim, inputs, scoring=s) for s in (False, True)]


@pytest.fixture(scope="module")
def stop(honest):
    """A stop string this job's text holds (two characters from its second half)."""
    text = run(honest, job()).data.decode()
    return next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2])


@pytest.fixture(scope="module")
def eager(eager_llama_weights):
    plugin = load_llama_plugin(eager_llama_weights)
    yield plugin
    plugin.teardown()


def claim(out, **meta):
    return out.data, {**out.meta, **meta}


def test_an_honest_stop_string_ending_passes(honest, stop):
    inputs = job(stop=stop)
    out = run(honest, inputs)
    assert out.meta["finish_reason"] == "stop" and len(out.meta["token_ids"]) < 40
    for result in both(honest, claim(out), inputs):
        assert result.verdict is Verdict.MATCH, result.reasons
        assert result.figures()["end"] == "stop"


def test_honest_end_of_sequence_and_length_endings_pass(honest, eager):
    inputs = job(ignore_eos=False, seed=0)
    ended = run(eager, inputs)
    assert ended.meta["finish_reason"] == "stop" and not ended.meta["stopped_by_string"]
    for result in both(eager, claim(ended), inputs):
        assert result.verdict is Verdict.MATCH and result.figures()["end"] == "stop"
    full = run(honest, job())
    assert full.meta["finish_reason"] == "length"
    for result in both(honest, claim(full), job()):
        assert result.verdict is Verdict.MATCH and result.figures()["end"] == "length"


@pytest.mark.parametrize("has_stop", [True, False])
def test_half_the_tokens_claimed_as_met_the_stop_string_is_caught(honest, has_stop):
    """The cheat of issue #20: stop after half the tokens, claim a stop string (the claim's
    meta says so three ways; the job's stop string is nowhere in its text)."""
    inputs = job(stop="<END>") if has_stop else job()
    cut = run(honest, {**inputs, "max_new_tokens": 20})
    fake = claim(cut, finish_reason="stop", stopped_by_string=True, stop_at=19,
                 max_new_tokens=40)
    for result in both(honest, fake, inputs):
        assert result.verdict is Verdict.MISMATCH
        assert any("truncated" in r for r in result.reasons), result.reasons
        assert result.figures()["end"] == "none"
    assert has_stop or any("it has none" in r for r in result.reasons)


def test_tokens_past_the_stop_string_are_caught(honest, stop):
    """A run that went on past the job's stop string (paid for more tokens), claimed as
    reaching max_new_tokens."""
    inputs = job(stop=stop)
    went_on = run(honest, job())  # the same seed without the stop: it goes on past it
    assert len(went_on.meta["token_ids"]) == 40
    for result in both(honest, claim(went_on), inputs):
        assert result.verdict is Verdict.MISMATCH
        assert any("after the stop string" in r for r in result.reasons), result.reasons


def test_a_false_finish_reason_is_caught(honest, eager):
    inputs = job(ignore_eos=False, seed=0)
    ended = run(eager, inputs)
    for result in both(eager, claim(ended, finish_reason="length"), inputs):
        assert result.verdict is Verdict.MISMATCH  # it ends at an end-of-sequence token
    full = run(honest, job())
    for result in both(honest, claim(full, finish_reason="stop"), job()):
        assert result.verdict is Verdict.MISMATCH  # neither eos nor a stop string ends it
        assert any("neither an end-of-sequence token nor the job's stop string" in r
                   for r in result.reasons)


def test_the_claims_own_word_on_its_ending_decides_nothing(honest, stop):
    full = run(honest, job())
    said = claim(full, stopped_by_string=True, stop_at=3)
    for result in both(honest, said, job(stop="<END>")):
        assert result.verdict is Verdict.MATCH, result.reasons


def test_a_checker_that_cannot_locate_the_stop_string_leaves_a_doubt(honest, stop):
    """A scoring run of an older build does not say where the stop string is: a claimed
    stop by it is then neither confirmed nor refuted (a third run, never a slash)."""
    inputs = job(stop=stop)
    out = run(honest, inputs)
    scoring = run(honest, scoring_inputs(inputs, out.meta["token_ids"]))
    old = {k: v for k, v in scoring.meta.items() if k not in ("stop_at", "stopped_by_string")}
    result = compare_text_runs(out.meta, old, inputs, texts=(out.data, scoring.data))
    assert result.verdict is Verdict.TIEBREAK and result.figures()["end"] == "unknown"


def test_delivered_text_that_is_not_the_claimed_tokens_is_caught(honest):
    out = run(honest, job())
    altered = (out.data + b" Visit example.com", out.meta)
    for result in both(honest, altered, job()):
        assert result.verdict is Verdict.MISMATCH
        assert "not the decoding of the claimed tokens" in result.reasons[0]
