"""Does a check run agree with the run it checks? Pure comparisons of two providers' outputs.

Each comparison returns a ``Verdict``: ``MATCH``, ``MISMATCH``, or ``TIEBREAK`` (a grey zone
too close to call, which goes to a third provider like a mismatch but is never by itself
grounds for slashing) with the figures that decided it, for the audit log.

Images (DESIGN §6): the job pins plugin build, weights, adapters, scheduler, steps, size,
seed (CPU generator) and dtype. Two runs of the same *reproducibility class* (hardware
class, dtype and plugin build) must give bit-identical final latents, so their hashes must
be equal. Across classes the numeric path differs (fp16 vs bf16 kernels, thread counts,
attention implementations) and the decoded images are compared structurally: SSIM, PSNR
and a perceptual hash, with thresholds calibrated by ``bench/calibrate.py`` on honest
numeric variants and on cheating variants (``thresholds.json`` beside this module). Never
CLIP: an embedding says two images show the same thing, not that the same computation
made them.

Text: ``compare_text`` checks the claimed tokens against the checker's teacher-forced
re-scoring of those very tokens (``broker.verification.rescoring``): per-token log-prob
gaps and ranks, end-of-sequence handling, the end the job's own parameters give the tokens
(its stop string, max_new_tokens, the checker's end-of-sequence ids: never the claim's
word), and for sampled jobs a statistical test that the tokens are a sample of the job's
distribution (``sampled_text``). Never string equality: sampled text differs run to run
even when both runs are honest.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from broker.verification.sampled_text import (Position, SamplingBounds, SamplingEvidence,
                                             SamplingState, sampling_evidence)

THRESHOLDS_PATH = Path(__file__).with_name("thresholds.json")
PSNR_CAP_DB = 99.0  # identical images have infinite PSNR; the figure is capped for JSON


class Verdict(str, Enum):
    MATCH = "match"
    MISMATCH = "mismatch"
    TIEBREAK = "tiebreak"


# -- images ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReproClass:
    """Runs in the same class are bit-reproducible: same hardware class, dtype and build."""

    hardware_class: str
    dtype: str
    plugin_build: str


@dataclass(frozen=True)
class ImageResult:
    """One provider's output image: the PNG it returned and, when the plugin reports them,
    the sha256 of its final latents (``latent_digest``) and its latent trace (the meta's
    ``latent_trace``: its latents at fixed fractions of its schedule, see
    ``plugins.api.latent_trace``)."""

    png: bytes
    repro: ReproClass
    latent_sha256: str | None = None
    latent_trace: Any = None


@dataclass(frozen=True)
class ImageThresholds:
    """Accept when every figure is inside its accept bound; reject when any figure is past
    its reject bound; otherwise tiebreak. Higher SSIM/PSNR and lower pHash distance are
    closer."""

    accept_ssim: float
    accept_psnr_db: float
    accept_phash_bits: int
    reject_ssim: float
    reject_psnr_db: float
    reject_phash_bits: int
    # The latent trace's distance (``trace_distance``: the largest relative L2 distance of
    # two runs' latents at one point of their schedule); inf: the trace decides nothing.
    accept_trace: float = math.inf
    reject_trace: float = math.inf

    def __post_init__(self) -> None:
        if not (self.reject_ssim <= self.accept_ssim and self.reject_psnr_db <= self.accept_psnr_db
                and self.reject_phash_bits >= self.accept_phash_bits
                and self.reject_trace >= self.accept_trace):
            raise ValueError(f"reject bounds must be no closer than accept bounds: {self}")


@dataclass(frozen=True)
class ImageMetrics:
    ssim: float
    psnr_db: float
    phash_bits: int  # Hamming distance of the 64-bit perceptual hashes


@dataclass(frozen=True)
class ImageComparison:
    verdict: Verdict
    method: str  # "latent_hash" (same reproducibility class) or "structural"
    metrics: ImageMetrics | None
    reasons: tuple[str, ...] = ()
    trace_distance: float | None = None  # None: neither run carried a latent trace

    def figures(self) -> dict[str, Any]:
        """Plain data for the audit log."""
        out: dict[str, Any] = {"verdict": self.verdict.value, "method": self.method,
                               "reasons": list(self.reasons)}
        if self.metrics is not None:
            out.update(ssim=self.metrics.ssim, psnr_db=self.metrics.psnr_db,
                       phash_bits=self.metrics.phash_bits)
        if self.trace_distance is not None:
            out["trace_distance"] = (round(self.trace_distance, 6)
                                     if math.isfinite(self.trace_distance) else None)
        return out


#: The most latent pixels a trace point may hold (a provider's meta is read with care).
MAX_TRACE_VALUES = 16 * 64 * 64


def decode_trace(trace: Any) -> tuple[int, tuple[int, int, int], tuple[int, ...],
                                      list[np.ndarray]]:
    """(total steps, point shape, recorded steps, points as float32 arrays) of a
    ``latent_trace`` meta
    (``plugins.api.latent_trace``); ValueError saying what is wrong with it otherwise."""
    import base64
    import binascii

    if not isinstance(trace, dict) or trace.get("v") != 1:
        raise ValueError("the latent trace is not a version 1 trace object")
    total, steps, shape, points = (trace.get("total"), trace.get("steps"), trace.get("shape"),
                                   trace.get("points"))
    ints = (lambda xs: isinstance(xs, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in xs))
    if (not ints([total]) or not ints(steps) or not ints(shape) or len(shape) != 3
            or not isinstance(points, list) or len(points) != len(steps)
            or not 1 <= len(points) <= 16):
        raise ValueError("the latent trace's total, steps, shape or points are malformed")
    count = shape[0] * shape[1] * shape[2]
    if count > MAX_TRACE_VALUES:
        raise ValueError(f"a latent trace point of shape {shape} is larger than allowed")
    arrays = []
    for p in points:
        try:
            raw = base64.b64decode(p, validate=True) if isinstance(p, str) else b""
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 2 * count:
            raise ValueError("a latent trace point is not base64 float16 of its shape")
        arr = np.frombuffer(raw, dtype=np.float16).astype(np.float32)
        if not np.all(np.isfinite(arr)):
            raise ValueError("a latent trace point holds values that are not finite")
        arrays.append(arr)
    return int(total), (int(shape[0]), int(shape[1]), int(shape[2])), tuple(steps), arrays


def trace_distance(claimed: Any, check: Any) -> float:
    """How far apart two runs' latent traces are: over the points of their schedules, the
    largest L2 distance of the two runs' latents relative to their mean norm. Two honest
    runs of one job on different numeric paths stay close at every point; a run of fewer
    steps, at another size or with another seed follows another trajectory. inf when the
    traces are not of one schedule and shape (a run of another step count, or size)."""
    total_a, shape_a, steps_a, points_a = decode_trace(claimed)
    total_b, shape_b, steps_b, points_b = decode_trace(check)
    if (total_a, shape_a, steps_a) != (total_b, shape_b, steps_b):
        return math.inf
    worst = 0.0
    for a, b in zip(points_a, points_b):
        scale = math.sqrt((float(a @ a) + float(b @ b)) / 2.0)
        diff = float(np.linalg.norm(a - b))
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def _judge_trace(claimed: ImageResult, check: ImageResult, t: ImageThresholds
                 ) -> tuple[float | None, Verdict, tuple[str, ...]]:
    """The latent traces' part of a structural comparison: (distance, verdict, reasons).
    A run of one plugin build either carries a trace or not; a trace on one side only is a
    mismatch (one that could only be dropped, or made up)."""
    if claimed.latent_trace is None and check.latent_trace is None:
        return None, Verdict.MATCH, ()
    if claimed.latent_trace is None or check.latent_trace is None:
        side = "claimed run" if claimed.latent_trace is None else "check"
        return math.inf, Verdict.MISMATCH, (f"the {side} carries no latent trace; runs of "
                                            "this build record one",)
    try:
        d = trace_distance(claimed.latent_trace, check.latent_trace)
    except ValueError as exc:
        return math.inf, Verdict.MISMATCH, (str(exc),)
    if not math.isfinite(d):
        return d, Verdict.MISMATCH, ("the latent traces are of other schedules or sizes "
                                     "(another step count or image size)",)
    if d > t.reject_trace:
        return d, Verdict.MISMATCH, (f"latent trace distance {d:.4f} > {t.reject_trace:.4f}",)
    if d > t.accept_trace:
        return d, Verdict.TIEBREAK, (f"latent trace distance {d:.4f} above accept "
                                     f"{t.accept_trace:.4f}",)
    return d, Verdict.MATCH, ()


def latent_digest(latents: Any) -> str:
    """sha256 of final latents (a numpy array or a CPU tensor), over dtype, shape and bytes,
    so that two runs agree only if every bit agrees."""
    arr = np.ascontiguousarray(latents.detach().cpu().float().numpy()
                               if hasattr(latents, "detach") else np.asarray(latents))
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def decode_image(image: bytes | np.ndarray | Any) -> np.ndarray:
    """An RGB uint8 array (H, W, 3) from PNG/JPEG bytes, a PIL image or an array."""
    from PIL import Image

    if isinstance(image, (bytes, bytearray)):
        image = Image.open(io.BytesIO(image))
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        if arr.dtype.kind != "f":
            raise ValueError(f"image arrays must be uint8 or float in [0, 1], got {arr.dtype}")
        arr = (np.clip(arr, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"image arrays must be (height, width, 3), got shape {arr.shape}")
    return arr


def image_metrics(a: Any, b: Any) -> ImageMetrics:
    """SSIM, PSNR and perceptual-hash distance of two images of the same size."""
    import imagehash
    from PIL import Image
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    x, y = decode_image(a), decode_image(b)
    if x.shape != y.shape:
        raise ValueError(f"images differ in size: {x.shape[1]}x{x.shape[0]} vs "
                         f"{y.shape[1]}x{y.shape[0]}")
    win = min(7, x.shape[0], x.shape[1])
    win -= 1 - win % 2  # odd
    ssim = float(structural_similarity(x, y, channel_axis=2, data_range=255, win_size=win))
    if np.array_equal(x, y):
        psnr = PSNR_CAP_DB
    else:
        psnr = min(PSNR_CAP_DB, float(peak_signal_noise_ratio(x, y, data_range=255)))
    bits = int(imagehash.phash(Image.fromarray(x)) - imagehash.phash(Image.fromarray(y)))
    return ImageMetrics(ssim=ssim, psnr_db=psnr, phash_bits=bits)


def judge_metrics(m: ImageMetrics, t: ImageThresholds) -> tuple[Verdict, tuple[str, ...]]:
    rejected = []
    if m.ssim < t.reject_ssim:
        rejected.append(f"ssim {m.ssim:.4f} < {t.reject_ssim:.4f}")
    if m.psnr_db < t.reject_psnr_db:
        rejected.append(f"psnr {m.psnr_db:.2f} dB < {t.reject_psnr_db:.2f} dB")
    if m.phash_bits > t.reject_phash_bits:
        rejected.append(f"phash distance {m.phash_bits} > {t.reject_phash_bits}")
    if rejected:
        return Verdict.MISMATCH, tuple(rejected)
    grey = []
    if m.ssim < t.accept_ssim:
        grey.append(f"ssim {m.ssim:.4f} below accept {t.accept_ssim:.4f}")
    if m.psnr_db < t.accept_psnr_db:
        grey.append(f"psnr {m.psnr_db:.2f} dB below accept {t.accept_psnr_db:.2f} dB")
    if m.phash_bits > t.accept_phash_bits:
        grey.append(f"phash distance {m.phash_bits} above accept {t.accept_phash_bits}")
    return (Verdict.TIEBREAK, tuple(grey)) if grey else (Verdict.MATCH, ())


def compare_images(claimed: ImageResult, check: ImageResult,
                   thresholds: ImageThresholds | None = None) -> ImageComparison:
    """Compare a provider's image with a checker's run of the same pinned job.

    Exact latents decide when both runs are of one reproducibility class and both report
    a latent hash; otherwise (another class, or a plugin that reports no hash) the decoded
    images are compared structurally."""
    if claimed.repro == check.repro and claimed.latent_sha256 and check.latent_sha256:
        if claimed.latent_sha256 != check.latent_sha256:
            return ImageComparison(Verdict.MISMATCH, "latent_hash", None,
                                   ("final-latent hashes differ within one reproducibility "
                                    "class",))
        if claimed.png != check.png:  # same latents must decode and encode to same bytes
            return ImageComparison(Verdict.MISMATCH, "latent_hash", None,
                                   ("latent hashes match but the PNG bytes differ",))
        return ImageComparison(Verdict.MATCH, "latent_hash", None)
    t = thresholds or load_image_thresholds()
    distance, trace_verdict, trace_reasons = _judge_trace(claimed, check, t)
    try:
        metrics = image_metrics(claimed.png, check.png)
    except ValueError as exc:  # another size: the job's pinned size was not honoured
        return ImageComparison(Verdict.MISMATCH, "structural", None,
                               (str(exc),) + trace_reasons, distance)
    verdict, reasons = judge_metrics(metrics, t)
    order = (Verdict.MATCH, Verdict.TIEBREAK, Verdict.MISMATCH)
    worst = max(verdict, trace_verdict, key=order.index)
    return ImageComparison(worst, "structural", metrics, reasons + trace_reasons, distance)


@lru_cache(maxsize=4)
def _load_json(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def load_image_thresholds(path: Path | str = THRESHOLDS_PATH) -> ImageThresholds:
    """The image thresholds chosen by ``bench/calibrate.py`` (``thresholds.json``)."""
    try:
        data = _load_json(str(path))["image"]["thresholds"]
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing; run `python bench/calibrate.py` to "
                                f"calibrate the image thresholds and write it") from None
    return ImageThresholds(**data)


# -- text --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextClaim:
    """What a provider returned for a text job, and the job's own sampling settings (the
    broker's record of the job's inputs, never the provider's meta).

    ``logprobs`` are the provider's natural-log probabilities of each claimed token under
    the model's raw (temperature 1) distribution, as the llama plugin reports them.
    ``finish_reason`` is the provider's claim, judged against the end these tokens and the
    job's parameters give (``compare_text``).
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str        # "stop" or "length"
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    ignore_eos: bool = False
    stop: str | None = None   # the job's stop string

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} "
                             f"logprobs; the provider must report one logprob per token")


