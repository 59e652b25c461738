"""How plugin hosts are started: inside the bubblewrap sandbox (provider_agent.sandbox), or
— only when the operator passes --no-sandbox — as plain subprocesses."""
from __future__ import annotations

import itertools
import logging
import os
import subprocess
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger("agent")
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Variables a plugin host may see; everything else of the agent's environment stays out
# (it may hold the provider API key).
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES",
              "SPARECYCLES_DTYPE")
_counter = itertools.count()


def default_memory_limit_mb() -> int:
    """Three quarters of this machine's memory: a runaway plugin cannot take the machine
    down, and a large model (SDXL loads ~7 GB through host memory) still fits."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError):
        return 8192
    return max(2048, total * 3 // 4)


def gpu_indices_for(device: str, dev_root: Path = Path("/dev")) -> list[int]:
    """The NVIDIA device nodes a host for ``device`` needs: none for "cpu", N for
    "cuda:N", and for "cuda"/"auto" the GPUs in CUDA_VISIBLE_DEVICES (numeric form) or GPU 0
    when this machine has one."""
    if device == "cpu":
        return []
    if device.startswith("cuda:"):
        return [int(device.split(":", 1)[1])]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible and all(p.strip().isdigit() for p in visible.split(",")):
        return [int(p) for p in visible.split(",")]
    return [0] if (dev_root / "nvidia0").exists() else []


def sandbox_ro_paths(plugin_dirs: dict, installer=None, cheat=None) -> list[Path]:
    """The folders a sandboxed plugin host gets read-only beside the source tree and the
    weights (``host_launcher(plugin_dirs=...)``): the served plugins' folders
    (``plugin_dirs``: name -> folder), the registry cache when there is an installer
    (installed plugins, and the adapters the weights folders link to), and what a
    verification-harness cheat needs (provider_agent.cheats)."""
    return [*(Path(d) for d in plugin_dirs.values()),
            *([installer.root] if installer is not None else []),
            *(cheat.extra_ro_paths() if cheat is not None else [])]


def host_launcher(*, sandboxed: bool, home: Path | None = None, cfg=None,
                  memory_limit_mb: int | None = None, pids_limit: int = 256,
                  gpu_devices: list[int] | None = None, plugin_dirs: list[Path] | None = None):
    """A callable ``argv -> Popen`` for PluginHost, or None for a plain subprocess. The
    Popen of a sandboxed host carries its Sandbox as ``.sandbox`` (to kill the whole tree).

    The host is told ``SPARECYCLES_SANDBOXED=1``: alone in its pid namespace, it may then
    kill whatever a job left running (see provider_agent.host.main)."""
    if not sandboxed:
        log.warning("plugins will run WITHOUT a sandbox (--no-sandbox): plugin code can reach "
                    "the network and this machine's files")
        return None
    from .config import config_dir
    from .sandbox import Sandbox, SandboxPolicy

    ok, reason = Sandbox.available()
    if not ok:
        raise ConfigError(f"cannot sandbox plugin hosts: {reason}. Install bubblewrap "
                          "(apt-get install bubblewrap) or, knowing the risk, run with --no-sandbox")
    # Plugin folders outside the source tree (installed ones) are bound read-only too.
    extra_ro = [Path(d).resolve() for d in plugin_dirs or ()]
    if cfg is not None:
        for name in cfg.plugins:
            w = cfg.weights_for(name)
            if w is not None:
                extra_ro.append(w.resolve())
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env.update(PYTHONPATH=str(PROJECT_ROOT), HOME="/scratch", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1",
               SPARECYCLES_SANDBOXED="1")
    hide = [(home or config_dir()).resolve()]
    if memory_limit_mb is None:
        memory_limit_mb = default_memory_limit_mb()
    if gpu_devices is None:
        gpu_devices = gpu_indices_for(getattr(cfg, "device", "auto") or "auto")

    def launch(argv: list[str]) -> subprocess.Popen:
        policy = SandboxPolicy.for_current_python(
            ro_paths=[PROJECT_ROOT, *extra_ro], memory_limit_mb=memory_limit_mb,
            pids_limit=pids_limit, gpu_devices=list(gpu_devices or []), hide_paths=hide, env=env)
        sandbox = Sandbox(policy, f"host-{os.getpid()}-{next(_counter)}")
        proc = sandbox.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc.sandbox = sandbox
        return proc

    return launch
