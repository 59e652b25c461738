"""Security end to end, real processes on TLS: a job's prompt reaches the client's output
and nowhere else in plaintext — not the broker's database or blob folder, not the broker's
or the agent's log, not the agent's home; the CLI client verifies the broker's dev CA."""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from sdk.localnet import cli

pytestmark = [pytest.mark.e2e]


def test_prompts_stay_sealed_across_real_processes(localnet, tmp_path):
    assert localnet.tls
    info = localnet.start_broker()
    assert info["http"].startswith("https://") and info["tls"]
    localnet.start_agent("alpha", localnet.create_key("provider"), plugins="echo",
                         sandbox=False)
    localnet.wait_for_providers(1)
    prompt = f"sealed-{uuid.uuid4().hex}"
    client_key = localnet.create_key("client")
    with localnet.client(client_key) as client:
        assert client.generate("echo", text=prompt, timeout=120).json[0]["text"] == prompt
    # The command-line client trusts the dev CA through SPARECYCLES_CA_BUNDLE, and
    # refuses the broker without it (self-signed CA, not in the system store).
    env = {**os.environ, "SPARECYCLES_URL": localnet.url, "SPARECYCLES_API_KEY": client_key}
    gen = cli("generate", "echo", "--set", "text=cli", "--out", str(tmp_path / "cli.json"))
    ok = subprocess.run(gen, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    env.pop("SPARECYCLES_CA_BUNDLE", None)
    refused = subprocess.run(gen, env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "not signed by a CA" in refused.stderr
    localnet.stop()
    seen = 0
    for path in localnet.workdir.rglob("*"):
        if path.is_file():
            seen += 1
            assert prompt.encode() not in path.read_bytes(), f"the prompt is in {path}"
    assert seen and (localnet.workdir / "broker.log").exists()
