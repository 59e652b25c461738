"""`sparecycles plugins ...`: commands about the built-in plugins.

    sparecycles plugins build-tiny {sd15,sdxl,llama,lora-sd15,lora-sdxl,lora-llama} --out DIR [--seed N]

builds tiny random weights (``plugins.tiny``) for tests and the demo, in the real layout
the plugin loads. ``register`` is looked up through the ``sparecycles.commands`` entry
point, so the SDK's dispatcher never imports this package directly.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    """Add the ``plugins`` command group to the ``sparecycles`` argument parser."""
    from plugins.tiny import KINDS

    parser = subparsers.add_parser("plugins", help="built-in model plugins and their weights")
    commands = parser.add_subparsers(dest="plugins_command", metavar="COMMAND", required=True)
    build = commands.add_parser(
        "build-tiny", help="write tiny random weights in a plugin's real layout (tests, demo)",
        description="Build tiny, randomly initialised, seed-deterministic weights for a "
                    "built-in plugin, in the same folder layout as the real model.")
    build.add_argument("kind", choices=KINDS, help="which model layout to build")
    build.add_argument("--out", required=True, type=Path, metavar="DIR",
                       help="folder to write (created; replaced if it holds an older tiny build)")
    build.add_argument("--seed", type=_seed, default=0, metavar="N",
                       help="seed of the random weights (default 0)")
    build.set_defaults(func=_build_tiny)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seed must be an integer >= 0, got {value}")
    return value


def _build_tiny(args: argparse.Namespace) -> int:
    from plugins.tiny import build_tiny, weights_digest

    started = time.monotonic()
    try:
        folder = build_tiny(args.kind, args.out, seed=args.seed)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size_mb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
    print(f"built tiny {args.kind} (seed {args.seed}) in {folder.resolve()}: "
          f"{size_mb:.1f} MB, {time.monotonic() - started:.1f} s")
    print(f"weights digest {weights_digest(folder)}")
    return 0
