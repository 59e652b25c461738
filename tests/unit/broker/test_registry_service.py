"""RegistryService on SQLite: publisher keys, signed immutable versions, files in the blob
store, names, adapter bases, search and royalties."""
import io
import json

import pytest
from sqlalchemy.orm import sessionmaker

from broker.auth.service import Principal
from broker.blobs.local import LocalBlobStore
from broker.catalog.registry import PluginCatalog
from broker.errors import BrokerError
from broker.registry.service import RegistryService
from broker.settings import BUILTIN_PLUGINS
from broker.storage.base import make_engine
from broker.storage.migrate import upgrade
from broker.storage.registry_sql import SqlRegistryRepository
from sdk.protocol.package import build_document, publisher_proof_document, sign_document
from sdk.protocol.signing import KeyPair

from tests.marketplace_helpers import adapter_folder, plugin_folder, publish, register

ALICE = Principal("acct-alice", "publisher", "k1")
BOB = Principal("acct-bob", "publisher", "k2")
CLIENT = Principal("acct-carol", "client", "k3")
ADMIN = Principal("acct-admin", "admin", "k4")


@pytest.fixture
def reg(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'r.db'}")
    upgrade(engine)
    opened = []
    registry = RegistryService(SqlRegistryRepository(sessionmaker(engine, expire_on_commit=False)),
                               LocalBlobStore(tmp_path / "blobs"),
                               PluginCatalog.from_folders([BUILTIN_PLUGINS]),
                               on_publisher=opened.append)
    registry.opened = opened
    yield registry
    engine.dispose()


def _code(exc_info) -> str:
    return exc_info.value.code


def test_publisher_keys_need_a_proof_and_a_publisher_role(reg):
    keys = KeyPair.generate()
    with pytest.raises(BrokerError) as e:
        reg.register_key(CLIENT, keys.public_key_hex, "00", "")
    assert _code(e) == "not_a_publisher"
    forged = keys.sign("publisher", publisher_proof_document("someone-else", keys.public_key_hex))
    with pytest.raises(BrokerError) as e:
        reg.register_key(ALICE, keys.public_key_hex, forged, "")
    assert _code(e) == "bad_signature" and e.value.field == "proof"
    register(reg, ALICE, keys)
    again, created = reg.register_key(ALICE, keys.public_key_hex, keys.sign(
        "publisher", publisher_proof_document(ALICE.account_id, keys.public_key_hex)))
    assert not created and again.account_id == ALICE.account_id
    assert reg.opened == [ALICE.account_id]  # royalties account opened once
    with pytest.raises(BrokerError) as e:
        register(reg, BOB, keys)
    assert _code(e) == "key_taken"


def test_publish_adapter_then_identical_is_idempotent_and_changed_is_409(reg, tmp_path):
    keys = register(reg, ALICE)
    folder = adapter_folder(tmp_path, royalty=700)
    rec, created = publish(reg, ALICE, keys, folder)
    assert created and rec.ref == "ink@1.0.0" and rec.base_plugin == "sd15"
    assert rec.royalty_micro == 700 and rec.publisher_account == ALICE.account_id
    same, created = publish(reg, ALICE, keys, folder)
    assert not created and same.digest == rec.digest
    other = adapter_folder(tmp_path, royalty=700)  # same name@version, other weights
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, keys, other)
    assert _code(e) == "version_exists" and e.value.http_status == 409
    assert "immutable" in str(e.value)
    disk, _ = reg.file_path("adapter", "ink", "1.0.0", "pytorch_lora_weights.safetensors")
    assert disk.read_bytes() == (folder / "pytorch_lora_weights.safetensors").read_bytes()


def test_unsigned_wrongly_signed_and_tampered_documents_are_refused(reg, tmp_path):
    keys = register(reg, ALICE)
    folder = adapter_folder(tmp_path)
    doc = build_document(folder, keys.public_key_hex)
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, keys, folder, document=doc, signature="")
    assert _code(e) == "unsigned" and e.value.http_status == 400
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, keys, folder, document=doc,
                signature=KeyPair.generate().sign("adapter", doc))
    assert _code(e) == "bad_signature"
    sig = sign_document(keys, doc)
    tampered = {**doc, "royalty_micro": doc["royalty_micro"] + 1}
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, keys, folder, document=tampered, signature=sig)
    assert _code(e) == "bad_signature"
    # signed for another purpose (a plugin manifest) does not pass as an adapter
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, keys, folder, document=doc, signature=keys.sign("manifest", doc))
    assert _code(e) == "bad_signature"
    assert reg.search("adapter") == []


