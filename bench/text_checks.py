"""Text checks on the tiny llama, judged as the verifier judges them (DESIGN §6), in-process.

Each job (a prompt, temperature, top_p, seed, length and sometimes a stop string, drawn at
random) is run by a primary and checked by a checker of another numeric configuration:
float32 on one thread, float32 on two threads, or bfloat16 (honest checks, which must
pass); it is also checked by a checker of the primary's own configuration (the same
tokens). Cheating claims of the same job are judged against the cross-configuration
checker:

* **another model**: sampled from another tiny llama (built from seed 1);
* **greedy as sampled**: the job's model, greedy, claimed as the job's sampling (sampled
  jobs only);
* **colder** / **hotter**: sampled at half / 1.5 times the job's temperature;
* **narrower nucleus**: sampled with half the job's top_p;
* **early stop**: half the tokens, claimed as ended by the stop string;
* **altered text**: honest tokens, but the delivered text has something appended.

Every claim is judged twice: **read-off only** (``compare_text_runs`` on what the
checker's own run shows) and **with scoring** (where that judged fewer tokens than the
claim holds and is not a clear mismatch, the checker's teacher-forced scoring of the
claimed tokens, as ``VerificationService`` asks for). A verdict is *pass* (match), *grey*
(tiebreak: a third run, never a slash) or *mismatch*. An honest claim that does not pass is
a false dispute; a cheat that passes is a missed one.

Two models: the tiny llama as built (its next-token distributions are nearly flat: the
likeliest token holds ~0.3 % of the mass) and the same one **sharpened** (its output
layer scaled by 30: the likeliest token holds ~70 %, about a trained model's profile at
temperature 0.7), on which the sampling test has far less to go on per token. For the
sampling test the script also prints, over the honest claims, how far the probability
integral transform of the claimed tokens is from uniform (the KS distance of all of them
pooled: the test's null hypothesis, across numeric paths), the largest e-value seen
(Ville: at most 1/α of honest claims may reach 1/α), and how far outside the checker's
nucleus an honest token came. Last, the evidence compounded across a provider's checks
(``sampled_text.SamplingState``): each cheat's claims taken as one provider's successive
checks, how many checks it takes to cross the reject bound (fresh, and after the honest
claims came first), and the honest claims as providers' histories: how far their
compounded evidence ever got.

    python bench/text_checks.py              # 60 jobs per model (a few minutes on two cores)
    python bench/text_checks.py --jobs 200 --models sharp
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from broker.verification.comparators import TextThresholds, Verdict  # noqa: E402
from broker.verification.judging import (compare_text_runs, needs_scoring,  # noqa: E402
                                         rescore_from_rerun, scoring_inputs)
from broker.verification.sampled_text import (SamplingBounds, SamplingState, pit,  # noqa: E402
                                              uniform)
from plugins import builtin_plugin_dir  # noqa: E402
from plugins.api import load_manifest  # noqa: E402
from plugins.tiny import build_tiny_llama  # noqa: E402

PROMPTS = ["Once upon a time", "Once upon a time there was a lighthouse",
           "The recipe calls for", "In 1887 the harbour", "Dear committee,",
           "def fibonacci(n):", "The weather today", "Ask the lighthouse keeper"]
CONFIGS = {"fp32-1thread": ("float32", 1), "fp32-2threads": ("float32", 2),
           "bf16-1thread": ("bfloat16", 1)}
SHARPEN = 30.0
STOPS = [None, None, None, "th"]  # the job's stop string, drawn per job
LENGTHS = [16, 64, 256]


def sharpen_llama(src: Path, out: Path, factor: float = SHARPEN) -> Path:
    """The tiny llama at ``src`` with its output layer scaled by ``factor``: peaked
    next-token distributions, like a trained model's, in the same layout."""
    import shutil

    from transformers import AutoModelForCausalLM

    if out.exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    model.save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.suffix in (".json", ".txt") and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


