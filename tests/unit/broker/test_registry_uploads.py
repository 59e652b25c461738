"""Regressions from the marketplace review (RegistryService): uploads are checked before a
byte is read, streamed to disk with a size cap, concurrent key registrations are
idempotent, and publishing refuses over-long versions and file/folder clashes (422)."""
import hashlib
import io

import pytest
from sqlalchemy.orm import sessionmaker

from broker.auth.service import Principal
from broker.blobs.local import LocalBlobStore
from broker.catalog.registry import PluginCatalog
from broker.errors import BrokerError
from broker.registry.service import MAX_BLOB_BYTES, RegistryService
from broker.settings import BUILTIN_PLUGINS
from broker.storage.base import make_engine
from broker.storage.migrate import upgrade
from broker.storage.registry_sql import SqlRegistryRepository
from sdk.protocol.package import build_document, publisher_proof_document, sign_document

from tests.marketplace_helpers import adapter_folder, register

ALICE = Principal("acct-alice", "publisher", "k1")
BOB = Principal("acct-bob", "publisher", "k2")
CLIENT = Principal("acct-carol", "client", "k3")


@pytest.fixture
def reg(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'r.db'}")
    upgrade(engine)
    registry = RegistryService(SqlRegistryRepository(sessionmaker(engine, expire_on_commit=False)),
                               LocalBlobStore(tmp_path / "blobs"),
                               PluginCatalog.from_folders([BUILTIN_PLUGINS]))
    yield registry
    engine.dispose()


class Untouchable(io.RawIOBase):
    def read(self, n=-1):
        raise AssertionError("the body was read before the caller was checked")


def _tmp_files(reg) -> list:
    return list(reg.blobs.tmp_dir().iterdir())


def test_the_caller_and_the_sha256_are_checked_before_the_body_is_read(reg):
    sha = hashlib.sha256(b"x").hexdigest()
    with pytest.raises(BrokerError) as e:
        reg.put_blob_stream(CLIENT, sha, Untouchable())
    assert e.value.code == "not_a_publisher"
    with pytest.raises(BrokerError) as e:  # a publisher without a registered key
        reg.put_blob_stream(ALICE, sha, Untouchable())
    assert e.value.code == "no_publisher_key"
    register(reg, ALICE)
    for bad in ("nothex", sha.upper(), sha[:-1]):
        with pytest.raises(BrokerError) as e:
            reg.put_blob_stream(ALICE, bad, Untouchable())
        assert e.value.http_status == 400 and e.value.field == "sha256"


def test_uploads_stream_to_disk_under_a_cap_and_leave_nothing_behind(reg):
    register(reg, ALICE)
    assert reg.max_blob_bytes == MAX_BLOB_BYTES == 8 * 1024**3
    data = b"package bytes " * 100
    sha = hashlib.sha256(data).hexdigest()
    out = reg.put_blob_stream(ALICE, sha, io.BytesIO(data), chunk=64)
    assert out == {"sha256": sha, "size": len(data), "created": True}
    assert reg.blobs.get(sha) == data and reg.blobs.path(sha).read_bytes() == data
    assert reg.put_blob_stream(ALICE, sha, io.BytesIO(data), chunk=64)["created"] is False
    with pytest.raises(BrokerError) as e:
        reg.put_blob_stream(ALICE, sha, io.BytesIO(data[:-1] + b"!"), chunk=64)
    assert e.value.code == "sha256_mismatch" and e.value.http_status == 422
    reg.max_blob_bytes = len(data) - 1
    big = data + b"more"
    with pytest.raises(BrokerError) as e:
        reg.put_blob_stream(ALICE, hashlib.sha256(big).hexdigest(), io.BytesIO(big), chunk=64)
    assert e.value.http_status == 413 and e.value.code == "payload_too_large"
    assert not reg.blobs.exists(hashlib.sha256(big).hexdigest())
    assert _tmp_files(reg) == []


def test_a_concurrent_registration_of_the_same_key_is_idempotent(reg, monkeypatch):
    keys = register(reg, ALICE)
    real = reg.repo.key_by_public
    calls = []

    def racing(public_key):  # the first look misses: another request inserts meanwhile
        calls.append(public_key)
        return None if len(calls) == 1 else real(public_key)

    proof = keys.sign("publisher", publisher_proof_document(ALICE.account_id,
                                                            keys.public_key_hex))
    monkeypatch.setattr(reg.repo, "key_by_public", racing)
    key, created = reg.register_key(ALICE, keys.public_key_hex, proof)
    assert not created and key.account_id == ALICE.account_id
    calls.clear()
    bob_proof = keys.sign("publisher", publisher_proof_document(BOB.account_id,
                                                                keys.public_key_hex))
    with pytest.raises(BrokerError) as e:
        reg.register_key(BOB, keys.public_key_hex, bob_proof)
    assert e.value.code == "key_taken" and e.value.http_status == 409


def _upload(reg, folder, document):
    for f in document["files"]:
        reg.put_blob_stream(ALICE, f["sha256"], io.BytesIO((folder / f["path"]).read_bytes()))


def test_publishing_refuses_long_versions_and_file_folder_clashes(reg, tmp_path):
    keys = register(reg, ALICE)
    folder = adapter_folder(tmp_path)
    doc = build_document(folder, keys.public_key_hex)
    _upload(reg, folder, doc)
    long = {**doc, "version": "1.0.0-" + "a" * 59}
    with pytest.raises(BrokerError) as e:
        reg.publish(ALICE, long, sign_document(keys, long))
    assert e.value.http_status == 422 and e.value.field == "version"
    assert "at most 64" in str(e.value)
    x = {"path": "adapter.json/x", "sha256": hashlib.sha256(b"x").hexdigest(), "size": 1}
    reg.put_blob_stream(ALICE, x["sha256"], io.BytesIO(b"x"))
    clash = {**doc, "files": sorted(doc["files"] + [x], key=lambda f: f["path"])}
    with pytest.raises(BrokerError) as e:
        reg.publish(ALICE, clash, sign_document(keys, clash))
    assert e.value.http_status == 422 and e.value.field == "files"
    assert "'adapter.json'" in str(e.value) and "'adapter.json/x'" in str(e.value)
    assert reg.repo.versions("adapter", "ink") == []
