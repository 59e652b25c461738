"""Encryption at rest of what holds a client's prompt or outputs (docs/architecture.md,
*Security: who can read a prompt*).

Columns typed :class:`SealedJSON` / :class:`SealedText` (a job's inputs, its envelope, its
error message, its events' data: streamed tokens, failure messages) and the job blob store
(:class:`SealedBlobStore`: outputs and checkpoints) are encrypted with the broker's at-rest
key: XSalsa20-Poly1305 (PyNaCl ``SecretBox``), a random nonce per value. The key is
``at_rest_key`` (``SPARECYCLES_AT_REST_KEY``, 32 bytes in base64; replicas must share it)
or ``<data_dir>/at_rest.key`` (0600, made on first start). Whoever holds the database file
or the blob folder without that key holds ciphertext.

The key reaches the column types through the engine's dialect (``attach``), set where the
broker builds its engine: a type is shared by every engine, a dialect belongs to one. An
engine without a key (a test's own) stores plaintext; values written either way are read
back, so old rows keep working and are sealed when next written.
"""
from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from nacl.exceptions import CryptoError
from nacl.secret import SecretBox
from nacl.utils import random as random_bytes
from sqlalchemy import JSON, Text
from sqlalchemy.types import TypeDecorator

from broker.blobs.local import LocalBlobStore

_ATTR = "sparecycles_at_rest"
_JSON_MARK = "$sealed"
_TEXT_MARK = "sealed:v1:"
_BLOB_MARK = b"SCSEAL1\0"


class AtRestError(RuntimeError):
    pass


class AtRestCipher:
    def __init__(self, key: bytes):
        if len(key) != SecretBox.KEY_SIZE:
            raise AtRestError(f"the at-rest key must be {SecretBox.KEY_SIZE} bytes, got "
                              f"{len(key)}")
        self._box = SecretBox(key)

    @classmethod
    def load(cls, explicit_b64: str, path: Path) -> "AtRestCipher":
        """The key from ``explicit_b64`` (SPARECYCLES_AT_REST_KEY), else ``path``, made
        (0600) when missing."""
        if explicit_b64:
            try:
                return cls(base64.b64decode(explicit_b64, validate=True))
            except (ValueError, AtRestError) as exc:
                raise AtRestError(f"SPARECYCLES_AT_REST_KEY is not 32 bytes in base64 ({exc}); "
                                  "make one with: python -c \"import base64,os;"
                                  "print(base64.b64encode(os.urandom(32)).decode())\"") from None
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(base64.b64encode(random_bytes(SecretBox.KEY_SIZE)) + b"\n")
        try:
            return cls(base64.b64decode(path.read_bytes().strip(), validate=True))
        except (ValueError, AtRestError) as exc:
            raise AtRestError(f"{path} does not hold a 32-byte key in base64 ({exc})") from None

    def seal(self, data: bytes) -> bytes:
        return bytes(self._box.encrypt(data))

    def open(self, data: bytes) -> bytes:
        try:
            return self._box.decrypt(data)
        except CryptoError:
            raise AtRestError("a sealed value does not open with this broker's at-rest key "
                              "(was the key changed? replicas must share one)") from None


def attach(engine, cipher: AtRestCipher) -> None:
    setattr(engine.dialect, _ATTR, cipher)


def _cipher(dialect) -> AtRestCipher | None:
    return getattr(dialect, _ATTR, None)


class SealedJSON(TypeDecorator):
    """A JSON value stored as ``{"$sealed": "<base64>"}`` when the engine has a key."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value, dialect):
        cipher = _cipher(dialect)
        if value is None or cipher is None:
            return value
        raw = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        return {_JSON_MARK: base64.b64encode(cipher.seal(raw)).decode("ascii")}

    def process_result_value(self, value, dialect):
        if isinstance(value, dict) and len(value) == 1 and _JSON_MARK in value:
            cipher = _cipher(dialect)
            if cipher is None:
                raise AtRestError("a sealed column was read by an engine without the at-rest "
                                  "key")
            return json.loads(cipher.open(base64.b64decode(value[_JSON_MARK])))
        return value


class SealedText(TypeDecorator):
    impl = Text
    cache_ok = True

    def process_bind_param(self, value, dialect):
        cipher = _cipher(dialect)
        if value is None or cipher is None:
            return value
        return _TEXT_MARK + base64.b64encode(cipher.seal(value.encode())).decode("ascii")

    def process_result_value(self, value, dialect):
        if isinstance(value, str) and value.startswith(_TEXT_MARK):
            cipher = _cipher(dialect)
            if cipher is None:
                raise AtRestError("a sealed column was read by an engine without the at-rest "
                                  "key")
            return cipher.open(base64.b64decode(value[len(_TEXT_MARK):])).decode()
        return value


class SealedBlobStore(LocalBlobStore):
    """Job outputs and checkpoints, each file sealed with the at-rest key. Blobs are still
    named by the sha256 of their plaintext (receipts bind outputs by it), so equal outputs
    share a name; their contents are ciphertext."""

    def __init__(self, root, cipher: AtRestCipher):
        super().__init__(root)
        self.cipher = cipher

    def put(self, data: bytes) -> str:
        import hashlib
        import tempfile

        key = hashlib.sha256(data).hexdigest()
        path = self._path(key)
        if path.exists():
            return key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_BLOB_MARK + self.cipher.seal(data))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return key

    def get(self, key: str) -> bytes:
        data = super().get(key)
        if data.startswith(_BLOB_MARK):
            return self.cipher.open(data[len(_BLOB_MARK):])
        return data  # written before blobs were sealed

    def size(self, key: str) -> int:
        return len(self.get(key))

    def path(self, key: str) -> Path:
        raise AtRestError("sealed blobs cannot be served from disk as they are; read them "
                          "with get()")
