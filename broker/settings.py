"""Every setting of the broker, in one place. Argument beats environment variable beats
default; tests build a Settings object and never patch globals.

===========================  ==================================  ===========================
setting                      variable                            default
===========================  ==================================  ===========================
data_dir                     SPARECYCLES_DATA_DIR                <user data dir>/sparecycles/broker
db_url                       SPARECYCLES_DB_URL                  sqlite:///<data_dir>/broker.db
blob_dir                     SPARECYCLES_BLOB_DIR                <data_dir>/blobs
http                         SPARECYCLES_HTTP                    127.0.0.1:8080
grpc                         SPARECYCLES_GRPC                    127.0.0.1:50051
key_path                     SPARECYCLES_BROKER_KEY              <data_dir>/broker.key
signing_key                  SPARECYCLES_BROKER_SIGNING_KEY      (none: the key file; 64 hex, the seed)
plugin_dirs                  SPARECYCLES_PLUGIN_DIRS (":"-sep.)  the built-in plugins folder
lease_timeout_s              SPARECYCLES_LEASE_TIMEOUT_S         30
max_attempts                 SPARECYCLES_MAX_ATTEMPTS            3
checkpoint_min_steps         SPARECYCLES_CHECKPOINT_MIN_STEPS    8 (shorter jobs never checkpoint)
checkpoint_every_steps       SPARECYCLES_CHECKPOINT_EVERY_STEPS  0 (about 4 per job)
stall_factor                 SPARECYCLES_STALL_FACTOR            1.5 (× max(wall clock, expected))
http_threads                 SPARECYCLES_HTTP_THREADS            48 (the pool the Flask app runs in)
agent_threads                SPARECYCLES_AGENT_THREADS           16 (the pool agents' messages run in)
max_agent_streams            SPARECYCLES_MAX_AGENT_STREAMS       20000 (more: RESOURCE_EXHAUSTED)
agent_outbox_max             SPARECYCLES_AGENT_OUTBOX_MAX        256 (messages; more: cut off)
max_waiting_clients          SPARECYCLES_MAX_WAITING_CLIENTS     10000 (more: 503 replica_full)
max_pool_requests            SPARECYCLES_MAX_POOL_REQUESTS       1024 (more: 503 replica_full)
public_url                   SPARECYCLES_PUBLIC_URL              http://<http>
stripe_secret_key            SPARECYCLES_STRIPE_SECRET_KEY       (none: dev funding mode)
stripe_webhook_secret        SPARECYCLES_STRIPE_WEBHOOK_SECRET   (none)
stripe_api_base              SPARECYCLES_STRIPE_API_BASE         https://api.stripe.com
credit_price_cents           SPARECYCLES_CREDIT_PRICE_CENTS      1 (one credit costs 1 cent)
currency                     SPARECYCLES_CURRENCY                usd
hold_ttl_s                   SPARECYCLES_HOLD_TTL_S              86400
maintenance_interval_s       SPARECYCLES_MAINTENANCE_INTERVAL_S  5
unserved_expiry_s            SPARECYCLES_UNSERVED_EXPIRY_S       300 (0: never refuse or expire)
market_claim_factor          SPARECYCLES_MARKET_CLAIM_FACTOR     0 (unmeasured claims ineligible)
market_canary_interval_s     SPARECYCLES_MARKET_CANARY_INTERVAL_S 600 (0: first canary only)
market_reputation_floor      SPARECYCLES_MARKET_REPUTATION_FLOOR 0.5 (admins may change it live)
market_cold_start_s          SPARECYCLES_MARKET_COLD_START_S     10 (load time nobody measured)
check_delay_max_s            SPARECYCLES_CHECK_DELAY_MAX_S       5 (checks wait 0..this, at random)
verification                 SPARECYCLES_VERIFICATION            on (off: no job is re-run)
link_loopback                SPARECYCLES_LINK_LOOPBACK           off (on: loopback agents' address and hardware link accounts)
admin_session_secret         SPARECYCLES_ADMIN_SESSION_SECRET    (none: the secret file below)
admin_session_key_path       SPARECYCLES_ADMIN_SESSION_KEY       <data_dir>/admin_session.key (random)
admin_session_ttl_s          SPARECYCLES_ADMIN_SESSION_TTL_S     1800
tls_cert                     SPARECYCLES_TLS_CERT                (none: plaintext, loopback only)
tls_key                      SPARECYCLES_TLS_KEY                 (none)
insecure                     SPARECYCLES_INSECURE                off (on: plaintext off loopback too)
at_rest_key                  SPARECYCLES_AT_REST_KEY             (kept in <data_dir>/at_rest.key)
rate_limits                  SPARECYCLES_RATE_LIMITS             (broker/ratelimit.py defaults; off)
rate_limit_storage           SPARECYCLES_RATE_LIMIT_STORAGE      memory:// (redis://…: shared)
metrics                      SPARECYCLES_METRICS                 on (off: /metrics keeps only gauges)
replica_name                 SPARECYCLES_REPLICA_NAME            <hostname>:<pid> (in sparecycles_broker_info)
metrics_db_interval_s        SPARECYCLES_METRICS_DB_INTERVAL_S   5 (shared facts re-read at most this often)
log_format                   SPARECYCLES_LOG_FORMAT              text (json: one JSON object a line)
blob_store                   SPARECYCLES_BLOB_STORE              local (or s3)
s3_bucket                    SPARECYCLES_S3_BUCKET               (none; needed for s3)
s3_endpoint                  SPARECYCLES_S3_ENDPOINT             (AWS; e.g. http://minio:9000)
s3_region                    SPARECYCLES_S3_REGION               (boto3's: AWS_REGION, …)
s3_path_style                SPARECYCLES_S3_PATH_STYLE           off (on for MinIO, Ceph, moto)
s3_prefix                    SPARECYCLES_S3_PREFIX               "" (object names: <prefix><sha256>)
s3_get_ttl_s                 SPARECYCLES_S3_GET_TTL_S            300 (clients' download URLs)
s3_put_ttl_s                 SPARECYCLES_S3_PUT_TTL_S            900 (agents' upload URLs)
output_retention_s           SPARECYCLES_OUTPUT_RETENTION_S      604800 (7 days; 0: keep for ever)
orphan_grace_s               SPARECYCLES_ORPHAN_GRACE_S          3600 (unnamed uploads kept this long)
retention_interval_s         SPARECYCLES_RETENTION_INTERVAL_S    300 (between retention sweeps)
s3_access_key_id             AWS_ACCESS_KEY_ID                   (boto3's chain: profile, role)
s3_secret_access_key         AWS_SECRET_ACCESS_KEY               (boto3's chain)
s3_session_token             AWS_SESSION_TOKEN                   (boto3's chain)
===========================  ==================================  ===========================

With ``tls_cert`` and ``tls_key`` the broker serves REST and gRPC over TLS with them
(``sparecycles broker dev-cert`` makes a dev pair in ``<data_dir>/tls``); without them it
listens only on loopback addresses unless ``insecure`` is on (logged as a warning).

``<user data dir>`` is the platform's (``platformdirs.user_data_dir``): ``$XDG_DATA_HOME``,
else ``~/.local/share``, on Linux. The default lies outside any source tree on purpose: the
data dir holds the broker key, the admin session key and the database (API keys), and a
checkout may be readable to code that must not see them (plugin hosts bind parts of it).
Connections cost sockets, not threads (docs/architecture.md, *Runtime*): ``max_agent_streams``
caps the agents one replica holds; ``agent_outbox_max`` the messages waiting to be written to
one agent (an agent that stops reading is cut off past it); ``max_waiting_clients`` the
requests waiting for a job at once (long polls, ``Prefer: wait``, event streams; past it a
``Prefer: wait`` is answered at once); ``max_pool_requests`` the requests running in or
queued for the ``http_threads`` pool. ``sparecycles broker serve`` raises its open-files
limit to the hard limit at start.

Replicas (several ``broker serve`` on one PostgreSQL, docs/architecture.md *Replicas*) must
sign with one key and share one console secret: give each the same
``SPARECYCLES_BROKER_SIGNING_KEY`` and ``SPARECYCLES_ADMIN_SESSION_SECRET`` (or the same files
through ``SPARECYCLES_BROKER_KEY`` and ``SPARECYCLES_ADMIN_SESSION_KEY``); a replica whose
signing key differs from a live one's refuses to start. They also need one blob store
(``blob_dir`` on a shared filesystem).

The registry's package files live in a blob store of their own, ``<blob_dir>/registry``, apart
from job outputs. A package file uploaded with PUT /v1/blobs may be at most 8 GiB
(broker.registry.service.MAX_BLOB_BYTES; larger is a 413).

Job outputs and checkpoints go to ``blob_store``: ``local`` (``<blob_dir>``, the bytes travel
through the agent's stream) or ``s3`` (an S3-compatible bucket through boto3: agents PUT
with presigned URLs pinned to each object's SHA-256, clients GET with presigned URLs; see
broker/blobs/s3.py). Outputs are deleted ``output_retention_s`` after their job ended,
checkpoints once their job is over, uploads no job names after ``orphan_grace_s``
(broker/blobs/retention.py; the maintenance thread sweeps every ``retention_interval_s``).
S3 credentials are the usual AWS variables (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``), else boto3's own chain (``AWS_PROFILE``,
an instance role); the broker never stores them. The registry's package files stay in the local folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import broker

BUILTIN_PLUGINS = Path(broker.__file__).resolve().parent.parent / "plugins"


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("0", "off", "false", "no")


def default_data_dir() -> Path:
    """``<user data dir>/sparecycles/broker`` (see the table above)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("sparecycles")) / "broker"


