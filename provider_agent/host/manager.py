"""PluginHost: the agent's handle on one warm plugin-host subprocess.

``start()`` pays process start and model load once; ``run()`` sends one job and relays its
progress, streamed text and outputs. A host that dies, hangs past the job's wall clock or
breaks a limit is killed and restarted, and the job fails with a clear, retryable error.

The thread running a job reads the host's frames itself (``FrameReader``, waiting with a
timeout): no pump thread and no queue between the pipe and the job.
"""
from __future__ import annotations

import logging

from sdk import logs
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from provider_agent.errors import AgentError, HostError
from .protocol import FrameReader, FrameWriter, ProtocolError

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class HostOutput:
    index: int
    media_type: str
    data: bytes
    meta: dict = field(default_factory=dict)


@dataclass
class HostResult:
    outputs: list[HostOutput]
    run_ms: int
    work_units: float


class PluginHost:
    """One plugin, one process, many jobs (one at a time)."""

    def __init__(self, plugin_dir: Path, weights_dir: Path | None, *, device: str = "auto",
                 launcher: Callable[..., subprocess.Popen] | None = None,
                 start_timeout_s: float = 600.0, name: str | None = None,
                 max_vram_gb: float = 0.0):
        self.plugin_dir = Path(plugin_dir)
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.device = device
        # ``launcher(argv, plugin=…, plugin_dir=…, weights_dir=…) -> Popen``: told which
        # plugin it starts, so that a sandbox shows that plugin's files and no other's.
        self.launcher = launcher or self._plain_launcher
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}
        self._reader: FrameReader | None = None
        self._writer: FrameWriter | None = None
        self._lock = threading.Lock()  # one job at a time
        self.name = name or self.plugin_dir.name
        self.max_vram_gb = max_vram_gb  # the owner's cap on this host's GPU memory (0: none)

    # ---- lifecycle ---------------------------------------------------------------------
    @staticmethod
    def _plain_launcher(argv: list[str], **_plugin) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT),
                                                          env.get("PYTHONPATH")]))
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def start(self) -> dict:
        """Start the process and load the model; returns the host's ready message."""
        t0 = time.perf_counter()
        try:
            self.proc = self.launcher([sys.executable, "-m", "provider_agent.host.main"],
                                      plugin=self.name, plugin_dir=self.plugin_dir,
                                      weights_dir=self.weights_dir)
        except AgentError as exc:  # the sandbox could not be set up (SandboxError)
            raise HostError("host_start_failed", f"could not start the plugin host for "
                            f"{self.name}: {exc}", retryable=True) from exc
        self._reader = FrameReader(self.proc.stdout)
        self._writer = FrameWriter(self.proc.stdin)
        try:
            self._writer.send({"type": "init", "plugin_dir": str(self.plugin_dir),
                               "weights_dir": str(self.weights_dir) if self.weights_dir else None,
                               "device": self.device, "scratch_dir": "/tmp",
                               "max_vram_gb": self.max_vram_gb,
                               "log_format": logs.current_format()})
        except (OSError, ValueError):  # the pipe broke (or was closed): the host died at once
            self.kill()
            raise HostError("host_died", f"plugin host {self.name} exited while starting",
                            retryable=True) from None
        try:
            header, _ = self._next(self.start_timeout_s, job_id="")
        except TimeoutError:  # (_next turns a dead host into HostError)
            self.kill()
            raise HostError("start_timeout", f"plugin {self.name} did not load within "
                            f"{self.start_timeout_s:g}s", retryable=True) from None
        except HostError:
            self.kill()  # also removes its sandbox (cgroup)
            raise
        if header["type"] != "ready":
            self.kill()
            raise HostError(header.get("code", "load_failed"),
                            f"plugin {self.name} failed to load: {header.get('message')}",
                            retryable=False)
        self.ready = header
        self.ready["start_ms"] = int((time.perf_counter() - t0) * 1000)
        log.info("plugin host %s ready in %.1fs (model load %.1fs, pid %d)", self.name,
                 self.ready["start_ms"] / 1000, header.get("load_ms", 0) / 1000, self.proc.pid)
        return self.ready

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Kill the host and everything it started (the whole sandbox when there is one)."""
        if self.proc is None:
            return
        sandbox = getattr(self.proc, "sandbox", None)
        if sandbox is not None:
            sandbox.kill()
            sandbox.cleanup()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def limit_breached(self) -> str | None:
        sandbox = getattr(self.proc, "sandbox", None) if self.proc else None
        return sandbox.limit_breached() if sandbox is not None else None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.alive():
            try:
                self._writer.send({"type": "shutdown"})
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()

    # ---- jobs --------------------------------------------------------------------------
    def _next(self, timeout_s: float, job_id: str) -> tuple[dict, bytes]:
        """The host's next frame; TimeoutError when none came within ``timeout_s``, HostError
        when the host is gone (its pipe closed, broke, or carried garbage)."""
        try:
            frame = self._reader.next(max(0.0, timeout_s))
        except (EOFError, OSError, ValueError, ProtocolError) as exc:
            # EOF, a broken or closed pipe, a header that is not JSON, a broken frame
            raise self._died(job_id, str(exc)) from None
        if frame is None:
            raise TimeoutError
        return frame

    def _died(self, job_id: str, why: str) -> HostError:
        """The error for a host found dead during job ``job_id`` ("" while loading)."""
        try:
            code = self.proc.wait(2) if self.proc else None
        except subprocess.TimeoutExpired:
            code = "unknown: it closed its pipe"
        breached = self.limit_breached()
        if breached == "memory":  # the kernel (or the watchdog) killed it for this
            return HostError("memory_limit", f"plugin host {self.name} broke its memory "
                             f"limit during job {job_id or 'load'} and was killed",
                             retryable=True)
        # Hitting the pids limit only makes fork fail; it is a clue, never the killer.
        clue = f" (it had hit its {breached} limit)" if breached else ""
        why = f" ({why})" if why else ""
        return HostError("host_died", f"plugin host {self.name} exited (code {code}) "
                                      f"during job {job_id or 'load'}{clue}{why}",
                         retryable=True)

    def cancel(self, job_id: str) -> None:
        if self.alive():
            try:
                self._writer.send({"type": "cancel", "job_id": job_id})
            except OSError:
                pass

    def run(self, job_id: str, inputs: dict, *, wall_clock_s: float,
            on_progress: Callable[[int, int, str], None] = lambda *a: None,
            on_stream: Callable[[str, list], None] = lambda *a: None,
            cancelled: threading.Event | None = None,
            checkpoint_every: int = 0, resume_from: bytes | None = None,
            on_checkpoint: Callable[[int, bytes], None] = lambda *a: None,
            request_id: str = "",
            on_preview: Callable[[int, bytes, str], None] = lambda *a: None) -> HostResult:
        """Run one job. Raises HostError (``code`` says why) when it fails. The plugin
        writes a checkpoint every ``checkpoint_every`` steps (0: never), each handed to
        ``on_checkpoint(step, data)``; ``resume_from`` is a checkpoint to continue from."""
        with self._lock:
            if not self.alive():
                log.warning("plugin host %s is not running; restarting", self.name)
                self.start()
            try:
                self._writer.send({"type": "run", "job_id": job_id, "inputs": inputs,
                                   "checkpoint_every": int(checkpoint_every),
                                   "request_id": request_id},
                                  resume_from or b"")
            except (OSError, ValueError):  # it died between jobs: the pipe is broken
                self._recover(f"host was gone when job {job_id} arrived")
                raise HostError("host_died", f"plugin host {self.name} had exited before job "
                                f"{job_id} started; it was restarted", retryable=True) from None
            deadline = time.monotonic() + wall_clock_s
            outputs: list[HostOutput] = []
            cancel_sent = False
            while True:
                if cancelled is not None and cancelled.is_set() and not cancel_sent:
                    self.cancel(job_id)
                    cancel_sent = True
                left = deadline - time.monotonic()
                if left <= 0:
                    self._recover(f"job {job_id} ran past its wall clock of {wall_clock_s:g}s")
                    raise HostError("wall_clock_exceeded", f"the job ran longer than "
                                    f"{wall_clock_s:g}s; the plugin host was restarted",
                                    retryable=True)
                try:
                    header, body = self._next(min(left, 0.1), job_id)
                except TimeoutError:
                    continue
                except HostError:
                    self._recover(f"host died during job {job_id}")
                    raise
                kind = header["type"]
                if header.get("job_id") not in (job_id, "", None):
                    continue  # a late frame of an earlier, abandoned job
                if kind == "progress":
                    on_progress(header["step"], header["total"], header.get("message", ""))
                elif kind == "stream":
                    on_stream(header["text"], header.get("token_ids", []))
                elif kind == "checkpoint":
                    on_checkpoint(int(header["step"]), body)
                elif kind == "preview":
                    on_preview(int(header["step"]), body, header.get("media_type", ""))
                elif kind == "output":
                    outputs.append(HostOutput(header["index"], header["media_type"], body,
                                              header.get("meta", {})))
                elif kind == "result":
                    return HostResult(outputs, header["run_ms"], header["work_units"])
                elif kind == "failed":
                    raise HostError(header["code"], header["message"],
                                    retryable=header.get("retryable", True))

    def _recover(self, why: str) -> None:
        log.error("plugin host %s: %s; restarting it", self.name, why)
        self.kill()
        try:
            self.start()
        except HostError as exc:
            log.error("plugin host %s could not restart: %s", self.name, exc)


class HostFactory(Protocol):
    """What the agent builds each plugin's host with (``Agent(host_factory=...)``):
    ``PluginHost`` itself in production. A harness may pass a factory of hosts with
    PluginHost's interface (bench/cheating_host.py wraps the real host to simulate
    cheats); the production agent has no other."""

    def __call__(self, plugin_dir: Path, weights_dir: Path | None, *, device: str,
                 launcher: Callable[..., subprocess.Popen] | None, name: str,
                 max_vram_gb: float) -> PluginHost: ...
