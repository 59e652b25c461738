"""Image checks: bit-identical latents within a reproducibility class, structural
comparison (SSIM, PSNR, pHash) across classes with the calibrated thresholds. On the tiny
sd15, every honest numeric variant is accepted and every cheating variant is rejected or
sent to a tiebreaker, on a job the calibration never saw."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from broker.verification.comparators import (THRESHOLDS_PATH, ImageMetrics, ImageResult,
                                             ImageThresholds, ReproClass, Verdict,
                                             compare_images, image_metrics, judge_metrics,
                                             latent_digest, load_image_thresholds)

GPU_A = ReproClass("nvidia-ada-24g", "float16", "sd15@1.0.0+abc")
GPU_B = ReproClass("nvidia-ampere-80g", "bfloat16", "sd15@1.0.0+abc")
THRESHOLDS = ImageThresholds(accept_ssim=0.999, accept_psnr_db=43.0, accept_phash_bits=4,
                             reject_ssim=0.99, reject_psnr_db=35.0, reject_phash_bits=10)


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def smooth_image(seed: int, size: int = 64) -> np.ndarray:
    """A picture-like image: low-frequency structure plus a little texture."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (8, 8, 3)).astype(np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC),
                      dtype=np.float64)
    return np.clip(base + rng.normal(0, 4, base.shape), 0, 255).astype(np.uint8)


def perturbed(arr: np.ndarray, sigma: float, seed: int = 99) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0, sigma, arr.shape)
    return np.clip(arr + noise, 0, 255).round().astype(np.uint8)


def structural(a: np.ndarray, b: np.ndarray, thresholds=THRESHOLDS):
    return compare_images(ImageResult(png(a), GPU_A), ImageResult(png(b), GPU_B), thresholds)


# -- synthetic images ---------------------------------------------------------------------
def test_identical_images_match_with_capped_psnr():
    img = smooth_image(0)
    result = structural(img, img)
    assert result.verdict == Verdict.MATCH and result.method == "structural"
    assert result.metrics == ImageMetrics(ssim=pytest.approx(1.0), psnr_db=99.0, phash_bits=0)


def test_rounding_noise_matches():
    img = smooth_image(1)
    assert structural(img, perturbed(img, 0.6)).verdict == Verdict.MATCH


def test_a_different_image_is_a_mismatch_with_reasons():
    result = structural(smooth_image(2), smooth_image(3))
    assert result.verdict == Verdict.MISMATCH
    assert any("ssim" in r for r in result.reasons)
    assert result.figures()["psnr_db"] < 35


def test_between_the_bounds_is_a_tiebreak():
    img = smooth_image(4)
    result = structural(img, perturbed(img, 2.5))
    assert 35.0 <= result.metrics.psnr_db < 43.0
    assert result.verdict == Verdict.TIEBREAK, result.figures()


def test_a_different_size_is_a_mismatch():
    result = structural(smooth_image(5, 64), smooth_image(5, 72))
    assert result.verdict == Verdict.MISMATCH and "size" in result.reasons[0]


def test_any_metric_past_its_reject_bound_rejects():
    assert judge_metrics(ImageMetrics(0.9999, 60.0, 11), THRESHOLDS)[0] == Verdict.MISMATCH
    assert judge_metrics(ImageMetrics(0.98, 60.0, 0), THRESHOLDS)[0] == Verdict.MISMATCH
    assert judge_metrics(ImageMetrics(0.9999, 30.0, 0), THRESHOLDS)[0] == Verdict.MISMATCH
    assert judge_metrics(ImageMetrics(0.9999, 60.0, 5), THRESHOLDS)[0] == Verdict.TIEBREAK


def test_thresholds_refuse_reject_bounds_inside_accept_bounds():
    with pytest.raises(ValueError, match="reject bounds"):
        ImageThresholds(accept_ssim=0.99, accept_psnr_db=40, accept_phash_bits=4,
                        reject_ssim=0.995, reject_psnr_db=35, reject_phash_bits=10)