@dataclass
class Settings:
    data_dir: Path = field(default_factory=default_data_dir)
    db_url: str = ""
    blob_dir: Path | None = None
    http: str = "127.0.0.1:8080"
    grpc: str = "127.0.0.1:50051"
    key_path: Path | None = None
    signing_key: str = ""
    plugin_dirs: list[Path] = field(default_factory=lambda: [BUILTIN_PLUGINS])
    lease_timeout_s: float = 30.0
    max_attempts: int = 3
    checkpoint_min_steps: int = 8
    checkpoint_every_steps: int = 0
    stall_factor: float = 1.5
    http_threads: int = 48
    agent_threads: int = 16
    max_agent_streams: int = 20_000
    agent_outbox_max: int = 256
    max_waiting_clients: int = 10_000
    max_pool_requests: int = 1024
    envelope_ttl_s: float = 60.0
    public_url: str = ""
    stripe_secret_key: str = ""
    stripe_webhook_secret: str = ""
    stripe_api_base: str = ""
    credit_price_cents: int = 1
    currency: str = "usd"
    hold_ttl_s: int = 24 * 3600
    maintenance_interval_s: float = 5.0
    # A build no provider connected now or seen this long ago serves: refused at submit
    # (409 no_provider), and its queued jobs fail (refunded) once it has had none this long.
    unserved_expiry_s: float = 300.0
    market_claim_factor: float = 0.0
    market_canary_interval_s: float = 600.0
    market_reputation_floor: float = 0.5
    market_cold_start_s: float = 10.0
    check_delay_max_s: float = 5.0
    verification: bool = True
    # Operator links (broker.links): whether agents connecting over loopback link accounts
    # by their address and hardware (off: on one machine they say nothing of who runs them).
    link_loopback: bool = False
    admin_session_secret: str = ""
    admin_session_key_path: Path | None = None
    admin_session_ttl_s: int = 1800
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure: bool = False
    at_rest_key: str = ""
    rate_limits: str = ""
    rate_limit_storage: str = "memory://"
    # Observability (docs/architecture.md, *Observability*): off leaves the hot path
    # uncounted (HTTP requests, job events); /metrics then keeps the scrape-time gauges.
    metrics: bool = True
    replica_name: str = ""
    metrics_db_interval_s: float = 5.0
    log_format: str = "text"
    blob_store: str = "local"
    s3_bucket: str = ""
    s3_endpoint: str = ""
    s3_region: str = ""
    s3_path_style: bool = False
    s3_prefix: str = ""
    s3_get_ttl_s: float = 300.0
    s3_put_ttl_s: float = 900.0
    output_retention_s: float = 7 * 24 * 3600.0
    orphan_grace_s: float = 3600.0
    retention_interval_s: float = 300.0
    s3_access_key_id: str = field(default="", repr=False)
    s3_secret_access_key: str = field(default="", repr=False)
    s3_session_token: str = field(default="", repr=False)

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        if not self.db_url:
            self.db_url = f"sqlite:///{self.data_dir / 'broker.db'}"
        self.blob_dir = Path(self.blob_dir) if self.blob_dir else self.data_dir / "blobs"
        self.key_path = Path(self.key_path) if self.key_path else self.data_dir / "broker.key"
        self.admin_session_key_path = (Path(self.admin_session_key_path)
                                       if self.admin_session_key_path
                                       else self.data_dir / "admin_session.key")
        key = self.signing_key.strip().lower()
        if key and (len(key) != 64 or any(c not in "0123456789abcdef" for c in key)):
            raise ValueError("signing_key (SPARECYCLES_BROKER_SIGNING_KEY) must be the 64 hex "
                             "digits of an Ed25519 seed, e.g. from `python -c \"import "
                             "secrets; print(secrets.token_hex(32))\"`; got "
                             f"{len(self.signing_key)} characters")
        self.signing_key = key
        self.plugin_dirs = [Path(p) for p in self.plugin_dirs]
        self.tls_cert = Path(self.tls_cert) if self.tls_cert else None
        self.tls_key = Path(self.tls_key) if self.tls_key else None
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both (the certificate "
                             "and its private key, PEM) or neither")
        from broker.ratelimit import parse_limits

        parse_limits(self.rate_limits)  # a bad spec is an error at start, naming the pair
        if not self.public_url:
            self.public_url = f"{'https' if self.tls else 'http'}://{self.http}"
        if self.credit_price_cents <= 0 or 1_000_000 % self.credit_price_cents:
            raise ValueError(f"credit_price_cents must divide 1,000,000, got {self.credit_price_cents}")
        if self.lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {self.lease_timeout_s}")
        if not self.unserved_expiry_s >= 0:
            raise ValueError(f"unserved_expiry_s must be >= 0 (0: off), got "
                             f"{self.unserved_expiry_s}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if not self.metrics_db_interval_s >= 0:
            raise ValueError(f"metrics_db_interval_s must be >= 0, got "
                             f"{self.metrics_db_interval_s}")
        self.blob_store = (self.blob_store or "local").strip().lower()
        if self.blob_store not in ("local", "s3"):
            raise ValueError(f"blob_store is {self.blob_store!r}; use \"local\" (a folder, "
                             "the default) or \"s3\" (an S3-compatible bucket)")
        if self.blob_store == "s3" and not self.s3_bucket:
            raise ValueError("blob_store is s3 but no bucket is set: set SPARECYCLES_S3_BUCKET "
                             "(and SPARECYCLES_S3_ENDPOINT for a self-hosted store)")
        if self.s3_get_ttl_s <= 0 or self.s3_put_ttl_s <= 0:
            raise ValueError(f"s3_get_ttl_s and s3_put_ttl_s must be > 0, got "
                             f"{self.s3_get_ttl_s} and {self.s3_put_ttl_s}")
        for name in ("output_retention_s", "orphan_grace_s", "retention_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        for name in ("http_threads", "agent_threads", "max_agent_streams", "agent_outbox_max",
                     "max_waiting_clients", "max_pool_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def signer(self):
        """The broker's signing key: ``signing_key`` when set, else the key file (created
        on first use)."""
        from sdk.protocol.signing import KeyPair

        if self.signing_key:
            return KeyPair.from_seed_hex(self.signing_key)
        return KeyPair.load_or_create(self.key_path)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def heartbeat_interval_s(self) -> float:
        return max(0.2, self.lease_timeout_s / 3)

    @classmethod
    def from_env(cls, env: dict | None = None, **overrides) -> "Settings":
        env = os.environ if env is None else env
        conv = {
            "data_dir": ("SPARECYCLES_DATA_DIR", Path),
            "db_url": ("SPARECYCLES_DB_URL", str),
            "blob_dir": ("SPARECYCLES_BLOB_DIR", Path),
            "http": ("SPARECYCLES_HTTP", str),
            "grpc": ("SPARECYCLES_GRPC", str),
            "key_path": ("SPARECYCLES_BROKER_KEY", Path),
            "signing_key": ("SPARECYCLES_BROKER_SIGNING_KEY", str),
            "plugin_dirs": ("SPARECYCLES_PLUGIN_DIRS",
                            lambda v: [Path(p) for p in v.split(":") if p]),
            "lease_timeout_s": ("SPARECYCLES_LEASE_TIMEOUT_S", float),
            "max_attempts": ("SPARECYCLES_MAX_ATTEMPTS", int),
            "checkpoint_min_steps": ("SPARECYCLES_CHECKPOINT_MIN_STEPS", int),
            "checkpoint_every_steps": ("SPARECYCLES_CHECKPOINT_EVERY_STEPS", int),
            "stall_factor": ("SPARECYCLES_STALL_FACTOR", float),
            "http_threads": ("SPARECYCLES_HTTP_THREADS", int),
            "agent_threads": ("SPARECYCLES_AGENT_THREADS", int),
            "max_agent_streams": ("SPARECYCLES_MAX_AGENT_STREAMS", int),
            "agent_outbox_max": ("SPARECYCLES_AGENT_OUTBOX_MAX", int),
            "max_waiting_clients": ("SPARECYCLES_MAX_WAITING_CLIENTS", int),
            "max_pool_requests": ("SPARECYCLES_MAX_POOL_REQUESTS", int),
            "public_url": ("SPARECYCLES_PUBLIC_URL", str),
            "stripe_secret_key": ("SPARECYCLES_STRIPE_SECRET_KEY", str),
            "stripe_webhook_secret": ("SPARECYCLES_STRIPE_WEBHOOK_SECRET", str),
            "stripe_api_base": ("SPARECYCLES_STRIPE_API_BASE", str),
            "credit_price_cents": ("SPARECYCLES_CREDIT_PRICE_CENTS", int),
            "currency": ("SPARECYCLES_CURRENCY", str),
            "hold_ttl_s": ("SPARECYCLES_HOLD_TTL_S", int),
            "maintenance_interval_s": ("SPARECYCLES_MAINTENANCE_INTERVAL_S", float),
            "unserved_expiry_s": ("SPARECYCLES_UNSERVED_EXPIRY_S", float),
            "market_claim_factor": ("SPARECYCLES_MARKET_CLAIM_FACTOR", float),
            "market_canary_interval_s": ("SPARECYCLES_MARKET_CANARY_INTERVAL_S", float),
            "market_reputation_floor": ("SPARECYCLES_MARKET_REPUTATION_FLOOR", float),
            "market_cold_start_s": ("SPARECYCLES_MARKET_COLD_START_S", float),
            "check_delay_max_s": ("SPARECYCLES_CHECK_DELAY_MAX_S", float),
            "verification": ("SPARECYCLES_VERIFICATION",
                             lambda v: v.strip().lower() not in ("0", "off", "false", "no")),
            "link_loopback": ("SPARECYCLES_LINK_LOOPBACK",
                              lambda v: v.strip().lower() in ("1", "on", "true", "yes")),
            "admin_session_secret": ("SPARECYCLES_ADMIN_SESSION_SECRET", str),
            "admin_session_key_path": ("SPARECYCLES_ADMIN_SESSION_KEY", Path),
            "admin_session_ttl_s": ("SPARECYCLES_ADMIN_SESSION_TTL_S", int),
            "tls_cert": ("SPARECYCLES_TLS_CERT", Path),
            "tls_key": ("SPARECYCLES_TLS_KEY", Path),
            "at_rest_key": ("SPARECYCLES_AT_REST_KEY", str),
            "rate_limits": ("SPARECYCLES_RATE_LIMITS", str),
            "rate_limit_storage": ("SPARECYCLES_RATE_LIMIT_STORAGE", str),
            "insecure": ("SPARECYCLES_INSECURE",
                         lambda v: v.strip().lower() in ("1", "on", "true", "yes")),
            "metrics": ("SPARECYCLES_METRICS",
                        lambda v: v.strip().lower() not in ("0", "off", "false", "no")),
            "replica_name": ("SPARECYCLES_REPLICA_NAME", str),
            "metrics_db_interval_s": ("SPARECYCLES_METRICS_DB_INTERVAL_S", float),
            "log_format": ("SPARECYCLES_LOG_FORMAT", str),
            "blob_store": ("SPARECYCLES_BLOB_STORE", str),
            "s3_bucket": ("SPARECYCLES_S3_BUCKET", str),
            "s3_endpoint": ("SPARECYCLES_S3_ENDPOINT", str),
            "s3_region": ("SPARECYCLES_S3_REGION", str),
            "s3_path_style": ("SPARECYCLES_S3_PATH_STYLE", _flag),
            "s3_prefix": ("SPARECYCLES_S3_PREFIX", str),
            "s3_get_ttl_s": ("SPARECYCLES_S3_GET_TTL_S", float),
            "s3_put_ttl_s": ("SPARECYCLES_S3_PUT_TTL_S", float),
            "output_retention_s": ("SPARECYCLES_OUTPUT_RETENTION_S", float),
            "orphan_grace_s": ("SPARECYCLES_ORPHAN_GRACE_S", float),
            "retention_interval_s": ("SPARECYCLES_RETENTION_INTERVAL_S", float),
            "s3_access_key_id": ("AWS_ACCESS_KEY_ID", str),
            "s3_secret_access_key": ("AWS_SECRET_ACCESS_KEY", str),
            "s3_session_token": ("AWS_SESSION_TOKEN", str),
        }
        values = {}
        for name, (var, fn) in conv.items():
            if var in env and env[var] != "":
                values[name] = fn(env[var])
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})
