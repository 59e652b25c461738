"""Client-side commands of `sparecycles`: generate, demo."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub) -> None:
    g = sub.add_parser("generate", help="run one job and save its outputs")
    g.add_argument("plugin", help="plugin name, e.g. sd15")
    g.add_argument("--prompt")
    g.add_argument("--seed", type=int)
    g.add_argument("--steps", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--height", type=int)
    g.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="any other input (VALUE is parsed as JSON when it can be)")
    g.add_argument("--out", required=True, type=Path, help="file to write (out-N.ext for several)")
    g.add_argument("--timeout", type=float, default=600.0)
    g.add_argument("--url", help="broker URL (default $SPARECYCLES_URL)")
    g.add_argument("--api-key", help="API key (default $SPARECYCLES_API_KEY)")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="start a local broker and two agents, generate one image")
    d.add_argument("--workdir", type=Path, default=None,
                   help="folder for the demo's broker, agents and logs, emptied first "
                        "(default: ~/.cache/sparecycles/demo)")
    d.add_argument("--out", type=Path, default=Path("out"))
    d.add_argument("--no-sandbox", action="store_true", help="run plugin hosts unsandboxed")
    d.set_defaults(func=cmd_demo)


def _inputs(args) -> dict:
    inputs = {k: getattr(args, k) for k in ("prompt", "seed", "steps", "width", "height")
              if getattr(args, k) is not None}
    for item in args.set:
        name, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r} must look like NAME=VALUE")
        try:
            inputs[name] = json.loads(raw)
        except ValueError:
            inputs[name] = raw
    return inputs


def cmd_generate(args) -> int:
    from sdk import Client, SparecyclesError

    try:
        with Client(args.url, args.api_key) as client:
            job = client.jobs.create(args.plugin, **_inputs(args))
            print(f"job {job.id} queued", file=sys.stderr)
            follow_progress(job)
            result = job.wait(timeout=args.timeout)
            for path in result.save(args.out):
                print(path)
    except SparecyclesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def follow_progress(job, stream=None) -> None:
    """Show the job's progress events until it ends: a tqdm bar on a terminal (when tqdm is
    installed), else a line at each new step (at most one a second) and at the end."""
    import time

    stream = stream or sys.stderr
    bar = None
    if stream.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=None, desc=f"job {job.id[:8]}", unit="step", file=stream,
                       leave=True, dynamic_ncols=True)
    last_line = 0.0
    from sdk import SparecyclesError

    try:
        for ev in job.events():
            if ev.kind == "progress" and ev.data.get("total"):
                step, total = int(ev.data.get("step", 0)), int(ev.data["total"])
                if bar is not None:
                    bar.total = total
                    bar.n = min(step, total)
                    bar.set_postfix_str(ev.data.get("message", "")[:40], refresh=False)
                    bar.refresh()
                elif time.monotonic() - last_line >= 1.0 or step == total:
                    last_line = time.monotonic()
                    print(f"job {job.id[:8]}: step {step}/{total}", file=stream)
            elif ev.kind in ("assigned", "requeued") and bar is None:
                print(f"job {job.id[:8]}: {ev.kind}", file=stream)
    except SparecyclesError as exc:  # no progress to show; waiting for the job still works
        print(f"job {job.id[:8]}: cannot follow its progress ({exc}); waiting for it",
              file=stream)
    finally:
        if bar is not None:
            bar.close()


def cmd_demo(args) -> int:
    from sdk.demo import run_demo

    return run_demo(args.workdir, args.out, sandbox=not args.no_sandbox)
