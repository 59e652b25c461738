"""Output encoding and checkpoint compression in the agent (issue #24)."""
from __future__ import annotations

import io
import os

import pytest
from PIL import Image

from provider_agent.encode import (CHECKPOINT_MAGIC, encode_image, encode_outputs,
                                   pack_checkpoint, unpack_checkpoint)


def _png(size=(64, 64)) -> bytes:
    im = Image.new("RGB", size)
    for x in range(size[0]):
        for y in range(size[1]):
            im.putpixel((x, y), (x * 4 % 256, y * 4 % 256, (x + y) % 256))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("fmt, kind, media", [
    ({"format": "webp", "quality": 80}, "WEBP", "image/webp"),
    ({"format": "jpeg", "quality": 90}, "JPEG", "image/jpeg"),
])
def test_images_are_encoded_deterministically(fmt, kind, media):
    png = _png()
    a, media_a = encode_image(png, fmt)
    b, _ = encode_image(png, fmt)
    assert a == b  # two providers with the same pixels sign the same bytes
    assert media_a == media
    im = Image.open(io.BytesIO(a))
    assert im.format == kind and im.size == (64, 64)


def test_png_and_non_images_pass_unchanged():
    class Out:
        def __init__(self, data, media_type):
            self.data, self.media_type = data, media_type

    png = _png()
    outs = [Out(png, "image/png"), Out(b'{"a": 1}', "application/json")]
    encode_outputs(outs, {"format": "png"})
    assert outs[0].data == png
    encode_outputs(outs, {"format": "webp", "quality": 50})
    assert outs[0].media_type == "image/webp" and outs[1].data == b'{"a": 1}'


def test_a_checkpoint_is_compressed_when_that_is_smaller_and_always_reads_back():
    import torch

    buf = io.BytesIO()  # what plugins/checkpoints.py writes: torch.save of latents and state
    torch.save({"latents": torch.zeros(1, 4, 64, 64), "step": 4}, buf)
    raw = buf.getvalue()
    packed = pack_checkpoint(raw)
    assert packed.startswith(CHECKPOINT_MAGIC) and len(packed) < len(raw) / 4
    assert unpack_checkpoint(packed) == raw
    noise = os.urandom(4096)  # incompressible: stored as it is
    assert pack_checkpoint(noise) == noise and unpack_checkpoint(noise) == noise
    tricky = CHECKPOINT_MAGIC + os.urandom(100)  # raw bytes that look packed
    assert unpack_checkpoint(pack_checkpoint(tricky)) == tricky
