"""`sparecycles demo`: a broker and two agents on loopback, one real SD 1.5 image."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sdk.localnet import LocalNetwork, LocalNetworkError, cli


def _cache_dir() -> Path:
    env = os.environ.get("SPARECYCLES_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparecycles"


def default_workdir() -> Path:
    """Where the demo keeps its broker, agent homes (identity keys) and logs:
    ``<cache dir>/demo``, out of any source tree (plugin hosts see parts of the checkout;
    an agent's key must not be among them). Emptied at each start."""
    return _cache_dir() / "demo"


def _say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def run_demo(workdir: Path | None, out_dir: Path, *, sandbox: bool = True) -> int:
    workdir = Path(workdir) if workdir is not None else default_workdir()

    weights_root = _cache_dir() / "weights"
    if not (weights_root / "sd15" / "model_index.json").exists():
        _say(f"building tiny random SD 1.5 weights (diffusers layout) in {weights_root / 'sd15'}")
        subprocess.run(cli("plugins", "build-tiny", "sd15", "--out", str(weights_root / "sd15")),
                       check=True)
    if sandbox and shutil.which("bwrap") is None:
        _say("bubblewrap is not installed, so plugin hosts run WITHOUT a sandbox "
             "(install it with: apt-get install bubblewrap)")
        sandbox = False
    if workdir.exists():
        shutil.rmtree(workdir)
    net = LocalNetwork(workdir, tls=True)
    try:
        _say(f"made a dev CA and a TLS certificate for the broker ({net.ca_file}); the "
             "agents and this client trust that CA")
        _say("starting a broker (SQLite, local blob folder; REST and gRPC over TLS)")
        info = net.start_broker()
        _say(f"broker: REST {info['http']}, agents {info['grpc']} (TLS)")
        client_key = net.create_key("client", "demo-client")
        for name in ("alpha", "beta"):  # two operators, so each can check the other's work
            provider_key = net.create_key("provider", f"demo-provider-{name}")
            net.start_agent(name, provider_key, plugins="sd15", weights_dir=weights_root,
                            sandbox=sandbox)
        _say("starting two provider agents (each loads SD 1.5 once in a warm plugin host and "
             f"benchmarks it before connecting: minutes on a busy CPU; progress in "
             f"{net.workdir}/agent-*.log)")
        net.wait_for_providers(2, timeout_s=900)
        _say("both agents connected; running the README's first example, "
             'client.generate("sd15", prompt="a lighthouse at dusk", seed=7, steps=30)')
        t0 = time.perf_counter()
        with net.client(client_key) as client:
            # No size: the model's own (64×64 for these tiny weights, 512×512 for real ones)
            result = client.generate("sd15", prompt="a lighthouse at dusk", seed=7, steps=30)
            elapsed = time.perf_counter() - t0
            out_dir.mkdir(parents=True, exist_ok=True)
            path = (out_dir / f"demo-{result.job.id}.png").resolve()
            result.save(path)
            img = result.images[0]
            _say(f"job {result.job.id} settled in {elapsed:.2f}s on provider "
                 f"{result.job.data.get('provider_id')}; verification: {result.verification}")
            if result.verification == "checking":
                _say("the other agent re-runs it as a check (new providers are always checked)")
                status = result.wait_verified(timeout=120)
                _say(f"verification: {status}")
        print(f"image: {path} ({img.width}x{img.height})")
        print(f"job id: {result.job.id}")
        print(f"logs: {net.workdir}")
        return 0
    except LocalNetworkError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        _say("shutting down agents and broker")
        net.stop()
