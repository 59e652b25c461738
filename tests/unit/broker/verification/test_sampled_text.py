"""Sampled text is tested as sampled (DESIGN §6, ``sampled_text``): the claimed tokens of
a sampled job must look like a draw from the job's distribution under the checker's
teacher-forced scores. On the tiny llama, as built (flat next-token distributions) and
sharpened (as peaked as a trained model's): honest sampled claims pass whichever numeric
path made them and checked them; greedy output claimed as sampled, output sampled at
another temperature, and a token outside the nucleus are caught; a claim too short to
show how it was sampled is never rejected on that ground."""
from __future__ import annotations

import os
import random

import pytest
import torch

from broker.verification.comparators import Verdict
from broker.verification.judging import compare_text_runs, scoring_inputs
from broker.verification.sampled_text import (GREEDY_SLIP, Position, SamplingBounds,
                                              sampling_evidence)

from .conftest import RecordingContext, load_llama_plugin

PROMPT = "Once upon a time there was a lighthouse"


def _plugin(weights, dtype="float32"):
    before = os.environ.get("SPARECYCLES_DTYPE")
    os.environ["SPARECYCLES_DTYPE"] = dtype  # read once, at setup (as a plugin host does)
    try:
        return load_llama_plugin(weights)
    finally:
        if before is None:
            os.environ.pop("SPARECYCLES_DTYPE", None)
        else:
            os.environ["SPARECYCLES_DTYPE"] = before


@pytest.fixture(scope="module")
def paths(llama_weights, sharp_llama_weights):
    """The llama plugin per model and numeric path: float32 and bfloat16."""
    plugins = {(model, dtype): _plugin(weights, dtype)
               for model, weights in (("flat", llama_weights), ("sharp", sharp_llama_weights))
               for dtype in ("float32", "bfloat16")}
    yield plugins
    for plugin in plugins.values():
        plugin.teardown()


def job(**inputs):
    return {"prompt": PROMPT, "max_new_tokens": 96, "temperature": 0.7, "top_p": 0.95,
            "seed": 1, "ignore_eos": True, **inputs}


def run(plugin, inputs, threads=1):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return plugin.run(dict(inputs), RecordingContext())[0]
    finally:
        torch.set_num_threads(before)


def judged(claim, checker, inputs, salt=b"check-1"):
    """The claim judged as the verifier judges it once the checker scored its tokens."""
    scoring = run(checker, scoring_inputs(inputs, claim.meta["token_ids"]))
    return compare_text_runs(claim.meta, scoring.meta, inputs, salt=salt,
                             texts=(claim.data, scoring.data))


def claimed_as(out, inputs):
    """A run with other settings whose meta claims the job's (as a cheater's would)."""
    out.meta.update(temperature=inputs["temperature"], top_p=inputs["top_p"])
    return out


# (claimed on, checked by): float32 on two threads checked on one, bfloat16 checked in
# float32, float32 checked in bfloat16
PATHS = [(("float32", 2), "float32"), (("bfloat16", 1), "float32"), (("float32", 1), "bfloat16")]


@pytest.mark.parametrize("model", ["flat", "sharp"])
@pytest.mark.parametrize("claim_path,checker_dtype", PATHS)
@pytest.mark.parametrize("temperature,top_p,seed", [(0.7, 0.95, 1), (1.0, 1.0, 2),
                                                    (1.3, 0.8, 4)])
def test_honest_sampled_claims_pass_across_numeric_paths(paths, model, claim_path,
                                                         checker_dtype, temperature, top_p,
                                                         seed):
    inputs = job(temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=64)
    dtype, threads = claim_path
    claim = run(paths[model, dtype], inputs, threads)
    result = judged(claim, paths[model, checker_dtype], inputs)
    assert result.verdict is Verdict.MATCH, result.reasons
    sampling = result.figures()["sampling"]
    assert sampling["verdict"] == "pass" and sampling["tested"] > 0


@pytest.mark.parametrize("model,tokens", [("flat", 24), ("sharp", 128)])
def test_greedy_output_claimed_as_sampled_is_rejected(paths, model, tokens):
    inputs = job(max_new_tokens=tokens)
    greedy = claimed_as(run(paths[model, "float32"], {**inputs, "temperature": 0.0}), inputs)
    for checker in ("float32", "bfloat16"):
        result = judged(greedy, paths[model, checker], inputs)
        assert result.verdict is Verdict.MISMATCH
        sampling = result.figures()["sampling"]
        assert sampling["verdict"] == "reject" and sampling["alternative"] == "greedy"
        assert any("do not look sampled" in r for r in result.reasons)
    # every token is possible: only the test of the whole claim sees the cheat
    assert all(s.mass_above <= inputs["top_p"] for s in _rescored(greedy, paths[model,
                                                                                "float32"],
                                                                  inputs))


