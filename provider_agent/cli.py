"""`sparecycles agent …`: init, run, status, payout (install-service: provider_agent.service)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .host.manager import HostFactory


def register(sub) -> None:
    p = sub.add_parser("agent", help="run a provider agent on this machine")
    asub = p.add_subparsers(dest="agent_command", required=True)

    i = asub.add_parser("init", help="create this machine's identity key and agent config")
    i.add_argument("--broker", required=True, help="the broker's agent address, HOST:PORT; several "
                   "replicas' as HOST:PORT,HOST:PORT (the agent moves to the next when "
                   "one goes away)")
    i.add_argument("--api-key", help="provider API key (default $SPARECYCLES_API_KEY)")
    i.add_argument("--name", help="machine name shown to admins (default the host name)")
    i.add_argument("--plugins", help="comma-separated plugins to serve (default echo)")
    i.add_argument("--slots", type=int, help="jobs at once (default 1)")
    i.add_argument("--weights-dir", help="folder holding <plugin>/ weight folders")
    i.add_argument("--registry", help="the broker's REST address, to install published "
                                      "plugins and adapters from (e.g. http://HOST:8080)")
    i.add_argument("--ca-file", help="the broker's CA certificate, PEM (default "
                                     "$SPARECYCLES_CA_BUNDLE, else the system trust store)")
    i.add_argument("--insecure", action="store_true",
                   help="connect in plaintext even off loopback (logged as a warning)")
    i.add_argument("--home", type=Path, help="config folder (default $SPARECYCLES_AGENT_HOME "
                                             "or the platform config dir)")
    i.add_argument("--force", action="store_true", help="overwrite an existing config")
    i.set_defaults(func=cmd_init)

    r = asub.add_parser("run", help="connect and serve jobs until stopped (SIGTERM drains)")
    r.add_argument("--plugins", help="comma-separated plugins to serve (overrides the config)")
    r.add_argument("--slots", type=int)
    r.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    r.add_argument("--devices", help='several GPUs, one agent each: "cuda:0,cuda:1" or '
                                     '"all" (overrides `devices` in agent.toml)')
    r.add_argument("--no-sandbox", action="store_true",
                   help="run plugins WITHOUT the bubblewrap sandbox (unsafe; the broker and "
                        "its clients are told)")
    r.add_argument("--ask", action="append", default=[], metavar="PLUGIN=PRICE",
                   help="standing ask in micro-credits per work unit (repeatable; overrides "
                        "`asks` in agent.toml; without one a plugin stands at the reserve)")
    r.add_argument("--throttle", action="append", default=[], metavar="PLUGIN=MS",
                   help="development/tests: wait MS per work unit after each run, to "
                        "emulate a slower machine")
    t = r.add_argument_group("when to lend the GPU (override agent.toml)")
    t.add_argument("--idle-only", action="store_true", default=None,
                   help="take work only while no other process uses the GPU")
    t.add_argument("--idle-resume-s", type=float, metavar="S",
                   help="seconds of idleness before work resumes (default 60)")
    t.add_argument("--on-owner", choices=("finish", "give_back", "checkpoint"),
                   help="running jobs when the owner starts using the GPU")
    t.add_argument("--schedule", action="append", metavar="WINDOW",
                   help='a time window to work in, e.g. "22:00-07:00" or "weekdays '
                        '18:00-23:00" (repeatable; replaces the config\'s)')
    t.add_argument("--max-vram-gb", type=float, metavar="GB")
    t.add_argument("--max-gpu-hours", type=float, metavar="H", dest="max_gpu_hours_per_day",
                   help="GPU hours of work per day at most")
    t.add_argument("--max-temperature", type=float, metavar="C", dest="max_temperature_c")
    t.add_argument("--max-power", type=float, metavar="W", dest="max_power_w")
    t.add_argument("--min-price", type=int, metavar="MICRO", dest="min_price_micro_per_unit",
                   help="never ask less than this many micro-credits per work unit")
    r.add_argument("--insecure", action="store_true",
                   help="connect in plaintext even off loopback (logged as a warning)")
    r.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="serve the agent's Prometheus /metrics here (GPU, CPU, memory, job "
                        "times; overrides metrics_addr in agent.toml; default: none)")
    r.add_argument("--log-format", choices=["text", "json"],
                   help="text lines, or one JSON object a line naming the job and request "
                        "each is about; plugin hosts log alike (default text; "
                        "$SPARECYCLES_LOG_FORMAT)")
    r.add_argument("--home", type=Path)
    r.set_defaults(func=cmd_run)

    s = asub.add_parser("status", help="connection, each device's state, jobs today, credits "
                                       "and verification standing (a live view in a terminal)")
    s.add_argument("--json", action="store_true", help="print one JSON document and exit")
    s.add_argument("--once", action="store_true", help="print the view once, do not refresh")
    s.add_argument("--interval", type=float, default=2.0, metavar="S",
                   help="refresh period of the live view (default 2 s)")
    s.add_argument("--url", help="the broker's REST address (default $SPARECYCLES_URL or "
                                 "registry_url in agent.toml)")
    s.add_argument("--home", type=Path)
    s.set_defaults(func=cmd_status)

    po = asub.add_parser("payout", help="pay out available credits (Stripe Connect)")
    amount = po.add_mutually_exclusive_group(required=True)
    amount.add_argument("--credits", help="how many credits to pay out, e.g. 25 or 2.5")
    amount.add_argument("--all", action="store_true", help="every available credit")
    po.add_argument("--url")
    po.add_argument("--home", type=Path)
    po.set_defaults(func=cmd_payout)

    sv = asub.add_parser("install-service", help="run the agent under systemd as a non-root "
                                                 "user (logs in the journal; reinstalling "
                                                 "after an upgrade drains first)")
    kind = sv.add_mutually_exclusive_group()
    kind.add_argument("--user", dest="mode", action="store_const", const="user",
                      help="a systemd user unit (default for an ordinary user)")
    kind.add_argument("--system", dest="mode", action="store_const", const="system",
                      help="a system unit (as root), running as --run-as")
    sv.add_argument("--run-as", help="system units: the non-root account (default sparecycles)")
    sv.add_argument("--exec", dest="exec_path", help="the sparecycles command (default this "
                                                     "environment's)")
    sv.add_argument("--run-arg", action="append", default=[], metavar="ARG",
                    help="an argument for `agent run` (repeatable), e.g. --run-arg=--idle-only")
    sv.add_argument("--print", dest="print_only", action="store_true",
                    help="print the unit and change nothing")
    sv.add_argument("--no-start", action="store_true",
                    help="write the unit, do not enable or start it")
    sv.add_argument("--unit-dir", type=Path, help=argparse_suppress())
    sv.add_argument("--home", type=Path)
    sv.set_defaults(func=cmd_install_service)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


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
    if args.ca_file:
        cfg.ca_file = str(Path(args.ca_file).expanduser().resolve())
    cfg.insecure = bool(args.insecure)
    save_config(cfg, home)
    key = load_identity(home)
    print(f"agent config: {path}\nidentity key: {identity_path(home)} "
          f"(public {key.public_key_hex[:16]}…)")
    if not api_key:
        print("no API key yet: add api_key to the config or pass --api-key", file=sys.stderr)
    return 0


def cmd_run(args, *, host_factory: HostFactory | None = None) -> int:
    """``host_factory``: what builds each plugin's host (None: ``PluginHost``, the real
    one; bench/cheat_agent.py passes its cheating wrapper)."""
    from plugins import builtin_plugin_dir

    from .config import load_config
    from .host.manager import PluginHost
    from .errors import AgentError

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
        if args.devices:
            cfg.devices = [d.strip() for d in args.devices.split(",") if d.strip()]
        if args.insecure:
            cfg.insecure = True
        cfg.asks.update(parse_pairs(args.ask, int, "--ask"))
        cfg.throttle_ms_per_unit.update(parse_pairs(args.throttle, float, "--throttle"))
        for name in ("idle_only", "idle_resume_s", "on_owner", "schedule", "max_vram_gb",
                     "max_gpu_hours_per_day", "max_temperature_c", "max_power_w",
                     "min_price_micro_per_unit"):
            if getattr(args, name, None) is not None:
                setattr(cfg, name, getattr(args, name))
        cfg.rules()  # bad terms are refused before anything starts
        if args.metrics_addr is not None:
            cfg.metrics_addr = args.metrics_addr
        # Built-in plugins, else installed from the registry (signed, sha256-checked); one
        # that cannot be had is left out and the others are served.
        from .installer import make_installer, resolve_plugins

        installer = make_installer(cfg)
        plugin_dirs = resolve_plugins(cfg, installer, builtin=builtin_plugin_dir)
        if not plugin_dirs:
            raise AgentError("no plugin to serve (see the errors above)")
        cfg.check()
        from .fleet import build_fleet

        # One agent per device (a single one without `devices`); the first reuses the
        # installer made above, the others get their own.
        installers = iter([installer])
        fleet = build_fleet(cfg, home=args.home, plugin_dirs=plugin_dirs,
                            sandboxed=not args.no_sandbox,
                            host_factory=host_factory or PluginHost,
                            make_installer=lambda: next(installers, None) or make_installer(cfg))
        fleet.install_signal_handlers()
        return fleet.run()
    except (AgentError, LookupError) as exc:
        logging.getLogger("agent").error("%s", exc)
        return 2


def cmd_status(args) -> int:
    import json
    import time

    from .config import load_config
    from .errors import AgentError
    from .status import api_url, gather, render

    try:
        cfg = load_config(args.home)
        url = api_url(cfg, args.url)
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.interval <= 0:
        print(f"error: --interval is {args.interval}; give seconds above 0", file=sys.stderr)
        return 2
    if args.json:
        doc = gather(cfg, args.home, url)
        print(json.dumps(doc, indent=2))
        return 0 if doc["broker"]["reachable"] and not doc["broker"]["error"] else 1
    from rich.console import Console

    console = Console()
    if args.once or not console.is_terminal:
        console.print(render(gather(cfg, args.home, url)))
        return 0
    from rich.live import Live

    try:
        with Live(render(gather(cfg, args.home, url)), console=console, screen=False,
                  auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(gather(cfg, args.home, url)), refresh=True)
    except KeyboardInterrupt:
        return 0


def cmd_payout(args) -> int:
    import uuid

    from .config import load_config
    from .errors import AgentError
    from .status import api_url, credits, payout

    try:
        cfg = load_config(args.home)
        url = api_url(cfg, args.url)
        if args.credits is not None:
            from decimal import Decimal, InvalidOperation

            try:
                ok = Decimal(args.credits) > 0
            except InvalidOperation:
                ok = False
            if not ok:
                raise AgentError(f"--credits is {args.credits!r}; give a positive number of "
                                 "credits, e.g. 25 or 2.5")
        p = payout(url, cfg.api_key, credits_amount=args.credits, everything=args.all,
                   idempotency_key=f"agent-payout-{uuid.uuid4().hex}")
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"payout {p.get('id')}: {credits(p.get('amount_micro'))} credits to "
          f"{p.get('destination')} ({p.get('status')})")
    return 0


def cmd_install_service(args) -> int:
    from .config import config_dir
    from .errors import AgentError
    from .service import install, plan, render_unit

    try:
        spec = plan(mode=args.mode, run_as=args.run_as, home=args.home or config_dir(),
                    exec_path=args.exec_path, extra_args=tuple(args.run_arg))
        if args.print_only:
            print(render_unit(spec), end="")
            return 0
        path, done = install(spec, directory=args.unit_dir, start=not args.no_start)
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in done:
        print(line)
    scope = "--user " if spec.mode == "user" else ""
    print(f"logs: journalctl {scope}-u sparecycles-agent -f")
    if spec.mode == "user":
        print("to keep it running while you are logged out: loginctl enable-linger $USER")
    return 0
