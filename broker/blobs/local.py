"""LocalBlobStore: content-addressed files under one folder (``ab/cd/abcdef…``).

Writes go to a temporary file that is renamed into place, so a crash never leaves a
half-written blob under its final name, and storing the same bytes twice is a no-op.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from broker.errors import NotFound

_KEY = re.compile(r"^[0-9a-f]{64}$")


class LocalBlobStore:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise NotFound(f"no blob {key!r}: blob keys are sha256 hex digests")
        return self.root / key[:2] / key[2:4] / key

    def put(self, data: bytes) -> str:
        key = hashlib.sha256(data).hexdigest()
        path = self._path(key)
        if path.exists():
            return key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return key

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"no blob {key}") from None

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"no blob {key}") from None

    def exists(self, key: str) -> bool:
        try:
            return self._path(key).exists()
        except NotFound:
            return False
