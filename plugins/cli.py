"""`sparecycles plugins ...`: commands about the built-in plugins.

    sparecycles plugins build-tiny {sd15,sdxl,llama,lora-sd15,lora-sdxl,lora-llama} --out DIR [--seed N]
                                   [--name NAME] [--version X.Y.Z]   # lora-* only

builds tiny random weights (``plugins.tiny``) for tests and the demo, in the real layout
the plugin loads. A LoRA folder also gets the ``adapter.toml`` that `sparecycles publish`
reads (name: ``--name``, else the folder's name), so it publishes as it is. ``register`` is looked up through the ``sparecycles.commands`` entry
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
    build.add_argument("--name", metavar="NAME",
                       help="lora-*: the adapter's name in adapter.toml (default: the --out "
                            "folder's name)")
    build.add_argument("--version", default="1.0.0", metavar="X.Y.Z",
                       help="lora-*: the adapter's version in adapter.toml (default 1.0.0)")
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
    from plugins.tiny import build_tiny, weights_digest, write_adapter_toml
    from sdk.protocol.manifest import ManifestError

    lora = args.kind.startswith("lora-")
    if not lora and args.name is not None:
        print(f"error: --name names an adapter; {args.kind} is a model, not a lora-* kind",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        if lora:  # checked before the build: a bad name costs nothing
            write_adapter_toml(None, args.name or args.out.resolve().name, args.version,
                               args.kind.removeprefix("lora-"))
        folder = build_tiny(args.kind, args.out, seed=args.seed)
        if lora:
            manifest = write_adapter_toml(folder, args.name or folder.resolve().name,
                                          args.version, args.kind.removeprefix("lora-"))
    except (FileExistsError, ValueError) as exc:  # ManifestError is a ValueError
        hint = (" (pass --name to choose another)"
                if isinstance(exc, ManifestError) and args.name is None else "")
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    size_mb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
    print(f"built tiny {args.kind} (seed {args.seed}) in {folder.resolve()}: "
          f"{size_mb:.1f} MB, {time.monotonic() - started:.1f} s")
    print(f"weights digest {weights_digest(folder)}")
    if lora:
        print(f"adapter {manifest.name}@{manifest.version} for {manifest.base}: publish it with "
              f"`sparecycles publish {args.out} --broker URL --key FILE`")
    return 0
