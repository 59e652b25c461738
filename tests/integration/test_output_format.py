"""Output formats (issue #24): the client chooses png, webp or jpeg (with a quality) at
submit; the agent encodes the image outputs before it hashes and signs them; bad choices
are refused at submit with what is allowed."""
from __future__ import annotations

import io

import httpx
import pytest
from PIL import Image

from sdk import Client
from tests.browser.conftest import FIXTURE_PLUGINS
from tests.integration.conftest import LiveBroker, agent_starter, seen_provider


@pytest.fixture
def image_broker(tmp_path):
    from broker.settings import BUILTIN_PLUGINS

    b = LiveBroker(tmp_path, plugin_dirs=[BUILTIN_PLUGINS, FIXTURE_PLUGINS])
    yield b
    b.stop()


def test_webp_and_jpeg_outputs_are_encoded_by_the_agent_and_signed_as_such(image_broker):
    start, stop_all = agent_starter(image_broker)
    try:
        start("a", plugins={"swatch": FIXTURE_PLUGINS / "swatch"})
        client = Client(image_broker.url, image_broker.key("client"))
        png = client.generate("swatch", color="30a46c", timeout=30)
        webp = client.generate("swatch", color="30a46c", output_format="webp",
                               output_quality=80, timeout=30)
        jpeg = client.generate("swatch", color="30a46c", output_format="jpeg", timeout=30)
    finally:
        stop_all()
    assert png.outputs[0]["media_type"] == "image/png"
    for result, media, kind in ((webp, "image/webp", "WEBP"), (jpeg, "image/jpeg", "JPEG")):
        out = result.outputs[0]
        assert out["media_type"] == media
        im = Image.open(io.BytesIO(result.output_bytes(0)))
        assert im.format == kind and im.size == png.images[0].size
        # The receipt the provider signed names these bytes.
        assert result.job.data["output_format"]["format"] == kind.lower()
    assert webp.job.data["output_format"] == {"format": "webp", "quality": 80}
    assert jpeg.job.data["output_format"] == {"format": "jpeg", "quality": 90}


@pytest.mark.parametrize("plugin, extra, field, says", [
    ("swatch", {"output_format": "gif"}, "output_format", "png, webp, jpeg"),
    ("swatch", {"output_format": "webp", "output_quality": 0}, "output_quality", "1"),
    ("swatch", {"output_format": "webp", "output_quality": "high"}, "output_quality", "1"),
    ("swatch", {"output_format": "png", "output_quality": 80}, "output_quality", "lossless"),
    ("swatch", {"output_quality": 80}, "output_quality", "needs output_format"),
    ("echo", {"output_format": "webp"}, "output_format", "image outputs"),
])
def test_a_bad_output_format_is_refused_at_submit(image_broker, plugin, extra, field, says):
    seen_provider(image_broker.services, plugins=(plugin,))
    r = httpx.post(f"{image_broker.url}/v1/jobs", json={"plugin": plugin, "inputs": {}, **extra},
                   headers={"Authorization": f"Bearer {image_broker.key('client')}"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["field"] == field and says in body["detail"], body
    assert image_broker.services.jobs.repo.counts_by_state() == {}  # nothing queued or held


def test_a_progress_preview_reaches_the_clients_events_and_a_large_one_is_refused(live_broker):
    import base64
    import json

    from sdk.protocol import agent_pb2 as pb
    from sdk.protocol.signing import KeyPair
    from tests.integration.test_gateway_and_sdk import RawAgent, _handshake
    from tests.integration.test_s3_outputs import _next

    raw = RawAgent(live_broker.grpc, live_broker.key("provider"))
    try:
        _handshake(raw, KeyPair.generate())
        client = Client(live_broker.url, live_broker.key("client"))
        job = client.jobs.create("echo", text="x")
        env = json.loads(_next(raw, "assignment").envelope)
        thumb = _webp_thumb(_png_bytes())
        raw.send(progress=pb.JobProgress(job_id=job.id, attempt=env["attempt"], step=1, total=4,
                                         preview=thumb, preview_media_type="image/webp"))
        raw.send(progress=pb.JobProgress(job_id=job.id, attempt=env["attempt"], step=2, total=4,
                                         preview=b"x" * (17 * 1024),
                                         preview_media_type="image/webp"))
        refusal = _next(raw, "refusal")
        assert "at most 16384 bytes" in refusal.message
        events = [
            e for e in live_broker.services.jobs.repo.events_after(job.id, 0)
            if e.kind == "preview"]
        assert len(events) == 1 and events[0].data["step"] == 1
        url = events[0].data["preview"]
        assert url.startswith("data:image/webp;base64,")
        assert base64.b64decode(url.split(",", 1)[1]) == thumb
        from sdk.client import Event
        assert Event(events[0].id, "preview", events[0].data).preview == thumb
    finally:
        raw.close()


def _png_bytes() -> bytes:
    im = Image.new("RGB", (128, 96), (200, 40, 40))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def _webp_thumb(png: bytes) -> bytes:
    """A progress preview as plugins send one: a small WebP."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        im.thumbnail((64, 64))
        out = io.BytesIO()
        im.convert("RGB").save(out, format="WEBP", quality=60)
    return out.getvalue()
