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
def localnet(tmp_path, request):
    marker = request.node.get_closest_marker("localnet")
    kwargs = marker.kwargs if marker else {}
    net = LocalNetwork(tmp_path / "net", **kwargs)
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
