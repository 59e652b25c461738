"""Fixtures for end-to-end tests: real broker and agent processes on loopback."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from sdk.localnet import LocalNetwork, cli

SANDBOX = shutil.which("bwrap") is not None


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """A weights root holding tiny random sd15 weights in the diffusers layout."""
    root = tmp_path_factory.mktemp("weights")
    subprocess.run(cli("plugins", "build-tiny", "sd15", "--out", str(root / "sd15")),
                   check=True, capture_output=True)
    return root


@pytest.fixture
def localnet(tmp_path, request, monkeypatch):
    """A broker serving REST and gRPC over TLS with a dev CA, which the agents and this
    process's SDK clients trust (SPARECYCLES_CA_BUNDLE); @pytest.mark.localnet(tls=False)
    for plaintext on loopback."""
    marker = request.node.get_closest_marker("localnet")
    kwargs = dict(marker.kwargs) if marker else {}
    kwargs.setdefault("tls", True)
    # Verification re-runs sampled jobs on other agents: off unless a test turns it on
    # (@pytest.mark.localnet(env={"SPARECYCLES_VERIFICATION": "on"})).
    kwargs["env"] = {"SPARECYCLES_VERIFICATION": "off", "SPARECYCLES_CHECK_DELAY_MAX_S": "0",
                     **(kwargs.get("env") or {})}
    net = LocalNetwork(tmp_path / "net", **kwargs)
    if net.ca_file:
        monkeypatch.setenv("SPARECYCLES_CA_BUNDLE", str(net.ca_file))
    yield net
    net.stop()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for log in sorted(net.workdir.glob("*.log")):
            print(f"--- {log.name}\n{net.tail(log.name, 40)}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(scope="session")
def model_weights(tmp_path_factory):
    """A weights root for the model plugins: tiny sd15, sdxl and llama in their real layouts,
    and one sd15 LoRA at ``sd15/adapters/ink`` (inside the weights folder, which the sandboxed
    plugin host can read)."""
    import sys

    root = tmp_path_factory.mktemp("model-weights")
    script = ("import sys; from plugins.tiny import build_tiny; r = sys.argv[1]\n"
              "for kind in ('sd15', 'sdxl', 'llama'): build_tiny(kind, f'{r}/{kind}')\n"
              "build_tiny('lora-sd15', f'{r}/sd15/adapters/ink', seed=1)\n")
    subprocess.run([sys.executable, "-c", script, str(root)], check=True, capture_output=True)
    return root
