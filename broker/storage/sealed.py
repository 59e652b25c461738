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
# What sealing adds to a value: its nonce and its authenticator.
SEAL_OVERHEAD = SecretBox.NONCE_SIZE + SecretBox.MACBYTES


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

    def _stored(self, data: bytes) -> bytes:
        return _BLOB_MARK + self.cipher.seal(data)

    def put_file(self, src: Path | str, key: str) -> bool:
        """As :meth:`LocalBlobStore.put_file`, sealing the file's bytes on the way in (a
        sealed blob cannot be renamed into place as it is)."""
        src = Path(src)
        try:
            path = self._path(key)
            if path.exists():
                return False
            self._write(path, self._stored(src.read_bytes()))
            return True
        finally:
            src.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        data = super().get(key)
        if data.startswith(_BLOB_MARK):
            return self.cipher.open(data[len(_BLOB_MARK):])
        return data  # written before blobs were sealed

    def size(self, key: str) -> int:
        """The plaintext's size, from the file's (no need to open the seal)."""
        stored = super().size(key)
        with open(self._path(key), "rb") as f:
            if f.read(len(_BLOB_MARK)) != _BLOB_MARK:
                return stored  # written before blobs were sealed
        return stored - len(_BLOB_MARK) - SEAL_OVERHEAD

    def path(self, key: str) -> Path:
        raise AtRestError("sealed blobs cannot be served from disk as they are; read them "
                          "with get()")


def seal_existing(engine, blobs, batch: int = 500) -> dict[str, int]:
    """Seal what was stored in plaintext before this broker sealed at rest (or by an
    engine without the key): job inputs, envelopes, error messages, event data; then compact
    the database so the old plaintext is gone from its files too; then the job blob files
    of a sealed local folder (``blobs``, or the store it wraps; an S3 bucket seals its own).
    Idempotent; returns how many of each it sealed. (PostgreSQL's WAL segments and any
    backups still hold what was written before: rotate those as your retention allows.)"""
    from sqlalchemy import select, type_coerce, update

    from .models import JobEventRow, JobRow

    counts = {"jobs": 0, "events": 0, "blobs": 0}
    jobs, events = JobRow.__table__, JobEventRow.__table__
    for table, key, columns, what in (
            (jobs, jobs.c.id, ("inputs", "envelope", "error_message"), "jobs"),
            (events, events.c.id, ("data",), "events")):
        raw = [type_coerce(table.c[name], JSON if name != "error_message" else Text).label(name)
               for name in columns]
        last = None
        while True:
            with engine.begin() as c:
                # locked: a broker serving meanwhile must not have a newer value
                # overwritten by the one read here
                q = select(key, *raw).order_by(key).limit(batch).with_for_update()
                if last is not None:
                    q = q.where(key > last)
                rows = c.execute(q).all()
                for row in rows:
                    plain = {name: getattr(row, name) for name in columns
                             if getattr(row, name) is not None and not _is_sealed(
                                 getattr(row, name))}
                    if plain:
                        c.execute(update(table).where(key == row[0]).values(**plain))
                        counts[what] += 1
            if len(rows) < batch:
                break
            last = rows[-1][0]
    if counts["jobs"] or counts["events"]:
        _compact(engine)
    while not isinstance(blobs, SealedBlobStore) and hasattr(blobs, "_inner"):
        blobs = blobs._inner  # a wrapper that counts (broker.observability.metered)
    if not isinstance(blobs, SealedBlobStore):
        return counts  # S3: the bucket seals its objects (docs/architecture.md)
    for path in blobs.root.glob("[0-9a-f][0-9a-f]/[0-9a-f][0-9a-f]/*"):
        if not path.is_file() or path.name.startswith(".tmp-"):
            continue
        with open(path, "rb") as f:
            if f.read(len(_BLOB_MARK)) == _BLOB_MARK:
                continue
        data = path.read_bytes()
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_bytes(_BLOB_MARK + blobs.cipher.seal(data))
        os.replace(tmp, path)
        counts["blobs"] += 1
    return counts


def _compact(engine) -> None:
    """Drop the plaintext that rewritten rows leave behind: SQLite keeps old pages in its
    free list and old frames in the WAL file (VACUUM rewrites the file, a TRUNCATE
    checkpoint empties the WAL); PostgreSQL keeps dead row versions until a VACUUM FULL
    rewrites the tables (it locks them meanwhile: run this in a quiet moment)."""
    from sqlalchemy import text

    if engine.dialect.name == "sqlite":
        raw = engine.raw_connection()  # (the engine's connections BEGIN on their own)
        try:
            cur = raw.cursor()
            cur.execute("VACUUM")
            cur.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            cur.close()
        finally:
            raw.close()
    elif engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text("VACUUM FULL jobs, job_events"))


def _is_sealed(value) -> bool:
    if isinstance(value, dict):
        return len(value) == 1 and _JSON_MARK in value
    return isinstance(value, str) and value.startswith(_TEXT_MARK)