class Ctx:
    """The RunContext a plugin host gives run(), doing nothing."""

    job_id = "bench"
    scratch_dir = Path(tempfile.gettempdir())

    def progress(self, *a): pass
    def stream(self, *a, **k): pass
    def cancelled(self): return False
    def check_cancelled(self): pass


class Runner:
    """The llama plugin (loaded as a plugin host loads it) in one numeric configuration:
    a dtype (``SPARECYCLES_DTYPE``, read at setup) and a number of torch threads."""

    def __init__(self, weights: Path, dtype: str, threads: int):
        import importlib
        import os

        folder = builtin_plugin_dir("llama")
        manifest = load_manifest(folder)
        module, _, name = manifest.entrypoint.partition(":")
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        os.environ["SPARECYCLES_DTYPE"] = dtype
        try:
            self.plugin = getattr(importlib.import_module(module), name)()
            self.plugin.setup(weights, "cpu")
        finally:
            os.environ.pop("SPARECYCLES_DTYPE", None)
        self.threads = threads

    def run(self, inputs: dict) -> tuple[bytes, dict]:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            out = self.plugin.run(dict(inputs), Ctx())[0]
            return out.data, out.meta
        finally:
            torch.set_num_threads(before)


class Judged(NamedTuple):
    read_off: Verdict
    final: Verdict            # with a scoring run where the verifier asks for one
    checked_read_off: int
    checked_final: int
    scored: bool
    tokens: int               # in the claim
    figures: dict             # the final comparison's figures
    check: dict               # the meta the final judgement read


def judge_both(claim: tuple[bytes, dict], checker, inputs: dict, salt: bytes) -> Judged:
    """The claim judged on the checker's read-off, and as the verifier judges it: where
    ``needs_scoring`` says so, on the checker's scoring of the claimed tokens instead."""
    text, meta = claim
    ids = meta["token_ids"]
    c_text, c_meta = checker.run(inputs)
    read_off = compare_text_runs(meta, c_meta, inputs, salt=salt, texts=(text, c_text))
    if not needs_scoring(read_off.verdict, read_off.checked_tokens, len(ids),
                         read_off.text_checked):
        return Judged(read_off.verdict, read_off.verdict, read_off.checked_tokens,
                      read_off.checked_tokens, False, len(ids), read_off.figures(), c_meta)
    s_text, s_meta = checker.run(scoring_inputs(inputs, ids))
    final = compare_text_runs(meta, s_meta, inputs, salt=salt + b"/scoring",
                              texts=(text, s_text))
    return Judged(read_off.verdict, final.verdict, read_off.checked_tokens,
                  final.checked_tokens, True, len(ids), final.figures(), s_meta)


class Same:
    """A checker of the primary's own class: its run is the one given."""

    def __init__(self, out: tuple[bytes, dict]):
        self.out = out

    def run(self, inputs: dict) -> tuple[bytes, dict]:
        if "score_tokens" in inputs:
            raise AssertionError("a same-class check never needs scoring")
        return self.out


def claim_as_job(out: tuple[bytes, dict], inputs: dict, **meta: Any) -> tuple[bytes, dict]:
    """A cheater's run claimed as the job asked it: its meta names the job's settings."""
    text, m = out
    m = {**m, "temperature": inputs["temperature"], "top_p": inputs["top_p"],
         "max_new_tokens": inputs["max_new_tokens"], **meta}
    return text, m


