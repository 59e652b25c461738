"""sdk.protocol.package: the signed package document every side agrees on."""
import pytest

from sdk.protocol.manifest import ManifestError
from sdk.protocol.package import (PackageError, adapter_names, build_document, check_path,
                                  kind_of, parse_adapter_manifest, sign_document,
                                  verify_document)
from sdk.protocol.signing import KeyPair

from tests.marketplace_helpers import adapter_folder, plugin_folder


def test_documents_sign_and_verify_per_purpose(tmp_path):
    keys = KeyPair.generate()
    for folder, kind in ((plugin_folder(tmp_path), "plugin"), (adapter_folder(tmp_path), "adapter")):
        assert kind_of(folder) == kind
        doc = build_document(folder, keys.public_key_hex)
        assert [f["path"] for f in doc["files"]] == sorted(f["path"] for f in doc["files"])
        pkg = verify_document(doc, sign_document(keys, doc))
        assert pkg.kind == kind and pkg.size == sum(f["size"] for f in doc["files"])
        with pytest.raises(PackageError) as e:
            verify_document(doc, sign_document(keys, doc), expected_key=KeyPair.generate().public_key_hex)
        assert e.value.code == "wrong_publisher"


def test_adapter_manifest_errors_name_the_field():
    ok = {"name": "ink", "version": "1.0.0", "base": "sd15"}
    assert parse_adapter_manifest(ok).royalty_micro == 0
    for bad, field in (({**ok, "version": "one"}, "version"), ({**ok, "royalty_micro": 1.5}, "royalty_micro"),
                       ({**ok, "royalty_micro": -1}, "royalty_micro"), ({**ok, "extra": 1}, "unknown keys"),
                       ({k: v for k, v in ok.items() if k != "name"}, "name is missing")):
        with pytest.raises(ManifestError, match=field):
            parse_adapter_manifest(bad)


def test_paths_stay_inside_the_package():
    assert check_path("weights/unet/model.safetensors")
    for bad in ("../x", "/etc/passwd", "a//b", ".hidden", "a/./b", "a\\b", ""):
        with pytest.raises(PackageError):
            check_path(bad)


def test_adapter_names_in_job_inputs():
    assert adapter_names("ink:0.8, film") == ["ink", "film"]
    assert adapter_names('{"ink": 0.5, "neon": 1}') == ["ink", "neon"]
    assert adapter_names("") == [] and adapter_names(None) == [] and adapter_names("{bad") == []
    assert adapter_names("ink,ink:2,../x") == ["ink"]
