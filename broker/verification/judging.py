"""Judging two runs of one pinned job (DESIGN §6): which comparator applies, fed from what
each provider's signed receipt and uploaded outputs say.

A run is a :class:`Run`: its outputs (bytes, media type and the plugin's meta, which the
receipt signs), its reproducibility class, and what the broker asked of it (its job's id
and inputs). Images go to ``compare_images`` (exact latent hashes within one class,
structural figures across classes); text goes to ``compare_text`` on a teacher-forced
re-scoring read off the checker's own run of the same seeded job (see
:func:`rescore_from_rerun`), or off a scoring run's teacher-forced scores of the claimed
tokens themselves (two scorings are compared score for score: :func:`compare_scorings`),
with the job's sampling settings, stop string and length taken from the claimed run's job
inputs (the broker's record), never from a provider's meta; anything else (the ``echo``
test plugin) must match byte for byte. Pure: the caller loads the blobs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from broker.verification.comparators import (ImageResult, ReproClass, Rescore, TextClaim,
                                             TextThresholds, TokenScore, Verdict,
                                             compare_images, compare_text)
from broker.verification.sampled_text import Position, SamplingState

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
    # What the broker asked of the run: its job's inputs (the job's own parameters: a text
    # claim is judged by these, not by what its meta says) and its job's id (which fixes
    # the random draws of a text check that judges a claim against this run).
    inputs: Mapping[str, Any] = field(default_factory=dict)
    job_id: str = ""
    # The sampled-text evidence of this run's provider from its earlier checked claims
    # (``sampled_text.SamplingState``, the broker's record): a text check of this run as
    # the claim compounds with it. None: judged on this check alone.
    prior: SamplingState | None = None


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


def declared_repro(provider_id: str, plugin: str, version: str, declared: dict,
                   weights: str = "") -> ReproClass:
    """The class of a run of ``plugin@version`` on machine ``provider_id`` that declared
    ``declared`` ({"hardware_class", "dtype"}; recorded at assignment, see
    ``broker.jobs.repro``) on weights ``weights``. A part it did not declare is its own
    (``undeclared:<id>``), equal to no other's, so its runs are compared structurally."""
    own = f"undeclared:{provider_id}"
    return ReproClass(hardware_class=str(declared.get("hardware_class") or "") or own,
                      dtype=str(declared.get("dtype") or "") or own,
                      plugin_build=(f"{plugin}@{version}+{weights[:16]}" if weights
                                    else f"{plugin}@{version}"))


