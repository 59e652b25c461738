"""Text checks on the tiny llama, judged as the verifier judges them (DESIGN §6), in-process.

Each job (a prompt, temperature, top_p, seed and length drawn at random) is run by a
primary and checked by a checker of another numeric configuration: float32 on one
thread, float32 on two threads, or bfloat16 (honest checks, which must pass); it is also
checked by a checker of the primary's own configuration (the same tokens), and claimed by
a cheater that samples from another model (tiny llama built from seed 1). Every claim is
judged twice:

* **read-off only**: ``compare_text`` on the scores read off the checker's own run
  (what the verifier did before scoring runs);
* **with scoring**: the same, then, where the check judged fewer tokens than the claim
  holds and is not a clear mismatch, the checker's teacher-forced scoring of the claimed
  tokens (the llama plugin's ``score_tokens``), as ``VerificationService`` now asks for.

It prints, per group, how many claims each path passes, how many needed a scoring run,
and the tokens each path really checked. An honest claim that does not pass is a false
dispute; a cheat that passes is a missed one.

    python bench/text_checks.py              # 120 jobs (about a minute on two cores)
    python bench/text_checks.py --jobs 400
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from broker.verification.comparators import Verdict  # noqa: E402
from broker.verification.judging import (compare_text_runs, needs_scoring,  # noqa: E402
                                         scoring_inputs)
from plugins import builtin_plugin_dir  # noqa: E402
from plugins.api import load_manifest  # noqa: E402
from plugins.tiny import build_tiny_llama  # noqa: E402

PROMPTS = ["Once upon a time", "Once upon a time there was a lighthouse",
           "The recipe calls for", "In 1887 the harbour", "Dear committee,",
           "def fibonacci(n):", "The weather today", "Ask the lighthouse keeper"]
CONFIGS = {"fp32-1thread": ("float32", 1), "fp32-2threads": ("float32", 2),
           "bf16-1thread": ("bfloat16", 1)}


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

    def run(self, inputs: dict) -> dict:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self.plugin.run(dict(inputs), Ctx())[0].meta
        finally:
            torch.set_num_threads(before)


class Judged(NamedTuple):
    read_off: Verdict
    final: Verdict            # with a scoring run where the verifier asks for one
    checked_read_off: int
    checked_final: int
    scored: bool
    tokens: int               # in the claim


def judge_both(claim: dict, checker: Runner, inputs: dict) -> Judged:
    """The claim judged on the checker's read-off, and as the verifier judges it: where
    ``needs_scoring`` says so, on the checker's scoring of the claimed tokens instead."""
    ids = claim["token_ids"]
    read_off = compare_text_runs(claim, checker.run(inputs))
    if not needs_scoring(read_off.verdict, read_off.checked_tokens, len(ids)):
        return Judged(read_off.verdict, read_off.verdict, read_off.checked_tokens,
                      read_off.checked_tokens, False, len(ids))
    final = compare_text_runs(claim, checker.run(scoring_inputs(inputs, ids)))
    return Judged(read_off.verdict, final.verdict, read_off.checked_tokens,
                  final.checked_tokens, True, len(ids))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sc-text-checks-"))
    t0 = time.monotonic()
    honest_w = build_tiny_llama(work / "honest", seed=0)
    other_w = build_tiny_llama(work / "other", seed=1)
    runners = {name: Runner(honest_w, dtype, threads)
               for name, (dtype, threads) in CONFIGS.items()}
    other = Runner(other_w, "float32", 1)
    print(f"tiny llamas built and loaded in {time.monotonic() - t0:.0f} s; "
          f"{args.jobs} jobs per group")
    rng = random.Random(args.seed)
    groups: dict[str, dict] = {}

    def count(group: str, judged: Judged) -> None:
        g = groups.setdefault(group, dict.fromkeys(
            ("claims", "pass_read_off", "pass_scoring", "scored", "tokens",
             "checked_read_off", "checked_scoring"), 0))
        g["claims"] += 1
        g["pass_read_off"] += judged.read_off is Verdict.MATCH
        g["pass_scoring"] += judged.final is Verdict.MATCH
        g["scored"] += judged.scored
        g["tokens"] += judged.tokens
        g["checked_read_off"] += judged.checked_read_off
        g["checked_scoring"] += judged.checked_final

    names = list(runners)
    for _ in range(args.jobs):
        temperature = rng.choice([0.0, 0.7, 1.0])
        inputs = {"prompt": rng.choice(PROMPTS), "max_new_tokens": rng.choice([8, 16, 32]),
                  "temperature": temperature, "top_p": rng.choice([0.9, 0.95, 1.0]),
                  "seed": rng.randrange(2**31), "ignore_eos": False}
        primary, checker = rng.sample(names, 2)  # checks across configurations
        claim = runners[primary].run(inputs)
        count("honest (other numeric path)", judge_both(claim, runners[checker], inputs))
        same = runners[primary].run(inputs)  # the same configuration: the same tokens
        count("honest (same class)", judge_both(claim, _Same(same), inputs))
        count("cheat: another model", judge_both(other.run(inputs), runners[checker], inputs))
    print(f"\n{'group':<30} {'claims':>6} {'pass read-off':>14} {'pass w/ scoring':>16} "
          f"{'scoring runs':>13} {'tokens checked: read-off / w/ scoring':>38}")
    for name, g in groups.items():
        print(f"{name:<30} {g['claims']:>6} {g['pass_read_off']:>14} {g['pass_scoring']:>16} "
              f"{g['scored']:>13} {g['checked_read_off']:>17,} / {g['checked_scoring']:,} "
              f"of {g['tokens']:,}")
    print(f"\nAn honest claim that does not pass is a false dispute; a cheat that passes is "
          f"missed. ({time.monotonic() - t0:.0f} s)")
    return 0


class _Same:
    """A checker of the primary's own class: its run is the one given."""

    def __init__(self, meta: dict):
        self.meta = meta

    def run(self, inputs: dict) -> dict:
        if "score_tokens" in inputs:
            raise AssertionError("a same-class check never needs scoring")
        return self.meta


if __name__ == "__main__":
    sys.exit(main())
