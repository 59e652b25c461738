"""Weight folders: the digest an agent advertises so the broker matches exact weights."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_digest(folder: Path | None, cache_file: Path | None = None) -> str:
    """sha256 over every file's relative path and sha256, in sorted order ("" for None).
    File hashes are cached by (size, mtime) so a restart does not rehash gigabytes."""
    if folder is None:
        return ""
    folder = Path(folder)
    cache: dict = {}
    if cache_file and cache_file.exists():
        try:
            cache = json.loads(cache_file.read_text())
        except ValueError:
            cache = {}
    outer = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        digest = cache.get(key) or file_sha256(path)
        cache[key] = digest
        outer.update(f"{rel}\0{digest}\n".encode())
    if cache_file:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cache))
    return outer.hexdigest()
