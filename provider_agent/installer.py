"""Installing plugins and LoRA adapters from the broker's registry, safely.

Every install:

1. fetches the version's signed document (``GET /v1/{plugins|adapters}/<name>/<version>``)
   and verifies the publisher's Ed25519 signature over it (sdk.protocol.package) — an
   unsigned or wrongly signed package is refused before a byte of it is downloaded;
2. checks the publisher: the key must be the one pinned for that name at its first install
   (a package whose key changes is refused), and one of ``trusted_keys`` when the operator
   lists any; an adapter must be for the plugin it is installed for (its ``base``);
3. downloads every file into a fresh temporary folder under ``<cache>/.tmp/``, hashing as it
   goes: a file whose sha256 or size differs from the signed document is refused, naming
   the file;
4. checks the package's own rules again on the downloaded bytes (plugin.toml equals the
   signed manifest; [[weights]] match; an adapter.json declares the same base);
5. renames the folder into place in one step (``os.replace``). Any failure removes the
   temporary folder: nothing half-installed is ever visible under the cache's names.

The cache is size-capped (``max_bytes``): before an install, the least recently used
packages (not ``in_use``, not held by a running job) are evicted until the new one fits,
counting the downloads in progress. The lock guards the index and pins only: the document
fetch, the downloads and the re-hashing run without it, so one slot's long download never
stalls another's job; two installs of the same package take turns (the second finds the
first's). An eviction renames the package's folder aside under the lock and deletes it
after. Last-use times are kept in memory and written with the next install or eviction,
at most every SAVE_EVERY_S otherwise, and by ``flush()``. Layout::

    <cache>/plugins/<name>@<version>/          the plugin's files (plugin.toml, code, weights/)
    <cache>/adapters/<base>/<name>@<version>/  the adapter's files
    <cache>/<each package>/.package.json       the signed document, for re-verification
    <cache>/index.json                         sizes, last use, pinned publisher keys
    <cache>/.tmp/                              downloads in progress, evicted packages
                                               being deleted (cleared at start)

A plugin host finds adapters under ``<weights_dir>/adapters/<name>/`` (plugins.adapters);
:meth:`Installer.link_adapter` points that name at the installed folder with a symlink
swapped atomically, so a job never sees a half-replaced adapter. The sandbox binds the
cache read-only (provider_agent.launch), so the link resolves inside it too.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from sdk.protocol.package import (Package, PackageError, check_adapter_files, check_path,
                                  document_digest, verify_document)
from sdk.protocol.digest import file_sha256

from .errors import AgentError, ConfigError

log = logging.getLogger("agent.installer")
INDEX = "index.json"
PACKAGE_JSON = ".package.json"
DEFAULT_MAX_BYTES = 20 * 1024**3
SAVE_EVERY_S = 60.0  # a change of last-use times alone is written at most this often


class InstallError(AgentError):
    """A package could not be installed; ``code`` says why (sent to the broker as a job
    failure code when an install for a job fails)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Installed:
    kind: str
    name: str
    version: str
    path: Path
    package: Package
    # Downloaded by this call (every file was hashed on the way in), not found in the cache.
    fresh: bool = False

    @property
    def key(self) -> str:
        return _entry_key(self.kind, self.name, self.version, self.package.base)

    @property
    def digest(self) -> str:
        return self.package.digest


def _entry_key(kind: str, name: str, version: str, base: str | None = None) -> str:
    return f"plugin:{name}@{version}" if kind == "plugin" else f"adapter:{base}/{name}@{version}"


class _Gate:
    """One package's turn-taking lock, and how many threads hold or wait for it."""
    __slots__ = ("lock", "users")

    def __init__(self):
        self.lock, self.users = threading.Lock(), 0


def _remove(trash: list[Path]) -> None:
    for folder in trash:
        shutil.rmtree(folder, ignore_errors=True)


