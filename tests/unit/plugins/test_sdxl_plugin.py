"""The sdxl plugin on tiny seeded weights (two text encoders, text_time UNet), on the CPU.

The per-job machinery is shared with sd15 (plugins.diffusion) and tested in depth there;
this file checks what differs: the layout, both encoders, the defaults and the limits."""
from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from plugins.api import BadInput, Cancelled
from sdk.protocol.schema import InputError

pytest.importorskip("diffusers", reason="plugin tests need the [agent] extra")

FAST = {"prompt": "a lighthouse at dusk", "steps": 3, "width": 64, "height": 64}


@pytest.fixture
def run(sdxl, make_ctx):
    plugin, manifest = sdxl

    def run_job(ctx=None, **inputs):
        return plugin.run(manifest.validate_inputs({**FAST, **inputs}), ctx or make_ctx())

    return run_job


def test_tiny_sdxl_has_the_published_layout(sdxl_weights):
    index = json.loads((sdxl_weights / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    unet = json.loads((sdxl_weights / "unet" / "config.json").read_text())
    assert unet["addition_embed_type"] == "text_time"
    assert unet["projection_class_embeddings_input_dim"] == 32 + 6 * unet["addition_time_embed_dim"]


def test_defaults_are_sdxl_sized(sdxl):
    _, manifest = sdxl
    inputs = manifest.validate_inputs({"prompt": "x"})
    assert (inputs["width"], inputs["height"], inputs["guidance_scale"]) == (1024, 1024, 5.0)
    with pytest.raises(InputError, match="multiple of 8"):
        manifest.validate_inputs({"prompt": "x", "width": 1020})


def test_same_seed_same_bytes_other_seed_other_image(run):
    a, = run(seed=1)
    b, = run(seed=1)
    c, = run(seed=2)
    assert a.data == b.data != c.data
    assert a.media_type == "image/png" and Image.open(io.BytesIO(a.data)).size == (64, 64)


def test_img2img_and_progress(run, make_ctx):
    first, = run(seed=1)
    ctx = make_ctx()
    out, = run(ctx, seed=1, init_image=base64.b64encode(first.data).decode(), strength=0.7, steps=4)
    assert ctx.progress_calls == [(1, 2), (2, 2)]
    assert out.data != first.data


def test_cancellation(run, make_ctx):
    with pytest.raises(Cancelled):
        run(make_ctx(cancel_at_step=1), seed=0)


def test_a_prompt_too_long_for_the_encoders_is_refused(run):
    # 90 words: at least 90 tokens whatever the vocabulary, refused by the manifest's
    # rule on every side (the broker at submit)
    with pytest.raises(InputError, match="at most 75") as err:
        run(prompt="castle " * 90)
    assert err.value.field == "prompt"
    # 40 words this tiny vocabulary spells byte by byte: only the tokenizer can tell
    with pytest.raises(BadInput, match="at most 75 tokens"):
        run(prompt="zqxv " * 40)