@dataclass(frozen=True)
class TokenScore:
    """The checker's teacher-forced view of one claimed token."""

    logprob: float         # log p(token) at temperature 1
    rank: int              # 0 = the checker's most likely token
    top_logprob: float     # log p of the checker's most likely token
    mass_above: float      # probability (at the job's temperature) of tokens likelier than it
    eos_logprob: float     # log p(any end-of-sequence token) at temperature 1
    eos_mass_sampled: float = 0.0  # p(end-of-sequence) after temperature and top_p
    # Whether an end-of-sequence id is the checker's most likely token: what a greedy run
    # would have stopped at. None where unknown (the summed eos_logprob stands in): with
    # several end-of-sequence ids their sum can top the likeliest token while none of them
    # is it, and a greedy run then honestly goes on.
    eos_top: bool | None = None
    # Where the token sits in the distribution sampled from (sampled jobs), for the test
    # that the tokens are a sample of it (``sampled_text``); None: not known here.
    position: Position | None = None
    checked: bool = True   # False: a neutral stand-in, the checker could not score it


@dataclass(frozen=True)
class Rescore:
    tokens: tuple[TokenScore, ...]
    eos_ids: frozenset[int]
    temperature: float = 1.0  # the sampling settings mass_above and eos_mass_sampled use
    top_p: float = 1.0
    # Where the job's stop string first appears in the text of the claimed tokens (the
    # index of the token that completes it), as the checker decoded them: ``stop_at`` when
    # it appears within the first ``stop_searched`` tokens, else None. ``stop_searched``
    # None: all of them were searched.
    stop_at: int | None = None
    stop_searched: int | None = None


