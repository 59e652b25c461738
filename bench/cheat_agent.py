"""A deliberately cheating provider agent, for the verification harness (bench/cheaters.py).

The real agent (``sparecycles agent run``) with its plugin hosts built by
``cheating_host.CheatingHosts``: the production agent has no cheat switch of its own.

    python bench/cheat_agent.py --mode wrong-seed --seed 1 --log cheat.jsonl \\
        -- agent run --home ./agent-home --device cpu

Everything after ``--`` is the ``sparecycles`` command line, which must be ``agent run``.
Never run this against a real marketplace: its providers get slashed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cheating_host import CheatingHosts, add_arguments, from_args  # noqa: E402
from provider_agent.cli import cmd_run  # noqa: E402
from provider_agent.errors import ConfigError  # noqa: E402
from sdk.cli import build_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="cheat_agent.py", description=__doc__.split("\n")[0],
        usage="cheat_agent.py --mode MODE [cheat options] -- agent run [agent options]")
    add_arguments(parser)
    if "--" not in argv:
        parser.parse_args(argv)  # --help, or what is wrong with the cheat options
        parser.error("after the cheat options comes -- agent run [agent options]")
    cut = argv.index("--")
    cheat_args = parser.parse_args(argv[:cut])
    args = build_parser().parse_args(argv[cut + 1:])
    if getattr(args, "agent_command", None) != "run":
        print(f"after -- comes `agent run ...`, not {' '.join(argv[cut + 1:])!r}",
              file=sys.stderr)
        return 2
    try:
        cheat = from_args(cheat_args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return cmd_run(args, host_factory=CheatingHosts(cheat))


if __name__ == "__main__":
    sys.exit(main())
