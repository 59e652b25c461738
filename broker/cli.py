"""`sparecycles broker …`: serve, create-key."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _settings(args):
    from broker.settings import Settings

    settings = Settings.from_env(data_dir=args.data_dir, db_url=args.db, blob_dir=args.blob_dir,
                                 http=getattr(args, "http", None),
                                 grpc=getattr(args, "grpc", None),
                                 lease_timeout_s=getattr(args, "lease_timeout", None),
                                 log_format=getattr(args, "log_format", None))
    legacy = Path(".sparecycles")
    if args.data_dir is None and (legacy / "broker.key").exists() \
            and legacy.resolve() != settings.data_dir.resolve():
        logging.getLogger("broker").warning(
            "found a broker data dir at %s (the old default); this broker uses %s. To keep "
            "the old data pass --data-dir %s, or move it there", legacy.resolve(),
            settings.data_dir, legacy)
    return settings


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, help="folder for the embedded database, blobs and "
                                                 "the broker key (default: the user data dir, "
                                                 "~/.local/share/sparecycles/broker on Linux; "
                                                 "$SPARECYCLES_DATA_DIR)")
    p.add_argument("--db", help="database URL (default: SQLite in the data dir; e.g. "
                                "postgresql+psycopg://user@host/db)")
    p.add_argument("--blob-dir", type=Path, help="blob folder (default <data-dir>/blobs)")


def register(sub) -> None:
    p = sub.add_parser("broker", help="run and administer the broker")
    bsub = p.add_subparsers(dest="broker_command", required=True)

    s = bsub.add_parser("serve", help="serve the REST API and the agent gateway")
    _common(s)
    s.add_argument("--http", help="HOST:PORT for the REST API (default 127.0.0.1:8080)")
    s.add_argument("--grpc", help="HOST:PORT for agents (default 127.0.0.1:50051)")
    s.add_argument("--lease-timeout", type=float, help="seconds without heartbeat before a "
                                                       "job is taken back (default 30)")
    s.add_argument("--ready-file", type=Path, help="write the bound addresses here as JSON "
                                                   "once serving")
    s.add_argument("--log-format", choices=["text", "json"],
                   help="text lines, or one JSON object a line naming the request and job "
                        "each is about (default text; $SPARECYCLES_LOG_FORMAT)")
    s.set_defaults(func=cmd_serve)

    k = bsub.add_parser("create-key", help="create an account and print its API key once")
    _common(k)
    k.add_argument("--role", required=True, choices=["client", "provider", "publisher", "admin"])
    k.add_argument("--name", default="", help="account name shown to admins")
    k.add_argument("--credits", help="grant this many credits to the new account (dev funding "
                                     "mode only; same as `broker grant` afterwards)")
    k.set_defaults(func=cmd_create_key)

    g = bsub.add_parser("grant", help="credit an account (dev funding mode: no Stripe keys)")
    _common(g)
    g.add_argument("--account", required=True, help="the account id printed by create-key")
    g.add_argument("--credits", required=True, help="credits to grant, e.g. 100 or 2.5")
    g.set_defaults(func=cmd_grant)


def cmd_serve(args) -> int:
    from broker.server import serve
    from sdk import logs

    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format)
    serve(settings, ready_file=args.ready_file)
    return 0


def cmd_create_key(args) -> int:
    from broker.services import build_services

    services = build_services(_settings(args))
    try:
        key, who = services.auth.create_account_with_key(args.role, args.name)
        if args.credits:
            from broker.payments.service import credits_to_micro

            services.payments.grant(who.account_id, credits_to_micro(args.credits), by="cli")
    finally:
        services.engine.dispose()
    print(key)
    print(f"# {args.role} account {who.account_id}; this key is shown only once", file=sys.stderr)
    return 0


def cmd_grant(args) -> int:
    from broker.errors import BrokerError
    from broker.ledger.model import format_credits
    from broker.payments.service import credits_to_micro
    from broker.services import build_services

    services = build_services(_settings(args))
    try:
        amount = credits_to_micro(args.credits)
        txn = services.payments.grant(args.account, amount, by="cli")
        balance = services.ledger.balances(args.account)
    except BrokerError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        services.engine.dispose()
    available = next((v for k, v in balance.items() if k.value == "client_available"), 0)
    print(f"granted {format_credits(amount)} to {args.account} (transaction {txn.id}); "
          f"available: {format_credits(available)}")
    return 0
