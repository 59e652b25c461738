"""Published packages: signed, versioned plugins and LoRA adapters (the marketplace).

A package is a folder. A **plugin** folder has ``plugin.toml`` (sdk.protocol.manifest) and
its code; it may carry its weights under ``weights/`` (then every ``[[weights]]`` entry of
the manifest must be there with the same sha256 and size). An **adapter** folder has
``adapter.toml``::

    name = "ink"                    # [A-Za-z0-9][A-Za-z0-9._-]*, at most 64 characters
    version = "1.0.0"               # semantic version, immutable once published
    base = "sd15"                   # the plugin (model family) it applies to
    description = "..."             # optional
    royalty_micro = 500             # optional: micro-credits per job that uses it

and its weights (one or more ``.safetensors`` files, ``adapter_config.json`` for peft; an
``adapter.json`` that declares ``base_model`` must agree with ``base``).

Publishing signs a **document**: canonical JSON of ::

    {"format": 1, "kind": "plugin" | "adapter", "name", "version", "publisher_key",
     "description", "files": [{"path", "sha256", "size"}, ...],   # sorted by path
     "manifest": {...}                      # plugins: plugin.toml as parsed
     "base": "sd15", "royalty_micro": 500}  # adapters

with the publisher's Ed25519 key, purpose ``manifest`` for plugins and ``adapter`` for
adapters (sdk.protocol.signing). The document names every file's sha256, so one signature
covers every byte an agent installs. Defined here because the publishing CLI, the broker
and the agent's installer must agree on it exactly.
"""
from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from .canonical import CanonicalEncodingError, canonical_bytes, is_sha256_hex, sha256_hex
from .digest import file_sha256
from .manifest import NAME_RE, Manifest, ManifestError, check_version, parse_manifest
from .signing import KeyPair, SignatureError, verify

FORMAT = 1
KINDS = ("plugin", "adapter")
PURPOSE = {"plugin": "manifest", "adapter": "adapter"}
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}$")
MAX_FILES = 2000
MAX_ROYALTY_MICRO = 1_000 * 1_000_000          # 1,000 credits per use: a typo guard
SKIPPED = {"__pycache__", ".git", ".DS_Store"}
ADAPTER_TOML = "adapter.toml"
_ADAPTER_KEYS = {"name", "version", "base", "description", "royalty_micro"}
_DOC_KEYS = {"plugin": {"format", "kind", "name", "version", "publisher_key", "description",
                        "files", "manifest"},
             "adapter": {"format", "kind", "name", "version", "publisher_key", "description",
                         "files", "base", "royalty_micro"}}