@dataclass(frozen=True)
class TextThresholds:
    """Per-token logprob gap (nats) between provider and checker: accept up to
    ``accept_gap``, reject beyond ``reject_gap``. ``greedy_tie_nats``: at temperature 0 a
    claimed token no more than this below the checker's top token counts as a tie (fp16 /
    bf16 can flip a near-tie). ``nucleus_slack``: extra probability mass allowed above a
    claimed token beyond top_p. ``min_continue_log``: the lowest log-probability of having
    gone on sampling past every position where the checker could have stopped; below it
    the end of sequence was suppressed. (An honest sampler goes on past such positions
    with exactly that probability, so an honest run is flagged at most that often.)
    ``max_grey_fraction``: more grey tokens than this fraction is a mismatch.
    ``sampling``: the bounds of the test that sampled tokens are a sample of the job's
    distribution (``sampled_text``; their α are its false-alarm rates: ``reject`` per check,
    and per provider and plugin for the evidence compounded over its checks,
    ``SamplingState``; ``doubt`` per check). ``implausible_end``:
    a sampled claim that ends at an end-of-sequence token the checker gives probability p
    there is a mismatch when p · max_new_tokens is below this (an honest sampler ends on
    such a token anywhere in its run with at most that probability).

    These defaults are set by hand from the tiny llama, as built and sharpened (its output
    layer scaled by 30, so that it is as sure of its tokens as a trained model, and its
    logits as large): ``bench/text_checks.py`` measured honest float32 and bfloat16 runs
    of the sharpened one apart by up to 0.11 nats per token, a greedy bfloat16 pick 0.13
    nats below the float32 checker's top (bfloat16 rounds logits near 32 to steps of
    0.25), and an honest sampled token with 0.029 more mass above it than top_p in a
    bfloat16 checker's view; calibrate them on the real models before relying on them."""

    accept_gap: float = 0.15
    reject_gap: float = 1.0
    greedy_tie_nats: float = 0.3
    nucleus_slack: float = 0.05
    min_continue_log: float = math.log(1e-6)
    max_grey_fraction: float = 0.1
    sampling: SamplingBounds = field(default_factory=SamplingBounds)
    implausible_end: float = 1e-9