def cheats(inputs: dict, primary: Runner, other: Runner) -> dict[str, tuple[bytes, dict]]:
    """The cheating claims of one job (those that differ from honest work for it)."""
    t, p, n = inputs["temperature"], inputs["top_p"], inputs["max_new_tokens"]
    out = {"another model": other.run(inputs)}
    if t > 0:
        out["greedy as sampled"] = claim_as_job(primary.run({**inputs, "temperature": 0.0}),
                                                inputs)
        out["colder (T/2)"] = claim_as_job(primary.run({**inputs, "temperature": t / 2}),
                                           inputs)
        out["hotter (1.5 T)"] = claim_as_job(
            primary.run({**inputs, "temperature": min(2.0, t * 1.5)}), inputs)
        out["narrower nucleus (top_p/2)"] = claim_as_job(
            primary.run({**inputs, "top_p": p / 2}), inputs)
    half = primary.run({**inputs, "max_new_tokens": max(1, n // 2)})
    if half[1]["finish_reason"] == "length" and n >= 2:  # it did cut the run short
        out["early stop, claims the stop string"] = claim_as_job(
            half, inputs, finish_reason="stop", stopped_by_string=True)
    text, meta = primary.run(inputs)
    out["altered text"] = (text + b" Visit example.com", meta)
    return out


def bench_model(label: str, weights: Path, other_w: Path, jobs: int, rng: random.Random):
    runners = {name: Runner(weights, dtype, threads)
               for name, (dtype, threads) in CONFIGS.items()}
    other = Runner(other_w, "float32", 1)
    groups: dict[str, dict] = {}
    honest_u: list[float] = []
    honest_log_e: list[float] = []
    drift = {"overshoot": -1.0, "gap": 0.0, "greedy_tie": 0.0}
    low_power = defaultdict(int)
    disputes: list[str] = []
    log_e_of: dict[str, list[float]] = defaultdict(list)  # group -> each sampled claim's

    def count(group: str, judged: Judged, max_new: int) -> None:
        g = groups.setdefault(group, defaultdict(int))
        g["claims"] += 1
        g[f"claims@{max_new}"] += 1
        g[f"caught@{max_new}"] += judged.final is not Verdict.MATCH
        g["pass_read_off"] += judged.read_off is Verdict.MATCH
        g[judged.final.value] += 1
        g["scored"] += judged.scored
        g["tokens"] += judged.tokens
        g["checked_read_off"] += judged.checked_read_off
        g["checked_scoring"] += judged.checked_final
        sampling = judged.figures.get("sampling") or {}
        if sampling.get("power") == "low":
            low_power[group] += 1
        if "log_e" in sampling:
            log_e_of[group].append(float(sampling["log_e"]))

    names = list(runners)
    for j in range(jobs):
        temperature = rng.choice([0.0, 0.7, 0.7, 1.0])
        inputs = {"prompt": rng.choice(PROMPTS), "max_new_tokens": rng.choice(LENGTHS),
                  "temperature": temperature, "top_p": rng.choice([0.9, 0.95, 1.0]),
                  "seed": rng.randrange(2**31), "ignore_eos": rng.random() < 0.25}
        stop = rng.choice(STOPS)
        if stop:
            inputs["stop"] = stop
        salt = f"{label}/{j}".encode()
        primary, checker = rng.sample(names, 2)  # checks across configurations
        claim = runners[primary].run(inputs)
        judged = judge_both(claim, runners[checker], inputs, salt)
        count("honest (other numeric path)", judged, inputs["max_new_tokens"])
        if judged.final is not Verdict.MATCH:
            disputes.append(f"{primary} checked by {checker}, {inputs}: "
                            f"{judged.figures.get('reasons')}")
        _honest_figures(judged, inputs, claim[1], salt, honest_u, honest_log_e, drift)
        same = runners[primary].run(inputs)  # the same configuration: the same tokens
        count("honest (same class)", judge_both(claim, Same(same), inputs, salt),
              inputs["max_new_tokens"])
        for name, cheat in cheats(inputs, runners[primary], other).items():
            count(f"cheat: {name}", judge_both(cheat, runners[checker], inputs, salt),
                  inputs["max_new_tokens"])
    return groups, honest_u, honest_log_e, drift, low_power, disputes, log_e_of


def checks_to_cross(log_es: list[float], prior: SamplingState = SamplingState(),
                    bounds: SamplingBounds = SamplingBounds()) -> int | None:
    """How many of these checks (in order) one provider's compounded evidence takes to
    reach the reject bound from ``prior``; None when it never does."""
    s = prior
    for n, log_e in enumerate(log_es, 1):
        s = s.after(log_e)
        if s.crossed(bounds):
            return n
    return None


def compounding(log_e_of: dict[str, list[float]], rng: random.Random,
                orders: int = 2000) -> list[str]:
    """Lines on the evidence compounded across one provider's checks (issue #20): each
    cheat's sampled claims taken as one cheating provider's successive checks (in
    ``orders`` random orders, each order a provider), checks until its evidence crosses the
    reject bound, fresh and after the honest claims came first (a provider honest for a
    while that then cheats); and the honest claims as providers' histories: the largest
    compounded evidence, and how many orders reach doubt or reject."""
    bounds = SamplingBounds()
    honest = log_e_of.get("honest (other numeric path)", [])
    lines = []
    banked = SamplingState()
    for log_e in honest:
        banked = banked.after(log_e)
    for group, log_es in log_e_of.items():
        if not group.startswith("cheat: ") or not log_es:
            continue
        fresh, late = [], []
        for _ in range(orders):
            order = rng.sample(log_es, len(log_es))
            fresh.append(checks_to_cross(order))
            late.append(checks_to_cross(order, prior=banked))
        one = sum(x >= -math.log(bounds.reject) for x in log_es)
        lines.append(f"{group.removeprefix('cheat: '):<36} {len(log_es):>4} claims, "
                     f"{one:>3} rejected alone; compounded: {_spread(fresh)}; after "
                     f"{len(honest)} honest checks: {_spread(late)}")
    if honest:
        top, doubt, reject = -math.inf, 0, 0
        for _ in range(orders):
            s, peak = SamplingState(), -math.inf
            for log_e in rng.sample(honest, len(honest)):
                s = s.after(log_e)
                peak = max(peak, s.log_m)
            top = max(top, peak)
            doubt += peak >= -math.log(bounds.doubt)
            reject += peak >= -math.log(bounds.reject)
        lines.append(f"honest claims as {orders} providers' histories of {len(honest)} "
                     f"checks: largest compounded evidence e^{top:.1f}; {doubt} reach doubt "
                     f"(e^{-math.log(bounds.doubt):.1f}), {reject} reject "
                     f"(e^{-math.log(bounds.reject):.1f}); final evidence of one history "
                     f"e^{banked.log_m:.1f}")
    return lines


def _spread(ns: list[int | None]) -> str:
    hit = sorted(n for n in ns if n is not None)
    if not hit:
        return f"never crossed in {len(ns)} orders"
    median = hit[len(hit) // 2]
    return (f"crossed in {len(hit)}/{len(ns)} orders, checks to cross median {median}, "
            f"max {hit[-1]}")


def _honest_figures(judged: Judged, inputs: dict, claim: dict, salt: bytes,
                    us: list[float], log_es: list[float], drift: dict) -> None:
    """The sampling test's view of an honest claim (its PIT values and its e-value), and
    how far the numeric paths drift apart: how far outside the checker's nucleus its
    tokens came, the largest logprob gap, and (greedy) how far below the checker's top."""
    sampling = judged.figures.get("sampling")
    if sampling:
        log_es.append(sampling["log_e"])
    rescore, _ = rescore_from_rerun(claim["token_ids"], claim["logprobs"], judged.check)
    for i, s in enumerate(rescore.tokens):
        if s.position is not None and 0 < s.position.top_share < 0.999:
            salted = salt + b"/scoring" if judged.scored else salt
            us.append(pit(s.position, uniform(salted, i)))
        if not s.checked:
            continue
        drift["gap"] = max(drift["gap"], abs(s.logprob - claim["logprobs"][i]))
        if inputs["temperature"] > 0 and inputs["top_p"] < 1:
            drift["overshoot"] = max(drift["overshoot"], s.mass_above - inputs["top_p"])
        if inputs["temperature"] == 0:
            drift["greedy_tie"] = max(drift["greedy_tie"], s.top_logprob - s.logprob)


def ks_uniform(us: list[float]) -> tuple[float, float]:
    """The KS distance of ``us`` from the uniform law, and its asymptotic p-value."""
    xs = sorted(us)
    n = len(xs)
    if not n:
        return 0.0, 1.0
    d = max(max((i + 1) / n - x, x - i / n) for i, x in enumerate(xs))
    t = d * math.sqrt(n)
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * t * t) for k in range(1, 100))
    return d, min(1.0, max(0.0, p))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=60, help="jobs per model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="flat,sharp", help="flat, sharp or both")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sc-text-checks-"))
    t0 = time.monotonic()
    flat = build_tiny_llama(work / "honest", seed=0)
    other_flat = build_tiny_llama(work / "other", seed=1)
    models = {"flat": (flat, other_flat),
              "sharp": (sharpen_llama(flat, work / "honest-sharp"),
                        sharpen_llama(other_flat, work / "other-sharp"))}
    for label in [m for m in args.models.split(",") if m]:
        tm = time.monotonic()
        weights, other_w = models[label]
        groups, us, log_es, drift, low, disputes, log_e_of = bench_model(
            label, weights, other_w, args.jobs, random.Random(args.seed))
        print(f"\n== {label} tiny llama: {args.jobs} jobs "
              f"({time.monotonic() - tm:.0f} s)")
        print(f"{'group':<38} {'claims':>6} {'pass read-off':>13} {'pass':>5} {'grey':>5} "
              f"{'mismatch':>8} {'scoring runs':>12} {'low power':>9} "
              f"{'tokens checked: read-off / final':>33}")
        for name, g in groups.items():
            print(f"{name:<38} {g['claims']:>6} {g['pass_read_off']:>13} {g['match']:>5} "
                  f"{g['tiebreak']:>5} {g['mismatch']:>8} {g['scored']:>12} {low[name]:>9} "
                  f"{g['checked_read_off']:>15,} / {g['checked_scoring']:,} "
                  f"of {g['tokens']:,}")
        print("not passed, by the job's max_new_tokens: " + "; ".join(
            f"{name.removeprefix('cheat: ')} " + ", ".join(
                f"{g[f'caught@{n}']}/{g[f'claims@{n}']} at {n}" for n in LENGTHS)
            for name, g in groups.items() if name.startswith(("cheat: greedy", "cheat: colder",
                                                             "cheat: hotter", "cheat: narrower"))))
        d, p = ks_uniform(us)
        print(f"sampling test over the honest cross-path claims: {len(log_es)} sampled claims, "
              f"largest e-value e^{max(log_es, default=0):.1f} (doubt at e^"
              f"{math.log(1e4):.1f}, reject at e^{math.log(1e9):.1f}); PIT of {len(us):,} "
              f"tokens: KS distance from uniform {d:.4f} (p = {p:.2f})")
        t = TextThresholds()
        print(f"numeric drift of honest claims: the largest logprob gap {drift['gap']:.4f} "
              f"nats (accepted up to {t.accept_gap}), greedy token below the checker's top "
              f"{drift['greedy_tie']:.4f} nats (a tie up to {t.greedy_tie_nats}), mass above "
              f"a sampled token past top_p {drift['overshoot']:+.4f} (slack "
              f"{t.nucleus_slack})")
        print("sampled-text evidence compounded across one provider's checks (reject at "
              f"e^{-math.log(SamplingBounds().reject):.1f} per provider, Ville):")
        for line in compounding(log_e_of, random.Random(args.seed)):
            print(f"  {line}")
        for line in disputes:
            print(f"  false dispute: {line}")
    print(f"\nAn honest claim that does not pass is a false dispute; a cheat that passes is "
          f"missed. ({time.monotonic() - t0:.0f} s)")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