def judge(output_kind: str, claimed: Run, check: Run) -> Judgement:
    if len(claimed.outputs) != len(check.outputs):
        return Judgement(Verdict.MISMATCH, "count",
                         reasons=(f"{len(claimed.outputs)} outputs claimed, the check made "
                                  f"{len(check.outputs)}",))
    if output_kind == "images":
        return _worst("image", [
            compare_images(ImageResult(a.data, claimed.repro, a.meta.get("latent_sha256"),
                                       a.meta.get("latent_trace")),
                           ImageResult(b.data, check.repro, b.meta.get("latent_sha256"),
                                       b.meta.get("latent_trace")))
            for a, b in zip(claimed.outputs, check.outputs)])
    if output_kind == "text":
        if claimed.scored and check.scored:  # two scorings of the same claimed tokens
            return _worst("text_scores", [compare_scorings(a.meta, b.meta, texts=(a.data, b.data))
                                          for a, b in zip(claimed.outputs, check.outputs)])
        salt = check.job_id.encode()
        return _worst("text_rescore", [
            compare_text_runs(a.meta, b.meta, claimed.inputs, salt=salt, texts=(a.data, b.data),
                              prior=claimed.prior)
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
                      job: Mapping[str, Any] | None = None,
                      thresholds: TextThresholds = TextThresholds(), *, salt: bytes = b"",
                      texts: tuple[bytes, bytes] | None = None,
                      prior: SamplingState | None = None):
    """Judge a claimed completion (the primary's meta) against a checker's run of the same
    seeded job (its meta: token ids, log-probabilities and per-token scores), by the job's
    own parameters ``job`` (its inputs as the broker holds them: temperature, top_p,
    max_new_tokens, ignore_eos, stop). ``texts``: the two runs' output bytes; where the
    checker's tokens are the claim's (or it scored them), the claimed text must be theirs
    as the checker decoded it. ``salt`` fixes the sampling test's draws; ``prior``: the
    claiming provider's sampled-text evidence from its earlier checks."""
    params = text_parameters(job or {}, check)
    claim = TextClaim(token_ids=[int(t) for t in claimed.get("token_ids", [])],
                      logprobs=[float(x) for x in claimed.get("logprobs", [])],
                      finish_reason=str(claimed.get("finish_reason", "")), **params)
    rescore, checked = rescore_from_rerun(claim.token_ids, claim.logprobs, check,
                                          ignore_eos=claim.ignore_eos)
    result = compare_text(claim, rescore, thresholds, salt=salt, prior=prior)
    same_tokens = [int(t) for t in check.get("token_ids", [])] == list(claim.token_ids)
    text_differs = texts is not None and same_tokens and texts[0] != texts[1]
    return _TextJudgement(result, checked, text_differs,
                          text_checked=texts is None or same_tokens)


def text_parameters(job: Mapping[str, Any], check: Mapping[str, Any]) -> dict[str, Any]:
    """The text job's own parameters, from its inputs (validated at submit, so every one is
    there); the checker's meta stands in only where a run was built without its job's
    inputs (tests of these pure functions; no job the broker makes)."""
    def get(key: str, default: Any) -> Any:
        value = job.get(key)
        return value if value is not None else check.get(key, default)

    stop = job.get("stop") if job else check.get("stop")
    return {"max_new_tokens": int(get("max_new_tokens", 0) or 0),
            "temperature": float(get("temperature", 0.0)),
            "top_p": float(get("top_p", 1.0)),
            "ignore_eos": bool(get("ignore_eos", False)),
            "stop": str(stop) if stop else None}


#: The input by which a text plugin scores given tokens instead of generating (teacher
#: forcing): what a text check that could not judge every claimed token asks for.
SCORE_INPUT = "score_tokens"


def needs_scoring(verdict: Verdict, checked_tokens: int, claimed_tokens: int,
                  text_checked: bool = True) -> bool:
    """Whether a text check left claimed tokens unjudged (its run parted from the claim, or
    ended sooner: past that point the checker's context is not the claim's), or could not
    check the delivered text against the claimed tokens (its tokens are not the claim's),
    and is not a clear mismatch already (then the third run decides): a scoring run must
    judge them."""
    return verdict is not Verdict.MISMATCH and (checked_tokens < claimed_tokens
                                                or not text_checked)


def scoring_inputs(pinned: dict[str, Any], claim_ids: Sequence[int]) -> dict[str, Any]:
    """A scoring run's inputs: the job's pinned inputs and the claimed token ids, with room
    for all of them."""
    return {**pinned, SCORE_INPUT: json.dumps(list(claim_ids), separators=(",", ":")),
            "max_new_tokens": max(int(pinned.get("max_new_tokens") or 0), len(claim_ids))}


def compare_scorings(a: dict[str, Any], b: dict[str, Any],
                     thresholds: TextThresholds = TextThresholds(), *,
                     texts: tuple[bytes, bytes] | None = None) -> "_ScoringComparison":
    """Two providers' teacher-forced scorings of the same claimed tokens (a text dispute's
    checker and third run): they agree when they scored the same tokens with the same
    log-probabilities, within the gaps ``compare_text`` allows a claim, and decoded them to
    the same text (``texts``) with the stop string at the same token; whether the tokens
    are likely is not theirs to answer (that is each scoring against the claim)."""
    t = thresholds
    ids_a = [int(x) for x in a.get("token_ids", [])]
    ids_b = [int(x) for x in b.get("token_ids", [])]
    lps_a = [float(x) for x in a.get("logprobs", [])]
    lps_b = [float(x) for x in b.get("logprobs", [])]
    if ids_a != ids_b or len(lps_a) != len(ids_a) or len(lps_b) != len(ids_b):
        return _ScoringComparison(Verdict.MISMATCH, len(ids_a), 0.0, 0, (
            "the two scorings do not cover the same tokens with one log-probability each",))
    if (texts is not None and texts[0] != texts[1]) or a.get("stop_at") != b.get("stop_at"):
        return _ScoringComparison(Verdict.MISMATCH, len(ids_a), 0.0, 0, (
            "the two scorings decode the same tokens to different texts",))
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
    text_differs: bool = False  # the delivered text is not the claimed tokens' decoding
    text_checked: bool = True   # whether the checker's decoding could tell

    @property
    def verdict(self) -> Verdict:
        return Verdict.MISMATCH if self.text_differs else self.inner.verdict

    @property
    def reasons(self) -> tuple[str, ...]:
        extra = (("the delivered text is not the decoding of the claimed tokens",)
                 if self.text_differs else ())
        return extra + tuple(self.inner.reasons)

    def figures(self) -> dict[str, Any]:
        return {**self.inner.figures(), "verdict": self.verdict.value,
                "reasons": list(self.reasons), "checked_tokens": self.checked_tokens,
                "text_checked": self.text_checked}


def rescore_from_rerun(claim_ids: Sequence[int], claim_logprobs: Sequence[float],
                       check: dict[str, Any],
                       ignore_eos: bool | None = None) -> tuple[Rescore, int]:
    """Teacher-forced scores of the claimed tokens, read off the checker's own run.

    Along the common prefix the checker's context is the claim's, so its distribution at
    each position *is* the teacher-forced one. Where the runs part, the claimed token is
    scored from the checker's top-k at that position (an honest run parts only at a
    near-tie, so the claimed token is near the top). Past that point the contexts differ
    and nothing more is re-scored: those tokens get neutral scores (no gap), so only the
    structural rules (length, end of sequence, padding) judge them. Returns the re-scoring
    and how many tokens it really checked.

    Along the common prefix the checker's scores also place each claimed token in the
    distribution sampled from (``Position``, for the sampling test), and its decoding says
    where the job's stop string first appears (``stop_at``; a run of an older build that
    reports only ``stopped_by_string`` ends with it when that is true). Under the job's
    ``ignore_eos`` (the checker's meta's where not given) the end-of-sequence ids are out of
    the ranking: the likeliest token is the likeliest the sampler could take."""
    ids = [int(t) for t in check.get("token_ids", [])]
    lps = [float(x) for x in check.get("logprobs", [])]
    scores = list(check.get("scores", []))
    eos = frozenset(int(i) for i in check.get("eos_ids", []))
    if ignore_eos is None:
        ignore_eos = bool(check.get("ignore_eos"))
    banned = eos if ignore_eos else frozenset()
    temperature = float(check.get("temperature", 0.0))
    top_p = float(check.get("top_p", 1.0))
    out: list[TokenScore] = []
    checked = 0
    parted = False
    common = 0  # the claim's tokens the checker's run shares from the start
    for i, tok in enumerate(claim_ids):
        own = float(claim_logprobs[i]) if i < len(claim_logprobs) else 0.0
        if not parted and i < len(ids) and ids[i] == tok:
            common = i + 1
        if parted or i >= len(ids) or i >= len(scores) or not isinstance(scores[i], dict):
            # past the parting, beyond the checker's run, or a position the checker's run
            # did not score (replayed from an older checkpoint): not re-scored
            if i >= len(ids) or (not parted and ids[i] != tok):
                parted = True
            out.append(TokenScore(logprob=own, rank=0, top_logprob=own, mass_above=0.0,
                                  eos_logprob=-math.inf, eos_mass_sampled=0.0,
                                  checked=False))
            continue
        s = scores[i]
        top = [(int(t), float(lp), float(p)) for t, lp, p in s.get("top", [])
               if int(t) not in banned]
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
                                  eos_top=eos_top, position=Position.of(s)))
            continue
        parted = True  # the runs part here: score the claimed token from what is known
        hit = next((r for r, (t, _, _) in enumerate(top) if t == tok), None)
        near = {int(t): (float(lp), float(p)) for t, lp, p in s.get("near", [])}
        p_t = _tempered(s, float(lps[i]), temperature, banned)
        if hit is not None:
            # the mass above it before top_p, as top_p is judged (the sampled
            # probabilities in ``top`` are renormalised over the nucleus: summed, they
            # overstate it, and an honest parting at the nucleus' edge looked outside it)
            above = (sum(p_t(t, lp) for t, lp, _ in top[:hit]) if p_t is not None
                     else sum(p for _, _, p in top[:hit]))
            out.append(TokenScore(logprob=top[hit][1], rank=hit, top_logprob=top_lp,
                                  mass_above=above, eos_logprob=eos_lp, eos_mass_sampled=eos_p,
                                  eos_top=eos_top))
        elif tok in near:  # a sampled run flipped to the chosen token's neighbour
            above = float(s.get("mass_above", 0.0))
            if p_t is not None and near[tok][0] < float(lps[i]):  # the one below its pick
                above += float(s.get("mass_tied", p_t(ids[i], float(lps[i]))))
            out.append(TokenScore(logprob=near[tok][0], rank=len(top), top_logprob=top_lp,
                                  mass_above=above, eos_logprob=eos_lp, eos_mass_sampled=eos_p,
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
                                  eos_logprob=-math.inf, eos_mass_sampled=0.0,
                                  checked=False))
    stop_at, searched = _stop_of(check, ids, common)
    return Rescore(tokens=tuple(out), eos_ids=eos, temperature=temperature, top_p=top_p,
                   stop_at=stop_at, stop_searched=searched), checked