class PackageError(ValueError):
    """A package that cannot be published or installed; ``field`` names what is wrong."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_package"):
        super().__init__(message)
        self.field = field
        self.code = code


@dataclass(frozen=True)
class PackageFile:
    path: str
    sha256: str
    size: int

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class AdapterManifest:
    name: str
    version: str
    base: str
    description: str = ""
    royalty_micro: int = 0


@dataclass(frozen=True)
class Package:
    """A verified package document."""
    kind: str
    name: str
    version: str
    publisher_key: str
    description: str
    files: tuple[PackageFile, ...]
    document: dict
    manifest: Manifest | None = None      # plugins
    base: str | None = None               # adapters
    royalty_micro: int = 0                # adapters

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        return document_digest(self.document)


def document_digest(document: Mapping) -> str:
    return sha256_hex(canonical_bytes(document))


# ---- manifests -------------------------------------------------------------------------
def parse_adapter_manifest(data: Mapping[str, Any], source: str = ADAPTER_TOML) -> AdapterManifest:
    """Check a parsed adapter.toml; raises ManifestError naming the field."""
    def fail(msg: str) -> ManifestError:
        return ManifestError(f"{source}: {msg}")

    unknown = set(data) - _ADAPTER_KEYS
    if unknown:
        raise fail(f"unknown keys {sorted(unknown)}; allowed: {sorted(_ADAPTER_KEYS)}")
    for key in ("name", "version", "base"):
        if key not in data:
            raise fail(f"{key} is missing")
        if not isinstance(data[key], str):
            raise fail(f"{key} must be a str, got {data[key]!r}")
    if not ADAPTER_NAME_RE.match(data["name"]):
        raise fail(f"name {data['name']!r} must match {ADAPTER_NAME_RE.pattern}")
    try:
        check_version(data["version"])
    except ManifestError as exc:
        raise fail(str(exc)) from None
    if not NAME_RE.match(data["base"]):
        raise fail(f"base {data['base']!r} must be a plugin name (like sd15)")
    royalty = data.get("royalty_micro", 0)
    _check_royalty(royalty, fail)
    return AdapterManifest(data["name"], data["version"], data["base"],
                           str(data.get("description", "")), royalty)


def _check_royalty(royalty, fail) -> None:
    if isinstance(royalty, bool) or not isinstance(royalty, int) or not \
            0 <= royalty <= MAX_ROYALTY_MICRO:
        raise fail(f"royalty_micro must be an integer from 0 to {MAX_ROYALTY_MICRO:,} "
                   f"micro-credits, got {royalty!r}")


def load_adapter_manifest(folder: Path | str) -> AdapterManifest:
    path = Path(folder) / ADAPTER_TOML
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist; an adapter package is a folder with "
                            "adapter.toml (name, version, base) and its .safetensors") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from None
    return parse_adapter_manifest(data, source=str(path))


def kind_of(folder: Path | str) -> str:
    folder = Path(folder)
    if (folder / "plugin.toml").is_file():
        return "plugin"
    if (folder / ADAPTER_TOML).is_file():
        return "adapter"
    raise PackageError(f"{folder} has neither plugin.toml (a plugin) nor {ADAPTER_TOML} (an "
                       "adapter)", field="path")


# ---- files -----------------------------------------------------------------------------
def check_path(path: str) -> str:
    """A file path inside a package: relative, '/'-separated, no '..', no hidden parts."""
    if not isinstance(path, str) or not path or len(path) > 400:
        raise PackageError(f"file path {path!r} must be 1 to 400 characters", field="files")
    parts = PurePosixPath(path).parts
    if path.startswith("/") or "\\" in path or not parts or \
            any(not _SEGMENT.match(p) for p in parts) or "/".join(parts) != path:
        raise PackageError(f"file path {path!r} is not allowed: use relative paths of "
                           "letters, digits, '.', '_', '+', '-' (no '..', no hidden files)",
                           field="files")
    return path


def collect_files(folder: Path | str) -> list[PackageFile]:
    """Every file of a package folder (not __pycache__, .git or hidden files), sorted."""
    folder = Path(folder)
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part in SKIPPED or part.startswith(".") for part in rel.parts) or p.suffix == ".pyc":
            continue
        if p.is_symlink():
            raise PackageError(f"{rel.as_posix()} is a symbolic link; packages hold plain files",
                               field="files")
        if p.is_file():
            out.append(PackageFile(check_path(rel.as_posix()), file_sha256(p), p.stat().st_size))
    if len(out) > MAX_FILES:
        raise PackageError(f"{len(out)} files; a package holds at most {MAX_FILES}", field="files")
    return out


def _files_from(doc_files: Any) -> tuple[PackageFile, ...]:
    if not isinstance(doc_files, list) or not doc_files:
        raise PackageError("files must be a non-empty list of {path, sha256, size}", field="files")
    if len(doc_files) > MAX_FILES:
        raise PackageError(f"{len(doc_files)} files; at most {MAX_FILES}", field="files")
    files, seen = [], set()
    for i, f in enumerate(doc_files):
        if not isinstance(f, Mapping) or set(f) != {"path", "sha256", "size"}:
            raise PackageError(f"files[{i}] must be exactly {{path, sha256, size}}",
                               field=f"files[{i}]")
        path = check_path(f["path"])
        if path in seen:
            raise PackageError(f"files[{i}]: {path} is listed twice", field=f"files[{i}]")
        seen.add(path)
        if not is_sha256_hex(f["sha256"]):
            raise PackageError(f"files[{i}].sha256 must be 64 lowercase hex digits",
                               field=f"files[{i}].sha256")
        size = f["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PackageError(f"files[{i}].size must be an integer >= 0",
                               field=f"files[{i}].size")
        files.append(PackageFile(path, f["sha256"], size))
    if [f.path for f in files] != sorted(f.path for f in files):
        raise PackageError("files must be sorted by path", field="files")
    for f in files:  # "a" and "a/b": a path cannot be a file and a folder at once
        parts = f.path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in seen:
                raise PackageError(f"files: {parent!r} is a file, but {f.path!r} needs it to be "
                                   "a folder; a path cannot be both", field="files")
    return tuple(files)


def check_plugin_weights(manifest: Manifest, files: tuple[PackageFile, ...] | list[PackageFile]) -> None:
    """When a plugin package carries weights (files under weights/), each [[weights]] entry
    of its manifest must be among them with the same sha256 and size."""
    by_path = {f.path: f for f in files}
    if not any(p.startswith("weights/") for p in by_path):
        return
    for i, w in enumerate(manifest.weights):
        got = by_path.get(f"weights/{w.path}")
        if got is None:
            raise PackageError(f"weights[{i}] ({w.path}) is in the manifest but not in the "
                               "package's weights/ folder", field=f"weights[{i}].path",
                               code="weights_mismatch")
        if got.sha256 != w.sha256:
            raise PackageError(f"weights[{i}] ({w.path}): sha256 differs — the manifest says "
                               f"{w.sha256[:16]}…, the file is {got.sha256[:16]}…",
                               field=f"weights[{i}].sha256", code="sha256_mismatch")
        if got.size != w.size:
            raise PackageError(f"weights[{i}] ({w.path}): size differs — the manifest says "
                               f"{w.size}, the file is {got.size} bytes",
                               field=f"weights[{i}].size", code="size_mismatch")


def check_adapter_files(files, base: str, read=None) -> None:
    """An adapter holds at least one .safetensors file; an ``adapter.json`` it carries must
    declare the same base. ``read(path) -> bytes`` reads a file of the package."""
    if not any(f.path.endswith(".safetensors") for f in files):
        raise PackageError("an adapter package needs its weights as a .safetensors file",
                           field="files")
    if read is not None and any(f.path == "adapter.json" for f in files):
        try:
            declared = json.loads(read("adapter.json")).get("base_model")
        except (ValueError, AttributeError):
            raise PackageError("adapter.json is not a JSON object", field="adapter.json") from None
        if declared and declared != base:
            raise PackageError(f"base mismatch: adapter.json declares base_model {declared!r} "
                               f"but the package says base {base!r}", field="base",
                               code="base_mismatch")


# ---- documents -------------------------------------------------------------------------
def build_document(folder: Path | str, publisher_key: str, *,
                   royalty_micro: int | None = None) -> dict:
    """The document to sign for the package in ``folder`` (checks it first)."""
    folder = Path(folder)
    kind = kind_of(folder)
    files = collect_files(folder)
    if kind == "plugin":
        from .manifest import load_manifest

        manifest = load_manifest(folder)
        if royalty_micro:
            raise PackageError("--royalty applies to adapters; plugins are priced by the "
                               "platform per work unit", field="royalty_micro")
        check_plugin_weights(manifest, files)
        doc = {"format": FORMAT, "kind": "plugin", "name": manifest.name,
               "version": manifest.version, "publisher_key": publisher_key,
               "description": manifest.description, "files": [f.to_json() for f in files],
               "manifest": _canonical_raw(manifest.raw)}
    else:
        am = load_adapter_manifest(folder)
        if royalty_micro is not None:
            _check_royalty(royalty_micro, lambda m: PackageError(m, field="royalty_micro"))
        check_adapter_files(files, am.base, read=lambda p: (folder / p).read_bytes())
        doc = {"format": FORMAT, "kind": "adapter", "name": am.name, "version": am.version,
               "publisher_key": publisher_key, "description": am.description,
               "files": [f.to_json() for f in files], "base": am.base,
               "royalty_micro": am.royalty_micro if royalty_micro is None else royalty_micro}
    parse_document(doc)  # the same checks the broker and agents make
    return doc


def _canonical_raw(raw: dict) -> dict:
    try:
        canonical_bytes(raw)
    except CanonicalEncodingError as exc:
        raise PackageError(f"plugin.toml: {exc}", field="manifest") from None
    return raw


def sign_document(keys: KeyPair, document: dict) -> str:
    return keys.sign(PURPOSE[document["kind"]], document)


def parse_document(document: Any) -> Package:
    """Check a document's shape (no signature check); raises PackageError naming the field."""
    if not isinstance(document, Mapping):
        raise PackageError("document must be a JSON object", field="document")
    kind = document.get("kind")
    if kind not in KINDS:
        raise PackageError(f"kind is {kind!r}; one of {list(KINDS)}", field="kind")
    for key in sorted(_DOC_KEYS[kind]):
        if key not in document:
            raise PackageError(f"{key} is missing", field=key)
    extra = set(document) - _DOC_KEYS[kind]
    if extra:
        raise PackageError(f"unknown keys {sorted(extra)}", field=sorted(extra)[0])
    if document["format"] != FORMAT:
        raise PackageError(f"format {document['format']!r} is not supported (this side "
                           f"reads format {FORMAT})", field="format")
    key = document["publisher_key"]
    if not is_sha256_hex(key):
        raise PackageError("publisher_key must be a 64-hex-digit Ed25519 public key",
                           field="publisher_key")
    if not isinstance(document["description"], str) or len(document["description"]) > 4000:
        raise PackageError("description must be a string of at most 4000 characters",
                           field="description")
    files = _files_from(document["files"])
    name, version = document["name"], document["version"]
    try:
        check_version(version)
    except ManifestError as exc:
        raise PackageError(str(exc), field="version") from None
    if kind == "plugin":
        try:
            manifest = parse_manifest(document["manifest"], source="manifest")
        except ManifestError as exc:
            raise PackageError(str(exc), field="manifest") from None
        except (TypeError, AttributeError):
            raise PackageError("manifest must be a table", field="manifest") from None
        if (manifest.name, manifest.version) != (name, version):
            raise PackageError(f"name/version {name}@{version} differ from the manifest's "
                               f"{manifest.ref}", field="name")
        if "plugin.toml" not in {f.path for f in files}:
            raise PackageError("files must include plugin.toml", field="files")
        check_plugin_weights(manifest, files)
        return Package(kind, name, version, key, document["description"], files, dict(document),
                       manifest=manifest)
    if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        raise PackageError(f"name {name!r} must match {ADAPTER_NAME_RE.pattern}", field="name")
    base = document["base"]
    if not isinstance(base, str) or not NAME_RE.match(base):
        raise PackageError(f"base {base!r} must be a plugin name", field="base")
    _check_royalty(document["royalty_micro"], lambda m: PackageError(m, field="royalty_micro"))
    check_adapter_files(files, base)
    return Package(kind, name, version, key, document["description"], files, dict(document),
                   base=base, royalty_micro=document["royalty_micro"])


