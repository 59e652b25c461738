"""The sd15 plugin on tiny seeded weights, on the CPU: what a client of the marketplace sees."""
from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from plugins.api import BadInput, Cancelled
from sdk.protocol.schema import InputError

pytest.importorskip("diffusers", reason="plugin tests need the [agent] extra")
import numpy as np  # noqa: E402 - after the skip: numpy comes with the extra

FAST = {"prompt": "a lighthouse at dusk", "steps": 4, "width": 64, "height": 64}


@pytest.fixture
def run(sd15, make_ctx):
    """run(ctx=None, **inputs): validate like the host does, then run one job."""
    plugin, manifest = sd15

    def run_job(ctx=None, **inputs):
        return plugin.run(manifest.validate_inputs({**FAST, **inputs}), ctx or make_ctx())

    return run_job


def pixels(output) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(output.data)).convert("RGB")).astype(np.int16)


def test_manifest_work_units_are_steps_times_megapixels_times_images(sd15):
    _, manifest = sd15
    inputs = manifest.validate_inputs({"prompt": "x", "steps": 20, "width": 1024,
                                       "height": 512, "n": 3})
    assert manifest.work_units_for(inputs) == 20 * 0.5 * 3
    assert manifest.validate_inputs({"prompt": "x"})["width"] == 512


def test_txt2img_returns_one_png_of_the_asked_size(run):
    [out] = run(seed=1, width=80, height=64)
    assert out.media_type == "image/png" and out.data.startswith(b"\x89PNG")
    assert Image.open(io.BytesIO(out.data)).size == (80, 64)
    assert {k: out.meta[k] for k in ("seed", "index", "dtype")} == {
        "seed": 1, "index": 0, "dtype": "float32"}
    assert set(out.meta) == {"seed", "index", "dtype", "latent_sha256", "latent_trace"}


def test_same_seed_same_bytes_other_seed_other_image(run):
    a, = run(seed=42)
    b, = run(seed=42)
    c, = run(seed=43)
    assert a.data == b.data
    assert a.data != c.data


def test_n_images_use_consecutive_seeds(run):
    outs = run(seed=10, n=2)
    assert [(o.meta["seed"], o.meta["index"]) for o in outs] == [(10, 0), (11, 1)]
    alone, = run(seed=11)
    # batching may change rounding, never the picture
    assert np.abs(pixels(outs[1]) - pixels(alone)).max() <= 2
    assert outs[0].data != outs[1].data


def test_seed_left_out_is_drawn_and_reported(run):
    out, = run()
    again, = run(seed=out.meta["seed"])
    assert out.data == again.data


def test_img2img_moves_further_from_the_init_image_as_strength_grows(run, make_ctx):
    init = Image.new("RGB", (64, 64), (200, 40, 40))
    buf = io.BytesIO()
    init.save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    distance, steps_run = {}, {}
    for strength in (0.25, 1.0):
        ctx = make_ctx()
        out, = run(ctx, seed=3, steps=4, init_image=b64, strength=strength)
        distance[strength] = np.abs(pixels(out) - np.asarray(init, dtype=np.int16)).mean()
        steps_run[strength] = ctx.progress_calls[-1]
    assert distance[0.25] < distance[1.0]
    assert steps_run == {0.25: (1, 1), 1.0: (4, 4)}  # img2img runs steps × strength steps


def test_img2img_and_scheduler_swaps_reuse_the_loaded_weights(sd15, run):
    plugin, _ = sd15
    unet = plugin.pipe.unet
    run(seed=0, steps=2, scheduler="ddim")
    assert plugin.img2img.unet is unet and plugin.img2img.vae is plugin.pipe.vae
    assert plugin.pipe.unet is unet


def test_img2img_resizes_the_init_image_to_the_asked_size(run):
    buf = io.BytesIO()
    Image.new("RGB", (100, 30), (0, 90, 200)).save(buf, format="JPEG")
    out, = run(seed=0, init_image=base64.b64encode(buf.getvalue()).decode(), strength=0.5)
    assert Image.open(io.BytesIO(out.data)).size == (64, 64)


@pytest.mark.parametrize("bad", ["not base64!", base64.b64encode(b"GIF89a not a png").decode()])
def test_img2img_refuses_an_unreadable_init_image(run, bad):
    with pytest.raises(BadInput, match="init_image"):
        run(init_image=bad)


@pytest.mark.parametrize("scheduler", ["euler", "euler_a", "ddim", "dpmpp_2m"])
def test_every_scheduler_runs_and_is_reproducible(run, scheduler):
    a, = run(seed=5, steps=3, scheduler=scheduler)
    b, = run(seed=5, steps=3, scheduler=scheduler)
    assert a.data == b.data


def test_schedulers_give_different_images(run):
    images = {run(seed=5, steps=3, scheduler=s)[0].data for s in ("euler", "ddim")}
    assert len(images) == 2


def test_progress_is_reported_every_step(run, make_ctx):
    ctx = make_ctx()
    run(ctx, seed=0, steps=5)
    assert ctx.progress_calls == [(i, 5) for i in range(1, 6)]


def test_cancellation_stops_between_steps(run, make_ctx):
    ctx = make_ctx(cancel_at_step=2)
    with pytest.raises(Cancelled):
        run(ctx, seed=0, steps=6)
    assert ctx.progress_calls == [(1, 6), (2, 6)]


