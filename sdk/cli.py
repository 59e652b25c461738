"""The `sparecycles` command.

The SDK owns the dispatcher and the client commands (generate, demo); the broker, agent and
plugins register their own command groups through the ``sparecycles.commands`` entry
points, so installing only the SDK never imports them.
"""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparecycles",
                                     description="Inference on idle GPUs: client, broker, agent.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from sdk import commands

    commands.register(sub)
    for ep in sorted(entry_points(group="sparecycles.commands"), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except ImportError as exc:
            stub = sub.add_parser(ep.name, help=f"(unavailable: {exc.name} is not installed)")
            stub.set_defaults(func=_missing(ep.name, exc))
    return parser


def _missing(group: str, exc: ImportError):
    extra = {"broker": "broker", "agent": "agent", "plugins": "agent"}.get(group, group)

    def run(_args) -> int:
        print(f"`sparecycles {group}` needs the [{extra}] extra ({exc.name} is missing): "
              f"pip install 'sparecycles[{extra}]'", file=sys.stderr)
        return 2
    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
