"""The plugin host process: loads one plugin once, then runs jobs until told to stop.

Started by the agent as ``python -m provider_agent.host.main`` (inside the sandbox). The
protocol runs over the original stdin/stdout; stdout is then pointed at stderr so a plugin
that prints cannot corrupt the frames.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path


def _protocol_streams():
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    os.dup2(2, 1)  # plugin prints go to stderr (the agent's log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = sys.stderr
    return proto_in, proto_out


class Inbox:
    """The agent's frames, read by the thread that needs them, not by a reader thread.

    Between jobs the main loop waits in ``next()``. While a job runs, its cancellation
    checks (``Context.cancelled()``) ``poll()`` for what has arrived, without waiting: a
    cancel marks its job's context, anything else (a shutdown) waits its turn until the
    job is over. A cancel can only be seen when the plugin checks, as it always could, and
    a job costs no hand-off between threads.
    """

    def __init__(self, frames):
        self.frames = frames
        self.current: dict[str, Context] = {}   # the running job's context, by job id
        self._pending: deque = deque()
        self._lock = threading.Lock()            # one reader at a time
        self._closed = False                     # EOF, garbage or shutdown: read no more

    def next(self) -> dict:
        """The next frame other than a cancel (waits for it); ``shutdown`` at the end."""
        with self._lock:
            while True:
                if self._pending:
                    return self._pending.popleft()
                h = self._read(None)
                if not self._route(h):
                    return h

    def poll(self) -> None:
        """Take in whatever frames have arrived, without waiting (from any thread)."""
        if self._closed or not self._lock.acquire(blocking=False):
            return
        try:
            while not self._closed:
                h = self._read(0)
                if h is None:
                    return
                if not self._route(h):
                    self._pending.append(h)
        finally:
            self._lock.release()

    def _read(self, timeout_s: float | None) -> dict | None:
        if self._closed:
            return {"type": "shutdown"}
        try:
            got = self.frames.next(timeout_s)
        except EOFError:
            got = ({"type": "shutdown"}, b"")
        except Exception:  # noqa: BLE001 - a garbled frame: stop cleanly, not hang
            traceback.print_exc()
            got = ({"type": "shutdown"}, b"")
        if got is None:
            return None
        h, body = got
        if h["type"] == "run" and body:
            h["_resume_from"] = body  # the checkpoint to resume from
        elif h["type"] == "shutdown":
            self._closed = True
        return h

    def _route(self, h: dict) -> bool:
        """Apply a cancel (True: consumed); any other frame is for the main loop."""
        if h["type"] != "cancel":
            return False
        ctx = self.current.get(h.get("job_id", ""))
        if ctx:
            ctx._cancel.set()
        return True


class Context:
    """RunContext for one job (see plugins.api)."""

    # How often cancelled() looks at the pipe for a cancel (a plugin may check very often).
    POLL_EVERY_S = 0.005

    def __init__(self, job_id: str, writer, scratch: Path, *, checkpoint_every: int = 0,
                 resume_from: bytes | None = None, inbox: Inbox | None = None):
        self.job_id = job_id
        self.scratch_dir = scratch
        self.checkpoint_every = checkpoint_every
        self.resume_from = resume_from
        self._writer = writer
        self._cancel = threading.Event()
        self._inbox = inbox
        self._next_poll = 0.0

    def checkpoint(self, step: int, data: bytes) -> None:
        self._writer.send({"type": "checkpoint", "job_id": self.job_id, "step": int(step)},
                          bytes(data))

    def progress(self, step: int, total: int, message: str = "") -> None:
        self._writer.send({"type": "progress", "job_id": self.job_id, "step": int(step),
                           "total": int(total), "message": message})

    def stream(self, text: str, token_ids=None) -> None:
        self._writer.send({"type": "stream", "job_id": self.job_id, "text": text,
                           "token_ids": list(token_ids or [])})

    def cancelled(self) -> bool:
        if self._inbox is not None and not self._cancel.is_set():
            now = time.monotonic()
            if now >= self._next_poll:
                self._next_poll = now + self.POLL_EVERY_S
                self._inbox.poll()
        return self._cancel.is_set()

    def check_cancelled(self) -> None:
        if self.cancelled():
            from plugins.api import Cancelled

            raise Cancelled(f"job {self.job_id} was cancelled")


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    if "torch" in sys.modules:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def _hardware(device: str) -> dict:
    info = {"device": device.split(":")[0], "cpu_count": os.cpu_count() or 1}
    torch = sys.modules.get("torch")  # loaded by the plugin's setup, if it uses torch
    if torch is not None:
        # Bit-reproducibility on the CPU holds only for one thread count and torch build
        # (reductions split across threads round differently): part of the repro class.
        info.update(threads=torch.get_num_threads(), torch=torch.__version__)
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu_name=props.name, vram_gb=round(props.total_memory / 2**30, 1))
    return info


def main() -> int:
    from provider_agent.host.protocol import FrameReader, FrameWriter

    proto_in, proto_out = _protocol_streams()
    writer = FrameWriter(proto_out)
    frames = FrameReader(proto_in)
    header, _ = frames.next()
    if header["type"] != "init":
        writer.send({"type": "failed", "job_id": "", "code": "protocol",
                     "message": "first message must be init", "retryable": False})
        return 2
    t0 = time.perf_counter()
    plugin_dir = Path(header["plugin_dir"])
    scratch_root = Path(header.get("scratch_dir") or "/tmp")
    try:
        from plugins.api import load_manifest

        manifest = load_manifest(plugin_dir)
        module_name, _, class_name = manifest.entrypoint.partition(":")
        sys.path.insert(0, str(plugin_dir))
        cls = getattr(importlib.import_module(module_name), class_name)
        plugin = cls()
        plugin.manifest = manifest
        device = _resolve_device(header.get("device", "auto"))
        weights = header.get("weights_dir")
        plugin.setup(Path(weights) if weights else None, device)
    except Exception as exc:  # noqa: BLE001 - report any load failure to the agent
        traceback.print_exc()
        writer.send({"type": "failed", "job_id": "", "code": "load_failed",
                     "message": f"{type(exc).__name__}: {exc}", "retryable": False})
        return 3
    defaults = _weights_defaults(plugin, manifest)
    writer.send({"type": "ready", "plugin": manifest.name, "version": manifest.version,
                 "load_ms": int((time.perf_counter() - t0) * 1000),
                 "schema": manifest.inputs.json_schema(), "hardware": _hardware(device),
                 "input_defaults": defaults})

    # Inside the sandbox the host is alone in its pid namespace with bwrap's init: whatever
    # a job starts and leaves running can be found and killed. Outside it, /proc is the
    # provider's whole machine, so the host never does this.
    reaper = StrayReaper() if os.environ.get("SPARECYCLES_SANDBOXED") == "1" else None
    inbox = Inbox(frames)
    current = inbox.current
    from plugins.api import InputError, PluginError

    while True:
        h = inbox.next()
        if h["type"] == "shutdown":
            try:
                plugin.teardown()
            finally:
                return 0
        if h["type"] != "run":
            continue
        job_id = h["job_id"]
        scratch = scratch_root / f"job-{job_id}"
        _mkdir(scratch)
        ctx = Context(job_id, writer, scratch,
                      checkpoint_every=int(h.get("checkpoint_every") or 0),
                      resume_from=h.get("_resume_from"), inbox=inbox)
        current[job_id] = ctx
        t_run = time.perf_counter()
        failure: dict | None = None
        try:
            inputs = manifest.validate_inputs(h["inputs"], defaults)
            outputs = [(out.media_type, out.meta, out.data)
                       for out in plugin.run(inputs, ctx)]
            work_units = manifest.work_units_for(inputs)
        except PluginError as exc:
            failure = {"code": exc.code, "message": str(exc), "retryable": exc.retryable}
        except InputError as exc:  # the inputs failed the schema (not a plugin bug)
            failure = {"code": "bad_input", "message": str(exc), "retryable": False}
        except Exception as exc:  # noqa: BLE001 - any plugin bug becomes a clean job failure
            traceback.print_exc()
            failure = {"code": "plugin_crashed", "message": f"{type(exc).__name__}: {exc}",
                       "retryable": True}
        finally:
            current.pop(job_id, None)
            _rmtree(scratch)
        strays = reaper.reap() if reaper is not None else []
        if strays:
            print(f"plugin host: killed {len(strays)} process(es) left by job {job_id}",
                  file=sys.stderr)
            if failure is None:
                failure = {"code": "stray_processes", "retryable": False,
                           "message": f"the plugin left {len(strays)} process(es) running after "
                                      "the job; they were killed. A plugin must wait for every "
                                      "process it starts before run() returns"}
            else:
                failure["message"] += f" ({len(strays)} leftover process(es) were killed)"
        if failure is not None:
            writer.send({"type": "failed", "job_id": job_id, **failure})
            continue
        # The outputs and the result in one write: the agent reads them in one go.
        writer.send_many([*(({"type": "output", "job_id": job_id, "index": i,
                              "media_type": media_type, "meta": meta}, data)
                             for i, (media_type, meta, data) in enumerate(outputs)),
                          ({"type": "result", "job_id": job_id, "count": len(outputs),
                            "run_ms": int((time.perf_counter() - t_run) * 1000),
                            "work_units": work_units}, b"")])


def _weights_defaults(plugin, manifest) -> dict:
    """What the loaded weights give the inputs declared ``default_from = "weights"``
    (``Plugin.input_defaults``), checked against the schema; none, with a warning on
    stderr, when the plugin reports what the schema refuses (the manifest's defaults then
    stand)."""
    from plugins.api import InputError

    try:
        return manifest.inputs.weights_defaults(plugin.input_defaults())
    except InputError as exc:
        print(f"plugin host: {manifest.ref} reports weights defaults the manifest refuses "
              f"({exc}); its declared defaults apply", file=sys.stderr)
        return {}
    except Exception as exc:  # noqa: BLE001 - a plugin bug here must not stop the host
        traceback.print_exc()
        print(f"plugin host: {manifest.ref}: input_defaults() failed ({exc}); its declared "
              "defaults apply", file=sys.stderr)
        return {}


class StrayReaper:
    """Finds and kills the processes a job left behind, inside the sandbox's pid namespace.

    Everything alive when it is made (bwrap's init, this host, helpers the plugin started
    in ``setup()``) is kept; any other process seen after a job is SIGKILLed, repeatedly
    until none is left, so a fork loop cannot outrun it. Processes are told apart by pid
    *and* start time, so a recycled pid is not mistaken for a kept one — except this host
    and the pid namespace's init (pid 1), whose pids cannot be recycled while this host
    runs: those are known by pid alone, so the usual scan after a job (no strays) lists
    /proc and reads no process's stat.
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._dir = os.fspath(proc)
        self._kept_pids: set[int] = set()  # none yet: the first scan sees every process
        self.keep = {(pid, start) for pid, _state, start in self._live()}
        self.keep.add((os.getpid(), self._stat(os.getpid())[1]))
        self._kept_pids.add(os.getpid())
        if proc == Path("/proc") and any(pid == 1 for pid, _ in self.keep):
            self._kept_pids.add(1)

    def _stat(self, pid: int) -> tuple[str, int]:
        fd = os.open(f"{self._dir}/{pid}/stat", os.O_RDONLY)
        try:
            raw = b""
            while chunk := os.read(fd, 4096):
                raw += chunk
        finally:
            os.close(fd)
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0].decode(), int(fields[19])   # state, starttime (clock ticks)

    def _live(self) -> list[tuple[int, str, int]]:
        """(pid, state, start time) of every process but those kept by pid alone."""
        out = []
        for name in os.listdir(self._dir):
            if not name.isdigit() or int(name) in self._kept_pids:
                continue
            pid = int(name)
            try:
                out.append((pid, *self._stat(pid)))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        return out

    def _strays(self) -> list[int]:
        return [pid for pid, state, start in self._live()
                if state not in ("Z", "X") and (pid, start) not in self.keep]

    def reap(self, rounds: int = 200) -> list[int]:
        """Kill every process not kept; return their pids (empty when there were none)."""
        killed: set[int] = set()
        for _ in range(rounds):
            strays = self._strays()
            if not strays:
                break
            for pid in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                killed.add(pid)
            time.sleep(0.001)
        for pid in killed:  # our own children would stay zombies; init reaps the rest
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        return sorted(killed)


def _mkdir(path: Path) -> None:
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:  # the scratch root itself is missing
        path.mkdir(parents=True, exist_ok=True)


def _rmtree(path: Path) -> None:
    try:
        os.rmdir(path)  # the usual case: the job left its scratch folder empty
        return
    except OSError:
        pass
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