class Installer:
    def __init__(self, broker_url: str | None, api_key: str | None, cache_dir: Path | str, *,
                 max_bytes: int = DEFAULT_MAX_BYTES, http: httpx.Client | None = None,
                 trusted_keys: set[str] | None = None, timeout_s: float = 300.0,
                 clock=time.time, ca_file: str | None = None, insecure: bool = False):
        self.root = Path(cache_dir).resolve()
        self.max_bytes = int(max_bytes)
        self.trusted_keys = set(trusted_keys or ())
        self.clock = clock
        self.in_use: set[str] = set()     # entry keys that must not be evicted
        # The index, the pins and the counts below; never held over the network or a hash.
        self._lock = threading.RLock()
        self._held: dict[str, int] = {}   # entry keys running jobs use -> how many jobs
        # One download or re-hash per package at a time; a key is dropped when unused.
        self._gates: dict[str, _Gate] = {}
        self._reserved = 0                # bytes of the downloads in progress
        # Bumped by every install and eviction: compared before and after, it tells whether
        # the inventory changed.
        self.changes = 0
        self._dirty = False               # last-use times not yet written
        self._saved_at = time.monotonic()
        if http is None and broker_url:
            from sdk.tls import check_url, client_context

            try:  # the API key goes in clear over http:// only to loopback or when insecure
                check_url(broker_url, insecure, what="registry_url")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            http = httpx.Client(base_url=broker_url.rstrip("/"), headers=headers,
                                timeout=timeout_s, follow_redirects=False,
                                verify=client_context(ca_file))
        self.http = http
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.root / ".tmp", ignore_errors=True)  # downloads a crash left
        (self.root / ".tmp").mkdir(exist_ok=True)
        self._index = self._load_index()
        self._drop_strays()

    # ---- index -------------------------------------------------------------------------
    def _load_index(self) -> dict:
        try:
            data = json.loads((self.root / INDEX).read_text())
            if isinstance(data, dict) and isinstance(data.get("entries"), dict):
                data.setdefault("pins", {})
                return data
        except (OSError, ValueError):
            pass
        return {"entries": {}, "pins": {}}

    def _save_index(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".index-")
        with os.fdopen(fd, "w") as f:
            json.dump(self._index, f, indent=1, sort_keys=True)
        os.replace(tmp, self.root / INDEX)
        self._dirty = False
        self._saved_at = time.monotonic()

    def flush(self) -> None:
        """Write last-use times still only in memory (at the agent's stop)."""
        with self._lock:
            if self._dirty:
                self._save_index()

    def _drop_strays(self) -> None:
        """Index entries whose folder is gone are forgotten; folders the index does not
        know (an install interrupted between rename and index write) are removed."""
        known = set()
        for key, e in list(self._index["entries"].items()):
            if not Path(e["path"]).is_dir():
                del self._index["entries"][key]
            else:
                known.add(Path(e["path"]).resolve())
                folder = Path(e["path"])
                if folder.stat().st_mode & 0o005 != 0o005:  # installed 0700 by older agents
                    folder.chmod(0o755)
        for folder in [*self.root.glob("plugins/*"), *self.root.glob("adapters/*/*")]:
            if folder.is_dir() and folder.resolve() not in known:
                log.warning("removing %s: not in the installer's index", folder)
                shutil.rmtree(folder, ignore_errors=True)
        self._save_index()

    def entries(self) -> dict[str, dict]:
        with self._lock:
            return {k: dict(v) for k, v in self._index["entries"].items()}

    def used_bytes(self) -> int:
        with self._lock:
            return sum(int(e["size"]) for e in self._index["entries"].values())

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used (LRU): in memory; written later (see SAVE_EVERY_S)."""
        with self._lock:
            e = self._index["entries"].get(key)
            if e is not None:
                self._touch(e)

    def _touch(self, e: dict) -> None:
        e["last_used"] = self.clock()
        self._dirty = True
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._save_index()

    def touch_path(self, folder: Path, *, hold: bool = False) -> str | None:
        """Mark the package installed at ``folder`` as just used (LRU); with ``hold``, also
        keep it from eviction until ``release``. Its key, or None when none is there."""
        folder = str(Path(folder).resolve())
        with self._lock:
            for key, e in self._index["entries"].items():
                if e["path"] == folder:
                    self._touch(e)
                    if hold:
                        self._hold(key)
                    return key
        return None

    def _hold(self, key: str) -> None:
        self._held[key] = self._held.get(key, 0) + 1

    def release(self, keys) -> None:
        """Let packages a job held (``touch_path``/``install_adapter`` with ``hold``) be
        evicted again, once no other job holds them."""
        with self._lock:
            for key in keys:
                n = self._held.get(key, 0) - 1
                if n > 0:
                    self._held[key] = n
                else:
                    self._held.pop(key, None)

    def installed_adapters(self) -> list[dict]:
        """[{plugin, name, version, digest}] for the capabilities/inventory messages."""
        with self._lock:
            out = [{"plugin": e["base"], "name": e["name"], "version": e["version"],
                    "digest": e["digest"]}
                   for e in self._index["entries"].values() if e["kind"] == "adapter"]
        return sorted(out, key=lambda a: (a["plugin"], a["name"], a["version"]))

    # ---- installing --------------------------------------------------------------------
    def install_plugin(self, name: str, version: str = "latest") -> Installed:
        return self._install("plugin", name, version)

    def install_adapter(self, name: str, version: str = "latest", *, base: str,
                        hold: bool = False) -> Installed:
        """Install an adapter for plugin ``base``; an adapter for another base is refused.
        With ``hold`` it is kept from eviction until ``release([installed.key])``."""
        return self._install("adapter", name, version, base=base, hold=hold)

    def _install(self, kind: str, name: str, version: str, base: str | None = None,
                 hold: bool = False) -> Installed:
        """Install, surfacing every failure as InstallError: an unexpected one (a full disk,
        a path that is both a file and a folder, a registry answer of the wrong shape) is
        ``invalid_package``; either way nothing half-installed is left behind."""
        if self.http is None:
            raise InstallError("no_registry", f"cannot install {kind} {name}: no registry "
                               "configured (set registry_url in agent.toml)")
        try:
            return self._install_one(kind, name, version, base, hold)
        except InstallError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad package must not stop the agent
            log.warning("installing %s %s@%s failed unexpectedly", kind, name, version,
                        exc_info=True)
            raise InstallError("invalid_package", f"cannot install {kind} {name}@{version}: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _install_one(self, kind: str, name: str, version: str, base: str | None,
                     hold: bool) -> Installed:
        detail = self._get_json(f"/v1/{kind}s/{name}/{version}", f"{kind} {name}@{version}")
        with self._lock:
            package = self._verify(kind, name, version, base, detail)
            key = _entry_key(kind, package.name, package.version, package.base)
            got = self._cached(kind, package, key, hold)
            if got is not None:
                return got
        with self._gate(key):  # the same package installing in another thread: wait, use it
            trash: list[Path] = []  # evicted to make room: deleted without the lock
            try:
                with self._lock:
                    got = self._cached(kind, package, key, hold)
                    if got is not None:
                        return got
                    self._make_room(package.size, keep={key}, trash=trash)
                    self._reserved += package.size
            finally:
                _remove(trash)
            try:
                tmp = Path(tempfile.mkdtemp(dir=self.root / ".tmp", prefix=f"{package.name}-"))
                # mkdtemp makes it 0700; a root agent's plugin hosts run as an unprivileged
                # user, which must read the package (its files are made 0644 as usual).
                tmp.chmod(0o755)
                try:
                    for f in package.files:
                        self._download(kind, package, f, tmp)
                    self._check_contents(package, tmp)
                    (tmp / PACKAGE_JSON).write_text(json.dumps(
                        {"document": package.document, "signature": detail["signature"]},
                        sort_keys=True))
                    with self._lock:
                        final = self._commit(kind, package, key, tmp, hold)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            finally:
                with self._lock:
                    self._reserved -= package.size
        log.info("installed %s %s (%d files, %d bytes, publisher %s…)", kind, package.ref,
                 len(package.files), package.size, package.publisher_key[:16])
        return Installed(kind, package.name, package.version, final, package, fresh=True)

    def _cached(self, kind: str, package: Package, key: str, hold: bool) -> Installed | None:
        """The installed copy of ``package`` (marked used), or None. Under the lock."""
        entry = self._index["entries"].get(key)
        if entry is None or entry["digest"] != package.digest or \
                not Path(entry["path"]).is_dir():
            return None
        self._touch(entry)
        if hold:
            self._hold(key)
        return Installed(kind, package.name, package.version, Path(entry["path"]), package)

    def _commit(self, kind: str, package: Package, key: str, tmp: Path, hold: bool) -> Path:
        """Move the checked download into place and record it; a failure to record removes
        it again. Under the lock."""
        self._check_pin(kind, package)  # another version may have pinned a key meanwhile
        final = self._final_path(package)
        self._move_into_place(tmp, final)
        pin = f"{kind}:{package.name}"
        old_pin = self._index["pins"].get(pin)
        try:
            self._index["pins"][pin] = package.publisher_key
            self._index["entries"][key] = {
                "kind": kind, "name": package.name, "version": package.version,
                "base": package.base, "path": str(final), "size": package.size,
                "digest": package.digest, "publisher_key": package.publisher_key,
                "installed_at": self.clock(), "last_used": self.clock()}
            self._save_index()
        except BaseException:  # e.g. a full disk: the folder must not outlive its entry
            self._index["entries"].pop(key, None)
            if old_pin is None:
                self._index["pins"].pop(pin, None)
            else:
                self._index["pins"][pin] = old_pin
            shutil.rmtree(final, ignore_errors=True)
            raise
        self.changes += 1
        if hold:
            self._hold(key)
        return final

    def _get_json(self, path: str, what: str) -> dict:
        try:
            resp = self.http.get(path)
        except httpx.HTTPError as exc:
            raise InstallError("registry_unreachable", f"cannot fetch {what} from the "
                               f"registry: {exc}") from None
        if resp.status_code == 404:
            raise InstallError("not_found", f"the registry has no {what}")
        if resp.status_code >= 400:
            raise InstallError("registry_error", f"the registry refused {what}: HTTP "
                               f"{resp.status_code} {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError:
            raise InstallError("registry_error", f"the registry sent no JSON for {what}") from None

    def _verify(self, kind: str, name: str, version: str, base: str | None,
                detail: dict) -> Package:
        if not isinstance(detail, dict):
            raise InstallError("invalid_package", f"refusing {kind} {name}@{version}: the "
                               f"registry's answer is a JSON {type(detail).__name__}, not an "
                               "object with the signed document")
        try:
            package = verify_document(detail.get("document"), detail.get("signature") or "")
        except PackageError as exc:
            raise InstallError(exc.code, f"refusing {kind} {name}@{version}: {exc}") from None
        if package.kind != kind or package.name != name or \
                (version != "latest" and package.version != version):
            raise InstallError("wrong_package", f"asked for {kind} {name}@{version}, the "
                               f"registry sent {package.kind} {package.ref}")
        self._check_pin(kind, package)
        if self.trusted_keys and package.publisher_key not in self.trusted_keys:
            raise InstallError("untrusted_publisher", f"refusing {kind} {package.ref}: its "
                               f"publisher key {package.publisher_key[:16]}… is not in "
                               "trusted_publishers")
        if kind == "adapter" and base is not None and package.base != base:
            raise InstallError("base_mismatch", f"refusing adapter {package.ref}: it is for "
                               f"{package.base}, not for {base}")
        if package.size > self.max_bytes:
            raise InstallError("too_large", f"{kind} {package.ref} is {package.size} bytes; "
                               f"the cache holds at most {self.max_bytes}")
        return package

    def _check_pin(self, kind: str, package: Package) -> None:
        pinned = self._index["pins"].get(f"{kind}:{package.name}")
        if pinned is not None and pinned != package.publisher_key:
            raise InstallError("publisher_changed", f"refusing {kind} {package.ref}: signed by "
                               f"key {package.publisher_key[:16]}…, but earlier versions were "
                               f"signed by {pinned[:16]}… (pinned at first install)")

    def _final_path(self, package: Package) -> Path:
        if package.kind == "plugin":
            return self.root / "plugins" / package.ref
        return self.root / "adapters" / package.base / package.ref

    def _download(self, kind: str, package: Package, f, tmp: Path) -> None:
        check_path(f.path)
        dest = tmp / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        h, n = hashlib.sha256(), 0
        url = f"/v1/{kind}s/{package.name}/{package.version}/files/{f.path}"
        bar = download_progress(f"{package.ref} {f.path}", f.size)
        try:
            with self.http.stream("GET", url) as resp:
                if resp.status_code >= 400:
                    raise InstallError("download_failed", f"{package.ref}: downloading {f.path} "
                                       f"failed: HTTP {resp.status_code}")
                with open(dest, "wb") as out:
                    for block in resp.iter_bytes(1 << 20):
                        n += len(block)
                        bar.update(len(block))
                        if n > f.size:
                            raise InstallError("size_mismatch", f"refusing {package.ref}: "
                                               f"{f.path} is larger than the signed "
                                               f"{f.size} bytes")
                        h.update(block)
                        out.write(block)
        except httpx.HTTPError as exc:
            raise InstallError("download_failed", f"{package.ref}: downloading {f.path} "
                               f"failed: {exc}") from None
        finally:
            bar.close()
        if n != f.size:
            raise InstallError("size_mismatch", f"refusing {package.ref}: {f.path} has {n} "
                               f"bytes, the signed document says {f.size}")
        if h.hexdigest() != f.sha256:
            raise InstallError("sha256_mismatch", f"refusing {package.ref}: {f.path} has "
                               f"sha256 {h.hexdigest()[:16]}…, the signed document says "
                               f"{f.sha256[:16]}…")

    @staticmethod
    def _check_contents(package: Package, folder: Path) -> None:
        try:
            if package.kind == "plugin":
                data = tomllib.loads((folder / "plugin.toml").read_text())
                if data != package.document["manifest"]:
                    raise InstallError("manifest_mismatch", f"refusing {package.ref}: its "
                                       "plugin.toml differs from the signed manifest")
            else:
                check_adapter_files(package.files, package.base,
                                    read=lambda p: (folder / p).read_bytes())
        except PackageError as exc:
            raise InstallError(exc.code, f"refusing {package.ref}: {exc}") from None
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InstallError("invalid_package", f"refusing {package.ref}: {exc}") from None

    def _move_into_place(self, tmp: Path, final: Path) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        trash = None
        if final.exists():  # a damaged copy of the same version: replace it
            trash = Path(tempfile.mkdtemp(dir=self.root / ".tmp", prefix="old-"))
            os.replace(final, trash / "old")
        os.replace(tmp, final)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    @contextmanager
    def _gate(self, key: str):
        """Wait for, then hold, ``key``'s turn (an install or re-hash of it in another
        thread goes first). Not under the lock; the gate is dropped when no one holds or
        waits for it, so ``_gates`` holds only the packages in use."""
        with self._lock:
            gate = self._gates.get(key)
            if gate is None:
                gate = self._gates[key] = _Gate()
            gate.users += 1
        try:
            with gate.lock:
                yield
        finally:
            with self._lock:
                gate.users -= 1
                if not gate.users:
                    del self._gates[key]

    # ---- the cap -----------------------------------------------------------------------
    def _make_room(self, size: int, keep: set[str], trash: list[Path]) -> None:
        """Evict least recently used packages until ``size`` more bytes fit beside the
        installed ones and the downloads in progress. Under the lock; the evicted folders
        are added to ``trash`` for the caller to delete after leaving it."""
        entries = self._index["entries"]
        used = sum(int(e["size"]) for e in entries.values()) + self._reserved
        for key in sorted(entries, key=lambda k: entries[k]["last_used"]):
            if used + size <= self.max_bytes:
                break
            if key in keep or key in self.in_use or key in self._held:
                continue
            used -= int(entries[key]["size"])
            trash.append(self._evict(key))
        if used + size > self.max_bytes:
            raise InstallError("cache_full", f"cannot fit {size} bytes in the cache "
                               f"({used} of {self.max_bytes} bytes held by packages in use "
                               "or downloading)")

    def evict(self, key: str) -> bool:
        """Remove an installed package; False when it was not installed. Its files are
        deleted after the lock is let go."""
        with self._lock:
            if key not in self._index["entries"]:
                return False
            trash = self._evict(key)
        _remove([trash])
        return True

    def _evict(self, key: str) -> Path:
        """Forget installed ``key`` and move its folder into a trash folder under ``.tmp``,
        returned for the caller to delete without the lock. Under the lock."""
        e = self._index["entries"].pop(key)
        self.changes += 1
        trash = Path(tempfile.mkdtemp(dir=self.root / ".tmp", prefix="evict-"))
        try:
            os.replace(e["path"], trash / "old")
        except FileNotFoundError:
            pass
        try:
            self._save_index()
        except BaseException:  # e.g. a full disk: the files go all the same
            shutil.rmtree(trash, ignore_errors=True)
            raise
        log.info("evicted %s (%d bytes) from the package cache", key, e["size"])
        return trash

    # ---- use -----------------------------------------------------------------------------
    def verify_installed(self, key: str) -> Installed:
        """Re-check an installed package before use: its signed document and every file's
        sha256 on disk. A damaged package is evicted and InstallError raised. The files are
        hashed without the lock (the package is held meanwhile, and not reinstalled)."""
        with self._gate(key):
            with self._lock:
                e = self._index["entries"].get(key)
                if e is None:
                    raise InstallError("not_installed", f"{key} is not installed")
                e = dict(e)
                self._hold(key)
            try:
                folder = Path(e["path"])
                try:
                    saved = json.loads((folder / PACKAGE_JSON).read_text())
                    package = verify_document(saved["document"], saved["signature"],
                                              expected_key=e["publisher_key"])
                    if document_digest(package.document) != e["digest"]:
                        raise PackageError("document changed on disk", code="tampered")
                    for f in package.files:
                        p = folder / f.path
                        if not p.is_file() or p.stat().st_size != f.size or \
                                file_sha256(p) != f.sha256:
                            raise PackageError(f"{f.path} changed on disk", code="tampered")
                except (OSError, ValueError, KeyError, PackageError) as exc:
                    self.evict(key)  # (being held keeps a package from _make_room only)
                    raise InstallError(getattr(exc, "code", "tampered"), f"{key} failed "
                                       f"verification and was removed: {exc}") from None
            finally:
                self.release([key])
            return Installed(e["kind"], e["name"], e["version"], folder, package)

    @staticmethod
    def link_adapter(installed: Installed, adapters_root: Path) -> Path:
        """Make ``<adapters_root>/<name>`` point at the installed adapter (atomic swap)."""
        adapters_root = Path(adapters_root)
        adapters_root.mkdir(parents=True, exist_ok=True)
        link = adapters_root / installed.name
        if link.exists() and not link.is_symlink():
            raise InstallError("adapter_exists", f"{link} is a folder the operator placed; "
                               "not replacing it with the registry's adapter")
        tmp = adapters_root / f".{installed.name}.{os.getpid()}.{threading.get_ident()}.link"
        try:
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(installed.path, target_is_directory=True)
            os.replace(tmp, link)
        finally:
            tmp.unlink(missing_ok=True)
        return link

    def close(self) -> None:
        """At the agent's stop: write the last-use times (a failure is logged) and close
        the registry connection."""
        try:
            self.flush()
        except OSError as exc:
            log.warning("could not save the package cache's last-use times: %s", exc)
        finally:
            if self.http is not None:
                self.http.close()


# ---- the agent's start -------------------------------------------------------------------
PROGRESS_MIN_BYTES = 8 << 20  # smaller downloads show no progress


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def download_progress(what: str, size: int, stream=None):
    """Progress of a download of ``size`` bytes: a tqdm bar on a terminal, else one log
    line as it starts (downloads below PROGRESS_MIN_BYTES show nothing)."""
    import sys

    stream = stream or sys.stderr
    if size < PROGRESS_MIN_BYTES:
        return _NoBar()
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(total=size, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
                    file=stream, leave=False, dynamic_ncols=True)
    log.info("downloading %s (%.1f MiB)", what, size / 2**20)
    return _NoBar()


def make_installer(cfg) -> Installer | None:
    """The agent's installer, or None when agent.toml names no registry_url."""
    if not cfg.registry_url:
        return None
    return Installer(cfg.registry_url, cfg.api_key, cfg.registry_cache_dir(),
                     max_bytes=int(cfg.cache_max_gb * 1024**3),
                     trusted_keys=set(cfg.trusted_publishers),
                     ca_file=_ca(cfg), insecure=cfg.insecure)


