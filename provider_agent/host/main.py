"""The plugin host process: loads one plugin once, then runs jobs until told to stop.

Started by the agent as ``python -m provider_agent.host.main`` (inside the sandbox). The
protocol runs over the original stdin/stdout; stdout is then pointed at stderr so a plugin
that prints cannot corrupt the frames.

Inside the sandbox the host is warm and long-lived, and jobs of different clients follow
each other in it, so after every job it puts back what the job could change besides the
plugin's own memory: ``StrayReaper`` kills the processes the job left running (the host is
alone in its pid namespace), then ``ScratchCleaner`` removes every file and folder the
job made or changed in the sandbox's writable places (``/scratch``, ``/tmp``,
``/dev/shm``) and every System V IPC object it made, truncating files first so that a
descriptor still open on one (a thread the plugin left behind) reads nothing. What
``setup()`` left there is kept as it was. What a plugin keeps in its own memory is not
cleaned: the plugin runs every job of its host, so it is trusted with all of them
(docs/architecture.md, *Agent*).
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import stat
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

#: The sandbox's writable places (provider_agent.sandbox.bwrap.WRITABLE_PLACES): each a
#: private tmpfs that only this host's jobs can write.
WRITABLE_PLACES = ("/scratch", "/tmp", "/dev/shm")


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


MAX_PREVIEW_BYTES = 16 * 1024  # a progress preview; larger ones are dropped

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

    def preview(self, step: int, data: bytes, media_type: str = "image/webp") -> None:
        data = bytes(data)
        if len(data) <= MAX_PREVIEW_BYTES:  # a thumbnail, never an output by another name
            self._writer.send({"type": "preview", "job_id": self.job_id, "step": int(step),
                               "media_type": str(media_type)[:100]}, data)

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


def _dtype_of(plugin) -> str:
    """The dtype the plugin runs in, where it says (the built-in models keep the torch
    dtype as ``dtype``, or their model's): part of its reproducibility class; "" if not."""
    dtype = getattr(plugin, "dtype", None) or getattr(getattr(plugin, "model", None),
                                                      "dtype", None)
    return str(dtype or "").removeprefix("torch.")
def _cap_vram(device: str, max_vram_gb: float) -> None:
    """The owner's VRAM limit (agent.toml max_vram_gb): torch's allocator refuses to hold
    more than that share of the GPU, so a job that needs more fails with out-of-memory
    instead of pushing the owner's own programs out."""
    if not max_vram_gb or not device.startswith("cuda"):
        return
    import torch

    dev = torch.device(device)
    total_gb = torch.cuda.get_device_properties(dev).total_memory / 2**30
    torch.cuda.set_per_process_memory_fraction(min(1.0, max_vram_gb / total_gb), dev)


def _hardware(device: str) -> dict:
    info = {"device": device.split(":")[0], "cpu_count": os.cpu_count() or 1}
    torch = sys.modules.get("torch")  # loaded by the plugin's setup, if it uses torch
    if torch is not None:
        # Bit-reproducibility on the CPU holds only for one thread count and torch build
        # (reductions split across threads round differently): part of the repro class.
        info.update(threads=torch.get_num_threads(), torch=torch.__version__)
    if device.startswith("cuda"):
        if torch is None:  # a plugin that needs no torch (tests' fake devices)
            info["gpu_error"] = "the plugin did not load torch: GPU figures unknown"
            return info
        try:
            props = torch.cuda.get_device_properties(torch.device(device))
            info.update(gpu_name=props.name, vram_gb=round(props.total_memory / 2**30, 1))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: the plugin loaded
            info["gpu_error"] = f"{type(exc).__name__}: {exc}"
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
    from sdk import logs

    # The host's log lines (and the plugin's own logging) name the job and the request
    # they belong to, in the agent's format; they go to stderr, the agent's log.
    logs.configure(header.get("log_format") or "text")
    log = logging.getLogger("plugin_host")
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
        _cap_vram(device, header.get("max_vram_gb") or 0)
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
                 "input_defaults": defaults,
                 "dtype": _dtype_of(plugin)})

    # Inside the sandbox the host is alone in its pid namespace with bwrap's init, and the
    # writable places are its own: whatever a job starts and leaves running can be found
    # and killed, whatever it leaves behind removed. Outside it, /proc and /tmp are the
    # provider's whole machine, so the host never does this.
    sandboxed = os.environ.get("SPARECYCLES_SANDBOXED") == "1"
    reaper = StrayReaper() if sandboxed else None
    cleaner = ScratchCleaner.inside_sandbox() if sandboxed else None
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
        log_token = logs.bind(job_id=job_id, request_id=h.get("request_id"))
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
            log.warning("job failed: %s (%s)", failure["message"], failure["code"])
        else:
            log.debug("job done in %d ms", (time.perf_counter() - t_run) * 1000)
        logs.unbind(log_token)
        if failure is not None:
            writer.send({"type": "failed", "job_id": job_id, **failure})
        else:
            # The outputs and the result in one write: the agent reads them in one go.
            writer.send_many([*(({"type": "output", "job_id": job_id, "index": i,
                                  "media_type": media_type, "meta": meta}, data)
                                 for i, (media_type, meta, data) in enumerate(outputs)),
                              ({"type": "result", "job_id": job_id, "count": len(outputs),
                                "run_ms": int((time.perf_counter() - t_run) * 1000),
                                "work_units": work_units}, b"")])
        # After the answer is out (it is not delayed) and before the next job is read.
        if cleaner is not None:
            cleaner.clean()


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