def verify_document(document: Any, signature: str, *, expected_key: str | None = None) -> Package:
    """Parse a document and check its publisher signature; raises PackageError (code
    ``unsigned`` / ``bad_signature`` / ``wrong_publisher``) or the shape errors of
    :func:`parse_document`."""
    package = parse_document(document)
    if not signature:
        raise PackageError(f"{package.kind} {package.ref} is unsigned: publish it with "
                           "`sparecycles publish` and a publisher key", field="signature",
                           code="unsigned")
    if expected_key is not None and expected_key != package.publisher_key:
        raise PackageError(f"{package.ref} names publisher key {package.publisher_key[:16]}…, "
                           f"not the expected {expected_key[:16]}…", field="publisher_key",
                           code="wrong_publisher")
    try:
        verify(package.publisher_key, PURPOSE[package.kind], package.document, signature)
    except SignatureError as exc:
        raise PackageError(f"{package.kind} {package.ref}: {exc}", field="signature",
                           code="bad_signature") from None
    return package


# ---- publisher keys --------------------------------------------------------------------
def publisher_proof_document(account_id: str, public_key: str) -> dict:
    """What a publisher signs (purpose ``publisher``) with the key it registers, to show the
    broker it holds that key for that account."""
    return {"account_id": account_id, "public_key": public_key}


# ---- jobs ------------------------------------------------------------------------------
# A job's ``adapters`` input: parsed and checked in sdk.protocol.adapters (which the input
# rules call too); named here as well, where the marketplace's code looks for them.
from .adapters import (ADAPTER_INPUT_NAME_RE, ADAPTER_SCALE_LIMITS,  # noqa: E402,F401
                       MAX_ADAPTERS_PER_JOB, adapter_names, adapter_pairs, check_adapters)
