"""`sparecycles agent …`: init, run."""
from __future__ import annotations

import logging
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("agent", help="run a provider agent on this machine")
    asub = p.add_subparsers(dest="agent_command", required=True)

    i = asub.add_parser("init", help="create this machine's identity key and agent config")
    i.add_argument("--broker", required=True, help="the broker's agent address, HOST:PORT")
    i.add_argument("--api-key", help="provider API key (default $SPARECYCLES_API_KEY)")
    i.add_argument("--name", help="machine name shown to admins (default the host name)")
    i.add_argument("--plugins", help="comma-separated plugins to serve (default echo)")
    i.add_argument("--slots", type=int, help="jobs at once (default 1)")
    i.add_argument("--weights-dir", help="folder holding <plugin>/ weight folders")
    i.add_argument("--registry", help="the broker's REST address, to install published "
                                      "plugins and adapters from (e.g. http://HOST:8080)")
    i.add_argument("--home", type=Path, help="config folder (default $SPARECYCLES_AGENT_HOME "
                                             "or the platform config dir)")
    i.add_argument("--force", action="store_true", help="overwrite an existing config")
    i.set_defaults(func=cmd_init)

    r = asub.add_parser("run", help="connect and serve jobs until stopped (SIGTERM drains)")
    r.add_argument("--plugins", help="comma-separated plugins to serve (overrides the config)")
    r.add_argument("--slots", type=int)
    r.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    r.add_argument("--no-sandbox", action="store_true",
                   help="run plugins WITHOUT the bubblewrap sandbox (unsafe; the broker and "
                        "its clients are told)")
    r.add_argument("--ask", action="append", default=[], metavar="PLUGIN=PRICE",
                   help="standing ask in micro-credits per work unit (repeatable; overrides "
                        "`asks` in agent.toml; without one a plugin stands at the reserve)")
    r.add_argument("--throttle", action="append", default=[], metavar="PLUGIN=MS",
                   help="development/tests: wait MS per work unit after each run, to "
                        "emulate a slower machine")
    r.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="serve the agent's Prometheus /metrics here (GPU, CPU, memory, job "
                        "times; overrides metrics_addr in agent.toml; default: none)")
    r.add_argument("--log-format", choices=["text", "json"],
                   help="text lines, or one JSON object a line naming the job and request "
                        "each is about; plugin hosts log alike (default text; "
                        "$SPARECYCLES_LOG_FORMAT)")
    r.add_argument("--home", type=Path)
    r.set_defaults(func=cmd_run)


def parse_pairs(items: list[str], kind, what: str) -> dict:
    """``["sd15=15000", "echo=10,llama=3"]`` -> ``{"sd15": 15000, ...}``."""
    from .errors import ConfigError

    out = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            name, sep, value = part.partition("=")
            try:
                if not sep or not name:
                    raise ValueError
                out[name.strip()] = kind(value)
            except ValueError:
                raise ConfigError(f"{what} {part!r} must look like PLUGIN=NUMBER, e.g. "
                                  "sd15=15000") from None
    return out


def cmd_init(args) -> int:
    import os

    from .config import (AgentConfig, config_path, identity_path, load_identity,
                         save_config)

    home = args.home
    path = config_path(home)
    if path.exists() and not args.force:
        print(f"{path} already exists; pass --force to overwrite it", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("SPARECYCLES_API_KEY", "")
    cfg = AgentConfig(broker=args.broker, api_key=api_key)
    if args.name:
        cfg.name = args.name
    if args.plugins:
        cfg.plugins = [p.strip() for p in args.plugins.split(",") if p.strip()]
    if args.slots:
        cfg.slots = args.slots
    if args.weights_dir:
        cfg.weights_dir = str(Path(args.weights_dir).resolve())
    if args.registry:
        cfg.registry_url = args.registry
    save_config(cfg, home)
    key = load_identity(home)
    print(f"agent config: {path}\nidentity key: {identity_path(home)} "
          f"(public {key.public_key_hex[:16]}…)")
    if not api_key:
        print("no API key yet: add api_key to the config or pass --api-key", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    from plugins import builtin_plugin_dir

    from .agent import Agent
    from .cheats import from_env as cheat_from_env
    from .config import load_config, load_identity
    from .errors import AgentError
    from .launch import host_launcher

    import os

    from sdk import logs

    log_format = args.log_format or os.environ.get("SPARECYCLES_LOG_FORMAT") or "text"
    if log_format not in logs.FORMATS:
        print(f"SPARECYCLES_LOG_FORMAT is {log_format!r}; use text or json", file=sys.stderr)
        return 2
    logs.configure(log_format)
    try:
        cfg = load_config(args.home)
        if args.plugins:
            cfg.plugins = [p.strip() for p in args.plugins.split(",") if p.strip()]
        if args.slots:
            cfg.slots = args.slots
        if args.device:
            cfg.device = args.device
        cfg.asks.update(parse_pairs(args.ask, int, "--ask"))
        cfg.throttle_ms_per_unit.update(parse_pairs(args.throttle, float, "--throttle"))
        if args.metrics_addr is not None:
            cfg.metrics_addr = args.metrics_addr
        # Built-in plugins, else installed from the registry (signed, sha256-checked); one
        # that cannot be had is left out and the others are served.
        from .installer import make_installer, resolve_plugins

        installer = make_installer(cfg)
        plugin_dirs = resolve_plugins(cfg, installer, builtin=builtin_plugin_dir)
        if not plugin_dirs:
            raise AgentError("no plugin to serve (see the errors above)")
        # SPARECYCLES_CHEAT: the verification harness's deliberately dishonest agent
        # (provider_agent.cheats); unset, this is None and the agent is honest.
        cheat = cheat_from_env()
        launcher = host_launcher(
            sandboxed=not args.no_sandbox, home=args.home, cfg=cfg,
            extra_ro_paths=cheat.extra_ro_paths() if cheat is not None else [],
            registry_root=installer.root if installer is not None else None)
        agent = Agent(cfg, load_identity(args.home), plugin_dirs=plugin_dirs,
                      sandboxed=not args.no_sandbox, launcher=launcher, home=args.home,
                      cheat=cheat, installer=installer)
        agent.install_signal_handlers()
        return agent.run()
    except (AgentError, LookupError) as exc:
        logging.getLogger("agent").error("%s", exc)
        return 2
