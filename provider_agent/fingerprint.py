"""The machine's fingerprint, sent with the agent's hardware (issue #20).

The broker links two operator accounts whose agents report the same fingerprint: one
machine, most likely one person. It is the SHA-256 of the operating system's machine id
(``/etc/machine-id``, set once at install) and the UUIDs of the NVIDIA GPUs (NVML, when
the library is there), so neither leaves the machine in the clear; "" when there is
nothing stable to read. An agent can report anything here: a fingerprint links, it can
never unlink (the broker's other signals stand).
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger("agent")

MACHINE_ID_PATHS = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


def gpu_uuids() -> list[str]:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
            return sorted(out)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no GPU: nothing to add
        return []


def machine_fingerprint(paths=MACHINE_ID_PATHS) -> str:
    parts = []
    for path in paths:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            parts.append(f"machine:{text}")
            break
    parts += [f"gpu:{u}" for u in gpu_uuids()]
    if not parts:
        return ""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