def _rescored(claim, checker, inputs):
    from broker.verification.judging import rescore_from_rerun

    scoring = run(checker, scoring_inputs(inputs, claim.meta["token_ids"]))
    return rescore_from_rerun(claim.meta["token_ids"], claim.meta["logprobs"],
                              scoring.meta)[0].tokens


def test_a_claim_too_short_to_show_its_sampling_is_not_rejected_for_it(paths):
    """Six greedy tokens of the sharpened model could be an honest sample: the test has no
    power there, says so, and never rejects on it (a doubt brings a third run at most)."""
    inputs = job(max_new_tokens=6)
    greedy = claimed_as(run(paths["sharp", "float32"], {**inputs, "temperature": 0.0}), inputs)
    result = judged(greedy, paths["sharp", "float32"], inputs)
    sampling = result.figures()["sampling"]
    assert sampling["power"] == "low" and sampling["verdict"] != "reject"
    assert result.verdict is not Verdict.MISMATCH, result.reasons


@pytest.mark.parametrize("cheat", [{"temperature": 1.4, "top_p": 1.0},   # hotter
                                   {"temperature": 0.3}])                 # colder
def test_text_sampled_at_another_temperature_is_caught(paths, cheat):
    inputs = job(max_new_tokens=256, top_p=1.0, seed=7)
    other = claimed_as(run(paths["sharp", "float32"], {**inputs, **cheat}), inputs)
    result = judged(other, paths["sharp", "bfloat16"], inputs)
    assert result.verdict is not Verdict.MATCH
    assert result.figures()["sampling"]["verdict"] in ("doubt", "reject")
    assert result.figures()["sampling"]["alternative"].startswith(("tilt", "low", "high"))


def test_a_token_outside_the_nucleus_is_a_mismatch(paths):
    inputs = job(top_p=0.5, seed=5, max_new_tokens=32)
    wide = claimed_as(run(paths["sharp", "float32"], {**inputs, "top_p": 1.0, "temperature":
                                                      1.0}), inputs)
    wide.meta["temperature"] = inputs["temperature"]
    result = judged(wide, paths["sharp", "bfloat16"], inputs)
    assert result.verdict is Verdict.MISMATCH
    assert any("outside the top_p=0.5 nucleus" in r for r in result.reasons)


# -- the e-value itself, on synthetic draws -----------------------------------------------
def _synthetic(rng: random.Random, n: int, draw) -> list[Position]:
    """n positions of random 12-token distributions (nucleus: all), with the token ``draw``
    picks from the probabilities sorted in descending order."""
    out = []
    for _ in range(n):
        w = sorted((rng.expovariate(1.0) ** 3 for _ in range(12)), reverse=True)
        total = sum(w)
        p = [x / total for x in w]
        k = draw(p)
        out.append(Position(lp=_log(p[k]), mass_above=sum(p[:k]), mass_tied=p[k],
                            top_mass=p[0], nucleus_mass=1.0,
                            tilts=tuple((g, _log(sum(x ** g for x in p)))
                                        for g in (0.6, 1.5, 3.0))))
    return out


def _log(x: float) -> float:
    import math

    return math.log(x)


def test_honest_draws_reach_a_bound_no_more_often_than_its_alpha():
    """Ville's inequality, in the implementation: over many honest claims, the share whose
    evidence reaches 1/α is at most α (here α = 5 %, to see it at all)."""
    rng = random.Random(0)
    bounds = SamplingBounds(reject=0.01, doubt=0.05)

    def honest(p):
        return rng.choices(range(len(p)), weights=p)[0]

    flagged = sum(sampling_evidence(_synthetic(rng, rng.choice([5, 20, 60]), honest),
                                    str(i).encode(), bounds).verdict != "pass"
                  for i in range(1500))
    assert flagged / 1500 <= 0.05
    greedy = sampling_evidence(_synthetic(rng, 60, lambda p: 0), b"x", bounds)
    assert greedy.verdict == "reject" and greedy.alternative == "greedy"
    slips = sampling_evidence(_synthetic(rng, 60, lambda p: 0 if rng.random() > GREEDY_SLIP
                                         else 1), b"x", bounds)
    assert slips.verdict == "reject"  # a near-tie flipped now and then still shows
