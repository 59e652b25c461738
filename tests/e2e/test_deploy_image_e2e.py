"""The broker image (infra/docker/broker.Dockerfile), built and run by a real container
engine: it starts as its own user with TLS from `broker dev-cert` run in the image, its
health check answers, an agent outside it connects and a job runs through it, and SIGTERM
stops it cleanly.

Podman, rootful (we are root here, no daemon), from Debian's packages (`make system-deps`).
No image registry is reachable, so the base image is made with debootstrap (Debian 12 with
python3 and its venv module: what the pinned python:3.11-slim-bookworm provides) and
imported once; the build then runs the Dockerfile as written, with the base passed as
PYTHON_IMAGE. The engine's storage (overlay where the kernel allows it) and the base's
root file system (a tar) live in the user cache dir, so layers are reused between runs: a
cold run takes minutes (debootstrap, then pip installs the broker's dependencies), a warm
one with only code or README.md changed well under a minute.

In tests/e2e (`make test`), not tests/integration (`make test-fast`). Skipped, with the
reason, where the engine cannot run a container here: not root, podman or debootstrap
missing, or every runtime and storage driver failing `podman info`, the import or
`podman run`, or hanging (infra/README.md, *Container engine on this
machine*, says what was needed and why)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/sparecycles-base:bookworm"
IMAGE = "localhost/sparecycles-broker:test"
BUILD_STAGE = "localhost/sparecycles-broker-build:test"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparecycles" / "podman"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]


def _ulimits() -> list[str]:
    # Without CAP_SYS_RESOURCE (this machine's root lacks it) the engine may not raise a
    # limit above our own hard one, and podman's defaults (nofile 1048576) are higher.
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


class Podman:
    def __init__(self, runtime: str, driver: str):
        self.label = f"{runtime}/{driver}"
        self.base = ["podman", "--cgroup-manager=cgroupfs", "--events-backend=file",
                     f"--runtime={runtime}", f"--storage-driver={driver}",
                     f"--root={CACHE / driver / 'storage'}", f"--runroot={CACHE / driver / 'run'}"]

    def __call__(self, *args: str, timeout: float = 120, check: bool = True,
                 **kwargs) -> subprocess.CompletedProcess:
        try:
            out = subprocess.run([*self.base, *args], capture_output=True, text=True,
                                 timeout=timeout, **kwargs)
        except subprocess.TimeoutExpired:
            # A hung engine (storage locked, a runtime that never returns) is this machine's
            # state, not the image's: the reason, not an error.
            pytest.skip(f"podman ({self.label}) {' '.join(args[:3])}… did not finish in "
                        f"{timeout:g} s: the engine hangs here")
        if check and out.returncode:
            raise AssertionError(f"podman {' '.join(args[:3])}… failed ({out.returncode}):\n"
                                 f"{out.stderr[-3000:]}")
        return out


def _base_tarball() -> Path:
    """The base image's root file system as a tar in the cache dir, made with debootstrap
    once: kept apart from the engine's storage, so a new storage driver or a wiped store
    imports it in seconds instead of running debootstrap again."""
    tar = CACHE / "base-bookworm.tar"
    if tar.exists():
        return tar
    if not shutil.which("debootstrap"):
        pytest.skip("no base image and no debootstrap to make one (no registry is reachable): "
                    "make system-deps installs it")
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = CACHE / f"rootfs-{os.getpid()}"
    try:
        out = subprocess.run(["debootstrap", "--variant=minbase",
                              "--include=python3,python3-venv,ca-certificates", "bookworm",
                              str(rootfs), "http://deb.debian.org/debian"],
                             capture_output=True, text=True, timeout=900)
        if out.returncode:
            pytest.skip(f"debootstrap could not make the base image: {out.stdout[-1500:]}")
        partial = tar.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True,
                       timeout=300)
        partial.rename(tar)
    except subprocess.TimeoutExpired as exc:
        pytest.skip(f"debootstrap could not make the base image in {exc.timeout:g} s")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return tar


def _unusable(engine: Podman) -> str | None:
    """Why this engine cannot run the base image here, or None when it can. The engine is
    asked first (`podman info`), so that debootstrap runs only for one that answers."""
    info = engine("info", "--format", "{{.Store.GraphDriverName}}", check=False, timeout=60)
    if info.returncode:
        return f"podman info: {info.stderr.strip()[-400:]}"
    if engine("image", "exists", BASE, check=False).returncode:
        with _base_tarball().open("rb") as tar:
            out = engine("import", "--change", 'CMD ["/bin/bash"]', "-", BASE, stdin=tar,
                         check=False, timeout=600)
        if out.returncode:
            return f"podman import: {out.stderr.strip()[-400:]}"
    out = engine("run", "--rm", "--network=host", *_ulimits(), BASE,
                 "python3", "-c", "print('ok')", check=False)
    if out.returncode or out.stdout.strip() != "ok":
        return f"podman run: {out.stderr.strip()[-400:]}"
    return None


@pytest.fixture(scope="module")
def podman() -> Podman:
    if not shutil.which("podman"):
        pytest.skip("podman is not installed (make system-deps installs it as root)")
    if os.geteuid() != 0:
        pytest.skip("needs root: rootful podman, and the data dir is handed to the image's "
                    "uid 10001 (chown)")
    tried = []
    runtimes = [r for r in ("crun", "runc") if shutil.which(r)]
    for driver in ("overlay", "vfs"):
        for runtime in runtimes:
            engine = Podman(runtime, driver)
            try:
                reason = _unusable(engine)
            except pytest.skip.Exception as exc:  # this engine hangs: try the next one
                reason = str(exc)
            if reason is None:
                return engine
            tried.append(f"{engine.label}: {reason}")
    pytest.skip("podman cannot run a container here: " + " | ".join(tried))


@pytest.fixture(scope="module")
def broker_image(podman) -> str:
    mounts = []
    # This machine's pip configuration (its index and CA bundle) for the build's RUN steps
    # only; nothing of it is committed into a layer.
    for path in ("/etc/pip.conf", "/etc/ssl/certs/ca-certificates.crt"):
        if Path(path).exists():
            mounts += ["-v", f"{path}:{path}:ro"]
    build = ["build", "--format", "docker", "--isolation=chroot", "--network=host",
             *_ulimits(), *mounts, "--build-arg", f"PYTHON_IMAGE={BASE}", "-f",
             str(ROOT / "infra/docker/broker.Dockerfile")]
    # The build stage tagged too: its layers (the dependencies' above all) are then an
    # image's, not dangling, so the prune below keeps them for the next run's cache and
    # removes only what this build untagged (the previous image and build stage).
    podman(*build, "--target", "build", "-t", BUILD_STAGE, str(ROOT), timeout=2000)
    podman(*build, "-t", IMAGE, str(ROOT), timeout=600)
    podman("image", "prune", "-f", check=False)
    return IMAGE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, ca: Path, deadline_s: float, logs) -> dict:
    import httpx

    end = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < end:
        try:
            r = httpx.get(url, verify=str(ca), timeout=3)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready in {deadline_s:g} s ({last}); logs:\n{logs()}")


def test_the_broker_image_serves_a_job(podman, broker_image, tmp_path):
    config = podman("image", "inspect", broker_image, "--format",
                    "{{.Config.User}}|{{json .Config.Entrypoint}}|{{json .Config.Cmd}}|"
                    "{{json .Config.Healthcheck.Test}}").stdout.strip()
    user, entrypoint, cmd, health = config.split("|")
    assert user == "10001:10001"
    assert entrypoint == '["sparecycles","broker"]' and cmd == '["serve"]'
    assert "/readyz" in health

    data = tmp_path / "data"
    data.mkdir()
    os.chown(data, 10001, 10001)
    run = ["run", "--rm", "--network=host", *_ulimits(), "-v", f"{data}:/var/lib/sparecycles"]
    podman(*run, broker_image, "dev-cert", "--host", "127.0.0.1", timeout=180)
    ca = data / "tls" / "ca.pem"
    assert ca.exists() and (data / "tls" / "server.key").stat().st_uid == 10001

    def key(role: str, *extra: str) -> str:
        out = podman(*run, broker_image, "create-key", "--role", role, "--name", role, *extra,
                     timeout=180).stdout
        return next(line for line in out.splitlines() if line.startswith("sc_"))

    provider, client_key = key("provider"), key("client", "--credits", "100")

    http, grpc = _free_port(), _free_port()
    name = f"sc-broker-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name, "--no-healthcheck", "--network=host", *_ulimits(),
           "-v", f"{data}:/var/lib/sparecycles",
           "-e", f"SPARECYCLES_HTTP=127.0.0.1:{http}", "-e", f"SPARECYCLES_GRPC=127.0.0.1:{grpc}",
           "-e", "SPARECYCLES_TLS_CERT=/var/lib/sparecycles/tls/server.pem",
           "-e", "SPARECYCLES_TLS_KEY=/var/lib/sparecycles/tls/server.key",
           broker_image, timeout=180)
    def logs() -> str:  # the broker logs to stderr; podman logs gives it back there
        out = podman("logs", name, check=False)
        return (out.stdout + out.stderr)[-4000:]

    agent = None
    try:
        ready = _wait_ready(f"https://127.0.0.1:{http}/readyz", ca, 180, logs)
        assert ready["transport"] == "tls"
        assert podman("exec", name, "id", "-u").stdout.strip() == "10001"
        health = podman("exec", name, "python3", "/opt/sparecycles/healthcheck.py", check=False)
        assert health.returncode == 0, health.stderr

        home = tmp_path / "agent"
        cli = [str(Path(sys.executable).with_name("sparecycles"))]
        subprocess.run([*cli, "agent", "init", "--home", str(home), "--broker",
                        f"127.0.0.1:{grpc}", "--api-key", provider, "--ca-file", str(ca),
                        "--plugins", "echo"], check=True, capture_output=True, timeout=120)
        log = (tmp_path / "agent.log").open("w")
        agent = subprocess.Popen([*cli, "agent", "run", "--home", str(home), "--device", "cpu",
                                  "--no-sandbox"], stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        _wait_online(f"https://127.0.0.1:{http}/readyz", ca, tmp_path / "agent.log", logs)

        from sdk import Client

        client = Client(base_url=f"https://127.0.0.1:{http}", api_key=client_key,
                        ca_file=str(ca))
        result = client.generate("echo", text="through the container", timeout=120)
        assert "through the container" in json.dumps(result.json)
    finally:
        try:
            if agent is not None:
                agent.terminate()
                try:
                    agent.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()
                log.close()
        finally:
            try:
                stopped = podman("stop", "-t", "30", name, check=False, timeout=90)
                final = logs()
            finally:
                podman("rm", "-f", name, check=False)
    assert stopped.returncode == 0, stopped.stderr
    assert "broker stopping" in final


def _wait_online(url: str, ca: Path, agent_log: Path, logs, deadline_s: float = 120) -> None:
    import httpx

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if httpx.get(url, verify=str(ca), timeout=3).json().get("providers_online"):
            return
        time.sleep(0.5)
    raise AssertionError(f"the agent never came online; agent log:\n"
                         f"{agent_log.read_text()[-3000:]}\nbroker log:\n{logs()}")