def test_unregistered_key_and_someone_elses_key_are_refused(reg, tmp_path):
    register(reg, BOB)
    stranger = KeyPair.generate()
    folder = adapter_folder(tmp_path)
    doc = build_document(folder, stranger.public_key_hex)
    with pytest.raises(BrokerError) as e:
        reg.publish(BOB, doc, sign_document(stranger, doc))
    assert _code(e) == "unknown_publisher_key"
    alice_keys = register(reg, ALICE)
    doc = build_document(folder, alice_keys.public_key_hex)
    with pytest.raises(BrokerError) as e:
        reg.publish(BOB, doc, sign_document(alice_keys, doc))
    assert _code(e) == "unknown_publisher_key"


def test_files_must_be_uploaded_with_their_size(reg, tmp_path):
    keys = register(reg, ALICE)
    folder = adapter_folder(tmp_path)
    doc = build_document(folder, keys.public_key_hex)
    with pytest.raises(BrokerError) as e:
        reg.publish(ALICE, doc, sign_document(keys, doc))
    assert _code(e) == "missing_file" and "PUT it to /v1/blobs/" in str(e.value)
    with pytest.raises(BrokerError) as e:
        reg.put_blob_stream(ALICE, "0" * 64, io.BytesIO(b"not that"))
    assert _code(e) == "sha256_mismatch"


def test_adapter_base_must_match_and_exist(reg, tmp_path):
    keys = register(reg, ALICE)
    # adapter.json says sdxl, adapter.toml says sd15: refused by the builder ...
    from sdk.protocol.package import PackageError

    mismatched = adapter_folder(tmp_path, declared_base="sdxl")
    with pytest.raises(PackageError) as e:
        build_document(mismatched, keys.public_key_hex)
    assert e.value.code == "base_mismatch"
    # ... and by the broker, which reads adapter.json from the uploaded blob
    good = adapter_folder(tmp_path)
    doc = build_document(good, keys.public_key_hex)
    doc_json = json.dumps({"base_model": "sdxl"}).encode()
    (good / "adapter.json").write_bytes(doc_json)
    import hashlib

    entry = next(f for f in doc["files"] if f["path"] == "adapter.json")
    entry.update(sha256=hashlib.sha256(doc_json).hexdigest(), size=len(doc_json))
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, keys, good, document=doc)
    assert _code(e) == "base_mismatch" and e.value.field == "base"
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, keys, adapter_folder(tmp_path, name="x", base="nosuchmodel"))
    assert _code(e) == "unknown_base"
    publish(reg, ALICE, keys, adapter_folder(tmp_path, name="y", base="sd15"))
    with pytest.raises(BrokerError) as e:  # a later version cannot move to another base
        publish(reg, ALICE, keys, adapter_folder(tmp_path, name="y", version="1.1.0",
                                                 base="llama"))
    assert _code(e) == "base_mismatch"


def test_names_belong_to_their_first_publisher_and_builtins_to_the_platform(reg, tmp_path):
    a, b = register(reg, ALICE), register(reg, BOB)
    publish(reg, ALICE, a, adapter_folder(tmp_path))
    with pytest.raises(BrokerError) as e:
        publish(reg, BOB, b, adapter_folder(tmp_path, version="2.0.0"))
    assert _code(e) == "name_taken"
    with pytest.raises(BrokerError) as e:
        publish(reg, ALICE, a, plugin_folder(tmp_path, name="sd15", version="9.0.0"))
    assert _code(e) == "name_taken"
    admin_keys = register(reg, ADMIN)
    rec, _ = publish(reg, ADMIN, admin_keys, plugin_folder(tmp_path, name="sd15", version="9.0.1"))
    assert rec.ref == "sd15@9.0.1"


