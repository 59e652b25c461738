"""How plugin hosts are started: inside the bubblewrap sandbox (provider_agent.sandbox), or
— only when the operator passes --no-sandbox — as plain subprocesses.

A sandboxed host sees only what it needs to run (``host_code_paths``: the host's own
package, the plugin API and the wire definitions it imports, not the rest of the
checkout), the Python environment, and its own plugin: that plugin's folder, weights and
adapters — never another plugin's, never the agent's config, never a data directory.
"""
from __future__ import annotations

import itertools
import logging
import math
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
    """Three quarters of this machine's memory, for all plugin hosts of the agent
    together: a runaway plugin cannot take the machine down, and a large model (SDXL loads
    ~7 GB through host memory) still fits."""
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


def host_code_paths() -> list[Path]:
    """What of the project a plugin host imports, and nothing else of the checkout:
    ``provider_agent/host`` (the host process) with the package's ``__init__``, the
    ``plugins`` package's own modules (the plugin API and the shared plugin code, not the
    plugin folders beside them), and ``sdk/protocol`` (manifests, schemas) and
    ``sdk/logs.py`` (log lines naming the job and request) with the ``sdk`` package's
    ``__init__``. Secrets and data directories are never among them."""
    import plugins
    import provider_agent
    import sdk

    agent_pkg = Path(provider_agent.__file__).resolve().parent
    plugins_pkg = Path(plugins.__file__).resolve().parent
    sdk_pkg = Path(sdk.__file__).resolve().parent
    paths = [agent_pkg / "__init__.py", agent_pkg / "host",
             *sorted(plugins_pkg.glob("*.py")),
             sdk_pkg / "__init__.py", sdk_pkg / "protocol", sdk_pkg / "logs.py"]
    if (plugins_pkg / "__pycache__").is_dir():
        paths.append(plugins_pkg / "__pycache__")  # compiled plugin API: faster starts
    return paths


def secret_paths(home: Path | None) -> list[Path]:
    """Places never shown to a plugin, even below a folder that is bound: the agent's
    config dir (its identity key and provider API key), the default data dir of a broker
    on this machine and the demo's folder (other agents' homes)."""
    from .config import config_dir

    out = [Path(home or config_dir())]
    try:
        import platformdirs

        out.append(Path(platformdirs.user_data_dir("sparecycles")))
    except ImportError:
        pass
    try:
        from sdk.demo import default_workdir

        out.append(default_workdir())
    except ImportError:
        pass
    return [p.resolve() for p in out]


def plugin_ro_paths(plugin: str, plugin_dir: Path, weights_dir: Path | None,
                    registry_root: Path | None = None) -> list[Path]:
    """What one plugin's host reads besides the Python environment and the host code:
    its folder; its weights folder and the adapters linked from it or kept beside it
    (``<weights>/../adapters/<plugin>``, see plugins.adapters); and, with a registry cache,
    that plugin's share of it (``<cache>/adapters/<plugin>``, made if missing so that
    adapters installed while the host runs show up in it). Nothing of other plugins."""
    out = [Path(plugin_dir).resolve()]
    if weights_dir is not None:
        weights = Path(weights_dir).resolve()
        out.append(weights)
        links = weights / "adapters"
        if links.is_dir():
            for entry in links.iterdir():  # an operator's own adapter folders, linked in
                if entry.is_symlink() and entry.resolve().is_dir():
                    target = entry.resolve()
                    if weights not in target.parents:
                        out.append(target)
        beside = weights.parent / "adapters" / plugin
        if beside.is_dir():
            out.append(beside.resolve())
    if registry_root is not None:
        share = Path(registry_root) / "adapters" / plugin
        share.mkdir(parents=True, exist_ok=True)
        out.append(share.resolve())
    return out


