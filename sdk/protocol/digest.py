"""The weights digest an agent advertises for a plugin (capabilities) and the tiny-weight
builder prints: sha256 over every file's relative path and sha256, in sorted order. Defined
once here because both sides of the wire must compute it the same way."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Callable


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_digest(folder: Path | str, file_hash: Callable[[Path], str] = file_sha256) -> str:
    """The digest of ``folder``; ``file_hash`` may serve file hashes from a cache."""
    folder = Path(folder)
    outer = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        outer.update(f"{rel}\0{file_hash(path)}\n".encode())
    return outer.hexdigest()


def files_digest(files: Iterable[tuple[str, str]]) -> str:
    """The same digest from a list of ``(relative path, sha256)`` pairs, e.g. a manifest's
    ``[[weights]]``: what :func:`folder_digest` gives for a folder holding exactly those
    files. Paths are ordered by their components, as ``folder_digest`` orders ``Path``
    objects (so ``a/b`` sorts before ``a-c``, unlike plain string order)."""
    entries = sorted((PurePosixPath(rel).parts, PurePosixPath(rel).as_posix(), sha)
                     for rel, sha in files)
    outer = hashlib.sha256()
    for _, rel, sha in entries:
        outer.update(f"{rel}\0{sha}\n".encode())
    return outer.hexdigest()
