"""Regressions from the marketplace review (sdk side): malformed signatures and unencodable
documents are SignatureErrors, a path cannot be a file and a folder, versions fit the
registry's 64-character columns."""
import copy

import pytest

import sdk.protocol.package as package
from sdk.protocol.manifest import ManifestError, parse_manifest
from sdk.protocol.package import (PackageError, build_document, parse_adapter_manifest,
                                  parse_document, sign_document, verify_document)
from sdk.protocol.signing import KeyPair, SignatureError, verify

from tests.marketplace_helpers import adapter_folder, plugin_folder


def test_a_signature_of_the_wrong_length_is_a_signature_error():
    keys = KeyPair.generate()
    for sig in ("abcd", "ab" * 63, "ab" * 65):
        with pytest.raises(SignatureError, match="malformed signature"):
            verify(keys.public_key_hex, "adapter", {"a": 1}, sig)


def test_a_document_with_nan_is_a_signature_error_not_an_encoding_crash():
    keys = KeyPair.generate()
    with pytest.raises(SignatureError, match="canonical"):
        verify(keys.public_key_hex, "manifest", {"x": float("nan")}, "ab" * 64)
    with pytest.raises(SignatureError):
        verify(keys.public_key_hex, "manifest", {"x": float("inf")}, "abcd")


def test_verify_document_turns_both_into_bad_signature(tmp_path):
    keys = KeyPair.generate()
    doc = build_document(adapter_folder(tmp_path), keys.public_key_hex)
    with pytest.raises(PackageError) as e:
        verify_document(doc, "abcd")
    assert e.value.code == "bad_signature"
    plugin = build_document(plugin_folder(tmp_path), keys.public_key_hex)
    bad = copy.deepcopy(plugin)
    bad["manifest"]["benchmark"]["nanval"] = float("nan")  # a free-form table: shape passes
    with pytest.raises(PackageError) as e:
        verify_document(bad, sign_document(keys, plugin))
    assert e.value.code == "bad_signature" and "nanval" in str(e.value)


def _entry(path: str) -> dict:
    return {"path": path, "sha256": "ab" * 32, "size": 1}


def test_a_path_that_is_both_a_file_and_a_folder_is_refused_naming_both(tmp_path):
    keys = KeyPair.generate()
    doc = build_document(adapter_folder(tmp_path), keys.public_key_hex)
    for extra in (["weights", "weights/a.bin"], ["weights", "weights/sub/a.bin"]):
        bad = {**doc, "files": sorted(doc["files"] + [_entry(p) for p in extra],
                                      key=lambda f: f["path"])}
        with pytest.raises(PackageError) as e:
            parse_document(bad)
        assert e.value.field == "files"
        assert "'weights'" in str(e.value) and repr(extra[1]) in str(e.value)
    # siblings that only share a prefix are fine
    ok = {**doc, "files": sorted(doc["files"] + [_entry("w"), _entry("w-x/a"), _entry("wx")],
                                 key=lambda f: f["path"])}
    assert parse_document(ok).name == doc["name"]


def test_versions_are_at_most_64_characters(tmp_path):
    long = "1.0.0-" + "a" * 59  # 65 characters, a valid semantic version otherwise
    assert len(long) == 65
    with pytest.raises(ManifestError, match="at most 64"):
        parse_adapter_manifest({"name": "ink", "version": long, "base": "sd15"})
    keys = KeyPair.generate()
    doc = build_document(adapter_folder(tmp_path), keys.public_key_hex)
    with pytest.raises(PackageError) as e:
        parse_document({**doc, "version": long})
    assert e.value.field == "version" and "at most 64" in str(e.value)
    assert parse_document({**doc, "version": long[:-1]}).version == long[:-1]
    plugin = build_document(plugin_folder(tmp_path), keys.public_key_hex)
    with pytest.raises(ManifestError, match="at most 64"):
        parse_manifest({**plugin["manifest"], "version": long})


def test_the_unused_file_hash_helper_is_gone():
    assert not hasattr(package, "sha256_file_matches")  # digest.file_sha256 is the one
