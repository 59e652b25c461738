"""What a plugin host may see and use: the ``SandboxPolicy`` value object.

A policy is plain data.  ``SandboxPolicy.for_current_python`` fills in the Python
environment of the running agent, which is what a plugin host normally runs on.
"""
from __future__ import annotations

import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SandboxPolicyError


@dataclass
class SandboxPolicy:
    """The limits and the view of the filesystem given to one plugin host.

    Paths are bound read-only at the same place inside the sandbox, so tracebacks and
    ``__file__`` read the same inside and out.  Nothing else of the host filesystem is
    visible except system libraries (``/usr``, a few files of ``/etc``); the only writable
    places are private tmpfs mounts, each capped at ``scratch_size_mb``: ``/scratch`` (the
    working directory), ``/tmp`` and ``/dev/shm``.  Their pages count against the memory
    limit where a cgroup enforces it.
    """

    python_prefixes: list[Path]
    ro_paths: list[Path]
    scratch_size_mb: int = 1024
    memory_limit_mb: int | None = 8192
    pids_limit: int = 256
    nofile_limit: int = 1024
    fsize_limit_mb: int = 1024
    gpu_devices: list[int] = field(default_factory=list)
    # Where the NVIDIA nodes of ``gpu_devices`` are found (bound at /dev/<name> inside);
    # only tests with fake devices move it.
    gpu_dev_root: Path = Path("/dev")
    hide_paths: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.python_prefixes = [Path(p) for p in self.python_prefixes]
        self.ro_paths = [Path(p) for p in self.ro_paths]
        self.hide_paths = [Path(p) for p in self.hide_paths]
        self.gpu_dev_root = Path(self.gpu_dev_root)
        for name in ("scratch_size_mb", "pids_limit", "nofile_limit", "fsize_limit_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise SandboxPolicyError(f"{name} must be a positive integer; got {value!r}")
        if self.memory_limit_mb is not None and (
                not isinstance(self.memory_limit_mb, int) or self.memory_limit_mb <= 0):
            raise SandboxPolicyError(
                f"memory_limit_mb must be a positive integer or None (no limit); "
                f"got {self.memory_limit_mb!r}")
        for idx in self.gpu_devices:
            if not isinstance(idx, int) or idx < 0:
                raise SandboxPolicyError(
                    f"gpu_devices holds NVIDIA device indices (0, 1, …); got {idx!r}")
        for path in [*self.python_prefixes, *self.ro_paths]:
            if not path.is_absolute():
                raise SandboxPolicyError(f"sandbox paths must be absolute; got {str(path)!r}")
        for key in self.env:
            if not key or "=" in key:
                raise SandboxPolicyError(f"bad environment variable name {key!r}")

    @staticmethod
    def current_python_prefixes() -> list[Path]:
        """The directories the running interpreter needs: its prefix, base prefix and
        site-packages (deduplicated, nested ones dropped)."""
        candidates = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
                      Path(sys.base_exec_prefix), *map(Path, site.getsitepackages())]
        # The interpreter binary may be a symlink out of the venv (pyenv, /usr/bin).
        candidates.append(Path(sys.executable).resolve().parent.parent)
        return _outermost([p.resolve() for p in candidates if p.exists()])

    @classmethod
    def for_current_python(cls, ro_paths: list[Path], **kwargs) -> "SandboxPolicy":
        """A policy for running the current interpreter (``sys.executable``) inside."""
        return cls(python_prefixes=cls.current_python_prefixes(), ro_paths=list(ro_paths),
                   **kwargs)


def _outermost(paths: list[Path]) -> list[Path]:
    """Drop duplicates and any path inside another one of the list."""
    out: list[Path] = []
    for path in sorted(set(paths), key=lambda p: len(p.parts)):
        if not any(path == kept or kept in path.parents for kept in out):
            out.append(path)
    return out
