"""Judging two runs of one pinned job (DESIGN §6): which comparator applies, fed from what
each provider's signed receipt and uploaded outputs say.

A run is a :class:`Run`: its outputs (bytes, media type and the plugin's meta, which the
receipt signs) and its reproducibility class. Images go to ``compare_images`` (exact latent
hashes within one class, structural figures across classes); text goes to ``compare_text``
on a teacher-forced re-scoring read off the checker's own run of the same seeded job (see
:func:`rescore_from_rerun`), or off a scoring run's teacher-forced scores of the claimed
tokens themselves (two scorings are compared score for score: :func:`compare_scorings`);
anything else (the ``echo`` test plugin) must match byte for byte. Pure: the caller loads
the blobs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from broker.verification.comparators import (ImageResult, ReproClass, Rescore, TextClaim,
                                             TextThresholds, TokenScore, Verdict,
                                             compare_images, compare_text)

_ORDER = {Verdict.MATCH: 0, Verdict.TIEBREAK: 1, Verdict.MISMATCH: 2}
#: Log-probability assumed for a claimed token the checker does not rank in its top-k at
#: the position where the runs part: far below any honest near-tie.
BELOW_TOP_K_NATS = 8.0


@dataclass(frozen=True)
class RunOutput:
    data: bytes
    media_type: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    outputs: tuple[RunOutput, ...]
    repro: ReproClass
    # A scoring run (text): it scored given tokens by teacher forcing instead of generating
    # (the broker asked for it; never read from what the provider says).
    scored: bool = False


@dataclass(frozen=True)
class Judgement:
    """The verdict on two runs, and plain figures for the audit log and the console."""

    verdict: Verdict
    method: str
    details: tuple[dict[str, Any], ...] = ()
    reasons: tuple[str, ...] = ()

    def figures(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "method": self.method,
                "reasons": list(self.reasons), "outputs": list(self.details)}


@dataclass(frozen=True)
class StoredJudgement:
    """A judgement read back from storage (its figures); enough for ``resolve_three``."""

    verdict: Verdict
    stored: dict[str, Any]

    def figures(self) -> dict[str, Any]:
        return dict(self.stored)

    @classmethod
    def of(cls, figures: dict[str, Any]) -> "StoredJudgement":
        return cls(Verdict(figures["verdict"]), figures)


def repro_of(receipt: dict | None) -> ReproClass:
    """The reproducibility class a receipt states (unknown parts never match another)."""
    r = (receipt or {}).get("repro") or {}
    return ReproClass(hardware_class=str(r.get("hardware_class") or "unknown"),
                      dtype=str(r.get("dtype") or "unknown"),
                      plugin_build=str(r.get("plugin_build") or "unknown"))


def judge(output_kind: str, claimed: Run, check: Run) -> Judgement:
    if len(claimed.outputs) != len(check.outputs):
        return Judgement(Verdict.MISMATCH, "count",
                         reasons=(f"{len(claimed.outputs)} outputs claimed, the check made "
                                  f"{len(check.outputs)}",))
    if output_kind == "images":
        return _worst("image", [
            compare_images(ImageResult(a.data, claimed.repro, a.meta.get("latent_sha256")),
                           ImageResult(b.data, check.repro, b.meta.get("latent_sha256")))
            for a, b in zip(claimed.outputs, check.outputs)])
    if output_kind == "text":
        if claimed.scored and check.scored:  # two scorings of the same claimed tokens
            return _worst("text_scores", [compare_scorings(a.meta, b.meta)
                                          for a, b in zip(claimed.outputs, check.outputs)])
        return _worst("text_rescore", [compare_text_runs(a.meta, b.meta)
                                       for a, b in zip(claimed.outputs, check.outputs)])
    same = [a.data == b.data for a, b in zip(claimed.outputs, check.outputs)]
    return Judgement(Verdict.MATCH if all(same) else Verdict.MISMATCH, "exact",
                     tuple({"index": i, "equal": eq} for i, eq in enumerate(same)),
                     () if all(same) else ("outputs differ byte for byte",))


def _worst(method: str, comparisons: list) -> Judgement:
    verdict = max((c.verdict for c in comparisons), key=_ORDER.__getitem__,
                  default=Verdict.MATCH)
    reasons = tuple(r for c in comparisons for r in c.reasons)
    return Judgement(verdict, method, tuple(c.figures() for c in comparisons), reasons[:10])


def compare_text_runs(claimed: dict[str, Any], check: dict[str, Any],
                      thresholds: TextThresholds = TextThresholds()):
    """Judge a claimed completion (the primary's meta) against a checker's run of the same
    seeded job (its meta: token ids, log-probabilities and per-token top-k scores)."""
    claim = TextClaim(token_ids=[int(t) for t in claimed.get("token_ids", [])],
                      logprobs=[float(x) for x in claimed.get("logprobs", [])],
                      finish_reason=str(claimed.get("finish_reason", "")),
                      max_new_tokens=int(check.get("max_new_tokens")
                                         or claimed.get("max_new_tokens") or 0),
                      temperature=float(check.get("temperature", 0.0)),
                      top_p=float(check.get("top_p", 1.0)),
                      ignore_eos=bool(check.get("ignore_eos", False)),
                      stopped_by_string=bool(claimed.get("stopped_by_string", False)))
    rescore, checked = rescore_from_rerun(claim.token_ids, claim.logprobs, check)
    result = compare_text(claim, rescore, thresholds)
    return _TextJudgement(result, checked)


#: The input by which a text plugin scores given tokens instead of generating (teacher
#: forcing): what a text check that could not judge every claimed token asks for.
SCORE_INPUT = "score_tokens"


def needs_scoring(verdict: Verdict, checked_tokens: int, claimed_tokens: int) -> bool:
    """Whether a text check left claimed tokens unjudged (its run parted from the claim, or
    ended sooner: past that point the checker's context is not the claim's) and is not a
    clear mismatch already (then the third run decides): a scoring run must judge them."""
    return verdict is not Verdict.MISMATCH and checked_tokens < claimed_tokens


def scoring_inputs(pinned: dict[str, Any], claim_ids: Sequence[int]) -> dict[str, Any]:
    """A scoring run's inputs: the job's pinned inputs and the claimed token ids, with room
    for all of them."""
    return {**pinned, SCORE_INPUT: json.dumps(list(claim_ids), separators=(",", ":")),
            "max_new_tokens": max(int(pinned.get("max_new_tokens") or 0), len(claim_ids))}


def compare_scorings(a: dict[str, Any], b: dict[str, Any],
                     thresholds: TextThresholds = TextThresholds()) -> "_ScoringComparison":
    """Two providers' teacher-forced scorings of the same claimed tokens (a text dispute's
    checker and third run): they agree when they scored the same tokens with the same
    log-probabilities, within the gaps ``compare_text`` allows a claim; whether the tokens
    are likely is not theirs to answer (that is each scoring against the claim)."""
    t = thresholds
    ids_a = [int(x) for x in a.get("token_ids", [])]
    ids_b = [int(x) for x in b.get("token_ids", [])]
    lps_a = [float(x) for x in a.get("logprobs", [])]
    lps_b = [float(x) for x in b.get("logprobs", [])]
    if ids_a != ids_b or len(lps_a) != len(ids_a) or len(lps_b) != len(ids_b):
        return _ScoringComparison(Verdict.MISMATCH, len(ids_a), 0.0, 0, (
            "the two scorings do not cover the same tokens with one log-probability each",))
    gaps = [abs(x - y) for x, y in zip(lps_a, lps_b)]
    worst = max(gaps, default=0.0)
    grey = sum(1 for g in gaps if t.accept_gap < g <= t.reject_gap)
    reasons: tuple[str, ...] = ()
    if worst > t.reject_gap:
        verdict = Verdict.MISMATCH
        reasons = (f"token {gaps.index(worst)}: the scorings differ by {worst:.3f} nats "
                   f"> {t.reject_gap}",)
    elif grey > t.max_grey_fraction * len(gaps):
        verdict = Verdict.MISMATCH
        reasons = (f"{grey} of {len(gaps)} tokens scored more than {t.accept_gap} nats "
                   f"apart",)
    else:
        verdict = Verdict.TIEBREAK if grey else Verdict.MATCH
    return _ScoringComparison(verdict, len(gaps), worst, grey, reasons)


@dataclass(frozen=True)
class _ScoringComparison:
    verdict: Verdict
    tokens: int
    max_gap: float
    grey_tokens: int
    reasons: tuple[str, ...]

    def figures(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "tokens": self.tokens,
                "max_gap": round(self.max_gap, 6), "grey_tokens": self.grey_tokens,
                "checked_tokens": self.tokens}


@dataclass(frozen=True)
class _TextJudgement:
    inner: Any
    checked_tokens: int

    @property
    def verdict(self) -> Verdict:
        return self.inner.verdict

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.inner.reasons

    def figures(self) -> dict[str, Any]:
        return {**self.inner.figures(), "checked_tokens": self.checked_tokens}


def rescore_from_rerun(claim_ids: Sequence[int], claim_logprobs: Sequence[float],
                       check: dict[str, Any]) -> tuple[Rescore, int]:
    """Teacher-forced scores of the claimed tokens, read off the checker's own run.

    Along the common prefix the checker's context is the claim's, so its distribution at
    each position *is* the teacher-forced one. Where the runs part, the claimed token is
    scored from the checker's top-k at that position (an honest run parts only at a
    near-tie, so the claimed token is near the top). Past that point the contexts differ
    and nothing more is re-scored: those tokens get neutral scores (no gap), so only the
    structural rules (length, end of sequence, padding) judge them. Returns the re-scoring
    and how many tokens it really checked."""
    ids = [int(t) for t in check.get("token_ids", [])]
    lps = [float(x) for x in check.get("logprobs", [])]
    scores = list(check.get("scores", []))
    eos = frozenset(int(i) for i in check.get("eos_ids", []))
    temperature = float(check.get("temperature", 0.0))
    top_p = float(check.get("top_p", 1.0))
    out: list[TokenScore] = []
    checked = 0
    parted = False
    for i, tok in enumerate(claim_ids):
        own = float(claim_logprobs[i]) if i < len(claim_logprobs) else 0.0
        if parted or i >= len(ids) or i >= len(scores) or not isinstance(scores[i], dict):
            # past the parting, beyond the checker's run, or a position the checker's run
            # did not score (replayed from an older checkpoint): not re-scored
            out.append(TokenScore(logprob=own, rank=0, top_logprob=own, mass_above=0.0,
                                  eos_logprob=-math.inf, eos_mass_sampled=0.0))
            continue
        s = scores[i]
        top = [(int(t), float(lp), float(p)) for t, lp, p in s.get("top", [])]
        top_lp = top[0][1] if top else float(lps[i])
        eos_lp = float(s.get("eos_lp", -math.inf))
        eos_p = float(s.get("eos_p", 0.0))
        eos_top = top[0][0] in eos if top else None
        checked += 1
        if ids[i] == tok:
            rank = next((r for r, (t, _, _) in enumerate(top) if t == tok), len(top))
            out.append(TokenScore(logprob=float(lps[i]), rank=rank, top_logprob=top_lp,
                                  mass_above=float(s.get("mass_above", 0.0)),
                                  eos_logprob=eos_lp, eos_mass_sampled=eos_p,
                                  eos_top=eos_top))
            continue
        parted = True  # the runs part here: score the claimed token from what is known
        hit = next((r for r, (t, _, _) in enumerate(top) if t == tok), None)
        near = {int(t): (float(lp), float(p)) for t, lp, p in s.get("near", [])}
        if hit is not None:
            above = sum(p for _, _, p in top[:hit])
            out.append(TokenScore(logprob=top[hit][1], rank=hit, top_logprob=top_lp,
                                  mass_above=above, eos_logprob=eos_lp, eos_mass_sampled=eos_p,
                                  eos_top=eos_top))
        elif tok in near:  # a sampled run flipped to the chosen token's neighbour
            out.append(TokenScore(logprob=near[tok][0], rank=len(top), top_logprob=top_lp,
                                  mass_above=float(s.get("mass_above", 0.0)),
                                  eos_logprob=eos_lp, eos_mass_sampled=eos_p,
                                  eos_top=eos_top))
        elif temperature == 0:
            # greedy runs part only at a near-tie of the top tokens: a token outside the
            # checker's top-k cannot be one
            floor = (top[-1][1] if top else float(lps[i])) - BELOW_TOP_K_NATS
            out.append(TokenScore(logprob=floor, rank=len(top), top_logprob=top_lp,
                                  mass_above=1.0, eos_logprob=eos_lp, eos_mass_sampled=eos_p,
                                  eos_top=eos_top))
        else:
            # sampled runs whose orders differ (near-equal probabilities sort differently
            # across numeric paths) can part anywhere: nothing to re-score here
            checked -= 1
            out.append(TokenScore(logprob=own, rank=0, top_logprob=own, mass_above=0.0,
                                  eos_logprob=-math.inf, eos_mass_sampled=0.0))
    return Rescore(tokens=tuple(out), eos_ids=eos, temperature=temperature, top_p=top_p), checked
