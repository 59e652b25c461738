"""Text checks by teacher-forced re-scoring on the tiny llama: the claimed tokens and the
provider's logprobs against the checker's own pass over those tokens. Honest runs pass
whatever the checker's dtype; another model, truncation, padding and a suppressed end of
sequence are flagged."""
from __future__ import annotations

import math
import random

import pytest

from broker.verification.comparators import TextClaim, TextThresholds, Verdict, compare_text
from broker.verification.rescoring import rescore_causal_lm

from .conftest import RecordingContext, load_llama_plugin

PROMPT = "Once upon a time there was a lighthouse"


@pytest.fixture(scope="module")
def checkers(llama_weights):
    import torch
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(llama_weights, dtype=dtype).eval()
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}


def run(plugin, **inputs):
    inputs = {"prompt": PROMPT, "max_new_tokens": 32, "temperature": 0.7, "top_p": 0.95,
              "seed": 1, **inputs}
    out = plugin.run(dict(inputs), RecordingContext())[0]
    return plugin.encode(inputs), out.meta, inputs


def claim_of(meta, inputs, **overrides) -> TextClaim:
    fields = dict(token_ids=meta["token_ids"], logprobs=meta["logprobs"],
                  finish_reason=meta["finish_reason"], max_new_tokens=inputs["max_new_tokens"],
                  temperature=inputs["temperature"], top_p=inputs["top_p"],
                  ignore_eos=bool(inputs.get("ignore_eos")), stop=inputs.get("stop"))
    fields.update(overrides)
    return TextClaim(**fields)


def judge(checker, eos_ids, prompt_ids, claim: TextClaim, tokenizer=None):
    rescore = rescore_causal_lm(checker, prompt_ids, claim.token_ids, eos_ids,
                                temperature=claim.temperature, top_p=claim.top_p,
                                ignore_eos=claim.ignore_eos, tokenizer=tokenizer,
                                stop=claim.stop)
    return compare_text(claim, rescore)


@pytest.mark.parametrize("checker_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("temperature", "top_p", "seed", "ignore_eos"), [
    (0.0, 1.0, 0, True), (0.7, 0.95, 1, False), (1.0, 1.0, 2, False), (0.7, 0.5, 3, True),
    (1.3, 0.9, 4, False)])
def test_honest_tokens_are_accepted(honest, checkers, checker_dtype, temperature, top_p, seed,
                                    ignore_eos):
    prompt_ids, meta, inputs = run(honest, temperature=temperature, top_p=top_p, seed=seed,
                                   ignore_eos=ignore_eos)
    result = judge(checkers[checker_dtype], honest.eos_ids, prompt_ids, claim_of(meta, inputs))
    assert result.verdict == Verdict.MATCH, result.reasons
    assert result.max_gap < TextThresholds().accept_gap


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.7, 0.95), (1.0, 1.0)])
def test_tokens_from_another_model_are_flagged(honest, other, checkers, temperature, top_p):
    # the cheaper model's own tokens and logprobs, claimed as the job's model's
    prompt_ids, meta, inputs = run(other, temperature=temperature, top_p=top_p,
                                   ignore_eos=True)
    result = judge(checkers["fp32"], honest.eos_ids, prompt_ids, claim_of(meta, inputs))
    assert result.verdict == Verdict.MISMATCH
    assert result.bad_positions or result.grey_tokens > 3


def test_made_up_logprobs_are_flagged(honest, checkers):
    prompt_ids, meta, inputs = run(honest, ignore_eos=True)
    rng = random.Random(0)
    fake = [lp + rng.choice([-1.5, 1.5]) for lp in meta["logprobs"]]
    result = judge(checkers["fp32"], honest.eos_ids, prompt_ids,
                   claim_of(meta, inputs, logprobs=fake))
    assert result.verdict == Verdict.MISMATCH
    assert "logprob gap" in result.reasons[0]


def test_truncated_output_is_flagged(honest, checkers):
    prompt_ids, meta, inputs = run(honest, ignore_eos=True)
    assert meta["finish_reason"] == "length" and len(meta["token_ids"]) == 32
    cut = claim_of(meta, inputs, token_ids=meta["token_ids"][:12], logprobs=meta["logprobs"][:12])
    result = judge(checkers["fp32"], honest.eos_ids, prompt_ids, cut)
    assert result.verdict == Verdict.MISMATCH
    assert any("truncated" in r for r in result.reasons)
    # the same cut dressed up as a natural stop
    stop = claim_of(meta, inputs, token_ids=meta["token_ids"][:12],
                    logprobs=meta["logprobs"][:12], finish_reason="stop")
    assert judge(checkers["fp32"], honest.eos_ids, prompt_ids, stop).verdict == Verdict.MISMATCH


def test_padded_output_is_flagged(honest, checkers):
    prompt_ids, meta, inputs = run(honest, max_new_tokens=16, ignore_eos=True)
    extra_ids, extra_lps = meta["token_ids"][:6], meta["logprobs"][:6]
    padded = claim_of(meta, inputs, token_ids=meta["token_ids"] + extra_ids,
                      logprobs=meta["logprobs"] + extra_lps)
    result = judge(checkers["fp32"], honest.eos_ids, prompt_ids, padded)
    assert result.verdict == Verdict.MISMATCH
    assert any("padded" in r for r in result.reasons)


