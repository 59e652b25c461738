"""The agent's configuration and identity, kept in the platform config directory.

``<config dir>/agent.toml`` (0600: it holds the provider API key) and
``<config dir>/identity.key`` (0600: the Ed25519 seed). The config dir is
``$SPARECYCLES_AGENT_HOME`` when set, else ``platformdirs.user_config_dir("sparecycles")/agent``.
Flags beat variables beat the file beat defaults.

agent.toml::

    broker = "127.0.0.1:50051"
    api_key = "sc_provider_…"
    ca_file = ""                # the broker's CA (PEM); "": $SPARECYCLES_CA_BUNDLE, else
                                # the system trust store
    insecure = false            # plaintext to a non-loopback broker (logged as a warning;
                                # loopback brokers without TLS are reached in plaintext)
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

    # When to lend the GPU (provider_agent.availability):
    idle_only = true          # work only while no other process uses the GPU
    idle_resume_s = 60        # ... and it has been idle this long
    idle_util_pct = 10        # utilisation that counts as use when no job of ours runs
    idle_ignore_processes = ["Xorg", "gnome-shell"]   # GPU users that are not "use"
                              # (absent: the usual display servers and compositors)
    owner_away_s = 0          # also wait until the owner is away this long (0: ignore)
    on_owner = "finish"       # running jobs when the owner comes: finish | give_back |
                              # checkpoint (wait up to checkpoint_wait_s for a checkpoint)
    checkpoint_wait_s = 30
    schedule = ["22:00-07:00", "weekends 00:00-24:00"]   # windows (empty: always)
    max_vram_gb = 0           # 0: no limit (advertised VRAM is capped to it)
    max_gpu_hours_per_day = 0
    max_temperature_c = 0
    max_power_w = 0
    min_price_micro_per_unit = 0   # never ask less than this per work unit
    devices = ["cuda:0", "cuda:1"]  # one agent per GPU (provider_agent.fleet); ["all"]:
                                    # every /dev/nvidiaN; []: the one `device`
    [device_slots]                  # per device, over `slots`
    "cuda:1" = 2
    [device_asks."cuda:1"]          # per device, over [asks]
    sd15 = 12000
    telemetry_interval_s = 15.0   # GPU/CPU/memory and job timings sent in heartbeats at
                                  # most this often
    metrics_addr = ""             # e.g. "127.0.0.1:9464": a local Prometheus /metrics
                                  # (several devices: 9464, 9465, … one per device)
"""
from __future__ import annotations

