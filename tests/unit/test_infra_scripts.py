"""The scripts the images run: the agent's entrypoint hands its arguments to `agent init`
and `agent run` (split at `--`) and refuses to start without a broker address or a key;
the broker's health check answers 0 only for a 200 from the path it asks."""
from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[2] / "infra" / "docker"


@pytest.fixture
def fake_cli(tmp_path):
    """A `sparecycles` on PATH that records each call's arguments, one line each."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls"
    script = bin_dir / "sparecycles"
    script.write_text(f'#!/bin/sh\nprintf "%s|" "$@" >> {record}\necho >> {record}\n')
    script.chmod(0o755)
    return bin_dir, record


def _entrypoint(bin_dir, *args, key="sc_provider_x"):
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **({"SPARECYCLES_API_KEY": key} if key else {})}
    return subprocess.run(["bash", str(DOCKER / "agent-entrypoint.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=30)


def test_the_entrypoint_runs_init_with_the_first_arguments_then_run_with_the_rest(fake_cli):
    bin_dir, record = fake_cli
    out = _entrypoint(bin_dir, "--broker", "b.example:50051", "--plugins", "echo", "--",
                      "--devices", "all")
    assert out.returncode == 0, out.stderr
    assert record.read_text().splitlines() == [
        "agent|init|--force|--broker|b.example:50051|--plugins|echo|",
        "agent|run|--devices|all|"]


def test_the_entrypoint_without_run_arguments_runs_plain_run(fake_cli):
    bin_dir, record = fake_cli
    assert _entrypoint(bin_dir, "--broker=b:1").returncode == 0
    assert record.read_text().splitlines()[1] == "agent|run|"


@pytest.mark.parametrize("args,key,says", [
    ((), "sc_provider_x", "--broker HOST:PORT"),
    (("--broker", "b:1"), "", "SPARECYCLES_API_KEY"),
])
def test_the_entrypoint_refuses_without_broker_or_key(fake_cli, args, key, says):
    bin_dir, record = fake_cli
    out = _entrypoint(bin_dir, *args, key=key)
    assert out.returncode == 2 and says in out.stderr
    assert not record.exists()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/readyz" else 503)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.mark.parametrize("path,code", [("/readyz", 0), ("/elsewhere", 1)])
def test_the_health_check_passes_only_on_200(server, path, code):
    env = {k: v for k, v in os.environ.items() if k != "SPARECYCLES_TLS_CERT"}
    out = subprocess.run([sys.executable, str(DOCKER / "healthcheck.py"), path], timeout=30,
                         env={**env, "SPARECYCLES_HTTP": f"0.0.0.0:{server}"},
                         capture_output=True, text=True)
    assert out.returncode == code, out.stderr
    if code:
        assert "503" in out.stderr


def test_the_health_check_says_why_when_nothing_listens(tmp_path):
    out = subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], timeout=30,
                         env={"SPARECYCLES_HTTP": "0.0.0.0:9", "PATH": os.environ["PATH"]},
                         capture_output=True, text=True)
    assert out.returncode == 1 and "127.0.0.1:9/readyz" in out.stderr