def test_published_plugin_joins_the_catalog_and_versions_sort(reg, tmp_path):
    keys = register(reg, ALICE)
    publish(reg, ALICE, keys, plugin_folder(tmp_path, version="1.0.0"))
    publish(reg, ALICE, keys, plugin_folder(tmp_path, version="1.10.0"))
    publish(reg, ALICE, keys, plugin_folder(tmp_path, version="1.2.0"))
    assert [r.version for r in reg.versions("plugin", "reverse")] == ["1.10.0", "1.2.0", "1.0.0"]
    assert reg.catalog.get("reverse").version == "1.10.0"
    assert reg.get("plugin", "reverse").version == "1.10.0"
    with pytest.raises(BrokerError) as e:
        reg.get("plugin", "reverse", "3.0.0")
    assert _code(e) == "unknown_version"


def test_manifest_missing_a_field_names_it(reg, tmp_path):
    keys = register(reg, ALICE)
    from sdk.protocol.manifest import ManifestError

    with pytest.raises(ManifestError, match="entrypoint is missing"):
        build_document(plugin_folder(tmp_path, drop="entrypoint"), keys.public_key_hex)
    with pytest.raises(ManifestError, match="base is missing"):
        build_document(adapter_folder(tmp_path, omit="base"), keys.public_key_hex)
    # a hand-made document without the field is refused by the broker, naming it
    doc = build_document(plugin_folder(tmp_path), keys.public_key_hex)
    del doc["manifest"]["work_units"]
    with pytest.raises(BrokerError) as e:
        reg.publish(ALICE, doc, sign_document(keys, doc))
    assert _code(e) == "invalid_package" and "work_units is missing" in str(e.value)


def test_weights_in_the_package_must_match_the_manifest(reg, tmp_path):
    keys = register(reg, ALICE)
    folder = plugin_folder(tmp_path, weights={"model.safetensors": b"w" * 100})
    publish(reg, ALICE, keys, folder)
    bad = plugin_folder(tmp_path / "bad", version="1.0.1", weights={"model.safetensors": b"w" * 100})
    (bad / "weights" / "model.safetensors").write_bytes(b"x" * 100)  # same size, other bytes
    from sdk.protocol.package import PackageError

    with pytest.raises(PackageError) as e:
        build_document(bad, keys.public_key_hex)
    assert e.value.code == "sha256_mismatch" and e.value.field == "weights[0].sha256"


def test_search_and_royalties(reg, tmp_path):
    a, b = register(reg, ALICE), register(reg, BOB)
    publish(reg, ALICE, a, adapter_folder(tmp_path, name="ink", royalty=500))
    publish(reg, ALICE, a, adapter_folder(tmp_path, name="ink", version="1.1.0", royalty=800))
    publish(reg, ALICE, a, adapter_folder(tmp_path, name="film", royalty=0))
    publish(reg, BOB, b, adapter_folder(tmp_path, name="neon", royalty=300))
    publish(reg, BOB, b, adapter_folder(tmp_path, name="chat", base="llama", royalty=900))
    assert [r.name for r in reg.search("adapter", base="sd15")] == ["film", "ink", "neon"]
    assert [r.version for r in reg.search("adapter", q="INK")] == ["1.1.0"]
    assert [r.name for r in reg.search("adapter", publisher=BOB.account_id)] == ["chat", "neon"]
    # latest version's royalty; unknown names and other bases earn nothing
    assert reg.royalty_split("sd15", {"adapters": "ink:0.5,nosuch,chat"}) == (
        (ALICE.account_id, 800),)
    assert reg.royalty_split("sd15", {"adapters": '{"film": 1}'}) == ()
    # each publisher is paid, in the order of its first paid adapter
    assert reg.royalty_split("sd15", {"adapters": "neon,ink"}) == (
        (BOB.account_id, 300), (ALICE.account_id, 800))
    # as_of: versions published after the job was submitted do not count
    first = reg.get("adapter", "ink", "1.0.0").published_at
    assert reg.royalty_split("sd15", {"adapters": "ink"}, as_of=first) == (
        (ALICE.account_id, 500),)