import contextlib
import os
import socket
import tempfile
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
    idle_only: bool = False
    idle_resume_s: float = 60.0
    idle_util_pct: float = 10.0
    idle_ignore_processes: list[str] | None = None   # None: the display servers
    owner_away_s: float = 0.0
    on_owner: str = "finish"
    checkpoint_wait_s: float = 30.0
    schedule: list[str] = field(default_factory=list)
    max_vram_gb: float = 0.0
    max_gpu_hours_per_day: float = 0.0
    max_temperature_c: float = 0.0
    max_power_w: float = 0.0
    min_price_micro_per_unit: int = 0
    devices: list[str] = field(default_factory=list)
    device_slots: dict[str, int] = field(default_factory=dict)
    device_asks: dict[str, dict[str, int]] = field(default_factory=dict)

    def for_device(self, device: str) -> "AgentConfig":
        """This config as one device's agent runs it: its own slots and asks
        (``device_slots``, ``device_asks`` over ``slots``, ``asks``), its own copies."""
        import copy

        cfg = copy.deepcopy(self)
        cfg.device, cfg.devices = device, []
        cfg.slots = int(self.device_slots.get(device, self.slots))
        cfg.asks = {**self.asks, **self.device_asks.get(device, {})}
        cfg.device_slots, cfg.device_asks = {}, {}
        return cfg

    def rules(self):
        """The owner's terms (provider_agent.availability.Rules), checked."""
        from .availability import OWNER_POLICIES, Rules, Schedule

        for name, low, high in (("idle_resume_s", 0, 86400), ("idle_util_pct", 0, 100),
                                ("owner_away_s", 0, 86400), ("checkpoint_wait_s", 0, 3600),
                                ("max_vram_gb", 0, 4096), ("max_gpu_hours_per_day", 0, 24),
                                ("max_temperature_c", 0, 120), ("max_power_w", 0, 5000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not low <= value <= high:
                raise ConfigError(f"{name} is {value!r}; give a number from {low} to {high}"
                                  + (" (0: no limit)" if name.startswith("max_") else ""))
        ignore = self.idle_ignore_processes
        if ignore is not None and (not isinstance(ignore, list)
                                   or not all(isinstance(n, str) and n for n in ignore)):
            raise ConfigError(f"idle_ignore_processes is {ignore!r}; give process names, e.g. "
                              '["Xorg", "gnome-shell"]')
        if not isinstance(self.idle_only, bool):
            raise ConfigError(f"idle_only is {self.idle_only!r}; give true or false")
        if self.on_owner not in OWNER_POLICIES:
            raise ConfigError(f"on_owner is {self.on_owner!r}; give one of "
                              f"{', '.join(OWNER_POLICIES)}")
        if isinstance(self.min_price_micro_per_unit, bool) \
                or not isinstance(self.min_price_micro_per_unit, int) \
                or self.min_price_micro_per_unit < 0:
            raise ConfigError(f"min_price_micro_per_unit is {self.min_price_micro_per_unit!r}; "
                              "give a whole number of micro-credits per work unit, 0 for none")
        from .availability import DISPLAY_PROCESSES

        return Rules(idle_only=self.idle_only, idle_resume_s=float(self.idle_resume_s),
                     idle_util_pct=float(self.idle_util_pct),
                     idle_ignore_processes=tuple(DISPLAY_PROCESSES if ignore is None
                                                 else ignore),
                     owner_away_s=float(self.owner_away_s), on_owner=self.on_owner,
                     checkpoint_wait_s=float(self.checkpoint_wait_s),
                     schedule=Schedule.parse(self.schedule),
                     max_vram_gb=float(self.max_vram_gb),
                     max_gpu_hours_per_day=float(self.max_gpu_hours_per_day),
                     max_temperature_c=float(self.max_temperature_c),
                     max_power_w=float(self.max_power_w))

    def effective_asks(self, plugins) -> dict[str, int]:
        """The asks to post: each at least ``min_price_micro_per_unit``, and one at that
        floor for every served plugin without an ask (else it would stand at the reserve,
        possibly below the floor). Second-score clearing pays at least the ask."""
        floor = self.min_price_micro_per_unit
        asks = {p: int(v) for p, v in self.asks.items()}
        if floor:
            asks = {p: max(v, floor) for p, v in asks.items()}
            for p in plugins:
                asks.setdefault(p, floor)
        return asks
    ca_file: str = ""
    insecure: bool = False
    telemetry_interval_s: float = 15.0  # least time between telemetry reports in heartbeats
    metrics_addr: str = ""              # HOST:PORT of an agent-local /metrics ("": none)

    def registry_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return default_weights_dir().parent / "registry"

    @property
    def brokers(self) -> list[str]:
        """The broker's agent addresses: ``broker`` is one HOST:PORT, or several replicas'
        separated by commas; the agent connects to one and, when that stream is lost,
        tries the next (its leases stand: any replica takes its receipts)."""
        return [b.strip() for b in self.broker.split(",") if b.strip()]

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
        if not self.brokers or any(":" not in b for b in self.brokers):
            raise ConfigError(f"broker {self.broker!r} must look like HOST:PORT, or several "
                              "replicas' addresses separated by commas "
                              "(HOST:PORT,HOST:PORT)")
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
        self.rules()
        if self.devices != ["all"] and (not isinstance(self.devices, list) or not all(
                isinstance(d, str) and (d in ("cpu", "cuda", "auto") or (
                    d.startswith("cuda:") and d[5:].isdigit())) for d in self.devices)
                or len(set(self.devices)) != len(self.devices)):
            raise ConfigError(f"devices is {self.devices!r}; give distinct devices such as "
                              '["cuda:0", "cuda:1"], or ["all"] for every NVIDIA GPU, or [] '
                              "for the one `device`")
        for name, table in (("device_slots", self.device_slots),
                            ("device_asks", self.device_asks)):
            if not isinstance(table, dict):
                raise ConfigError(f"{name} is {table!r}; give a table keyed by device, e.g. "
                                  f'[{name}] "cuda:1" = …')
            for dev, value in table.items():
                if self.devices not in ([], ["all"]) and dev not in self.devices:
                    raise ConfigError(f"{name} names {dev!r}, which is not among devices "
                                      f"{self.devices}")
                if name == "device_slots" and (isinstance(value, bool) or not isinstance(
                        value, int) or not 1 <= value <= 64):
                    raise ConfigError(f"device_slots.{dev} is {value!r}; must be between 1 "
                                      "and 64")
                if name == "device_asks" and (not isinstance(value, dict) or not all(
                        isinstance(v, int) and not isinstance(v, bool) and v > 0
                        for v in value.values())):
                    raise ConfigError(f"device_asks.{dev} is {value!r}; give plugin = price "
                                      "in micro-credits per work unit, e.g. sd15 = 12000")
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"insecure is {self.insecure!r}; give true or false")
        if not isinstance(self.ca_file, str):
            raise ConfigError(f"ca_file is {self.ca_file!r}; give the path of the broker's CA "
                              "certificate (PEM) as a string, or \"\" for the system trust")
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
    # Written beside it and renamed over it: a reader (another agent of the fleet pinning
    # the broker's key at the same moment) sees the old file or the new one, never a
    # truncated one that would load as the defaults and be written back so.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            tomli_w.dump({k: v for k, v in asdict(cfg).items() if v not in (None,)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def pin_broker_key(key: str, home: Path | None = None) -> None:
    """Write the broker's key into agent.toml, changing nothing else of the file (an
    agent's settings may differ from it by flags, or per device)."""
    try:
        cfg = load_config(home)
    except ConfigError:
        return  # no file (an agent built in code): nothing to pin into
    if cfg.broker_public_key != key:
        cfg.broker_public_key = key
        save_config(cfg, home)


def load_identity(home: Path | None = None) -> KeyPair:
    return KeyPair.load_or_create(identity_path(home))