@dataclass(frozen=True)
class TextComparison:
    verdict: Verdict
    reasons: tuple[str, ...]
    tokens: int
    max_gap: float
    mean_gap: float
    grey_tokens: int
    bad_positions: tuple[int, ...] = field(default=())
    continue_log: float = 0.0  # log p of not stopping where the checker could have
    # How the tokens end under the job's own parameters: "stop" (an end-of-sequence token,
    # or the stop string completed by the last token), "length" (max_new_tokens), "none"
    # (neither: cut short) or "unknown" (the checker could not locate the stop string).
    end: str = "none"
    sampling: SamplingEvidence | None = None

    def figures(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "reasons": list(self.reasons),
                "tokens": self.tokens, "max_gap": self.max_gap, "mean_gap": self.mean_gap,
                "grey_tokens": self.grey_tokens, "bad_positions": list(self.bad_positions),
                "continue_log": self.continue_log, "end": self.end,
                "sampling": self.sampling.figures() if self.sampling else None}


def derived_end(claim: TextClaim, rescore: Rescore) -> tuple[str, list[str]]:
    """How the claimed tokens end under the job's own parameters (see
    ``TextComparison.end``), and what is wrong with where they end: tokens past the stop
    string. From the tokens, the checker's end-of-sequence ids and decoding, and the job's
    stop string and max_new_tokens; nothing the claiming provider says."""
    n = len(claim.token_ids)
    wrong: list[str] = []
    if n and claim.token_ids[-1] in rescore.eos_ids and not claim.ignore_eos:
        return "stop", wrong
    if claim.stop:
        searched = n if rescore.stop_searched is None else min(n, rescore.stop_searched)
        if rescore.stop_at is not None and rescore.stop_at < searched:
            if rescore.stop_at == n - 1:
                return "stop", wrong
            wrong.append(f"{n - 1 - rescore.stop_at} tokens after the stop string, which "
                         f"the text holds at token {rescore.stop_at} (padded)")
        elif searched < n:
            return "unknown", wrong
    return ("length" if n == claim.max_new_tokens else "none"), wrong


