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

The database records which key it is sealed with (``at_rest_key_check``: a keyed hash of a
constant, :attr:`AtRestCipher.check_value`, never the key). :func:`open_at_rest` loads the
broker's key and compares it with the recorded one, recording it the first time (a key
file a one-off command made for itself is not recorded: only ``serve`` records one); a broker
with another key, or none while the database has one, is refused at start
(:class:`AtRestMismatch`, naming the setting to fix), before it writes anything the others
cannot read.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from nacl.exceptions import CryptoError
from nacl.secret import SecretBox
from nacl.utils import random as random_bytes
from sqlalchemy import JSON, Text
from sqlalchemy.types import TypeDecorator

from broker.blobs.local import LocalBlobStore

log = logging.getLogger(__name__)

_ATTR = "sparecycles_at_rest"
_JSON_MARK = "$sealed"
_TEXT_MARK = "sealed:v1:"
_BLOB_MARK = b"SCSEAL1\0"
# What sealing adds to a value: its nonce and its authenticator.
SEAL_OVERHEAD = SecretBox.NONCE_SIZE + SecretBox.MACBYTES
# What the key check value hashes (keyed with the at-rest key): it names the key, and
# tells nothing about it.
_CHECK_CONSTANT = b"sparecycles at-rest key check v1"
KEY_SETTING = "SPARECYCLES_AT_REST_KEY"


class AtRestError(RuntimeError):
    pass


class AtRestMismatch(AtRestError):
    """This broker's at-rest key is not the one the database is sealed with (or it has
    none): it would write what the other replicas cannot read, and read nothing of theirs."""


class AtRestCipher:
    def __init__(self, key: bytes):
        if len(key) != SecretBox.KEY_SIZE:
            raise AtRestError(f"the at-rest key must be {SecretBox.KEY_SIZE} bytes, got "
                              f"{len(key)}")
        self._box = SecretBox(key)
        #: identifies the key (stored in the database; see :func:`open_at_rest`)
        self.check_value = hashlib.blake2b(_CHECK_CONSTANT, key=key, digest_size=16).hexdigest()

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


def open_at_rest(engine, explicit_b64: str, path: Path, *, record_new: bool) -> AtRestCipher:
    """The broker's at-rest key (:meth:`AtRestCipher.load`), checked against the one the
    database (migrated: it has the ``at_rest_key_check`` table) records, and recorded when
    none is. A database that records a key is refused to a broker that has none (no
    ``explicit_b64``, no file at ``path``) before a new key file is made for it.

    A key file made by this call is recorded only when ``record_new`` (``broker serve``,
    which keeps its data dir and seals with the key): a one-off command run where the file
    does not last (a throwaway container) must not record a key nobody keeps, which would
    refuse every real replica. A key file made by a call that is then refused is removed
    (the error says to copy the right key to that path)."""
    made = not explicit_b64 and not path.exists()
    stored = recorded_key_check(engine)
    if stored is not None and made:
        raise AtRestMismatch(
            f"this database is sealed with an at-rest key (check value {stored[:12]}…) that "
            f"this broker does not have: neither {KEY_SETTING} nor {path} is set. Give it "
            f"the key the other replicas use: set {KEY_SETTING} (at_rest_key) to it, or copy "
            "the at_rest.key of the broker that first served this database to "
            f"{path}; a new key would write what they cannot read")
    cipher = AtRestCipher.load(explicit_b64, path)
    try:
        record_key_check(engine, cipher, source=KEY_SETTING if explicit_b64 else str(path),
                         record=record_new or not made)
    except AtRestError:
        if made:
            path.unlink(missing_ok=True)
        raise
    if made and not record_new:
        log.warning("made a new at-rest key in %s for this command and did not record it in "
                    "the database: the first broker to serve it records its own key. Give "
                    "one-off commands the replicas' key (%s) where that file does not last",
                    path, KEY_SETTING)
    return cipher


