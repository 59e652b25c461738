"""Weight folders: the digest an agent advertises so the broker matches exact weights."""
from __future__ import annotations

import json
from pathlib import Path

from sdk.protocol.digest import file_sha256, folder_digest as _digest


def folder_digest(folder: Path | None, cache_file: Path | None = None) -> str:
    """The folder's weights digest (sdk.protocol.digest), "" for None. File hashes are
    cached by (path, size, mtime) so a restart does not rehash gigabytes; the cache keeps
    only the files seen this time."""
    if folder is None:
        return ""
    cache: dict = {}
    if cache_file and cache_file.exists():
        try:
            cache = json.loads(cache_file.read_text())
        except ValueError:
            cache = {}
    seen: dict = {}

    def cached(path: Path) -> str:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        seen[key] = cache.get(key) or file_sha256(path)
        return seen[key]

    digest = _digest(folder, cached)
    if cache_file and seen != cache:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(seen))
    return digest
