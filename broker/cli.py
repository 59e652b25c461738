"""`sparecycles broker …`: serve, migrate, create-key, keys (list, create, revoke, rotate),
grant, link, dev-cert."""
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
                                 tls_cert=getattr(args, "tls_cert", None),
                                 tls_key=getattr(args, "tls_key", None),
                                 insecure=True if getattr(args, "insecure", False) else None,
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
    s.add_argument("--tls-cert", type=Path, help="PEM certificate (chain) to serve REST and "
                                                 "gRPC with ($SPARECYCLES_TLS_CERT; a dev one: "
                                                 "`broker dev-cert`)")
    s.add_argument("--tls-key", type=Path, help="its PEM private key ($SPARECYCLES_TLS_KEY)")
    s.add_argument("--insecure", action="store_true",
                   help="serve plaintext on a non-loopback address (logged as a warning; API "
                        "keys and prompts cross the network in clear)")
    s.add_argument("--log-format", choices=["text", "json"],
                   help="text lines, or one JSON object a line naming the request and job "
                        "each is about (default text; $SPARECYCLES_LOG_FORMAT)")
    s.set_defaults(func=cmd_serve)

    m = bsub.add_parser("migrate", help="upgrade the database schema (run once per release, "
                                         "before `broker serve` on PostgreSQL)")
    _common(m)
    m.set_defaults(func=cmd_migrate)
    d = bsub.add_parser("dev-cert", help="make a local CA and a server certificate for a first "
                                         "TLS run (kept in <data-dir>/tls)")
    _common(d)
    d.add_argument("--host", action="append", default=[],
                   help="a name or address the certificate is for (repeatable; default "
                        "localhost, 127.0.0.1 and ::1, plus this machine's host name)")
    d.add_argument("--out", type=Path, help="folder to write ca.pem, server.pem and their keys "
                                            "(default <data-dir>/tls)")
    d.add_argument("--days", type=int, default=397, help="server certificate validity (days)")
    d.set_defaults(func=cmd_dev_cert)

    k = bsub.add_parser("create-key", help="create an account and print its API key once")
    _common(k)
    k.add_argument("--role", required=True, choices=["client", "provider", "publisher", "admin"])
    k.add_argument("--name", default="", help="account name shown to admins")
    k.add_argument("--credits", help="grant this many credits to the new account (dev funding "
                                     "mode only; same as `broker grant` afterwards)")
    _key_options(k)
    k.set_defaults(func=cmd_create_key)

    keys = bsub.add_parser("keys", help="list, create, revoke and rotate API keys")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    kl = ksub.add_parser("list", help="every key (or one account's), with scopes and state")
    _common(kl)
    kl.add_argument("--account", help="only this account's keys")
    kl.add_argument("--json", action="store_true", help="print JSON lines")
    kl.set_defaults(func=cmd_keys_list)
    kc = ksub.add_parser("create", help="a new key for an existing account")
    _common(kc)
    kc.add_argument("--account", required=True, help="the account id")
    kc.add_argument("--name", default="", help="a label shown in lists")
    _key_options(kc)
    kc.set_defaults(func=cmd_keys_create)
    kr = ksub.add_parser("revoke", help="revoke a key now (every replica refuses it within "
                                        "seconds, its tokens and agent streams too)")
    _common(kr)
    kr.add_argument("key_id", help="the key's id (the third part of sc_<role>_<id>_…)")
    kr.set_defaults(func=cmd_keys_revoke)
    ko = ksub.add_parser("rotate", help="a new key like this one; the old one stops working "
                                        "after --grace")
    _common(ko)
    ko.add_argument("key_id")
    ko.add_argument("--grace", default="0", help="how long the old key keeps working, e.g. "
                                                 "0, 3600, 90m, 1d (default 0: now)")
    ko.set_defaults(func=cmd_keys_rotate)

    sr = bsub.add_parser("seal-at-rest", help="encrypt job inputs, envelopes, events and job "
                                              "blobs stored before the broker sealed them")
    _common(sr)
    sr.set_defaults(func=cmd_seal_at_rest)

    g = bsub.add_parser("grant", help="credit an account (dev funding mode: no Stripe keys)")
    _common(g)
    g.add_argument("--account", required=True, help="the account id printed by create-key")
    g.add_argument("--credits", required=True, help="credits to grant, e.g. 100 or 2.5")
    g.set_defaults(func=cmd_grant)

    ln = bsub.add_parser("link", help="record that accounts belong to one person (they never "
                                      "check each other, and their word never outvotes one "
                                      "another's); shows an account's links without --with")
    _common(ln)
    ln.add_argument("--account", required=True, help="an account id")
    ln.add_argument("--with", dest="others", action="append", default=[],
                    help="another account of the same person (repeat for more)")
    ln.add_argument("--reason", default="", help="what you learnt it from (audit log)")
    ln.set_defaults(func=cmd_link)