def _tempered(score: Mapping[str, Any], own_logprob: float, temperature: float,
              banned: frozenset[int]):
    """A function giving any token's probability at the job's temperature, before top_p,
    at this position, from its raw log-probability: the checker's own token's two
    log-probabilities (``lp_t`` and the raw one) fix the normaliser. None where the score
    lacks ``lp_t`` (greedy, an older build)."""
    if temperature <= 0 or not isinstance(score.get("lp_t"), (int, float)):
        return None
    offset = float(score["lp_t"]) - own_logprob / temperature

    def p_t(token: int, logprob: float) -> float:
        if token in banned:
            return 0.0
        return math.exp(min(0.0, logprob / temperature + offset))
    return p_t


def _stop_of(check: Mapping[str, Any], ids: Sequence[int],
             common: int) -> tuple[int | None, int]:
    """(stop_at, stop_searched) of the claimed tokens (``Rescore``) from the checker's run,
    whose first ``common`` tokens are the claim's: where its decoding met the job's stop
    string, if within them; a run that reports neither ``stop_at`` nor
    ``stopped_by_string`` searched nothing."""
    if "stop_at" in check:
        own = check.get("stop_at")
    elif "stopped_by_string" in check:
        own = len(ids) - 1 if check.get("stopped_by_string") else None
    else:
        return None, 0
    if isinstance(own, bool) or not isinstance(own, (int, type(None))):
        return None, 0
    if own is not None and own < common:
        return int(own), common
    return None, common