def test_tokens_after_the_end_of_sequence_are_flagged(honest, checkers):
    prompt_ids, meta, inputs = run(honest, temperature=0.0, top_p=1.0, prompt="Once upon a time")
    assert meta["finish_reason"] == "stop" and meta["token_ids"][-1] in honest.eos_ids
    # pad past the stop with what the model would have said had it gone on
    _, more, _ = run(honest, temperature=0.0, top_p=1.0, prompt="Once upon a time", ignore_eos=True,
                     max_new_tokens=12)
    padded = claim_of(meta, inputs, token_ids=meta["token_ids"] + more["token_ids"],
                      logprobs=meta["logprobs"] + more["logprobs"], finish_reason="length",
                      max_new_tokens=32)
    result = judge(checkers["fp32"], honest.eos_ids, prompt_ids, padded)
    assert result.verdict == Verdict.MISMATCH
    assert any("after the end-of-sequence" in r or "padded" in r for r in result.reasons)


@pytest.fixture(scope="module")
def eager(eager_llama_weights):
    import torch
    from transformers import AutoModelForCausalLM

    plugin = load_llama_plugin(eager_llama_weights)
    checker = AutoModelForCausalLM.from_pretrained(eager_llama_weights,
                                                   dtype=torch.float32).eval()
    yield plugin, checker
    plugin.teardown()


@pytest.mark.parametrize("seed", range(4))
def test_an_eager_model_stopping_honestly_is_accepted(eager, seed):
    plugin, checker = eager
    prompt_ids, meta, inputs = run(plugin, seed=seed, temperature=1.0, top_p=1.0)
    result = judge(checker, plugin.eos_ids, prompt_ids, claim_of(meta, inputs))
    assert result.verdict == Verdict.MATCH, result.reasons


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.7, 0.95)])
def test_suppressed_end_of_sequence_is_flagged(eager, temperature, top_p):
    """A provider padding its output for pay: it bans the end-of-text token (as
    ignore_eos does) but the job did not ask for that."""
    plugin, checker = eager
    prompt_ids, meta, inputs = run(plugin, temperature=temperature, top_p=top_p,
                                   ignore_eos=True, seed=5, max_new_tokens=64)
    assert meta["finish_reason"] == "length"
    result = judge(checker, plugin.eos_ids, prompt_ids, claim_of(meta, inputs, ignore_eos=False))
    assert result.verdict == Verdict.MISMATCH
    assert any("suppressed end of sequence" in r for r in result.reasons), result.reasons
    assert temperature == 0 or result.continue_log < math.log(1e-6)


def test_the_rescoring_must_use_the_jobs_sampling_settings(honest, checkers):
    prompt_ids, meta, inputs = run(honest, max_new_tokens=8, ignore_eos=True)
    rescore = rescore_causal_lm(checkers["fp32"], prompt_ids, meta["token_ids"], honest.eos_ids,
                                temperature=1.0, top_p=1.0)
    with pytest.raises(ValueError, match="re-score with the job's"):
        compare_text(claim_of(meta, inputs), rescore)


def test_claims_need_one_logprob_per_token():
    with pytest.raises(ValueError, match="one logprob per token"):
        TextClaim(token_ids=[1, 2, 3], logprobs=[-1.0], finish_reason="length",
                  max_new_tokens=3, temperature=0.0)


def test_greedy_honest_runs_agree_though_the_end_of_sequence_ids_together_top_the_pick(
        honest, checkers):
    """The tiny llama has several end-of-sequence ids; where their summed probability tops
    the likeliest token, none of them is that token, and a greedy run goes on. Judged by
    that sum, two identical honest greedy runs used to disagree (read off the checker's
    run as well as re-scored)."""
    from broker.verification.judging import compare_text_runs

    prompt_ids, a, inputs = run(honest, temperature=0.0, top_p=1.0, seed=0, max_new_tokens=24)
    _, b, _ = run(honest, temperature=0.0, top_p=1.0, seed=0, max_new_tokens=24)
    assert a["token_ids"] == b["token_ids"]
    assert any(s["eos_lp"] > s["top"][0][1] for s in a["scores"])  # the case is exercised
    read_off = compare_text_runs(a, b)
    assert read_off.verdict == Verdict.MATCH, read_off.reasons
    result = judge(checkers["fp32"], honest.eos_ids, prompt_ids, claim_of(a, inputs))
    assert result.verdict == Verdict.MATCH, result.reasons


def test_greedy_end_of_sequence_is_judged_by_the_likeliest_token():
    from broker.verification.comparators import Rescore, TokenScore

    claim = TextClaim(token_ids=[5], logprobs=[-1.0], finish_reason="length",
                      max_new_tokens=1, temperature=0.0, top_p=1.0)
    # the end-of-sequence ids together (-0.2) top the claimed, likeliest token (-1.0)
    base = dict(logprob=-1.0, rank=0, top_logprob=-1.0, mass_above=0.0, eos_logprob=-0.2)

    def judged(**score):
        return compare_text(claim, Rescore(tokens=(TokenScore(**{**base, **score}),),
                                           eos_ids=frozenset({1, 2}), temperature=0.0,
                                           top_p=1.0))

    assert judged(eos_top=False).verdict == Verdict.MATCH  # none of them is the pick
    unknown = judged(eos_top=None)  # not known: the summed mass stands in, as it did
    assert unknown.verdict == Verdict.MISMATCH
    assert "suppressed end of sequence" in unknown.reasons[0]
    stopped = judged(eos_top=True, top_logprob=-0.3, rank=1)  # one of them was the pick
    assert stopped.verdict == Verdict.MISMATCH
    assert any("suppressed end of sequence" in r for r in stopped.reasons)