def _key_options(p) -> None:
    p.add_argument("--scopes", help="comma-separated scopes, fewer than the role's (default "
                                    "all of the role's); e.g. jobs:read,account:read")
    p.add_argument("--expires", help="the key stops working after this long (e.g. 3600, 90m, "
                                     "12h, 30d) or at this UTC time (2027-01-31T00:00:00)")


def parse_duration(text: str, what: str) -> float:
    """``3600``, ``90s``, ``90m``, ``12h``, ``30d`` -> seconds; else ValueError naming them."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = -1
    if not value >= 0 or value != value:
        raise ValueError(f"{what} {text!r} is not a duration: give seconds or a number with "
                         "s, m, h or d (e.g. 90m, 30d)")
    return value


def expiry(text: str | None) -> float | None:
    import datetime as dt
    import time

    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        seconds = parse_duration(text, "--expires")
        if seconds <= 0:
            raise ValueError("--expires must be after now") from None
        return time.time() + seconds
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _fmt_time(t: float | None) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else "-"


def _with_services(args, fn) -> int:
    from broker.errors import BrokerError

    services = _admin_services(args)
    try:
        return fn(services)
    except BrokerError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        services.engine.dispose()


def cmd_keys_list(args) -> int:
    import json
    import time

    def run(services):
        now = time.time()
        from broker.api.keys import key_to_json

        rows = [key_to_json(k, now) for k in services.auth.list_keys(args.account)]
        if args.json:
            for r in rows:
                print(json.dumps(r))
            return 0
        print(f"{'KEY ID':<17} {'ROLE':<9} {'STATE':<8} {'EXPIRES':<20} {'ACCOUNT':<36} "
              "SCOPES")
        for r in rows:
            print(f"{r['id']:<17} {r['role']:<9} {r['state']:<8} "
                  f"{_fmt_time(r['expires_at']):<20} {r['account_id']:<36} "
                  f"{' '.join(r['scopes'])}")
        print(f"# {len(rows)} key(s)", file=sys.stderr)
        return 0
    return _with_services(args, run)


def cmd_keys_create(args) -> int:
    def run(services):
        account = services.auth.repo.get_account(args.account)
        if account is None:
            print(f"error: no account {args.account!r}; `sparecycles broker keys list` shows "
                  "them", file=sys.stderr)
            return 1
        key, who = services.auth.add_key(args.account, account[1], scopes=args.scopes,
                                         expires_at=expiry(args.expires), name=args.name)
        print(key)
        print(f"# key {who.key_id} of {account[1]} account {args.account}; scopes "
              f"{' '.join(sorted(who.scopes))}; shown only once", file=sys.stderr)
        return 0
    return _with_services(args, run)


def cmd_keys_revoke(args) -> int:
    def run(services):
        done = services.auth.revoke(args.key_id)
        print(f"key {args.key_id} {'revoked' if done else 'was already revoked'}; every "
              "replica refuses it (and its tokens and agent streams) within a few seconds")
        return 0
    return _with_services(args, run)


def cmd_keys_rotate(args) -> int:
    def run(services):
        grace = parse_duration(args.grace, "--grace")
        key, old = services.auth.rotate(args.key_id, grace_s=grace)
        print(key)
        print(f"# replaces key {old.id}, which stops working "
              f"{'now' if not grace else 'at ' + _fmt_time(services.auth.get_key(old.id).revoked_at)}"
              "; the new key is shown only once", file=sys.stderr)
        return 0
    return _with_services(args, run)


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


def cmd_seal_at_rest(args) -> int:
    settings = _settings(args)
    key_file = settings.data_dir / "at_rest.key"
    if not settings.at_rest_key and not key_file.exists():
        # A key made for this command alone would seal every row with a key nobody keeps
        # (a one-off container's data dir is gone when it exits) and record it.
        print("error: seal-at-rest needs the at-rest key the brokers serve with: set "
              "SPARECYCLES_AT_REST_KEY, or run it with the --data-dir of a broker that has "
              f"its at_rest.key (there is none at {key_file})", file=sys.stderr)
        return 2

    def run(services):
        from broker.storage.sealed import recorded_key_check, seal_existing

        counts = seal_existing(services.engine, services.jobs.blobs)
        check = recorded_key_check(services.engine)
        print(f"sealed {counts['jobs']} job row(s), {counts['events']} event(s) and "
              f"{counts['blobs']} blob file(s) that were stored in plaintext; the database "
              f"records the at-rest key's check value {check[:12]}… (replicas "
              "with another key are refused)")
        return 0
    return _with_services(args, run)


def cmd_dev_cert(args) -> int:
    import socket

    from broker.tls import DEFAULT_HOSTS, TLSError, issue_server_cert

    out = args.out or _settings(args).data_dir / "tls"
    hosts = args.host or [*DEFAULT_HOSTS, socket.gethostname()]
    if not 1 <= args.days <= 3650:
        print(f"error: --days is {args.days}; give 1 to 3650", file=sys.stderr)
        return 2
    try:
        made_ca = not (out / "ca.key").exists()
        cert = issue_server_cert(out, dict.fromkeys(hosts), days=args.days)
    except (TLSError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{'made a new' if made_ca else 'kept the'} CA: {out / 'ca.pem'} (its key "
          f"{out / 'ca.key'} stays here)")
    print(f"server certificate for {', '.join(cert.names)}: {cert.cert_file} (key "
          f"{cert.key_file}), valid until {cert.not_after:%Y-%m-%d}")
    print("serve with:\n"
          f"  sparecycles broker serve --tls-cert {cert.cert_file} --tls-key {cert.key_file}\n"
          "and have clients and agents trust the CA:\n"
          f"  export SPARECYCLES_CA_BUNDLE={out / 'ca.pem'}")
    return 0


def cmd_migrate(args) -> int:
    """Alembic upgrade to head; on PostgreSQL under an advisory lock, so replicas or deploy
    jobs that run it at once take turns (the later ones find nothing to do)."""
    from broker.services import shown_url
    from broker.storage.base import make_engine
    from broker.storage.migrate import current, heads, upgrade

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = _settings(args)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.db_url)
    try:
        before = current(engine)
        upgrade(engine)
        after = current(engine)
    except Exception as exc:  # noqa: BLE001 - say which database and why
        print(f"error: could not migrate {shown_url(settings.db_url)}: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    if before == after:
        print(f"{shown_url(settings.db_url)} is up to date (revision "
              f"{', '.join(sorted(after))})")
    else:
        print(f"migrated {shown_url(settings.db_url)} from "
              f"{', '.join(sorted(before)) or 'an empty database'} to "
              f"{', '.join(sorted(after))}")
    assert after == heads()
    return 0


def _admin_services(args):
    """The services for a one-off command: an un-migrated PostgreSQL database is refused
    with what to run (SQLite is upgraded, as `serve` does). An at-rest key file it makes
    for itself is not recorded in the database (it may not outlive the command: a
    throwaway container), so the first `serve` records its own."""
    from broker.services import build_services
    from broker.storage.migrate import NotMigrated
    from broker.storage.sealed import AtRestError

    try:
        return build_services(_settings(args), migrate="auto", record_new_key=False)
    except (NotMigrated, AtRestError) as exc:
        raise SystemExit(f"error: {exc}") from None


def cmd_create_key(args) -> int:
    from broker.errors import BrokerError

    services = _admin_services(args)
    try:
        try:
            key, who = services.auth.create_account_with_key(
                args.role, args.name, scopes=args.scopes, expires_at=expiry(args.expires))
        except (ValueError, BrokerError) as exc:
            print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
            return 2
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

    services = _admin_services(args)
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


def cmd_link(args) -> int:
    services = _admin_services(args)
    try:
        missing = [a for a in [args.account, *args.others]
                   if services.auth.repo.get_account(a) is None]
        if missing:
            print(f"error: no account {missing[0]!r}; account ids are what create-key prints "
                  "(and the admin console lists)", file=sys.stderr)
            return 1
        if args.others:
            if not args.reason.strip():
                print("error: --reason is required with --with (it goes to the audit log)",
                      file=sys.stderr)
                return 1
            services.links.declare([args.account, *args.others], args.reason.strip(), by="cli")
        linked = sorted(services.links.linked_to(args.account))
        for other in linked:
            print(f"{args.account} ~ {other}: {'; '.join(services.links.why(args.account, other))}")
        if not linked:
            print(f"{args.account} is linked to no other account")
    finally:
        services.engine.dispose()
    return 0