def _ca(cfg) -> str | None:
    from sdk.tls import TLSConfigError, ca_bundle

    try:
        return ca_bundle(cfg.ca_file or None)
    except TLSConfigError as exc:
        raise ConfigError(str(exc)) from None


def resolve_plugins(cfg, installer: Installer | None, builtin=None) -> dict[str, Path]:
    """The folder of each plugin in ``cfg.plugins`` (``name`` or ``name@version``): a
    built-in one, else installed from the registry (verified; a cached copy is re-hashed
    before use, a fresh download is not: it was hashed on the way in). A plugin that
    cannot be had is logged and left out — the agent serves the others. Then installs ``cfg.adapters`` and links them where the plugin hosts look.
    Leaves ``cfg.plugins`` naming the plugins served; points ``cfg.weights`` of a registry
    plugin that carries its weights at them."""
    if builtin is None:
        from plugins import builtin_plugin_dir as builtin
    dirs: dict[str, Path] = {}
    for spec in cfg.plugins:
        name, _, version = spec.partition("@")
        try:
            if not version:
                try:
                    dirs[name] = builtin(name)
                    continue
                except LookupError:
                    if installer is None:
                        raise
            if installer is None:
                raise InstallError("no_registry", f"plugin {spec} is not built in and no "
                                   "registry_url is configured")
            inst = installer.install_plugin(name, version or "latest")
            if not inst.fresh:  # a fresh install was hashed while it downloaded
                inst = installer.verify_installed(inst.key)
            installer.in_use.add(inst.key)
            dirs[name] = inst.path
            if name not in cfg.weights and (inst.path / "weights").is_dir():
                cfg.weights[name] = str(inst.path / "weights")
        except (InstallError, LookupError) as exc:
            log.error("not serving %s: %s", spec, exc)
        except Exception as exc:  # noqa: BLE001 - the agent serves its other plugins
            log.exception("not serving %s: unexpected %s: %s", spec, type(exc).__name__, exc)
    cfg.plugins = list(dirs)
    if installer is not None:
        for plugin, names in (cfg.adapters or {}).items():
            weights = cfg.weights_for(plugin) if plugin in dirs else None
            for name in names:
                try:
                    if weights is None:
                        raise InstallError("no_weights", f"plugin {plugin} is not served here "
                                           "with a weights folder")
                    inst = installer.install_adapter(name, base=plugin)
                    if not inst.fresh:
                        inst = installer.verify_installed(inst.key)
                    installer.link_adapter(inst, weights / "adapters")
                except InstallError as exc:
                    log.error("adapter %s for %s not installed: %s", name, plugin, exc)
                except Exception as exc:  # noqa: BLE001 - e.g. the link cannot be made
                    log.exception("adapter %s for %s not installed: unexpected %s: %s", name,
                                  plugin, type(exc).__name__, exc)
    return dirs