# -- the same reproducibility class: exact latents ----------------------------------------
def test_same_class_needs_identical_latent_hashes():
    img = png(smooth_image(6))
    latents = np.random.default_rng(0).normal(size=(1, 4, 8, 8)).astype(np.float32)
    same = compare_images(ImageResult(img, GPU_A, latent_digest(latents)),
                          ImageResult(img, GPU_A, latent_digest(latents.copy())))
    assert (same.verdict, same.method) == (Verdict.MATCH, "latent_hash")
    nudged = latents.copy()
    nudged[0, 0, 0, 0] = np.nextafter(nudged[0, 0, 0, 0], np.float32(1))  # one ulp
    differ = compare_images(ImageResult(img, GPU_A, latent_digest(latents)),
                            ImageResult(img, GPU_A, latent_digest(nudged)))
    assert (differ.verdict, differ.method) == (Verdict.MISMATCH, "latent_hash")


def test_same_latents_but_other_pixels_is_a_mismatch():
    digest = latent_digest(np.zeros((1, 4, 8, 8), np.float32))
    result = compare_images(ImageResult(png(smooth_image(7)), GPU_A, digest),
                            ImageResult(png(perturbed(smooth_image(7), 1.0)), GPU_A, digest))
    assert result.verdict == Verdict.MISMATCH


def test_other_classes_compare_structurally_even_with_hashes():
    img = smooth_image(8)
    result = compare_images(ImageResult(png(img), GPU_A, "a" * 64),
                            ImageResult(png(perturbed(img, 0.5)), GPU_B, "b" * 64), THRESHOLDS)
    assert (result.verdict, result.method) == (Verdict.MATCH, "structural")


def test_image_metrics_takes_arrays_and_pil_images():
    img = smooth_image(9)
    assert image_metrics(img, Image.fromarray(img)).ssim == pytest.approx(1.0)
    assert image_metrics(img / 255.0, img).psnr_db == 99.0


# -- the committed calibration ------------------------------------------------------------
def test_committed_thresholds_never_reject_a_calibration_honest_sample():
    data = json.loads(THRESHOLDS_PATH.read_text())["image"]
    t = load_image_thresholds()
    groups = {v: s["group"] for v, s in data["summary"].items()}
    assert set(groups.values()) == {"honest", "cheat"}
    worst_honest_d = 1.0 - data["basis"]["worst_honest"]["ssim"]
    counts: dict[str, list[str]] = {}
    from bench.calibrate import judge_row  # the image figures and the latent trace

    for sample in data["samples"]:
        row = dict(zip(data["sample_fields"], sample))
        variant, ssim, latent_equal = row["variant"], row["ssim"], row["latent_equal"]
        verdict = judge_row(row, t)
        counts.setdefault(variant, []).append(verdict.value)
        if groups[variant] == "honest":
            assert verdict != Verdict.MISMATCH, row
            assert row["trace"] <= t.accept_trace, row  # honest traces: within accept
        elif variant in ("fewer-steps", "reduced-res"):  # what the trace is for
            assert row["trace"] > t.reject_trace and verdict == Verdict.MISMATCH, row
        elif verdict == Verdict.MATCH:
            # only a cheat as close as honest rounding noise may pass (the adapter-dropped
            # tiny LoRA at some seeds): no threshold can separate it
            assert 1.0 - ssim < data["basis"]["min_separation"] * worst_honest_d, (variant, ssim)
        if variant == "repeat":
            assert latent_equal == 1  # the same class reproduces the latents bit for bit
    for variant, verdicts in counts.items():  # the recorded summary is what the file says
        summary = data["summary"][variant]
        assert [summary[k] for k in ("match", "tiebreak", "mismatch")] == [
            verdicts.count(k) for k in ("match", "tiebreak", "mismatch")]


# -- the tiny sd15: a job the calibration did not see -------------------------------------
def _bench():
    from bench.calibrate import Job, variants_for

    return Job, variants_for


@pytest.fixture(scope="module")
def tiny_job_images(sd15_renderer):
    Job, variants_for = _bench()
    job = Job(prompt="a castle on a mountain at night", seed=23, steps=5, scheduler="euler",
              adapter=True)
    honest, cheats = variants_for(job)
    ref = sd15_renderer.render(job)
    return ref, {v: sd15_renderer.render(job, v) for v in honest}, {
        v: sd15_renderer.render(job, v) for v in cheats}


def test_a_rerun_in_the_same_class_has_identical_latents(tiny_job_images):
    (ref, ref_latent), honest, _ = tiny_job_images
    again, again_latent = honest["repeat"]
    cpu = ReproClass("cpu-x86_64", "float32", "sd15@1.0.0")
    result = compare_images(ImageResult(png(ref), cpu, ref_latent),
                            ImageResult(png(again), cpu, again_latent))
    assert (result.verdict, result.method) == (Verdict.MATCH, "latent_hash")


