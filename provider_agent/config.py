"""The agent's configuration and identity, kept in the platform config directory.

``<config dir>/agent.toml`` (0600: it holds the provider API key) and
``<config dir>/identity.key`` (0600: the Ed25519 seed). The config dir is
``$SPARECYCLES_AGENT_HOME`` when set, else ``platformdirs.user_config_dir("sparecycles")/agent``.
Flags beat variables beat the file beat defaults.

agent.toml::

    broker = "127.0.0.1:50051"
    api_key = "sc_provider_…"
    name = "gaming-pc"
    broker_public_key = "…"     # pinned on first connect; a different key is refused
    slots = 1
    plugins = ["sd15"]
    device = "auto"
    weights_dir = "~/.cache/sparecycles/weights"   # <weights_dir>/<plugin>/ per plugin
    [weights]                                     # per-plugin override
    sd15 = "/models/stable-diffusion-v1-5"
    [asks]                                        # standing asks, micro-credits per work
    sd15 = 15000                                  # unit (absent: stand at the reserve)
    [throttle_ms_per_unit]                        # development/tests only: emulate a
    echo = 200                                    # slower machine (jobs and benchmarks)
    registry_url = "http://127.0.0.1:8080"        # the broker's REST address: install
                                                  # published plugins and adapters from it
    cache_dir = "~/.cache/sparecycles/registry"   # where they go (size-capped, LRU)
    cache_max_gb = 20.0
    trusted_publishers = []                       # publisher keys to accept (empty: any
                                                  # key the broker registered, pinned per name)
    [adapters]                                    # registry adapters to install at start
    sd15 = ["ink"]                                # (others are fetched when a job names them)
    memory_limit_mb = 0       # all plugin hosts together (0: three quarters of the memory)
    cpu_cores = 0.0           # all plugin hosts together, e.g. 2.5 (0: every core)
    sandbox_user = ""         # host user the sandboxes run as when the agent is root
                              # ("": sparecycles-sandbox if it exists, else nobody)
    telemetry_interval_s = 15.0   # GPU/CPU/memory and job timings sent in heartbeats at
                                  # most this often
    metrics_addr = ""             # e.g. "127.0.0.1:9464": a local Prometheus /metrics
"""
from __future__ import annotations

import os
import socket
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tomli_w

from sdk.protocol.signing import KeyPair
from .errors import ConfigError


def config_dir() -> Path:
    env = os.environ.get("SPARECYCLES_AGENT_HOME")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_config_dir("sparecycles")) / "agent"


def default_weights_dir() -> Path:
    env = os.environ.get("SPARECYCLES_WEIGHTS_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("sparecycles")) / "weights"


@dataclass
class AgentConfig:
    broker: str = "127.0.0.1:50051"
    api_key: str = ""
    name: str = field(default_factory=socket.gethostname)
    broker_public_key: str = ""
    slots: int = 1
    plugins: list[str] = field(default_factory=lambda: ["echo"])
    device: str = "auto"
    weights_dir: str = ""
    weights: dict[str, str] = field(default_factory=dict)
    asks: dict[str, int] = field(default_factory=dict)
    throttle_ms_per_unit: dict[str, float] = field(default_factory=dict)
    registry_url: str = ""
    cache_dir: str = ""
    cache_max_gb: float = 20.0
    trusted_publishers: list[str] = field(default_factory=list)
    adapters: dict[str, list[str]] = field(default_factory=dict)
    memory_limit_mb: int = 0
    cpu_cores: float = 0.0
    sandbox_user: str = ""
    telemetry_interval_s: float = 15.0  # least time between telemetry reports in heartbeats
    metrics_addr: str = ""              # HOST:PORT of an agent-local /metrics ("": none)

    def registry_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return default_weights_dir().parent / "registry"

    def weights_for(self, plugin: str) -> Path | None:
        if plugin in self.weights:
            return Path(self.weights[plugin]).expanduser()
        root = Path(self.weights_dir).expanduser() if self.weights_dir else default_weights_dir()
        folder = root / plugin
        return folder if folder.exists() else None

    def check(self) -> None:
        if not self.api_key:
            raise ConfigError("no provider API key: run `sparecycles agent init --broker HOST:PORT "
                              "--api-key sc_provider_…` (an admin creates keys with "
                              "`sparecycles broker create-key --role provider`)")
        if not 1 <= self.slots <= 64:
            raise ConfigError(f"slots is {self.slots}; must be between 1 and 64")
        if ":" not in self.broker:
            raise ConfigError(f"broker {self.broker!r} must look like HOST:PORT")
        if isinstance(self.memory_limit_mb, bool) or not isinstance(self.memory_limit_mb, int) \
                or self.memory_limit_mb < 0:
            raise ConfigError(f"memory_limit_mb is {self.memory_limit_mb!r}; give the MiB all "
                              "plugin hosts may use together (a whole number), or 0 for three "
                              "quarters of this machine's memory")
        cores = os.cpu_count() or 1
        if isinstance(self.cpu_cores, bool) or not isinstance(self.cpu_cores, (int, float)) \
                or not 0 <= self.cpu_cores <= cores:
            raise ConfigError(f"cpu_cores is {self.cpu_cores!r}; this machine has {cores} "
                              f"core(s): give how many all plugin hosts may use together, "
                              f"above 0 and at most {cores} (e.g. 1.5), or 0 for all of them")
        if isinstance(self.telemetry_interval_s, bool) or not isinstance(
                self.telemetry_interval_s, (int, float)) or not self.telemetry_interval_s >= 1:
            raise ConfigError(f"telemetry_interval_s is {self.telemetry_interval_s!r}; give "
                              "the seconds between telemetry reports, at least 1 (e.g. 15)")
        if self.metrics_addr and (":" not in self.metrics_addr
                                  or not self.metrics_addr.rpartition(":")[2].isdigit()):
            raise ConfigError(f"metrics_addr is {self.metrics_addr!r}; give HOST:PORT for the "
                              "agent's /metrics (e.g. 127.0.0.1:9464), or \"\" for none")
        if not isinstance(self.sandbox_user, str):
            raise ConfigError(f"sandbox_user is {self.sandbox_user!r}; give a user name, a "
                              "uid or uid:gid as a string, or \"\" for the default")


def config_path(home: Path | None = None) -> Path:
    return (home or config_dir()) / "agent.toml"


def identity_path(home: Path | None = None) -> Path:
    return (home or config_dir()) / "identity.key"


def load_config(home: Path | None = None) -> AgentConfig:
    path = config_path(home)
    if not path.exists():
        raise ConfigError(f"no agent config at {path}: run `sparecycles agent init --broker "
                          "HOST:PORT --api-key KEY` first")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    known = set(AgentConfig.__dataclass_fields__)
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{path}: unknown settings {sorted(unknown)}; known: {sorted(known)}")
    return AgentConfig(**data)


def save_config(cfg: AgentConfig, home: Path | None = None) -> Path:
    path = config_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        tomli_w.dump({k: v for k, v in asdict(cfg).items() if v not in (None,)}, f)
    os.chmod(path, 0o600)
    return path


def load_identity(home: Path | None = None) -> KeyPair:
    return KeyPair.load_or_create(identity_path(home))
