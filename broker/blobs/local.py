"""LocalBlobStore: content-addressed files under one folder (``ab/cd/abcdef…``).

Writes go to a temporary file that is renamed into place, so a crash never leaves a
half-written blob under its final name, and storing the same bytes twice is a no-op.
Large uploads are streamed into a file under :meth:`tmp_dir` (same file system) and moved
into place with :meth:`put_file`; :meth:`path` lets a web server stream a blob from disk.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from typing import Iterator

from sdk.protocol.canonical import is_sha256_hex

from broker.errors import NotFound
from .model import StoredBlob


class LocalBlobStore:
    presigns = False  # no URLs: bytes travel through the broker (the agent's stream)

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not is_sha256_hex(key):
            raise NotFound(f"no blob {key!r}: blob keys are sha256 hex digests")
        return self.root.joinpath(key[:2], key[2:4], key)

    def put(self, data: bytes) -> str:
        key = hashlib.sha256(data).hexdigest()
        path = self._path(key)
        if not path.exists():
            self._write(path, self._stored(data))
        return key

    def _stored(self, data: bytes) -> bytes:
        """What is written to disk for ``data`` (a sealed store seals it)."""
        return data

    @staticmethod
    def _write(path: Path, stored: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(stored)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def tmp_dir(self) -> Path:
        """A folder for uploads in progress, on the blobs' file system (cheap renames)."""
        tmp = self.root / ".tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def put_file(self, src: Path | str, key: str) -> bool:
        """Move the file ``src`` into place as blob ``key`` — its sha256, which the caller
        has checked. True when the blob is new; ``src`` is gone afterwards either way."""
        src = Path(src)
        path = self._path(key)
        if path.exists():
            src.unlink(missing_ok=True)
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(src, path)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            os.close(fd)
            try:
                shutil.copyfile(src, tmp)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            src.unlink(missing_ok=True)
        return True

    def path(self, key: str) -> Path:
        """The file holding blob ``key`` (read it, never write it); NotFound if absent."""
        path = self._path(key)
        if not path.is_file():
            raise NotFound(f"no blob {key}")
        return path

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

    def check(self, key: str) -> str:
        """"ok" or "missing" (bytes reach this store only through the broker, which
        checked their sha256 on arrival; :meth:`get` readers may check again)."""
        return "ok" if self.exists(key) else "missing"

    def delete(self, key: str) -> bool:
        """Remove blob ``key``; False when it was not there."""
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def blobs(self) -> Iterator[StoredBlob]:
        """Every blob stored (uploads in progress under .tmp are not blobs)."""
        for first in sorted(self.root.iterdir()):
            if len(first.name) != 2 or not first.is_dir():
                continue
            for path in first.glob("*/*"):
                if is_sha256_hex(path.name):
                    try:
                        st = path.stat()
                    except FileNotFoundError:
                        continue  # deleted meanwhile
                    yield StoredBlob(path.name, st.st_size, st.st_mtime)

    def usage(self) -> tuple[int, int]:
        """(blobs, bytes) stored."""
        n = total = 0
        for b in self.blobs():
            n += 1
            total += b.size
        return n, total