def test_warm_index_records_what_each_provider_holds(reg):
    warm = reg.warm
    warm.update("p-hot", [{"name": "sd15", "warm": True}],
                [{"plugin": "sd15", "name": "ink", "version": "1.0.0"}])
    warm.update("p-cold", [{"name": "sd15", "warm": False}], [])
    assert warm.holdings("p-hot").plugins == {"sd15": True}
    assert warm.holdings("p-hot").adapters == {("sd15", "ink"): "1.0.0"}
    assert warm.holdings("p-cold").plugins == {"sd15": False}
    warm.forget("p-hot")
    assert warm.holdings("p-hot") is None


def test_the_warm_index_says_who_would_first_download_an_adapter():
    from types import SimpleNamespace

    from broker.registry.warm import WarmIndex

    warm = WarmIndex()
    warm.update("a", [{"name": "sd15", "warm": True}],
                [{"plugin": "sd15", "name": "ink", "version": "1.0.0"}])
    warm.update("b", [{"name": "sd15", "warm": True}], [])
    job = SimpleNamespace(plugin="sd15", inputs={"adapters": "ink:0.8"})
    assert not warm.needs_download("a", job)
    assert warm.needs_download("b", job)
    assert not warm.needs_download("unknown", job)  # no report: nothing assumed
    assert not warm.needs_download("b", SimpleNamespace(plugin="sd15", inputs={}))


def test_the_registry_and_the_job_catalog_pick_the_same_latest_version(reg, tmp_path):
    from sdk.protocol.manifest import version_key

    keys = register(reg, ALICE)
    publish(reg, ALICE, keys, plugin_folder(tmp_path, name="reverse", version="1.0.0"))
    publish(reg, ALICE, keys, plugin_folder(tmp_path, name="reverse", version="1.0.0-rc.1"))
    # a release ranks above its pre-releases (semver), in both places
    assert reg.get("plugin", "reverse").version == "1.0.0"
    assert reg.catalog.get("reverse").version == "1.0.0"
    assert [r.version for r in reg.versions("plugin", "reverse")] == ["1.0.0", "1.0.0-rc.1"]
    ordered = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta.2",
               "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.2.0", "1.10.0"]
    assert sorted(reversed(ordered), key=version_key) == ordered
    assert version_key("1.0.0+build.5") == version_key("1.0.0")  # build metadata ignored


def test_a_quote_and_settlement_share_one_royalty_breakdown(reg, tmp_path):
    a, b = register(reg, ALICE), register(reg, BOB)
    publish(reg, ALICE, a, adapter_folder(tmp_path, name="ink", royalty=500))
    publish(reg, ALICE, a, adapter_folder(tmp_path, name="film", royalty=0))
    publish(reg, BOB, b, adapter_folder(tmp_path, name="neon", royalty=300))
    publish(reg, BOB, b, adapter_folder(tmp_path, name="glow", royalty=200))
    out = reg.royalty_breakdown("sd15", {"adapters": "film,neon,ink,glow"})
    assert [r.adapter for r in out.royalties] == ["film", "neon", "ink", "glow"]
    assert out.micro == 1_000
    assert [out.charged(r) for r in out.royalties] == [False, True, True, True]
    assert out.by_publisher == ((BOB.account_id, 500), (ALICE.account_id, 500))
    assert reg.royalty_split("sd15", {"adapters": "film,neon,ink,glow"}) == out.by_publisher
    none = reg.royalty_breakdown("sd15", {})
    assert (none.royalties, none.by_publisher, none.micro) == ((), (), 0)


def test_is_warm_reads_one_report_and_counts_the_unreported_as_warm():
    from broker.registry.warm import WarmIndex

    warm = WarmIndex()
    assert warm.is_warm("nobody", "sd15")
    warm.update("p", [{"name": "sd15", "warm": False}, {"name": "llama", "warm": True}], [])
    assert not warm.is_warm("p", "sd15") and warm.is_warm("p", "llama")
    assert warm.is_warm("p", "echo")  # not reported: warm
    warm.forget("p")
    assert warm.is_warm("p", "sd15")


def test_a_read_record_does_not_load_the_file_rows(reg, tmp_path):
    keys = register(reg, ALICE)
    rec, _ = publish(reg, ALICE, keys, adapter_folder(tmp_path, name="ink"))
    assert rec.files  # given to the repository at publish
    again = reg.repo.get("adapter", "ink", "1.0.0")
    assert again.files == () and again.detail()["files"] == [
        {k: f[k] for k in ("path", "sha256", "size")} for f in rec.files]