@pytest.mark.parametrize("field,value,message", [
    ("width", 100, "multiple of 8"),
    ("height", 2048, "between 64 and 1024"),
    ("width", 32, "between 64 and 1024"),
    ("scheduler", "lms", "one of"),
    ("n", 9, "between 1 and 4"),
])
def test_bad_inputs_are_refused_by_the_schema(sd15, field, value, message):
    _, manifest = sd15
    with pytest.raises(InputError, match=message) as info:
        manifest.validate_inputs({**FAST, field: value})
    assert info.value.field == field


def test_a_prompt_longer_than_the_text_encoder_reads_is_refused(run):
    # 80 words: at least 80 tokens whatever the vocabulary, refused by the manifest's
    # rule on every side (the broker at submit, before any provider sees it)
    long_prompt = " ".join(["lighthouse"] * 80)
    with pytest.raises(InputError, match="at most 75") as err:
        run(prompt=long_prompt)
    assert err.value.field == "prompt"
    with pytest.raises(InputError, match="at most 75") as err:
        run(negative_prompt=long_prompt)
    assert err.value.field == "negative_prompt"
    # 40 words this tiny vocabulary spells byte by byte: only the tokenizer can tell
    spelled = " ".join(["zqxv"] * 40)
    with pytest.raises(BadInput, match="at most 75 tokens"):
        run(prompt=spelled)
    with pytest.raises(BadInput, match="negative_prompt"):
        run(negative_prompt=spelled)


def test_benchmark_payload_is_valid_and_small(sd15):
    _, manifest = sd15
    inputs = manifest.validate_inputs(manifest.benchmark_inputs)
    assert manifest.work_units_for(inputs) <= 1.0


def test_the_weights_give_the_default_size_as_diffusers_does(sd15, sdxl):
    # diffusers' own rule: the UNet's sample size times the VAE's scale factor; the tiny
    # weights (sample size 32, a 2-block VAE) make 64×64 pictures, which a CPU draws in a
    # second or two at 30 steps (512×512 took over half an hour)
    plugin, manifest = sd15
    assert plugin.input_defaults() == {"width": 64, "height": 64}
    assert manifest.inputs.weights_defaults(plugin.input_defaults()) == {"width": 64,
                                                                         "height": 64}
    assert sdxl[0].input_defaults() == {"width": 64, "height": 64}


def test_weights_shaped_like_sd15_give_512(tmp_path):
    # the real SD 1.5 layout's config: a 64-sample UNet and a 4-block VAE (factor 8); the
    # layers are tiny, the rule is the one real weights go through
    import torch
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextModel

    from plugins.tiny import _clip_config, _clip_tokenizer, _sd_scheduler_config
    from tests.unit.plugins.conftest import load_builtin

    torch.manual_seed(0)
    tokenizer = _clip_tokenizer()
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=64, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        norm_num_groups=32)
    vae = AutoencoderKL(block_out_channels=(32,) * 4, latent_channels=4, norm_num_groups=32,
                        down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1)
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=CLIPTextModel(_clip_config(len(tokenizer), tokenizer)),
        tokenizer=tokenizer, unet=unet, scheduler=EulerDiscreteScheduler(**_sd_scheduler_config()),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(tmp_path / "sd15-shaped")
    plugin, manifest = load_builtin("sd15")
    plugin.setup(tmp_path / "sd15-shaped", "cpu")
    try:
        assert plugin.input_defaults() == {"width": 512, "height": 512}
        assert manifest.validate_inputs({"prompt": "a"}, plugin.input_defaults())["width"] == 512
    finally:
        plugin.teardown()


def test_progress_previews_are_small_webps_and_leave_the_output_as_it_was(run, make_ctx):
    class PreviewContext(make_ctx):
        def __init__(self):
            super().__init__()
            self.previews = []

        def preview(self, step, data, media_type="image/webp"):
            self.previews.append((step, data, media_type))

    ctx = PreviewContext()
    [with_previews] = run(ctx=ctx, seed=5, steps=8)
    [plain] = run(seed=5, steps=8)  # a context without preview(): none are made
    assert with_previews.data == plain.data
    assert [s for s, _, _ in ctx.previews] == [2, 4, 6]  # 4 per job, never the last step
    for _, data, media_type in ctx.previews:
        im = Image.open(io.BytesIO(data))
        assert media_type == "image/webp" and im.format == "WEBP"
        assert max(im.size) <= 64 and len(data) < 16 * 1024


@pytest.mark.parametrize("steps,strength", [(10, 0.7), (9, 0.5), (100, 0.29)])
def test_the_broker_counts_an_img2img_runs_steps_as_the_plugin_runs_them(run, ckpt_ctx, sd15,
                                                                        steps, strength):
    """Issue #20: a checkpoint whose total is not the job's own step count is refused, so
    the broker must count image-to-image steps as diffusers runs them: min(int(steps ×
    strength), steps), truncated (100 × 0.29 is 28.999…: 28 steps, not 29)."""
    from broker.jobs.checkpoints import steps_of
    from broker.jobs.model import Job, JobState

    _, manifest = sd15
    init = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(init, format="PNG")
    inputs = manifest.validate_inputs({**FAST, "seed": 3, "steps": steps, "strength": strength,
                                       "init_image": base64.b64encode(init.getvalue()).decode()})
    ctx = ckpt_ctx(every=2)
    run(ctx, **inputs)
    total = ctx.progress_calls[-1][1]
    job = Job(id="j", account_id="c", plugin="sd15", plugin_version=manifest.version,
              inputs=inputs, state=JobState.QUEUED, created_at=0.0)
    assert steps_of(job) == total == min(int(steps * strength), steps)
    assert ctx.checkpoints and all(step < total for step in ctx.checkpoints)