def test_honest_numeric_variants_are_accepted(tiny_job_images):
    (ref, _), honest, _ = tiny_job_images
    for variant, (image, _) in honest.items():
        result = structural(ref, image, load_image_thresholds())
        assert result.verdict == Verdict.MATCH, (variant, result.figures())


def test_every_cheating_variant_is_rejected_or_sent_to_a_tiebreak(tiny_job_images):
    (ref, _), _, cheats = tiny_job_images
    assert set(cheats) == {"wrong-seed", "fewer-steps", "other-model", "adapter-dropped",
                           "random-image", "cached-output", "reduced-res"}
    verdicts = {}
    for variant, (image, _) in cheats.items():
        verdicts[variant] = structural(ref, image, load_image_thresholds()).verdict
    assert Verdict.MATCH not in verdicts.values(), verdicts
    for variant in ("wrong-seed", "other-model", "random-image"):
        assert verdicts[variant] == Verdict.MISMATCH


def test_latent_traces_tell_reduced_work_from_honest_numeric_paths(sd15_renderer):
    """Issue #20: at the step counts clients ask, half the steps or half the size looks
    like the honest image; the latent trace (claimed as the job's own schedule and size)
    does not, while every honest numeric path stays within the accept bound."""
    Job, _ = _bench()
    job = Job(prompt="a castle on a mountain at night", seed=23, steps=30, scheduler="euler",
              adapter=False)
    t = load_image_thresholds()
    ref, _, ref_trace = sd15_renderer.render_traced(job)
    cpu = ReproClass("cpu-x86_64", "float32", "sd15@1.1.0")
    for variant in ("bf16", "threads-2"):
        image, _, trace = sd15_renderer.render_traced(job, variant)
        result = compare_images(ImageResult(png(ref), GPU_A, None, ref_trace),
                                ImageResult(png(image), cpu, None, trace), t)
        assert result.verdict == Verdict.MATCH, (variant, result.figures())
    for variant in ("fewer-steps", "reduced-res"):
        image, _, trace = sd15_renderer.render_traced(job, variant)
        result = compare_images(ImageResult(png(ref), GPU_A, None, ref_trace),
                                ImageResult(png(image), cpu, None, trace), t)
        assert result.verdict == Verdict.MISMATCH, (variant, result.figures())
        assert result.trace_distance > t.reject_trace
    # a trace on one side only: dropped, or made up
    dropped = compare_images(ImageResult(png(ref), GPU_A, None, ref_trace),
                             ImageResult(png(ref), cpu, None, None), t)
    assert dropped.verdict == Verdict.MISMATCH and "no latent trace" in dropped.reasons[0]


@pytest.mark.parametrize("bad", [
    "not a trace", {"v": 2}, {"v": 1, "total": 4, "steps": [4], "shape": [4, 8, 8],
                             "points": ["AAAA"]},
    {"v": 1, "total": 4, "steps": [4], "shape": [4, 8, 8], "points": ["!!"]},
    {"v": 1, "total": True, "steps": [4], "shape": [4, 8, 8], "points": []},
    {"v": 1, "total": 4, "steps": [4], "shape": [4096, 4096, 4], "points": [""]},
])
def test_a_malformed_latent_trace_is_a_mismatch_not_an_error(bad):
    import base64

    good = {"v": 1, "total": 4, "steps": [4], "shape": [4, 8, 8],
            "points": [base64.b64encode(np.ones(256, np.float16).tobytes()).decode()]}
    img = png(smooth_image(3))
    result = compare_images(ImageResult(img, GPU_A, None, bad), ImageResult(img, GPU_B, None, good),
                            THRESHOLDS)
    assert result.verdict == Verdict.MISMATCH, result.figures()
    nan = {**good, "points": [base64.b64encode(np.full(256, np.nan, np.float16).tobytes())
                              .decode()]}
    assert compare_images(ImageResult(img, GPU_A, None, nan), ImageResult(img, GPU_B, None, good),
                          THRESHOLDS).verdict == Verdict.MISMATCH
    same = compare_images(ImageResult(img, GPU_A, None, good),
                          ImageResult(img, GPU_B, None, good), THRESHOLDS)
    assert same.verdict == Verdict.MATCH and same.trace_distance == 0.0