class ScratchCleaner:
    """Puts the sandbox's writable places back as ``setup()`` left them, after each job.

    At construction it records every entry below ``roots`` (path → inode and ctime), the
    files this process holds open there, and the System V IPC objects of its namespace.
    ``clean()`` then removes every entry that is new or changed (a file whose inode or
    ctime differs; ctime moves with any write, chmod or utime and cannot be set back),
    keeping recorded folders but emptying them of what is new; truncates every file on
    those filesystems that this process still holds open with no name left (a job's file
    a lingering thread kept open); and removes new System V shared memory, semaphores and
    message queues (POSIX ones are refused by the seccomp filter). Files are truncated before they are unlinked, so no descriptor kept
    anywhere reads what a job wrote. Only processes of this sandbox could have written
    here, and ``StrayReaper`` has killed those of the job before this runs.
    """

    def __init__(self, roots: list[str] | tuple[str, ...], proc: Path = Path("/proc")) -> None:
        self.roots = [r for r in roots if os.path.isdir(r)]
        self.proc = proc
        self._fd_dir = f"{os.fspath(proc)}/self/fd"
        self.devs = {os.stat(r).st_dev for r in self.roots}
        self.keep: dict[str, tuple[int, int]] = {}
        for root in self.roots:
            self._record(root, os.stat(root).st_dev)
        self.keep_open = {(st.st_dev, st.st_ino) for st in self._open_files()}
        self.keep_ipc = {kind: set(ids) for kind, ids in self._ipc_ids().items()}

    @classmethod
    def inside_sandbox(cls) -> "ScratchCleaner | None":
        """A cleaner of ``WRITABLE_PLACES`` if this really is a sandbox, else None: each
        place is cleaned only where it is its own tmpfs mount, and /scratch must be one (it
        exists nowhere else), so a host started by hand on a machine never empties that
        machine's /tmp."""
        mounts = {}
        try:
            for line in Path("/proc/self/mountinfo").read_text().splitlines():
                left, _, right = line.partition(" - ")
                mounts[left.split()[4]] = right.split()[0]
        except OSError:
            return None
        if mounts.get("/scratch") != "tmpfs":
            return None
        return cls([p for p in WRITABLE_PLACES if mounts.get(p) == "tmpfs"])

    # ---- what setup() left ---------------------------------------------------------------
    # Only the writable place's own filesystem is walked: a read-only bind that shows
    # through it (a checkout or a venv below /tmp, bound at its own path) is another
    # device, which no job can write and whose walk would cost seconds after every job.
    def _record(self, folder: str, dev: int) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            self.keep[entry.path] = (st.st_ino, st.st_ctime_ns)
            if stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                self._record(entry.path, dev)

    def _open_files(self) -> list[os.stat_result]:
        """The regular files on the writable places this process holds open (raw calls:
        this runs after every job)."""
        out = []
        try:
            names = os.listdir(self._fd_dir)
        except OSError:
            return out
        for name in names:
            try:
                st = os.stat(f"{self._fd_dir}/{name}")
            except OSError:
                continue
            if st.st_dev in self.devs and stat.S_ISREG(st.st_mode):
                out.append(st)
        return out

    _IPC = {"shm": "shmctl", "sem": "semctl", "msg": "msgctl"}

    def _ipc_ids(self) -> dict[str, list[int]]:
        out = {}
        base = os.fspath(self.proc)
        for kind in self._IPC:
            try:
                fd = os.open(f"{base}/sysvipc/{kind}", os.O_RDONLY)
                try:
                    raw = b""
                    while chunk := os.read(fd, 65536):
                        raw += chunk
                finally:
                    os.close(fd)
                out[kind] = [int(line.split()[1]) for line in raw.splitlines()[1:]
                             if line.split()]
            except (OSError, ValueError, IndexError):
                out[kind] = []
        return out

    # ---- after a job ---------------------------------------------------------------------
    def clean(self) -> int:
        """Remove what the last job left; the number of things removed or emptied."""
        removed = sum(self._clean_folder(root, os.stat(root).st_dev) for root in self.roots)
        removed += self._truncate_orphans()
        removed += self._remove_ipc()
        return removed

    def _clean_folder(self, folder: str, dev: int) -> int:
        removed = 0
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return 0
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev != dev:
                continue  # a mount point: a bind, not this place's (see _record)
            kept = self.keep.get(entry.path)
            if stat.S_ISDIR(st.st_mode):
                if kept is not None and kept[0] == st.st_ino:
                    removed += self._clean_folder(entry.path, dev)
                else:
                    removed += self._remove_tree(entry.path)
            elif kept != (st.st_ino, st.st_ctime_ns):
                self._remove_file(entry.path, st)
                removed += 1
        return removed

    @staticmethod
    def _remove_file(path: str, st: os.stat_result) -> None:
        # Truncate a file no other name shares first: a descriptor kept open on it reads
        # nothing. (A second link would be a name of another file, kept or not.)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size:
            try:
                os.truncate(path, 0)
            except PermissionError:
                try:
                    os.chmod(path, 0o600)
                    os.truncate(path, 0)
                except OSError:
                    pass
            except OSError:
                pass
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            pass

    def _remove_tree(self, folder: str) -> int:
        removed = 0
        try:
            os.chmod(folder, 0o700)  # a job may have made it unreadable to us, its owner
            entries = list(os.scandir(folder))
        except OSError:
            entries = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                removed += self._remove_tree(entry.path)
            else:
                self._remove_file(entry.path, st)
                removed += 1
        try:
            os.rmdir(folder)
            removed += 1
        except OSError:
            pass
        return removed

    def _truncate_orphans(self) -> int:
        """Empty the files with no name left that this process still holds open (their
        names were just removed, or the job removed them itself), except those setup()
        held."""
        done = 0
        fd_dir = self._fd_dir
        for st in self._open_files():
            if st.st_nlink or not st.st_size or (st.st_dev, st.st_ino) in self.keep_open:
                continue
            for name in os.listdir(fd_dir):
                link = f"{fd_dir}/{name}"
                try:
                    again = os.stat(link)
                    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                        continue
                    fd = os.open(link, os.O_WRONLY)
                except OSError:
                    continue
                try:
                    os.ftruncate(fd, 0)
                    done += 1
                except OSError:
                    pass
                finally:
                    os.close(fd)
                break
        return done

    def _remove_ipc(self) -> int:
        now = self._ipc_ids()
        fresh = {kind: [i for i in ids if i not in self.keep_ipc.get(kind, ())]
                 for kind, ids in now.items()}
        if not any(fresh.values()):
            return 0
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        ipc_rmid = 0
        done = 0
        for kind, ids in fresh.items():
            for ipc_id in ids:
                if kind == "sem":
                    ok = libc.semctl(ipc_id, 0, ipc_rmid) == 0
                else:
                    ok = getattr(libc, self._IPC[kind])(ipc_id, ipc_rmid, None) == 0
                done += ok
        return done


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
