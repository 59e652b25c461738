"""The marketplace through a real broker (uvicorn + gRPC, in-process): `sparecycles
publisher init` and `sparecycles publish` over HTTP, search and downloads, immutability,
quotes with royalties, and an agent that installs a published plugin from the registry
(signature and sha256 checked) and runs a job on it through the SDK."""
import threading
import time

import httpx
import pytest

from broker.settings import Settings
from sdk import cli
from sdk.client import Client
from sdk.errors import ConflictError, InvalidInputError, PermissionDeniedError
from sdk.protocol.package import build_document
from sdk.protocol.signing import KeyPair

from tests.integration.conftest import LiveBroker
from tests.marketplace_helpers import adapter_folder, plugin_folder

NO_VERIFY = {"verification": False} if "verification" in Settings.__dataclass_fields__ else {}


@pytest.fixture
def market(tmp_path):
    broker = LiveBroker(tmp_path, **NO_VERIFY)
    yield broker
    broker.stop()


def _cli(*argv) -> int:
    return cli.main([str(a) for a in argv])


def test_publish_search_download_and_quote(market, tmp_path, capsys):
    pub_key = market.key("publisher")
    key_file = tmp_path / "publisher.key"
    assert _cli("publisher", "init", "--key", key_file, "--broker", market.url,
                "--api-key", pub_key, "--label", "acme") == 0
    assert "registered with" in capsys.readouterr().out
    ink = adapter_folder(tmp_path, name="ink", royalty=None)
    assert _cli("publish", ink, "--broker", market.url, "--key", key_file, "--api-key", pub_key,
                "--royalty", 1234) == 0
    assert "adapter ink@1.0.0 published, base sd15, royalty 1234" in capsys.readouterr().out
    # the same again: idempotent; other bytes under the same version: refused, clearly
    assert _cli("publish", ink, "--broker", market.url, "--key", key_file, "--api-key", pub_key,
                "--royalty", 1234) == 0
    assert "already published" in capsys.readouterr().out
    changed = adapter_folder(tmp_path, name="ink", royalty=1234)
    assert _cli("publish", changed, "--broker", market.url, "--key", key_file,
                "--api-key", pub_key) == 1
    assert "immutable" in capsys.readouterr().err
    reverse = plugin_folder(tmp_path, name="reverse")
    assert _cli("publish", reverse, "--broker", market.url, "--key", key_file,
                "--api-key", pub_key) == 0

    with Client(market.url, market.key("client")) as client:
        [found] = client.adapters("ink", base="sd15")
        assert (found["name"], found["royalty_micro"], found["base"]) == ("ink", 1234, "sd15")
        assert client.adapters(base="llama") == []
        detail = client.adapter("ink", "1.0.0")
        assert detail["document"]["publisher_key"] == KeyPair.load(key_file).public_key_hex
        got = client.request("GET", "/v1/adapters/ink/1.0.0/files/adapter.json")
        assert got.content == (ink / "adapter.json").read_bytes()
        assert got.headers["X-Content-SHA256"] == next(
            f["sha256"] for f in detail["files"] if f["path"] == "adapter.json")
        [plugin] = client.plugins("reverse")
        assert plugin["source"] == "registry" and plugin["publisher"] == "acme"
        assert [p["name"] for p in client.plugins(output="text")] == ["llama"]
        assert [v["version"] for v in client.plugin_versions("reverse")] == ["1.0.0"]
        quote = client.quote("sd15", prompt="a lighthouse", adapters="ink:0.8")
        assert quote["royalty_micro"] == 1234
        assert quote["royalties"] == [{"adapter": "ink", "version": "1.0.0",
                                       "publisher_account": found["publisher_account"],
                                       "royalty_micro": 1234, "charged": True}]
        assert quote["expected_micro"] <= quote["max_micro"]
        # a client key cannot publish; a bad package is refused naming the problem
        with pytest.raises(PermissionDeniedError):
            client.publish(ink, KeyPair.load(key_file))
    with Client(market.url, pub_key) as publisher:
        doc = build_document(ink, KeyPair.load(key_file).public_key_hex)
        with pytest.raises(Exception) as e:
            publisher.request("POST", "/v1/adapters", json_body={"document": doc, "signature": ""})
        assert e.value.status == 400 and e.value.code == "unsigned"
        doc["royalty_micro"] = -5
        with pytest.raises(InvalidInputError) as e:
            publisher.request("POST", "/v1/adapters", json_body={"document": doc,
                                                                  "signature": "ab" * 64})
        assert e.value.code == "invalid_package" and e.value.field == "royalty_micro"
        with pytest.raises(ConflictError):
            publisher.publish(adapter_folder(tmp_path, name="ink"), KeyPair.load(key_file))
    resp = httpx.get(f"{market.url}/v1/adapters/ink/1.0.0")
    assert resp.status_code == 401  # the registry is for the broker's own accounts


def test_an_agent_installs_a_published_plugin_and_runs_a_job(market, tmp_path):
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from provider_agent.installer import make_installer, resolve_plugins

    pub_key = market.key("publisher")
    keys = KeyPair.generate()
    with Client(market.url, pub_key) as publisher:
        publisher.register_publisher_key(keys)
        out = publisher.publish(plugin_folder(tmp_path, name="reverse"), keys)
        assert out["created"] and out["kind"] == "plugin"
    cfg = AgentConfig(broker=market.grpc, api_key=market.key("provider"), name="installer",
                      plugins=["reverse", "nosuch-plugin"], device="cpu",
                      registry_url=market.url, cache_dir=str(tmp_path / "cache"))
    installer = make_installer(cfg)
    dirs = resolve_plugins(cfg, installer)
    assert list(dirs) == ["reverse"]  # the one that could not be had is left out
    agent = Agent(cfg, KeyPair.generate(), plugin_dirs=dirs, sandboxed=False, installer=installer)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not agent.provider_id and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.provider_id
        with Client(market.url, market.key("client")) as client:
            result = client.generate("reverse", text="from the registry", timeout=120)
            assert result.json[0]["text"] == "from the registry"
        warm = market.services.registry.warm.holdings(agent.provider_id)
        assert warm.plugins == {"reverse": True}
    finally:
        agent.stop()
        t.join(10)
