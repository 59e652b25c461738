"""Output encoding (issue #24): the image format the job's envelope asks for.

Plugins return PNG; a job whose envelope says ``"output_format": {"format": "webp" |
"jpeg", "quality": 1-100}`` gets its images re-encoded here, in the agent, before they are
hashed and signed, so the receipt covers the bytes the client receives. Pillow's encoders
are deterministic for the same input and settings, so two providers with the same pixels
produce the same bytes (what verification compares). Non-image outputs pass unchanged.
"""
from __future__ import annotations

import io
import zlib

MEDIA = {"png": "image/png", "webp": "image/webp", "jpeg": "image/jpeg"}


def encode_image(data: bytes, fmt: dict) -> tuple[bytes, str]:
    """(bytes, media type) of ``data`` (an image) in ``fmt``; PNG stays as it is."""
    from PIL import Image

    kind = fmt.get("format", "png")
    if kind not in MEDIA:
        raise ValueError(f"unknown output format {kind!r}; one of {sorted(MEDIA)}")
    if kind == "png":
        return data, MEDIA["png"]
    quality = int(fmt.get("quality", 90))
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if kind == "jpeg" and im.mode not in ("RGB", "L"):
            im = im.convert("RGB")
        out = io.BytesIO()
        if kind == "webp":
            im.save(out, format="WEBP", quality=quality, method=4)
        else:
            im.save(out, format="JPEG", quality=quality, optimize=True)
    return out.getvalue(), MEDIA[kind]


def encode_outputs(outputs, fmt: dict | None) -> None:
    """Re-encode, in place, the image outputs of a run (``HostResult.outputs``)."""
    if not fmt or fmt.get("format", "png") == "png":
        return
    for out in outputs:
        if str(out.media_type).startswith("image/"):
            out.data, out.media_type = encode_image(out.data, fmt)


# ---- checkpoints ------------------------------------------------------------------------
CHECKPOINT_MAGIC = b"SCZ1"  # a compressed checkpoint: magic, then a zlib stream


def pack_checkpoint(data: bytes, level: int = 6) -> bytes:
    """A plugin's checkpoint as stored: zlib-compressed behind CHECKPOINT_MAGIC when that is
    smaller (latents and RNG state usually are), else as it is. The broker stores and
    hashes these bytes; only agents read them (:func:`unpack_checkpoint`)."""
    packed = CHECKPOINT_MAGIC + zlib.compress(data, level)
    if len(packed) < len(data) or data.startswith(CHECKPOINT_MAGIC):
        return packed
    return data


def unpack_checkpoint(data: bytes) -> bytes:
    """The plugin's bytes of a stored checkpoint (an uncompressed one passes as it is)."""
    if data.startswith(CHECKPOINT_MAGIC):
        return zlib.decompress(data[len(CHECKPOINT_MAGIC):])
    return data
