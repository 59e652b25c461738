"""The plugin host process: loads one plugin once, then runs jobs until told to stop.

Started by the agent as ``python -m provider_agent.host.main`` (inside the sandbox). The
protocol runs over the original stdin/stdout; stdout is then pointed at stderr so a plugin
that prints cannot corrupt the frames.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import traceback
from pathlib import Path


def _protocol_streams():
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    os.dup2(2, 1)  # plugin prints go to stderr (the agent's log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = sys.stderr
    return proto_in, proto_out


class Context:
    """RunContext for one job (see plugins.api)."""

    def __init__(self, job_id: str, writer, scratch: Path):
        self.job_id = job_id
        self.scratch_dir = scratch
        self._writer = writer
        self._cancel = threading.Event()

    def progress(self, step: int, total: int, message: str = "") -> None:
        self._writer.send({"type": "progress", "job_id": self.job_id, "step": int(step),
                           "total": int(total), "message": message})

    def stream(self, text: str, token_ids=None) -> None:
        self._writer.send({"type": "stream", "job_id": self.job_id, "text": text,
                           "token_ids": list(token_ids or [])})

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check_cancelled(self) -> None:
        from plugins.api import Cancelled

        if self._cancel.is_set():
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
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu_name=props.name, vram_gb=round(props.total_memory / 2**30, 1))
    return info


def main() -> int:
    from provider_agent.host.protocol import FrameWriter, read_frame

    proto_in, proto_out = _protocol_streams()
    writer = FrameWriter(proto_out)
    header, _ = read_frame(proto_in)
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
    writer.send({"type": "ready", "plugin": manifest.name, "version": manifest.version,
                 "load_ms": int((time.perf_counter() - t0) * 1000),
                 "schema": manifest.inputs.json_schema(), "hardware": _hardware(device)})

    jobs: list = []
    jobs_cv = threading.Condition()
    current: dict[str, Context] = {}

    def reader():
        while True:
            try:
                h, _ = read_frame(proto_in)
            except EOFError:
                h = {"type": "shutdown"}
            if h["type"] == "cancel":
                ctx = current.get(h.get("job_id", ""))
                if ctx:
                    ctx._cancel.set()
                continue
            with jobs_cv:
                jobs.append(h)
                jobs_cv.notify()
            if h["type"] == "shutdown":
                return

    threading.Thread(target=reader, daemon=True, name="host-reader").start()
    from plugins.api import PluginError

    while True:
        with jobs_cv:
            while not jobs:
                jobs_cv.wait()
            h = jobs.pop(0)
        if h["type"] == "shutdown":
            try:
                plugin.teardown()
            finally:
                return 0
        if h["type"] != "run":
            continue
        job_id = h["job_id"]
        scratch = scratch_root / f"job-{job_id}"
        scratch.mkdir(parents=True, exist_ok=True)
        ctx = Context(job_id, writer, scratch)
        current[job_id] = ctx
        t_run = time.perf_counter()
        try:
            inputs = manifest.validate_inputs(h["inputs"])
            outputs = plugin.run(inputs, ctx)
            for i, out in enumerate(outputs):
                writer.send({"type": "output", "job_id": job_id, "index": i,
                             "media_type": out.media_type, "meta": out.meta}, out.data)
            writer.send({"type": "result", "job_id": job_id, "count": len(outputs),
                         "run_ms": int((time.perf_counter() - t_run) * 1000),
                         "work_units": manifest.work_units_for(inputs)})
        except PluginError as exc:
            writer.send({"type": "failed", "job_id": job_id, "code": exc.code,
                         "message": str(exc), "retryable": exc.retryable})
        except ValueError as exc:  # schema errors from validate_inputs
            writer.send({"type": "failed", "job_id": job_id, "code": "bad_input",
                         "message": str(exc), "retryable": False})
        except Exception as exc:  # noqa: BLE001 - any plugin bug becomes a clean job failure
            traceback.print_exc()
            writer.send({"type": "failed", "job_id": job_id, "code": "plugin_crashed",
                         "message": f"{type(exc).__name__}: {exc}", "retryable": True})
        finally:
            current.pop(job_id, None)
            _rmtree(scratch)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
