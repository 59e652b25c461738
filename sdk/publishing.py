"""`sparecycles publish` and `sparecycles publisher init`: sign and publish plugins and
LoRA adapters to a broker's registry (registered through the ``sparecycles.commands``
entry point ``publish``).

    sparecycles publisher init [--key FILE] [--broker URL --api-key KEY]
    sparecycles publish PATH --broker URL [--key FILE] [--api-key KEY] [--royalty MICRO]

The key file holds the Ed25519 seed (0600), default ``$SPARECYCLES_PUBLISHER_KEY`` or
``~/.config/sparecycles/publisher.key``. Publishing registers the key with the broker
first when it is not yet (idempotent), uploads the files, then the signed document.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def default_key_path() -> Path:
    env = os.environ.get("SPARECYCLES_PUBLISHER_KEY")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "sparecycles" / "publisher.key"


def register(sub) -> None:
    p = sub.add_parser("publish", help="sign and publish a plugin or adapter folder")
    p.add_argument("path", type=Path, help="folder with plugin.toml or adapter.toml")
    p.add_argument("--broker", help="broker URL (default $SPARECYCLES_URL)")
    p.add_argument("--key", type=Path, help=f"publisher key file (default {default_key_path()})")
    p.add_argument("--api-key", help="publisher API key (default $SPARECYCLES_API_KEY)")
    p.add_argument("--royalty", type=int, metavar="MICRO",
                   help="adapters: royalty per job in micro-credits (overrides adapter.toml)")
    p.add_argument("--json", action="store_true", help="print the broker's answer as JSON")
    p.set_defaults(func=cmd_publish)

    k = sub.add_parser("publisher", help="publisher keys for signing packages")
    ksub = k.add_subparsers(dest="publisher_command", required=True)
    i = ksub.add_parser("init", help="create a publisher key file (and register it)")
    i.add_argument("--key", type=Path, help=f"where to write it (default {default_key_path()})")
    i.add_argument("--force", action="store_true", help="overwrite an existing key file")
    i.add_argument("--broker", help="also register the key with this broker")
    i.add_argument("--api-key", help="publisher API key (default $SPARECYCLES_API_KEY)")
    i.add_argument("--label", default="", help="a name for the key shown in listings")
    i.set_defaults(func=cmd_publisher_init)


def cmd_publisher_init(args) -> int:
    from sdk.protocol.signing import KeyPair

    path = args.key or default_key_path()
    if path.exists() and not args.force:
        keys = KeyPair.load(path)
        print(f"{path} already exists (public key {keys.public_key_hex}); pass --force to "
              "replace it", file=sys.stderr)
        if not args.broker:
            return 2
    else:
        keys = KeyPair.generate()
        keys.save(path)
        print(f"publisher key: {path}\npublic key:    {keys.public_key_hex}")
    if args.broker:
        return _register(args, keys)
    return 0


def _register(args, keys) -> int:
    from sdk import Client, SparecyclesError

    try:
        with Client(args.broker, args.api_key) as client:
            out = client.register_publisher_key(keys, label=args.label)
    except SparecyclesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"registered with {args.broker} as key {out['key_id']}")
    return 0


def cmd_publish(args) -> int:
    from sdk import Client, SparecyclesError
    from sdk.protocol.manifest import ManifestError
    from sdk.protocol.package import PackageError
    from sdk.protocol.signing import KeyPair

    path = args.key or default_key_path()
    if not path.exists():
        print(f"error: no publisher key at {path}: run `sparecycles publisher init --key "
              f"{path}` first", file=sys.stderr)
        return 2
    keys = KeyPair.load(path)
    try:
        with Client(args.broker, args.api_key) as client:
            client.register_publisher_key(keys)  # idempotent: 200 when already registered
            out = client.publish(args.path, keys, royalty_micro=args.royalty)
    except (ManifestError, PackageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SparecyclesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        what = "published" if out.get("created") else "already published (identical)"
        extra = (f", base {out['base']}, royalty {out['royalty_micro']} micro-credits/use"
                 if out.get("kind") == "adapter" else "")
        print(f"{out['kind']} {out['name']}@{out['version']} {what}{extra}; digest "
              f"{out['digest'][:16]}…")
    return 0
