"""Client-side commands of `sparecycles`: generate, jobs (list, show, cancel, wait), demo.

``generate`` and ``jobs wait`` follow the job as it runs: a progress bar per step on
stderr (image plugins' denoising steps), and for text plugins each token printed to
stdout as it streams; ``--timeout`` is one :class:`sdk.Timeout` over following and
waiting (counted from the submit), after which the job is cancelled. ``--json`` (every
command) prints one JSON document on stdout and nothing else there (errors too:
``{"error": {...}}`` with exit status 1), for scripts: it shows no progress, so it does not
follow the event stream, it waits for the job's record (a long poll) and prints it.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path


def _connection(p) -> None:
    p.add_argument("--url", help="broker URL (default $SPARECYCLES_URL)")
    p.add_argument("--api-key", help="API key (default $SPARECYCLES_API_KEY)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout (no progress), for scripts")


def register(sub) -> None:
    g = sub.add_parser("generate", help="run one job, follow it, and save or print its outputs")
    g.add_argument("plugin", help="plugin name, e.g. sd15 or llama")
    g.add_argument("--prompt")
    g.add_argument("--seed", type=int)
    g.add_argument("--steps", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--height", type=int)
    g.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="any other input (VALUE is parsed as JSON when it can be)")
    g.add_argument("--out", type=Path,
                   help="file to write (out-N.ext for several); text outputs are printed "
                        "when it is left out, other outputs need it")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds from the submit for following and waiting in all; then the "
                        "job is cancelled (default 600)")
    _connection(g)
    g.set_defaults(func=cmd_generate)

    j = sub.add_parser("jobs", help="list, show, cancel or wait for your jobs")
    jsub = j.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    lst = jsub.add_parser("list", help="your newest jobs")
    lst.add_argument("--limit", type=int, default=20)
    _connection(lst)
    lst.set_defaults(func=cmd_jobs_list)
    for name, helptext, func in (("show", "one job's record", cmd_jobs_show),
                                 ("cancel", "cancel a job (what was not earned is refunded)",
                                  cmd_jobs_cancel)):
        p = jsub.add_parser(name, help=helptext)
        p.add_argument("job_id")
        _connection(p)
        p.set_defaults(func=func)
    w = jsub.add_parser("wait", help="follow a job until it ends; save or print its outputs")
    w.add_argument("job_id")
    w.add_argument("--out", type=Path, help="file to write its outputs to")
    w.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for following and waiting in all; then the job is "
                        "cancelled (default 600)")
    _connection(w)
    w.set_defaults(func=cmd_jobs_wait)

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


class Progress:
    """A one-line progress bar on a terminal (``stream``): ``step/total`` with a bar,
    the percentage and the elapsed time, redrawn in place; on a stream that is not a
    terminal, one line per tenth of the way (a log stays readable)."""

    def __init__(self, stream, label: str):
        self.stream, self.label = stream, label
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.started = time.monotonic()
        self.drawn = False
        self.last_tenth = -1

    def update(self, step: int, total: int) -> None:
        if total <= 0:
            return
        step = min(step, total)
        if not self.tty:
            tenth = step * 10 // total
            if tenth != self.last_tenth:
                self.last_tenth = tenth
                print(f"{self.label}: step {step}/{total}", file=self.stream, flush=True)
            return
        width = max(10, min(40, shutil.get_terminal_size((80, 20)).columns - 40))
        done = width * step // total
        bar = "█" * done + "·" * (width - done)
        self.stream.write(f"\r{self.label} {bar} {step}/{total} {100 * step // total:3d}% "
                          f"{time.monotonic() - self.started:5.1f}s")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def _follow(job, budget) -> bool:
    """Follow ``job``'s events until it ends or ``budget`` (an sdk.Timeout) passes:
    progress bars on stderr, streamed text on stdout. Returns whether text was streamed."""
    from sdk._core import TokenText

    bar = Progress(sys.stderr, f"job {job.id[:8]}")
    text = TokenText()
    streamed = False
    try:
        for ev in job.events(timeout=budget):
            if ev.kind == "progress" and ev.total:
                if streamed:
                    continue  # the text shows the progress
                bar.update(int(ev.step or 0), int(ev.total))
            elif ev.kind == "requeued":
                text.feed(ev.kind, ev.data)  # its second attempt re-sends the text so far
                bar.close()
                print(f"\njob {job.id}: requeued ({ev.data.get('reason', '')})",
                      file=sys.stderr)
            elif ev.kind == "token":
                piece = text.feed(ev.kind, ev.data)
                if piece:
                    bar.close()
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                    streamed = True
    finally:
        bar.close()
        if streamed:
            sys.stdout.write("\n")
            sys.stdout.flush()
    return streamed


def _finish(job, args, budget) -> int:
    """Follow the job (not with --json: nothing would show it), wait for its result within
    what is left of ``budget`` (an sdk.Timeout), then save (--out) or print it."""
    streamed = False if args.json else _follow(job, budget)
    result = job.wait(timeout=budget)
    saved: list[str] = []
    if args.out is not None:
        saved = [str(p) for p in result.save(args.out)]
    elif not all(o["media_type"].startswith("text/") or o["media_type"] == "application/json"
                 for o in result.outputs):
        print(f"job {job.id} settled; its outputs are not text: pass --out FILE to save "
              f"them (or `sparecycles jobs wait {job.id} --out FILE`)", file=sys.stderr)
    if args.json:
        _print_json({**result.job.data, "saved": saved})
        return 0
    for path in saved:
        print(path)
    if args.out is None and not streamed:
        for i, o in enumerate(result.outputs):
            if o["media_type"].startswith("text/") or o["media_type"] == "application/json":
                print(result.output_bytes(i).decode("utf-8", "replace"))
    return 0


def _print_json(doc) -> None:
    print(json.dumps(doc, indent=2, ensure_ascii=False))


def _run(args, action) -> int:
    """Run ``action(client)`` and render SDK errors: a line on stderr, or with --json an
    error document on stdout; exit status 1 either way."""
    from sdk import Client, SparecyclesError

    try:
        with Client(args.url, args.api_key) as client:
            return int(action(client) or 0)
    except SparecyclesError as exc:
        if getattr(args, "json", False):
            _print_json({"error": {"type": type(exc).__name__, "code": exc.code,
                                   "message": str(exc), "request_id": exc.request_id}})
        else:
            rid = f" (request {exc.request_id})" if exc.request_id else ""
            print(f"error: {exc}{rid}", file=sys.stderr)
        return 1


def cmd_generate(args) -> int:
    def action(client):
        from sdk import Timeout

        budget = Timeout(args.timeout)  # counted from the submit
        job = client.jobs.create(args.plugin, **_inputs(args))
        if not args.json:
            print(f"job {job.id} queued", file=sys.stderr)
        return _finish(job, args, budget)
    return _run(args, action)


def cmd_jobs_list(args) -> int:
    def action(client):
        jobs = client.jobs.list(limit=args.limit)
        if args.json:
            _print_json([j.data for j in jobs])
            return 0
        if not jobs:
            print("no jobs yet", file=sys.stderr)
        for j in jobs:
            info = j.info
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.created_at))
            progress = (f"{info.progress_step}/{info.progress_total}"
                        if info.progress_total else "")
            print(f"{info.id}  {info.plugin:<8} {info.state:<10} {progress:>7}  {when}")
        return 0
    return _run(args, action)


def _show(job, args) -> None:
    if args.json:
        _print_json(job.data)
        return
    info = job.info
    lines = [f"job        {info.id}", f"plugin     {info.plugin}@{info.version}",
             f"state      {info.state}", f"attempt    {info.attempt}",
             f"progress   {info.progress_step}/{info.progress_total}",
             f"provider   {info.provider_id or '-'}",
             f"price      {info.price_micro_per_unit if info.price_micro_per_unit is not None else '-'} micro-credits per work unit × {info.work_units:g} units",
             f"verified   {info.verification}",
             f"inputs     {json.dumps(info.inputs, ensure_ascii=False)}"]
    if info.error:
        lines.append(f"error      {info.error.get('code')}: {info.error.get('message')}")
    for o in info.outputs:
        lines.append(f"output {o.index}   {o.media_type} {o.size} bytes sha256 {o.sha256[:16]}…")
    print("\n".join(lines))


def cmd_jobs_show(args) -> int:
    return _run(args, lambda client: _show(client.jobs.get(args.job_id), args))


def cmd_jobs_cancel(args) -> int:
    return _run(args, lambda client: _show(client.jobs.get(args.job_id).cancel(), args))


def cmd_jobs_wait(args) -> int:
    def action(client):
        from sdk import Timeout

        budget = Timeout(args.timeout)
        return _finish(client.jobs.get(args.job_id), args, budget)
    return _run(args, action)


def cmd_demo(args) -> int:
    from sdk.demo import run_demo

    return run_demo(args.workdir, args.out, sandbox=not args.no_sandbox)