def compare_text(claim: TextClaim, rescore: Rescore,
                 thresholds: TextThresholds = TextThresholds(),
                 salt: bytes = b"", prior: SamplingState | None = None) -> TextComparison:
    """Judge a claimed completion against the checker's teacher-forced re-scoring.
    ``salt``: what fixes the sampling test's random draws (the id of the run judged
    against; see ``sampled_text``); ``prior``: the claiming provider's sampled-text
    evidence from its earlier checks, compounded with this one's (``SamplingState``)."""
    t = thresholds
    n = len(claim.token_ids)
    if len(rescore.tokens) != n:
        raise ValueError(f"the re-scoring covers {len(rescore.tokens)} tokens, the claim {n}")
    if (rescore.temperature, rescore.top_p) != (claim.temperature, claim.top_p):
        raise ValueError(f"re-scored at temperature={rescore.temperature}, top_p="
                         f"{rescore.top_p} but the job sampled at temperature="
                         f"{claim.temperature}, top_p={claim.top_p}; re-score with the job's")
    hard: list[str] = []
    doubts: list[str] = []
    bad: list[int] = []
    grey = 0
    gaps = [abs(p - s.logprob) for p, s in zip(claim.logprobs, rescore.tokens)]

    if n > claim.max_new_tokens:
        hard.append(f"{n} tokens, more than max_new_tokens {claim.max_new_tokens} (padded)")
    eos_at = [i for i, tok in enumerate(claim.token_ids) if tok in rescore.eos_ids]
    if claim.ignore_eos and eos_at:
        hard.append(f"end-of-sequence token at {eos_at[0]} although the job ignores it")
    elif eos_at and eos_at[0] != n - 1:
        hard.append(f"tokens after the end-of-sequence token at {eos_at[0]} (padded)")
    end, wrong_end = derived_end(claim, rescore)
    hard.extend(wrong_end)
    ends_with_eos = end == "stop" and bool(eos_at) and eos_at[-1] == n - 1
    if claim.finish_reason not in ("stop", "length"):
        hard.append(f"unknown finish_reason {claim.finish_reason!r}")
    elif claim.finish_reason == "length" and n < claim.max_new_tokens:
        hard.append(f"finish_reason 'length' after {n} of {claim.max_new_tokens} tokens "
                    f"(truncated)")
    elif end == "unknown":
        if claim.finish_reason == "stop":
            doubts.append("finish_reason 'stop', but the checker could not say whether the "
                          "job's stop string ends the text")
    elif end == "none":
        if n < claim.max_new_tokens:
            hard.append(f"finish_reason 'stop' after {n} of {claim.max_new_tokens} tokens, "
                        f"but they end in neither an end-of-sequence token nor the job's "
                        f"stop string{'' if claim.stop else ' (it has none)'} (truncated)")
    elif claim.finish_reason != end:
        hard.append("finish_reason 'stop', but neither an end-of-sequence token nor the "
                    "job's stop string ends the tokens" if end == "length" else
                    "finish_reason 'length', but the tokens end at an end-of-sequence token "
                    "or the job's stop string")

    for i, (gap, s) in enumerate(zip(gaps, rescore.tokens)):
        problem = None
        if gap > t.reject_gap:
            problem = f"token {i}: logprob gap {gap:.3f} nats > {t.reject_gap}"
        elif claim.temperature == 0 and s.top_logprob - s.logprob > t.greedy_tie_nats:
            problem = (f"token {i}: greedy job but rank {s.rank}, "
                       f"{s.top_logprob - s.logprob:.3f} nats below the top token")
        elif claim.temperature > 0 and s.mass_above > claim.top_p + t.nucleus_slack:
            problem = (f"token {i}: outside the top_p={claim.top_p} nucleus "
                       f"({s.mass_above:.3f} of the mass is likelier)")
        if problem:
            if len(bad) < 5:
                hard.append(problem)
            bad.append(i)
        elif gap > t.accept_gap:
            grey += 1

    if ends_with_eos and claim.temperature > 0 and rescore.tokens[-1].checked:
        p_end = rescore.tokens[-1].eos_mass_sampled
        if p_end * max(1, claim.max_new_tokens) < t.implausible_end:
            hard.append(f"token {n - 1}: an end of sequence the job's distribution gives "
                        f"probability {p_end:.2e} there (a made-up stop)")
            bad.append(n - 1)

    # Suppressed end of sequence: the claim went on where the model would have stopped.
    continue_log = 0.0
    last_checked = n - 1 if end == "stop" else n
    if not claim.ignore_eos:
        for i in range(min(last_checked, n)):
            if i in eos_at:
                continue
            s = rescore.tokens[i]
            if claim.temperature == 0:
                if s.eos_top is False:
                    continue  # the likeliest token is no end of sequence: greedy goes on
                # (eos_top None: not known, the summed end-of-sequence mass stands in)
                stop_lp = s.top_logprob if s.eos_top else s.eos_logprob
                if stop_lp - s.logprob > t.greedy_tie_nats:
                    hard.append(f"token {i}: the end-of-sequence token was the greedy choice, "
                                f"{stop_lp - s.logprob:.3f} nats above the claimed token "
                                f"(suppressed end of sequence)")
                    bad.append(i)
                    break
            else:
                continue_log += math.log(max(1e-300, 1.0 - s.eos_mass_sampled))
        if continue_log < t.min_continue_log:
            hard.append(f"continuing past every likely end of sequence had probability "
                        f"e^{continue_log:.1f} (suppressed end of sequence)")

    sampling = None
    if claim.temperature > 0:
        sampling = sampling_evidence([s.position for s in rescore.tokens], salt, t.sampling,
                                     prior)
        if sampling.verdict == "reject":
            hard.append(sampling.reason)
        elif sampling.verdict == "doubt":
            doubts.append(sampling.reason)

    if n and grey > t.max_grey_fraction * n and not hard:
        hard.append(f"{grey} of {n} tokens have logprob gaps above {t.accept_gap} nats")
    verdict = (Verdict.MISMATCH if hard else
               Verdict.TIEBREAK if grey or doubts else Verdict.MATCH)
    return TextComparison(
        verdict=verdict, reasons=tuple(hard + doubts), tokens=n,
        max_gap=max(gaps, default=0.0), mean_gap=sum(gaps) / n if n else 0.0,
        grey_tokens=grey, bad_positions=tuple(sorted(set(bad))), continue_log=continue_log,
        end=end, sampling=sampling)