def record_key_check(engine, cipher: AtRestCipher, source: str = KEY_SETTING, *,
                     record: bool = True) -> str:
    """Compare ``cipher``'s check value with the database's; record it when the database
    has none (unless values already sealed there do not open with it; ``record`` False:
    only check). Returns what it did: ``"matches"``, ``"recorded"`` or ``"unrecorded"``;
    raises :class:`AtRestMismatch` (``source``: where the key came from, said in the
    error)."""
    from sqlalchemy import insert
    from sqlalchemy.exc import IntegrityError

    from .models import AtRestKeyCheckRow

    table = AtRestKeyCheckRow.__table__
    for _ in range(2):
        stored = recorded_key_check(engine)
        if stored == cipher.check_value:
            return "matches"
        if stored is not None:
            raise AtRestMismatch(
                f"this broker's at-rest key (check value {cipher.check_value[:12]}…, from "
                f"{source}) is not the one this database is sealed with (check value "
                f"{stored[:12]}…): a replica with another key writes what the others cannot "
                f"read. Set {KEY_SETTING} (at_rest_key) to the same key on every replica, "
                "or copy the at_rest.key of the broker that first served this database")
        _refuse_if_sealed_otherwise(engine, cipher, source)
        if not record:
            return "unrecorded"
        try:
            with engine.begin() as c:
                c.execute(insert(table).values(id=1, check_value=cipher.check_value,
                                               set_at=time.time()))
        except IntegrityError:
            continue  # another replica recorded one meanwhile: compare with it
        log.info("recorded the at-rest key's check value %s… in the database",
                 cipher.check_value[:12])
        return "recorded"
    raise AtRestError("the at-rest key check value could not be read or recorded")


def recorded_key_check(engine) -> str | None:
    """The check value of the key this database is sealed with (None: not recorded yet)."""
    from sqlalchemy import select

    from .models import AtRestKeyCheckRow

    table = AtRestKeyCheckRow.__table__
    with engine.connect() as c:
        return c.execute(select(table.c.check_value).where(table.c.id == 1)).scalar()


def _refuse_if_sealed_otherwise(engine, cipher: AtRestCipher, source: str,
                                sample: int = 20) -> None:
    """A database sealed before it recorded its key (by an older broker): the newest
    sealed job inputs must open with ``cipher`` before its check value is recorded."""
    from sqlalchemy import JSON, select, type_coerce

    from .models import JobRow

    t = JobRow.__table__
    with engine.connect() as c:
        rows = c.execute(select(t.c.id, type_coerce(t.c.inputs, JSON)).order_by(
            t.c.created_at.desc()).limit(sample)).all()
    job_id, sealed = next(((i, v) for i, v in rows if _is_sealed(v)), (None, None))
    if sealed is None:
        return
    try:
        raw = base64.b64decode(sealed[_JSON_MARK], validate=True)
    except (ValueError, TypeError):  # binascii.Error is a ValueError
        raise AtRestError(
            f"job {job_id}'s stored inputs are marked sealed but are not base64 "
            f"({str(sealed[_JSON_MARK])[:40]!r}): the row is damaged, so the database's "
            "at-rest key cannot be checked against its sealed jobs and none is recorded. "
            "Restore that row from a backup (or delete the job), then start again with "
            f"the key its jobs were sealed with ({KEY_SETTING}, at_rest_key)") from None
    try:
        cipher.open(raw)
    except AtRestError:
        raise AtRestMismatch(
            f"jobs in this database are sealed with another at-rest key than this broker's "
            f"(from {source}); give it the key they were sealed with: {KEY_SETTING} "
            "(at_rest_key) or the at_rest.key of the broker that wrote them") from None


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
    backups still hold what was written before: rotate those as your retention allows.)
    The database records the key's check value first (:func:`record_key_check`): a key
    that is not the one it is sealed with is refused before anything is rewritten."""
    from sqlalchemy import select, type_coerce, update

    from .models import JobEventRow, JobRow

    cipher = _cipher(engine.dialect)
    if cipher is None:
        raise AtRestError("seal_existing needs an engine with the at-rest key (attach)")
    record_key_check(engine, cipher)
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