class HostLauncher:
    """Starts one sandboxed plugin host per call: ``launcher(argv, plugin=…,
    plugin_dir=…, weights_dir=…) -> Popen`` (what ``PluginHost`` calls). The Popen carries
    its Sandbox as ``.sandbox`` (to kill the whole tree).

    Everything that is the same for every host of the agent comes at construction: the
    limits (``memory_limit_mb`` for all hosts together, ``cpu_cores``, ``pids_limit`` per
    host), the GPUs, the host user when the agent is root, the paths to hide and the
    registry cache. The agent group of the limits is made at the first host and removed
    by ``close``.

    Hosts are told ``SPARECYCLES_SANDBOXED=1``: alone in its pid namespace with private
    writable places, a host may then kill whatever a job left running and empty what it
    left behind (see provider_agent.host.main)."""

    def __init__(self, *, home: Path | None = None, memory_limit_mb: int | None = None,
                 cpu_cores: float | None = None, pids_limit: int = 256,
                 gpu_devices: list[int] | None = None, sandbox_user: str = "",
                 registry_root: Path | None = None, gpu_dev_root: Path = Path("/dev")):
        from .sandbox import SandboxError, SandboxUser
        from .sandbox.launcher import host_user

        if os.geteuid() != 0 and sandbox_user:
            log.warning("sandbox_user = %r is used only when the agent runs as root; plugin "
                        "hosts run as this agent's own user (uid %d)", sandbox_user,
                        os.geteuid())
            sandbox_user = ""
        try:
            self.user = host_user(SandboxUser.resolve(sandbox_user)) if os.geteuid() == 0 \
                else None
        except SandboxError as exc:
            raise ConfigError(str(exc)) from None
        machine = os.cpu_count() or 1
        if memory_limit_mb is not None and (not isinstance(memory_limit_mb, int)
                                            or memory_limit_mb <= 0):
            raise ConfigError(f"memory_limit_mb is {memory_limit_mb!r}; give a whole number "
                              "of MiB above 0 for all plugin hosts together (0 in agent.toml: "
                              "three quarters of this machine's memory)")
        if cpu_cores is not None and not 0 < cpu_cores <= machine:
            raise ConfigError(f"cpu_cores is {cpu_cores!r}; this machine has {machine} "
                              f"core(s): give a number above 0 and at most {machine} (0 in "
                              "agent.toml: all of them)")
        self.memory_limit_mb = memory_limit_mb or default_memory_limit_mb()
        self.cpu_cores = float(cpu_cores) if cpu_cores else float(machine)
        self.pids_limit = pids_limit
        self.gpu_devices = list(gpu_devices or [])
        self.gpu_dev_root = Path(gpu_dev_root)
        self.registry_root = Path(registry_root).resolve() if registry_root else None
        self.hide = secret_paths(home)
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        if cpu_cores and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, math.ceil(self.cpu_cores)))
        env.update(PYTHONPATH=str(PROJECT_ROOT), HOME="/scratch", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1",
                   SPARECYCLES_SANDBOXED="1")
        self.env = env
        self.name = f"{os.getpid()}-{next(_counter)}"  # the agent group's, in the cgroups
        self.limits = None  # cgroups.AgentLimits, made with the first host

    def agent_limits(self):
        """The agent group all hosts share (made the first time)."""
        if self.limits is None:
            from .sandbox.cgroups import make_agent_limits

            self.limits = make_agent_limits(self.name, self.memory_limit_mb, self.cpu_cores)
            log.info("plugin hosts share %s; CPU: %s; they run as %s",
                     self.limits.enforcement.get("memory"), self.limits.enforcement.get("cpu"),
                     f"host user {self.user}" if self.user else f"uid {os.geteuid()}")
        return self.limits

    def policy_for(self, plugin: str, plugin_dir: Path, weights_dir: Path | None):
        """The SandboxPolicy of ``plugin``'s host."""
        from .sandbox import SandboxPolicy

        ro = [*host_code_paths(),
              *plugin_ro_paths(plugin, plugin_dir, weights_dir, self.registry_root)]
        return SandboxPolicy.for_current_python(
            ro_paths=list(dict.fromkeys(ro)), memory_limit_mb=self.memory_limit_mb,
            pids_limit=self.pids_limit, gpu_devices=self.gpu_devices,
            gpu_dev_root=self.gpu_dev_root, hide_paths=self.hide,
            env=self.env)

    def __call__(self, argv: list[str], *, plugin: str, plugin_dir: Path,
                 weights_dir: Path | None = None) -> subprocess.Popen:
        from .sandbox import Sandbox

        policy = self.policy_for(plugin, plugin_dir, weights_dir)
        sandbox = Sandbox(policy, f"host-{os.getpid()}-{next(_counter)}",
                          agent_limits=self.agent_limits(), user=self.user)
        proc = sandbox.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc.sandbox = sandbox
        return proc

    def close(self) -> None:
        """Remove the agent group (once its hosts are gone); safe to call again."""
        if self.limits is not None:
            try:
                self.limits.remove()
            except OSError as exc:
                log.warning("could not remove the plugin hosts' cgroup: %s", exc)
            self.limits = None


def host_launcher(*, sandboxed: bool, home: Path | None = None, cfg=None,
                  memory_limit_mb: int | None = None, cpu_cores: float | None = None,
                  pids_limit: int = 256, gpu_devices: list[int] | None = None,
                  registry_root: Path | None = None, sandbox_user: str | None = None,
                  gpu_dev_root: Path = Path("/dev")) -> HostLauncher | None:
    """The launcher for PluginHost: a ``HostLauncher``, or None for plain subprocesses.
    Limits and the host user not given come from ``cfg`` (agent.toml), then defaults."""
    if not sandboxed:
        log.warning("plugins will run WITHOUT a sandbox (--no-sandbox): plugin code can reach "
                    "the network and this machine's files")
        return None
    from .sandbox import Sandbox, SandboxError, SandboxUser

    if memory_limit_mb is None:
        memory_limit_mb = getattr(cfg, "memory_limit_mb", 0) or None
    if cpu_cores is None:
        cpu_cores = getattr(cfg, "cpu_cores", 0) or None
    if sandbox_user is None:
        sandbox_user = getattr(cfg, "sandbox_user", "") or ""
    if gpu_devices is None:
        gpu_devices = gpu_indices_for(getattr(cfg, "device", "auto") or "auto", gpu_dev_root)
    try:
        user = SandboxUser.resolve(sandbox_user) if os.geteuid() == 0 else None
    except SandboxError as exc:
        raise ConfigError(str(exc)) from None
    ok, reason = Sandbox.available(user)
    if not ok:
        raise ConfigError(f"cannot sandbox plugin hosts: {reason}. Install bubblewrap "
                          "(apt-get install bubblewrap) or, knowing the risk, run with --no-sandbox")
    return HostLauncher(home=home, memory_limit_mb=memory_limit_mb, cpu_cores=cpu_cores,
                        pids_limit=pids_limit, gpu_devices=gpu_devices,
                        sandbox_user=sandbox_user,
                        registry_root=registry_root, gpu_dev_root=gpu_dev_root)
