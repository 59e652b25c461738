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
