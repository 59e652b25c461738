"""RegistryService: publishing and finding signed plugin and adapter versions.

* **Publisher keys**: an account with the ``publisher`` (or ``admin``) role registers an
  Ed25519 public key, proving it holds the private half by signing
  ``{"account_id", "public_key"}`` (purpose ``publisher``). A key belongs to one account.
* **Files first, then the document**: a publisher uploads each file into the registry's
  own blob store, apart from job outputs (``PUT /v1/blobs/<sha256>``, content-addressed,
  checked before the body is read, streamed to disk, at most ``MAX_BLOB_BYTES``), then
  publishes the signed document (sdk.protocol.package) that lists every file's sha256 and
  size. Publishing checks the signature, that the key is the caller's, that every file is
  in the blob store with that size, and the package's own rules (manifest, weights,
  adapter base).
* **Immutable versions**: ``name@version`` is published once. The same document again is
  accepted and changes nothing; another document for it is a 409 ``version_exists``.
* **Names**: the first account to publish a name owns it (plugins and adapters are separate
  namespaces); the built-in plugins' names belong to the platform (admins only).
* **Royalties**: an adapter version carries the per-use royalty its publisher set. Jobs
  name adapters without a version (``"ink:0.8"``); the broker and agents use the latest
  published version of an adapter for the job's plugin, and so does the royalty.

Domain code: no Flask, no SQLAlchemy (storage implements :class:`RegistryRepository`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from sdk.protocol.canonical import canonical_bytes, is_sha256_hex
from sdk.protocol.manifest import parse_manifest, version_key as semver_key
from sdk.protocol.package import (Package, PackageError, adapter_names, check_adapter_files,
                                  document_digest, publisher_proof_document, verify_document)
from sdk.protocol.signing import SignatureError, verify

from broker.errors import (Conflict, Forbidden, InvalidInput, InvalidRequest, NotFound,
                           PayloadTooLarge, UnknownPlugin)

log = logging.getLogger(__name__)

PUBLISH_ROLES = ("publisher", "admin")
MAX_BLOB_BYTES = 8 * 1024**3   # the largest package file PUT /v1/blobs accepts (413 above)
UPLOAD_CHUNK = 1 << 20


@dataclass(frozen=True)
class PublisherKey:
    key_id: str
    account_id: str
    public_key: str
    label: str
    created_at: float
    revoked_at: float | None = None

    def to_public(self) -> dict:
        return {"key_id": self.key_id, "public_key": self.public_key, "label": self.label,
                "created_at": self.created_at, "revoked": self.revoked_at is not None}


@dataclass(frozen=True)
class PackageRecord:
    kind: str
    name: str
    version: str
    publisher_account: str
    key_id: str
    document: dict
    signature: str
    digest: str
    base_plugin: str | None
    royalty_micro: int
    description: str
    published_at: float
    # {path, sha256, size, blob_key}: given to the repository at publish (it keeps one row
    # per file); records read back leave it empty: readers use document["files"].
    files: tuple[dict, ...] = field(default=())

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def published_by(self, publisher: str) -> bool:
        """Whether ``publisher`` (an account id or a publisher key, hex) published it."""
        return publisher in (self.publisher_account, self.document.get("publisher_key"))

    def summary(self) -> dict:
        out = {"kind": self.kind, "name": self.name, "version": self.version,
               "publisher_account": self.publisher_account,
               "publisher_key": self.document.get("publisher_key"),
               "description": self.description, "digest": self.digest,
               "published_at": self.published_at,
               "size": sum(int(f["size"]) for f in self.document.get("files", []))}
        if self.kind == "adapter":
            out.update(base=self.base_plugin, royalty_micro=self.royalty_micro)
        else:
            m = self.document.get("manifest", {})
            out.update(output=m.get("output"), publisher=m.get("publisher"))
        return out

    def detail(self) -> dict:
        """Everything an agent needs to install and verify it: the signed document itself."""
        return {**self.summary(), "document": self.document, "signature": self.signature,
                "files": [{"path": f["path"], "sha256": f["sha256"], "size": f["size"]}
                          for f in self.document.get("files", [])]}


@dataclass(frozen=True)
class Royalty:
    adapter: str
    version: str
    publisher_account: str
    royalty_micro: int


@dataclass(frozen=True)
class RoyaltyBreakdown:
    """What a job pays in royalties: ``royalties`` (every published adapter it names, in
    order) and, from them, ``by_publisher`` (each paid publisher's sum, in the order of
    its first paid adapter) and ``micro`` (the total charged)."""
    royalties: tuple[Royalty, ...]

    @staticmethod
    def charged(r: Royalty) -> bool:
        return r.royalty_micro > 0

    @property
    def by_publisher(self) -> tuple[tuple[str, int], ...]:
        sums: dict[str, int] = {}
        for r in self.royalties:
            if self.charged(r):
                sums[r.publisher_account] = sums.get(r.publisher_account, 0) + r.royalty_micro
        return tuple(sums.items())

    @property
    def micro(self) -> int:
        return sum(r.royalty_micro for r in self.royalties if self.charged(r))


class RegistryRepository(Protocol):
    def add_key(self, key: PublisherKey) -> None: ...
    def key_by_public(self, public_key: str) -> PublisherKey | None: ...
    def keys_of(self, account_id: str) -> list[PublisherKey]: ...
    def get(self, kind: str, name: str, version: str) -> PackageRecord | None: ...
    def versions(self, kind: str, name: str) -> list[PackageRecord]: ...
    def add(self, record: PackageRecord) -> bool: ...
    def all(self, kind: str) -> list[PackageRecord]: ...


class BlobStore(Protocol):
    """What the registry needs of its blob store (broker.blobs.LocalBlobStore)."""
    def tmp_dir(self) -> Path: ...
    def put_file(self, src: Path, key: str) -> bool: ...
    def path(self, key: str) -> Path: ...
    def get(self, key: str) -> bytes: ...
    def size(self, key: str) -> int: ...
    def exists(self, key: str) -> bool: ...


def matches_query(needle: str, name: str, description: str) -> bool:
    """The ``q`` of a search: ``needle`` (already stripped and lower-cased; "" matches
    everything) in the name or the description, case-insensitive."""
    return not needle or needle in name.lower() or needle in description.lower()


class RegistryService:
    def __init__(self, repo: RegistryRepository, blobs: BlobStore, catalog, *, clock=time.time,
                 on_publisher: Callable[[str], None] = lambda account_id: None,
                 builtin_plugins: Iterable[str] | None = None,
                 max_blob_bytes: int = MAX_BLOB_BYTES):
        self.repo = repo
        self.blobs = blobs              # the registry's own store, never the job outputs'
        self.max_blob_bytes = int(max_blob_bytes)
        self.catalog = catalog          # broker.catalog.PluginCatalog: published plugins join it
        self.clock = clock
        self.on_publisher = on_publisher  # opens the account's royalties ledger account
        self.builtin = set(catalog.names() if builtin_plugins is None else builtin_plugins)
        self._lock = threading.Lock()
        from .warm import WarmIndex

        self.warm = WarmIndex()

    # ---- startup -----------------------------------------------------------------------
    def load_catalog(self) -> int:
        """Add every published plugin version to the job catalog (at broker start)."""
        n = 0
        for rec in self.repo.all("plugin"):
            try:
                self.catalog.add(parse_manifest(rec.document["manifest"], source=rec.ref))
                n += 1
            except Exception as exc:  # noqa: BLE001 - one bad row must not stop the broker
                log.error("published plugin %s not loaded: %s", rec.ref, exc)
        return n

    # ---- publisher keys ----------------------------------------------------------------
    @staticmethod
    def key_proof_document(account_id: str, public_key: str) -> dict:
        return publisher_proof_document(account_id, public_key)  # the SDK signs the same

    def register_key(self, who, public_key: Any, proof: Any, label: Any = "") -> tuple[PublisherKey, bool]:
        """Register ``public_key`` for the caller's account; (key, created). Idempotent for
        the same account; a key registered by another account is a 409."""
        self._require_publisher(who)
        if not is_sha256_hex(public_key):
            raise InvalidRequest("public_key must be a 64-hex-digit Ed25519 public key "
                                 "(`sparecycles publisher init` makes one)", field="public_key")
        if not isinstance(label, str) or len(label) > 200:
            raise InvalidRequest("label must be a string of at most 200 characters",
                                 field="label")
        if not isinstance(proof, str) or not proof:
            raise InvalidRequest("proof is missing: sign {\"account_id\", \"public_key\"} with "
                                 "the key (purpose \"publisher\") to show you hold it",
                                 field="proof")
        try:
            verify(public_key, "publisher", self.key_proof_document(who.account_id, public_key),
                   proof)
        except SignatureError as exc:
            raise InvalidRequest(f"proof does not verify: {exc}; sign "
                                 "{\"account_id\": <your account id>, \"public_key\": <key>}",
                                 field="proof", code_override="bad_signature") from None
        existing = self.repo.key_by_public(public_key)
        if existing is not None:
            if existing.account_id != who.account_id:
                raise Conflict("this public key is registered to another account",
                               field="public_key", code_override="key_taken")
            return existing, False
        key = PublisherKey(key_id=hashlib.sha256(bytes.fromhex(public_key)).hexdigest()[:32],
                           account_id=who.account_id, public_key=public_key,
                           label=label or "", created_at=self.clock())
        try:
            self.repo.add_key(key)
        except Exception:  # noqa: BLE001 - a concurrent request registered it first
            existing = self.repo.key_by_public(public_key)
            if existing is None:
                raise
            if existing.account_id != who.account_id:
                raise Conflict("this public key is registered to another account",
                               field="public_key", code_override="key_taken") from None
            return existing, False
        self.on_publisher(who.account_id)
        return key, True

    def keys_of(self, who) -> list[PublisherKey]:
        return self.repo.keys_of(who.account_id)

    # ---- files -------------------------------------------------------------------------
    def check_upload(self, who, sha256: str) -> None:
        """What an upload needs before a byte of it is read: a publisher (or admin) key, a
        registered publisher key, a sha256 in the path."""
        self._require_publisher(who)
        if not any(k.revoked_at is None for k in self.repo.keys_of(who.account_id)):
            raise Forbidden("register a publisher key first (POST /v1/publishers)",
                            code_override="no_publisher_key")
        if not is_sha256_hex(sha256):
            raise InvalidRequest("the path must end in the file's sha256 (64 lowercase hex "
                                 "digits)", field="sha256")

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"a package file may be at most {self.max_blob_bytes} bytes",
                               field="body", limit=self.max_blob_bytes)

    @staticmethod
    def _mismatch(got: str, sha256: str) -> InvalidInput:
        return InvalidInput(f"the body's sha256 is {got}, not {sha256}: the upload was "
                            "damaged or the wrong file was sent", field="sha256",
                            code_override="sha256_mismatch")

    def put_blob_stream(self, who, sha256: str, stream, *, chunk: int = UPLOAD_CHUNK,
                        checked: bool = False) -> dict:
        """Store one package file read from ``stream`` (``read(n) -> bytes``): checked
        before reading (``checked``: the caller ran :meth:`check_upload` already), written
        to a temporary file in chunks while hashing (never held in memory), refused past
        ``max_blob_bytes``, then moved into the blob store."""
        if not checked:
            self.check_upload(who, sha256)
        fd, tmp = tempfile.mkstemp(dir=self.blobs.tmp_dir(), prefix=".upload-")
        try:
            h, n = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out:
                while block := stream.read(chunk):
                    n += len(block)
                    if n > self.max_blob_bytes:
                        raise self._too_large()
                    h.update(block)
                    out.write(block)
            if h.hexdigest() != sha256:
                raise self._mismatch(h.hexdigest(), sha256)
            created = self.blobs.put_file(Path(tmp), sha256)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return {"sha256": sha256, "size": n, "created": created}

    def _file_entry(self, kind: str, name: str, version: str, path: str) -> dict:
        rec = self.get(kind, name, version)
        entry = next((f for f in rec.document["files"] if f["path"] == path), None)
        if entry is None:
            raise NotFound(f"{kind} {rec.ref} has no file {path!r}", field="path")
        return entry

    def file_path(self, kind: str, name: str, version: str, path: str) -> tuple[Path, dict]:
        """The file on disk a download streams, and its entry in the document."""
        entry = self._file_entry(kind, name, version, path)
        return self.blobs.path(entry["sha256"]), entry

    # ---- publishing --------------------------------------------------------------------
    def publish(self, who, document: Any, signature: Any) -> tuple[PackageRecord, bool]:
        """Publish a signed package version; (record, created). Raises with a clear code:
        ``unsigned``, ``bad_signature``, ``invalid_package`` (field named),
        ``unknown_publisher_key``, ``name_taken``, ``version_exists``, ``missing_file``,
        ``base_mismatch``, ``unknown_base``."""
        self._require_publisher(who)
        try:
            pkg = verify_document(document, signature if isinstance(signature, str) else "")
        except PackageError as exc:
            status = InvalidRequest if exc.code in ("unsigned", "bad_signature") else InvalidInput
            raise status(str(exc), field=exc.field, code_override=exc.code) from None
        key = self.repo.key_by_public(pkg.publisher_key)
        if key is None or key.revoked_at is not None:
            raise Forbidden(f"{pkg.ref} is signed with key {pkg.publisher_key[:16]}…, which is "
                            "not a registered publisher key; register it with "
                            "POST /v1/publishers", field="publisher_key",
                            code_override="unknown_publisher_key")
        if key.account_id != who.account_id:
            raise Forbidden(f"key {pkg.publisher_key[:16]}… belongs to another account",
                            field="publisher_key", code_override="unknown_publisher_key")
        digest = document_digest(pkg.document)
        with self._lock:  # one publish at a time per broker: name and version checks
            versions = self.repo.versions(pkg.kind, pkg.name)
            same = next((r for r in versions if r.version == pkg.version), None)
            if same is not None:
                if same.digest == digest:
                    return same, False
                raise Conflict(f"{pkg.kind} {pkg.ref} is already published with other content "
                               f"(digest {same.digest[:16]}…, this one {digest[:16]}…); "
                               "published versions are immutable: publish a new version",
                               field="version", code_override="version_exists")
            self._check_name(who, pkg, versions)
            if pkg.kind == "adapter":
                self._check_base(pkg, versions)
            files = self._check_files(pkg)
            rec = PackageRecord(
                kind=pkg.kind, name=pkg.name, version=pkg.version,
                publisher_account=who.account_id, key_id=key.key_id,
                document=pkg.document, signature=signature, digest=digest,
                base_plugin=pkg.base, royalty_micro=pkg.royalty_micro,
                description=pkg.description, published_at=self.clock(), files=files)
            if not self.repo.add(rec):  # another broker replica published it meanwhile
                other = self.repo.get(pkg.kind, pkg.name, pkg.version)
                if other is not None and other.digest == digest:
                    return other, False
                raise Conflict(f"{pkg.kind} {pkg.ref} was just published with other content",
                               field="version", code_override="version_exists")
        if pkg.kind == "plugin":
            self.catalog.add(pkg.manifest)
        log.info("published %s %s (%d files) by %s", pkg.kind, pkg.ref, len(files),
                 who.account_id)
        return rec, True

    def _check_name(self, who, pkg: Package, versions: list[PackageRecord]) -> None:
        if pkg.kind == "plugin" and pkg.name in self.builtin and who.role != "admin":
            raise Forbidden(f"{pkg.name!r} is a built-in plugin of the platform; choose another "
                            "name", field="name", code_override="name_taken")
        owners = {r.publisher_account for r in versions}
        if owners and who.account_id not in owners:
            raise Forbidden(f"the {pkg.kind} name {pkg.name!r} belongs to another publisher; "
                            "choose another name", field="name", code_override="name_taken")

    def _check_base(self, pkg: Package, versions: list[PackageRecord]) -> None:
        if pkg.base not in self.catalog.names():
            raise InvalidInput(f"adapter {pkg.ref} is for base {pkg.base!r}, which is not a "
                               f"plugin of this broker; plugins: {self.catalog.names()}",
                               field="base", code_override="unknown_base")
        earlier = {r.base_plugin for r in versions}
        if earlier and pkg.base not in earlier:
            raise Conflict(f"adapter {pkg.name!r} was published for {sorted(earlier)[0]!r}; a "
                           f"new version cannot change its base to {pkg.base!r}",
                           field="base", code_override="base_mismatch")

    def _check_files(self, pkg: Package) -> tuple[dict, ...]:
        out = []
        for i, f in enumerate(pkg.files):
            size = self.blobs.size(f.sha256) if self.blobs.exists(f.sha256) else None
            if size is None:
                raise Conflict(f"file {f.path} (sha256 {f.sha256[:16]}…) has not been uploaded; "
                               f"PUT it to /v1/blobs/{f.sha256} first", field=f"files[{i}]",
                               code_override="missing_file")
            if size != f.size:
                raise InvalidInput(f"file {f.path}: the document says {f.size} bytes, the "
                                   f"uploaded file has {size}", field=f"files[{i}].size",
                                   code_override="size_mismatch")
            out.append({"path": f.path, "sha256": f.sha256, "size": f.size,
                        "blob_key": f.sha256})
        by_path = {f.path: f for f in pkg.files}
        if pkg.kind == "plugin":
            import tomllib

            try:
                same = tomllib.loads(self.blobs.get(by_path["plugin.toml"].sha256)
                                     .decode("utf-8")) == pkg.document["manifest"]
            except (UnicodeDecodeError, tomllib.TOMLDecodeError):
                same = False
            if not same:
                raise InvalidInput(f"plugin {pkg.ref}: the uploaded plugin.toml differs from the "
                                   "signed document's manifest", field="manifest",
                                   code_override="manifest_mismatch")
        if pkg.kind == "adapter":
            try:
                check_adapter_files(pkg.files, pkg.base,
                                    read=lambda p: self.blobs.get(by_path[p].sha256))
            except PackageError as exc:
                raise InvalidInput(str(exc), field=exc.field, code_override=exc.code) from None
        return tuple(out)

    @staticmethod
    def _require_publisher(who) -> None:
        if who.role not in PUBLISH_ROLES:
            raise Forbidden(f"publishing needs a publisher API key (this one is a {who.role} "
                            "key); an admin creates one with `sparecycles broker create-key "
                            "--role publisher`", code_override="not_a_publisher")

    # ---- reading -----------------------------------------------------------------------
    def get(self, kind: str, name: str, version: str | None = None) -> PackageRecord:
        if version is None or version == "latest":
            versions = self.repo.versions(kind, name)
            if not versions:
                raise self._unknown(kind, name)
            return max(versions, key=lambda r: semver_key(r.version))
        rec = self.repo.get(kind, name, version)
        if rec is None:
            if not self.repo.versions(kind, name):
                raise self._unknown(kind, name)
            raise NotFound(f"{kind} {name!r} has no published version {version!r}; see "
                           f"GET /v1/{kind}s/{name}/versions", field="version",
                           code_override="unknown_version")
        return rec

    @staticmethod
    def _unknown(kind: str, name: str):
        if kind == "plugin":
            return UnknownPlugin(f"no published plugin {name!r}", field="plugin")
        return NotFound(f"no published adapter {name!r}; see GET /v1/adapters",
                        field="adapter", code_override="unknown_adapter")

    def versions(self, kind: str, name: str) -> list[PackageRecord]:
        versions = sorted(self.repo.versions(kind, name), key=lambda r: semver_key(r.version),
                          reverse=True)
        if not versions and not (kind == "plugin" and name in self.catalog.names()):
            raise self._unknown(kind, name)
        return versions

    def search(self, kind: str, *, q: str | None = None, base: str | None = None,
               publisher: str | None = None, limit: int = 100) -> list[PackageRecord]:
        """The latest version of each matching package, by name. ``q`` matches name and
        description (case-insensitive); ``publisher`` an account id or publisher key."""
        latest: dict[str, PackageRecord] = {}
        for rec in self.repo.all(kind):
            cur = latest.get(rec.name)
            if cur is None or semver_key(rec.version) > semver_key(cur.version):
                latest[rec.name] = rec
        out = []
        needle = (q or "").strip().lower()
        for name in sorted(latest):
            rec = latest[name]
            if not matches_query(needle, name, rec.description):
                continue
            if base and rec.base_plugin != base:
                continue
            if publisher and not rec.published_by(publisher):
                continue
            out.append(rec)
        return out[:limit]

    # ---- jobs --------------------------------------------------------------------------
    def check_job_adapters(self, plugin: str, inputs: dict | None) -> None:
        """Refuse (422, ``inputs.adapters``) a job naming an adapter that the registry
        publishes only for other plugins: agents resolve a published name in the registry
        and refuse an adapter of another base, so no provider would run the job. (A name
        the registry does not know may be an adapter a provider holds privately: that is
        the provider's to judge.) The broker calls it at submit, after the input rules
        have checked the adapters input's form."""
        for name in adapter_names((inputs or {}).get("adapters")):
            versions = self.repo.versions("adapter", name)
            if versions and not any(r.base_plugin == plugin for r in versions):
                bases = sorted({r.base_plugin for r in versions})
                raise InvalidInput(f"adapters: {name!r} is an adapter for "
                                   f"{' and '.join(bases)}, not for {plugin}; use one made for "
                                   f"{plugin} (GET /v1/adapters?base={plugin} lists them)",
                                   field="inputs.adapters", plugin=plugin, adapter=name)

    # ---- royalties ---------------------------------------------------------------------
    def royalties_for(self, plugin: str, inputs: dict | None,
                      as_of: float | None = None) -> list[Royalty]:
        """The royalty of each published adapter a job of ``plugin`` with ``inputs`` names:
        its latest version for that plugin (published by ``as_of``, the job's submit time,
        when given); adapters a provider holds privately earn none."""
        out = []
        for name in adapter_names((inputs or {}).get("adapters")):
            versions = [r for r in self.repo.versions("adapter", name) if r.base_plugin == plugin
                        and (as_of is None or r.published_at <= as_of)]
            if not versions:
                continue
            rec = max(versions, key=lambda r: semver_key(r.version))
            out.append(Royalty(rec.name, rec.version, rec.publisher_account, rec.royalty_micro))
        return out

    def royalty_breakdown(self, plugin: str, inputs: dict | None,
                          as_of: float | None = None) -> RoyaltyBreakdown:
        """Every royalty a job of ``plugin`` with ``inputs`` names, who is paid and how
        much: each publisher whose adapters it uses earns their royalties."""
        return RoyaltyBreakdown(tuple(self.royalties_for(plugin, inputs, as_of)))

    def royalty_split(self, plugin: str, inputs: dict | None,
                      as_of: float | None = None) -> tuple[tuple[str, int], ...]:
        """((publisher account, micro-credits), ...) a job pays in royalties, one pair per
        publisher in the order of its first paid adapter — the hook JobBilling calls (see
        :meth:`royalty_breakdown`)."""
        return self.royalty_breakdown(plugin, inputs, as_of).by_publisher


def canonical_text(document: dict) -> str:
    return canonical_bytes(document).decode("utf-8")


__all__ = ["RegistryService", "PublisherKey", "PackageRecord", "Royalty", "RoyaltyBreakdown",
           "semver_key", "matches_query", "canonical_text"]
