"""Calibrate the image comparator's thresholds (DESIGN §6) on honest and cheating runs.

Every job is run once as the reference (float32, one thread, the default attention) and
then again as:

* honest replicas: the same run again (same reproducibility class: the final latents
  must be bit-identical), and runs that differ only in the numeric path: two torch
  threads, bfloat16, the classic attention processor instead of SDPA, the scheduler's
  arithmetic in float64, and the image as the first of a batch of two (as a provider
  batching ``n=2`` makes it);
* cheating variants: wrong seed, half the steps, another model (tiny sd15 built from
  seed 1), the job's LoRA adapter dropped, a random image, a cached earlier output
  (same settings and seed, another prompt), and the image made at half the width and
  height and scaled up (``reduced-res``).

Every run also records the plugins' latent trace (``plugins.api.latent_trace``: its
latents at a quarter, half, three quarters and all of its steps, pooled), and its
distance to the reference's (``broker.verification.comparators.trace_distance``) is
measured beside the image figures. The cheats report what a cheat that knows the trace
would: half the steps relabelled as the job's schedule (the points of its own quarter,
half, ... of the way), a reduced-size run's latents scaled up to the job's latent size.

It prints the SSIM / PSNR / pHash distributions of each group, chooses accept and reject
thresholds (below), shows how every variant would be judged, and writes the thresholds
and the figures that justified them to ``broker/verification/thresholds.json``, which
``broker.verification.comparators`` loads.

    python bench/calibrate.py            # 8 jobs, 64x64, 6 steps: ~80 s on two CPU cores
    python bench/calibrate.py --full     # 16 jobs of 30 and 40 steps (the committed file)
    python bench/calibrate.py --rechoose broker/verification/thresholds.json   # no rendering
    python bench/calibrate.py --weights /path/to/sd15 --size 512   # a real model (GPU)

The tiny models' images are deterministic noise, so these thresholds are the tiny
models'; rerun with ``--weights`` on the real model and hardware classes before relying
on them in production (the thresholds are per plugin).

Adapter jobs run the tiny LoRA at scale 4: the tiny LoRA is deliberately weak (its B
factor is scaled by 0.1), and at scale 1 dropping it changes the image less than
bfloat16 rounding does (PSNR 54-56 dB against bf16's 46-49 dB, measured with this bench),
so no structural comparison could see it; a same-class latent hash still does. Even at
scale 4 and 10 steps (--full) a quarter of the adapter-dropped samples sit inside the
bf16 noise and are accepted; the summary shows them.

How thresholds are chosen (distances: 1 - SSIM, -PSNR, pHash bits): the accept bound is
the worst honest distance widened by ``ACCEPT_SLACK`` (unseen numeric paths are a little
noisier than the ones measured), tightened if that would accept a cheating sample
outright (unless the cheat is within ``MIN_SEPARATION`` of the honest noise, where no
bound can separate them); the reject bound is the worst honest distance widened by
``REJECT_SAFETY`` (so no honest run comes near a slash), but never closer than the accept
bound. Cheating samples that land between the two go to a tiebreaker.

The latent trace's reject bound is the geometric mean of the farthest honest pair and the
nearest reduced-work cheat (half the steps, half the size), so it sits the same factor
(the margin, printed and recorded) from each; its accept bound is the farthest honest pair
widened by ``TRACE_ACCEPT_SLACK``. ``thresholds.json`` records both distributions
(``image.distributions``) for the console.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from broker.verification.comparators import (THRESHOLDS_PATH, ImageMetrics,  # noqa: E402
                                             ImageThresholds, Verdict, image_metrics,
                                             judge_metrics,
                                             latent_digest, trace_distance)

HONEST = ("repeat", "threads-2", "bf16", "attn-classic", "sched-fp64", "batch-2")
CHEATS = ("wrong-seed", "fewer-steps", "other-model", "adapter-dropped", "random-image",
          "cached-output", "reduced-res")
#: The cheats the latent trace is for (doing less of the work: fewer steps, a smaller
#: image); its reject bound lies between the farthest honest pair and the nearest of these.
TRACE_CHEATS = ("fewer-steps", "reduced-res")
TRACE_ACCEPT_SLACK = 1.5   # accept trace distances up to 1.5x the farthest honest one
TRACE_MIN_MARGIN = 2.0     # the reject bound must sit this factor from both sides
ACCEPT_SLACK = 1.5     # accept distances up to 1.5x the worst honest one (PSNR: -1.8 dB)
REJECT_SAFETY = 4.0    # reject only beyond 4x the worst honest distance (PSNR: -6 dB)
MIN_SEPARATION = 1.2   # tighten the accept bound only for cheats this much farther out
PHASH_ACCEPT_EXTRA_BITS = 2
PHASH_REJECT_EXTRA_BITS = 8
PROMPTS = ("a lighthouse at dusk", "a red fox in a snowy forest, oil painting",
           "portrait of an old knight, dramatic lighting")
CACHED_PROMPT = "a cat on a beach"


@dataclass(frozen=True)
class Job:
    prompt: str
    seed: int
    steps: int
    scheduler: str
    adapter: bool
    size: int = 64
    adapter_scale: float = 4.0
    guidance_scale: float = 7.5

    def label(self) -> str:
        return (f"{self.scheduler}/{'lora' if self.adapter else 'base'}/seed{self.seed}/"
                f"{self.prompt[:14]!r}")


class Renderer:
    """The tiny (or given) sd15 pipelines in float32 and bfloat16, with the LoRA loaded,
    plus another model for the 'other-model' cheat."""

    def __init__(self, weights: Path, other_weights: Path, lora: Path | None,
                 device: str = "cpu"):
        import torch
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
        # torch_dtype, not dtype: the older diffusers we support know only it
        warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
        self.device = device
        self.pipes = {}
        for name, folder, dtype in (("fp32", weights, torch.float32),
                                    ("bf16", weights, torch.bfloat16),
                                    ("other", other_weights, torch.float32)):
            pipe = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
            pipe.to(device)
            pipe.set_progress_bar_config(disable=True)
            if lora is not None and name != "other":
                pipe.load_lora_weights(lora, weight_name="pytorch_lora_weights.safetensors",
                                       adapter_name="job-adapter")
            self.pipes[name] = pipe
        self.has_lora = lora is not None
        self.scheduler_config = dict(self.pipes["fp32"].scheduler.config)

    def _scheduler(self, name: str, fp64: bool = False):
        from plugins.diffusion import SCHEDULERS

        cls, overrides = SCHEDULERS[name]
        sched = cls.from_config(self.scheduler_config, **overrides)
        if fp64:
            inner = sched.step

            def step(model_output, timestep, sample, *args, **kwargs):
                out = inner(model_output.double(), timestep, sample.double(), *args, **kwargs)
                return (out[0].to(model_output.dtype), *out[1:])

            sched.step = step
        return sched

    def render(self, job: Job, variant: str = "reference") -> tuple[np.ndarray, str | None]:
        """The job's image under ``variant`` as uint8 (H, W, 3), and the final-latent
        digest where the run has latents (None for a random image)."""
        image, digest, _ = self.render_traced(job, variant)
        return image, digest

    def render_traced(self, job: Job, variant: str = "reference"
                      ) -> tuple[np.ndarray, str | None, dict | None]:
        """``render``, and the run's latent trace as the plugins record it (as the job's
        schedule and size claim it, for the cheats; None for a random image)."""
        import torch
        import torch.nn.functional as F

        from plugins.api import latent_trace, trace_point, trace_steps

        if variant == "random-image":
            rng = np.random.default_rng(job.seed + 12345)
            return rng.integers(0, 256, (job.size, job.size, 3), dtype=np.uint8), None, None
        pipe = self.pipes[{"bf16": "bf16", "other-model": "other"}.get(variant, "fp32")]
        use_adapter = job.adapter and variant not in ("adapter-dropped", "other-model")
        if pipe is not self.pipes["other"] and self.has_lora:
            if use_adapter:
                pipe.enable_lora()
                pipe.set_adapters(["job-adapter"], [job.adapter_scale])
            else:
                pipe.disable_lora()
        seed = job.seed + 7919 if variant == "wrong-seed" else job.seed
        steps = max(1, job.steps // 2) if variant == "fewer-steps" else job.steps
        prompt = CACHED_PROMPT if variant == "cached-output" else job.prompt
        n = 2 if variant == "batch-2" else 1
        size = max(8, job.size // 16 * 8) if variant == "reduced-res" else job.size
        latent_side = job.size // 8
        pipe.scheduler = self._scheduler(job.scheduler, fp64=variant == "sched-fp64")
        final: dict[str, torch.Tensor] = {}
        points: dict[int, str] = {}

        def keep_latents(p, i, t, kwargs):
            final["latents"] = kwargs["latents"][:1].detach().clone()
            # every step's point (8x8 at most: cheap): a cheat claims the ones nearest the
            # job's own points
            x = final["latents"].float()
            if x.shape[-1] != latent_side:  # reduced-res: scaled up to the job's size
                x = F.interpolate(x, size=(latent_side, latent_side), mode="bilinear")
            points[i + 1] = trace_point(x[0])
            return kwargs

        with _threads(2 if variant == "threads-2" else 1), _attention(pipe, variant):
            images = pipe(prompt=prompt, num_inference_steps=steps, width=size,
                          height=size, guidance_scale=job.guidance_scale,
                          num_images_per_prompt=n, output_type="np",
                          generator=[torch.Generator("cpu").manual_seed(seed + i)
                                     for i in range(n)],
                          callback_on_step_end=keep_latents).images
        image = (np.clip(images[0], 0, 1) * 255).round().astype(np.uint8)
        if size != job.size:
            from PIL import Image

            image = np.asarray(Image.fromarray(image).resize((job.size, job.size),
                                                             Image.Resampling.BICUBIC))
        shape = (int(final["latents"].shape[1]), min(latent_side, 8), min(latent_side, 8))
        # claimed as the job's schedule: for each point the job's run records, the point of
        # its own run nearest the same fraction of the way
        claimed = trace_steps(job.steps)
        own = [min(steps, max(1, round(k * steps / job.steps))) for k in claimed]
        trace = latent_trace([points[k] for k in own], claimed, job.steps, shape)
        return image, latent_digest(final["latents"]), trace


@contextmanager
def _threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _attention(pipe, variant: str):
    if variant != "attn-classic":
        yield
        return
    from diffusers.models.attention_processor import AttnProcessor

    saved = {m: m.attn_processors for m in (pipe.unet, pipe.vae)}
    for module in saved:
        module.set_attn_processor(AttnProcessor())
    try:
        yield
    finally:
        for module, procs in saved.items():
            module.set_attn_processor(procs)


def variants_for(job: Job) -> tuple[list[str], list[str]]:
    honest = [v for v in HONEST if not (v == "sched-fp64" and job.scheduler == "euler_a")]
    # euler_a draws fresh noise in the dtype of its inputs: float64 noise is other noise
    cheats = [v for v in CHEATS if v != "adapter-dropped" or job.adapter]
    return honest, cheats


def build_weights(work: Path, weights: Path | None) -> tuple[Path, Path, Path | None]:
    from plugins.tiny import build_tiny

    other = build_tiny("sd15", work / "sd15-seed1", seed=1)
    if weights is not None:
        return weights, other, None
    return (build_tiny("sd15", work / "sd15", seed=0), other,
            build_tiny("lora-sd15", work / "lora-sd15", seed=0))


def measure(renderer: Renderer, jobs: list[Job], log=print) -> list[dict]:
    """One row per (job, variant): group, metrics against the reference, latent equality."""
    rows = []
    for job in jobs:
        t0 = time.perf_counter()
        ref, ref_latent, ref_trace = renderer.render_traced(job)
        honest, cheats = variants_for(job)
        for group, names in (("honest", honest), ("cheat", cheats)):
            for variant in names:
                if variant == "adapter-dropped" and not renderer.has_lora:
                    continue
                image, latent, trace = renderer.render_traced(job, variant)
                m = image_metrics(ref, image)
                # a run without a trace (a random image) is a mismatch whatever: recorded
                # as None, out of the distributions
                d = trace_distance(trace, ref_trace) if trace is not None else None
                rows.append({"job": job.label(), "scheduler": job.scheduler,
                             "adapter": job.adapter, "group": group, "variant": variant,
                             "ssim": round(m.ssim, 6), "psnr_db": round(m.psnr_db, 3),
                             "phash_bits": m.phash_bits,
                             "latent_equal": latent is not None and latent == ref_latent,
                             "trace": None if d is None else round(d, 6),
                             "steps": job.steps})
        log(f"  {job.label():58s} {time.perf_counter() - t0:5.1f} s")
    return rows


def choose_thresholds(rows: list[dict]) -> tuple[ImageThresholds, dict]:
    honest = [r for r in rows if r["group"] == "honest"]
    cheats = [r for r in rows if r["group"] == "cheat"]
    worst_ssim_d = max(1.0 - r["ssim"] for r in honest)
    worst_psnr = min(r["psnr_db"] for r in honest)
    worst_phash = max(r["phash_bits"] for r in honest)
    floor_d = 1e-4  # identical-looking honest runs still leave room for rounding
    accept_ssim = 1.0 - max(floor_d, worst_ssim_d) * ACCEPT_SLACK
    accept_psnr = worst_psnr - 10 * math.log10(ACCEPT_SLACK ** 2)
    accept_phash = worst_phash + PHASH_ACCEPT_EXTRA_BITS
    # Tighten the accept region until no cheating sample is accepted outright, but never
    # so far that an honest sample falls out of it.
    for r in sorted(cheats, key=lambda r: -r["ssim"]):
        cheat_d = 1.0 - r["ssim"]
        if (r["ssim"] >= accept_ssim and r["psnr_db"] >= accept_psnr
                and r["phash_bits"] <= accept_phash
                and cheat_d >= MIN_SEPARATION * max(floor_d, worst_ssim_d)):
            # SSIM separates best on these images: put its bound between the worst honest
            # sample and this cheat (geometric mean). A cheat as close as honest rounding
            # noise stays accepted (the summary shows it): no image comparison can see it.
            accept_ssim = 1.0 - math.sqrt(max(floor_d, worst_ssim_d) * cheat_d)
    reject_ssim = min(accept_ssim, 1.0 - max(floor_d, worst_ssim_d) * REJECT_SAFETY)
    reject_psnr = min(accept_psnr, worst_psnr - 10 * math.log10(REJECT_SAFETY ** 2))
    reject_phash = max(accept_phash, worst_phash + PHASH_REJECT_EXTRA_BITS)
    accept_trace, reject_trace, trace_basis = choose_trace_bounds(rows)
    t = ImageThresholds(accept_ssim=round(accept_ssim, 6), accept_psnr_db=round(accept_psnr, 3),
                        accept_phash_bits=int(accept_phash), reject_ssim=round(reject_ssim, 6),
                        reject_psnr_db=round(reject_psnr, 3),
                        reject_phash_bits=int(reject_phash),
                        accept_trace=accept_trace, reject_trace=reject_trace)
    basis = {"worst_honest": {"ssim": 1.0 - worst_ssim_d, "psnr_db": worst_psnr,
                              "phash_bits": worst_phash},
             "accept_slack": ACCEPT_SLACK, "reject_safety": REJECT_SAFETY,
             "min_separation": MIN_SEPARATION,
             "phash_extra_bits": [PHASH_ACCEPT_EXTRA_BITS, PHASH_REJECT_EXTRA_BITS],
             "trace": trace_basis}
    return t, basis


def choose_trace_bounds(rows: list[dict]) -> tuple[float, float, dict]:
    """(accept, reject, basis) of the latent trace distance. The reject bound is the
    geometric mean of the farthest honest pair and the nearest reduced-work cheat
    (``TRACE_CHEATS``), so each lies the same factor (the margin) from it; the accept
    bound is the farthest honest distance widened by ``TRACE_ACCEPT_SLACK``, never past the
    reject bound. When the margin would be under ``TRACE_MIN_MARGIN`` no bound both keeps
    every honest pair clear of a slash and rejects those cheats: the reject bound then
    stays ``TRACE_MIN_MARGIN`` from the honest side (honest providers first), and the
    summary shows the cheats it lets through."""
    honest = [r["trace"] for r in rows if r["group"] == "honest" and r.get("trace") is not None]
    cheats = [r["trace"] for r in rows
              if r["variant"] in TRACE_CHEATS and r.get("trace") is not None]
    if not honest or not cheats:
        return math.inf, math.inf, {"note": "no latent traces measured"}
    worst_honest = max(max(honest), 1e-6)
    nearest_cheat = min(cheats)
    reject = math.sqrt(worst_honest * nearest_cheat)
    margin = reject / worst_honest
    if margin < TRACE_MIN_MARGIN:
        print(f"!! the latent trace does not separate with a margin: the farthest honest pair "
              f"is {worst_honest:.4g}, the nearest reduced-work cheat {nearest_cheat:.4g} "
              f"(margin {margin:.2f}x < {TRACE_MIN_MARGIN}x); the reject bound stays "
              f"{TRACE_MIN_MARGIN}x from the honest side")
        reject = worst_honest * TRACE_MIN_MARGIN
        margin = TRACE_MIN_MARGIN
    accept = min(reject, worst_honest * TRACE_ACCEPT_SLACK)
    return (round(accept, 6), round(reject, 6),
            {"worst_honest": round(worst_honest, 6), "nearest_cheat": round(nearest_cheat, 6),
             "margin": round(margin, 3), "cheat_margin": round(nearest_cheat / reject, 3),
             "accept_slack": TRACE_ACCEPT_SLACK,
             "min_margin": TRACE_MIN_MARGIN, "cheats": list(TRACE_CHEATS)})


def judge_row(r: dict, t: ImageThresholds) -> Verdict:
    """How the comparator would judge a sample across classes: the image figures and the
    latent trace (a run without one, the random image, is a mismatch whatever)."""
    verdict, _ = judge_metrics(ImageMetrics(r["ssim"], r["psnr_db"], r["phash_bits"]), t)
    d = r.get("trace")
    if d is None and "trace" in r:
        return Verdict.MISMATCH
    if d is not None and d > t.reject_trace:
        return Verdict.MISMATCH
    if d is not None and d > t.accept_trace and verdict is Verdict.MATCH:
        return Verdict.TIEBREAK
    return verdict


def summarise(rows: list[dict], t: ImageThresholds) -> dict[str, dict]:
    """Per variant: the metric ranges and how the chosen thresholds judge it."""
    out: dict[str, dict] = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == variant]
        verdicts = [judge_row(r, t).value for r in rs]
        traces = [r["trace"] for r in rs if r.get("trace") is not None]
        out[variant] = {
            "group": rs[0]["group"], "samples": len(rs),
            "ssim": [min(r["ssim"] for r in rs), statistics.median(r["ssim"] for r in rs),
                     max(r["ssim"] for r in rs)],
            "psnr_db": [min(r["psnr_db"] for r in rs),
                        statistics.median(r["psnr_db"] for r in rs),
                        max(r["psnr_db"] for r in rs)],
            "phash_bits": [min(r["phash_bits"] for r in rs),
                           statistics.median(r["phash_bits"] for r in rs),
                           max(r["phash_bits"] for r in rs)],
            "latent_equal": sum(r["latent_equal"] for r in rs),
            "trace": ([min(traces), statistics.median(traces), max(traces)] if traces
                      else None),
            "match": verdicts.count("match"), "tiebreak": verdicts.count("tiebreak"),
            "mismatch": verdicts.count("mismatch")}
    return out


def write_record(path: Path, record: dict) -> None:
    """JSON, indented, except one line per sample (the file is committed: keep it small).
    Keeps the other sections of the file (``catch_probability``, from bench/cheaters.py)."""
    if path.exists():
        old = json.loads(path.read_text())
        record = {**{k: v for k, v in old.items() if k != "image"}, **record}
    samples = record["image"]["samples"]
    body = json.dumps({**record, "image": {**record["image"], "samples": "@SAMPLES@"}},
                      indent=1)
    rows = ",\n  ".join(json.dumps(row) for row in samples)
    path.write_text(body.replace('"@SAMPLES@"', f"[\n  {rows}\n ]") + "\n")


def distributions(rows: list[dict]) -> dict:
    """Honest pairs pooled and each cheat: the quantiles (min, 5 %, median, 95 %, max) of
    the latent trace distance, 1 - SSIM and PSNR: what the console's verification page
    shows beside the bounds."""
    def q(xs: list[float]) -> list[float] | None:
        if not xs:
            return None
        xs = sorted(xs)
        pick = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
        return [round(pick(f), 6) for f in (0.0, 0.05, 0.5, 0.95, 1.0)]

    groups = {"honest": [r for r in rows if r["group"] == "honest"]}
    for r in rows:
        if r["group"] == "cheat":
            groups.setdefault(r["variant"], []).append(r)
    return {name: {"samples": len(rs),
                   "trace": q([r["trace"] for r in rs if r.get("trace") is not None]),
                   "ssim_distance": q([round(1.0 - r["ssim"], 6) for r in rs]),
                   "psnr_db": q([r["psnr_db"] for r in rs])}
            for name, rs in groups.items()}


def default_jobs(full: bool, size: int) -> list[Job]:
    combos = [(sched, adapter) for sched in ("euler", "euler_a", "ddim", "dpmpp_2m")
              for adapter in (False, True)]
    if full:
        # the step counts clients ask (30, 40), where half of them looks alike
        return [Job(prompt=PROMPTS[(i + steps) % len(PROMPTS)], seed=i, steps=steps,
                    scheduler=sched, adapter=adapter, size=size)
                for i, (sched, adapter) in enumerate(combos) for steps in (30, 40)]
    # default: one job per sampler x adapter, seeds and prompts taking turns
    return [Job(prompt=PROMPTS[i % 2], seed=i, steps=6, scheduler=sched, adapter=adapter,
                size=size) for i, (sched, adapter) in enumerate(combos)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="more seeds and prompts, 10 steps")
    parser.add_argument("--size", type=int, default=64, help="image width and height (px)")
    parser.add_argument("--steps", type=int, help="every job's step count (default: 6, or "
                                                   "30 and 40 with --full)")
    parser.add_argument("--weights", type=Path, help="an sd15 folder instead of the tiny one")
    parser.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "sparecycles-calibrate",
                        help="where the tiny weights are built")
    parser.add_argument("--out", type=Path, default=THRESHOLDS_PATH,
                        help="thresholds file to write (default: %(default)s)")
    parser.add_argument("--rechoose", type=Path, metavar="FILE",
                        help="render nothing: choose thresholds again from the samples "
                             "recorded in FILE (a thresholds file) and write --out")
    parser.add_argument("--dry-run", action="store_true", help="print, write nothing")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    if args.rechoose:
        recorded = json.loads(args.rechoose.read_text())["image"]
        labels, calibrated_on = recorded["jobs"], recorded["calibrated_on"]
        groups = {**{v: "honest" for v in HONEST}, **{v: "cheat" for v in CHEATS}}
        fields = recorded.get("sample_fields", ["job", "variant", "ssim", "psnr_db",
                                                "phash_bits", "latent_equal"])
        rows = []
        for sample in recorded["samples"]:
            r = dict(zip(fields, sample))
            r.update(job=labels[r["job"]], group=groups[r["variant"]],
                     latent_equal=bool(r["latent_equal"]))
            rows.append(r)
        print(f"choosing again from {len(rows)} samples recorded in {args.rechoose}")
    else:
        import diffusers
        import torch

        from plugins.api import TRACE_FRACTIONS, TRACE_SIDE

        weights, other, lora = build_weights(args.work_dir, args.weights)
        renderer = Renderer(weights, other, lora, device=args.device)
        jobs = default_jobs(args.full, args.size)
        if args.steps:
            jobs = [replace(job, steps=args.steps) for job in jobs]
        labels = [job.label() for job in jobs]
        calibrated_on = {
            "model": str(args.weights) if args.weights else "tiny sd15 (plugins.tiny, seed 0)",
            "size_px": args.size, "jobs": len(jobs), "full": args.full,
            "steps": sorted({job.steps for job in jobs}), "device": args.device,
            "trace": {"fractions": list(TRACE_FRACTIONS), "side": TRACE_SIDE},
            "torch": torch.__version__, "diffusers": diffusers.__version__}
        print(f"calibrating on {len(jobs)} jobs ({args.size}x{args.size}), "
              f"{len(HONEST)} honest and {len(CHEATS)} cheating variants each")
        rows = measure(renderer, jobs)
    thresholds, basis = choose_thresholds(rows)
    summary = summarise(rows, thresholds)
    print_summary(summary, thresholds)
    tb = basis["trace"]
    if "margin" in tb:
        print(f"latent trace: farthest honest pair {tb['worst_honest']:.5f}, nearest "
              f"reduced-work cheat {tb['nearest_cheat']:.5f}; reject above "
              f"{thresholds.reject_trace:.5f} ({tb['margin']:.2f}x from each), accept up to "
              f"{thresholds.accept_trace:.5f}")
    print(f"{time.perf_counter() - started:.0f} s")
    if args.dry_run:
        return 0
    write_record(args.out, {"image": {
        "thresholds": asdict(thresholds), "basis": basis, "calibrated_on": calibrated_on,
        "summary": summary, "jobs": labels,
        "distributions": distributions(rows),
        "sample_fields": ["job", "variant", "ssim", "psnr_db", "phash_bits", "latent_equal",
                          "trace"],
        "samples": [[labels.index(r["job"]), r["variant"], r["ssim"], r["psnr_db"],
                     r["phash_bits"], int(r["latent_equal"]), r.get("trace")]
                    for r in rows]}})
    print(f"wrote {args.out}")
    return 0


def print_summary(summary: dict[str, dict], thresholds: ImageThresholds) -> None:
    print(f"\n{'variant':16s} {'group':6s} {'n':>3s}  {'SSIM min/med/max':26s} "
          f"{'PSNR dB min/med/max':24s} {'pHash':9s} {'lat=':>4s}  "
          f"{'trace min/med/max':26s} match/grey/reject")
    for variant, s in summary.items():
        tr = s.get("trace")
        trace = f"{tr[0]:.5f}/{tr[1]:.5f}/{tr[2]:.5f}" if tr else "-"
        print(f"{variant:16s} {s['group']:6s} {s['samples']:3d}  "
              f"{s['ssim'][0]:.4f}/{s['ssim'][1]:.4f}/{s['ssim'][2]:.4f}   "
              f"{s['psnr_db'][0]:6.2f}/{s['psnr_db'][1]:6.2f}/{s['psnr_db'][2]:6.2f}   "
              f"{s['phash_bits'][0]:2d}/{s['phash_bits'][1]:4.1f}/{s['phash_bits'][2]:2d}  "
              f"{s['latent_equal']:4d}  {trace:26s} "
              f"{s['match']}/{s['tiebreak']}/{s['mismatch']}")
    print(f"\nchosen thresholds: {asdict(thresholds)}")
    honest_rejected = sum(s["mismatch"] for s in summary.values() if s["group"] == "honest")
    honest_grey = sum(s["tiebreak"] for s in summary.values() if s["group"] == "honest")
    cheats_accepted = sum(s["match"] for s in summary.values() if s["group"] == "cheat")
    print(f"honest samples rejected: {honest_rejected}, sent to tiebreak: {honest_grey}; "
          f"cheating samples accepted: {cheats_accepted}")


if __name__ == "__main__":
    raise SystemExit(main())
