"""`sparecycles plugins build-tiny lora-sd15` writes a folder that `sparecycles publish`
takes as it is: the adapter.toml the README asks for, beside the adapter.json the plugins
check (issue #30)."""
import tomllib

from sdk import cli
from sdk.client import Client

from tests.integration.conftest import LiveBroker


def _cli(*argv) -> int:
    return cli.main([str(a) for a in argv])


def test_a_built_tiny_lora_publishes_as_built(tmp_path, capsys):
    folder = tmp_path / "ink-lora"
    assert _cli("plugins", "build-tiny", "lora-sd15", "--out", folder, "--name", "ink") == 0
    assert "adapter ink@1.0.0 for sd15" in capsys.readouterr().out
    manifest = tomllib.loads((folder / "adapter.toml").read_text())
    assert (manifest["name"], manifest["version"], manifest["base"]) == ("ink", "1.0.0", "sd15")

    broker = LiveBroker(tmp_path, verification=False)
    try:
        pub_key, key_file = broker.key("publisher"), tmp_path / "publisher.key"
        assert _cli("publisher", "init", "--key", key_file) == 0
        assert _cli("publish", folder, "--broker", broker.url, "--key", key_file,
                    "--api-key", pub_key, "--royalty", 2000) == 0
        assert ("adapter ink@1.0.0 published, base sd15, royalty 2000"
                in capsys.readouterr().out)
        with Client(broker.url, broker.key("client")) as client:
            [found] = client.adapters("ink", base="sd15")
            files = {f["path"] for f in client.adapter("ink", "1.0.0")["files"]}
        assert found["royalty_micro"] == 2000
        assert {"adapter.toml", "adapter.json", "pytorch_lora_weights.safetensors"} <= files
    finally:
        broker.stop()


def test_build_tiny_lora_names_the_adapter_after_its_folder_or_refuses_a_bad_name(
        tmp_path, capsys):
    assert _cli("plugins", "build-tiny", "lora-llama", "--out", tmp_path / "film",
                "--version", "0.2.0") == 0
    manifest = tomllib.loads((tmp_path / "film" / "adapter.toml").read_text())
    assert (manifest["name"], manifest["version"], manifest["base"]) == ("film", "0.2.0", "llama")
    capsys.readouterr()
    assert _cli("plugins", "build-tiny", "lora-sd15", "--out", tmp_path / "x", "--name",
                "no spaces") == 2
    assert "name 'no spaces' must match" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything was built
    assert _cli("plugins", "build-tiny", "sd15", "--out", tmp_path / "y", "--name", "ink") == 2
    assert "--name names an adapter" in capsys.readouterr().err
