"""The one canonical byte encoding that every signature in Sparecycles covers.

Canonical JSON: UTF-8, object keys sorted by code point, no insignificant whitespace, no
NaN or infinities; finite floats (a guidance scale, a temperature) are written in their
shortest round-trip form. Money is never a float: it is integer micro-credits.

Two parties that hold the same value always produce the same bytes, so signatures never
depend on protobuf's (non-canonical) wire format: protobuf messages carry canonical bytes
plus a signature.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any


class CanonicalEncodingError(ValueError):
    """A value cannot be encoded canonically (NaN, a non-string key, bytes...)."""


def _encodable(value: Any) -> bool:
    """Whether ``value`` has a canonical encoding: a walk with no paths built, since
    documents are nearly always fine (every envelope and receipt, on both sides, passes
    here). :func:`_check` says what is wrong when it is not."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return True
    if t is dict:
        for key, item in value.items():
            if type(key) is not str or not _encodable(item):
                return False
        return True
    if t is list or t is tuple:
        for item in value:
            if not _encodable(item):
                return False
        return True
    if t is float:
        return value - value == 0.0  # False for NaN and the infinities
    return False  # subclasses and other types: _check decides, with the path


def _check(value: Any, path: str) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise CanonicalEncodingError(f"{path or 'value'} is {value!r}; only finite numbers "
                                         "have a canonical encoding")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalEncodingError(f"{path or 'value'} has a non-string key {key!r}")
            _check(item, f"{path}.{key}" if path else key)
        return
    raise CanonicalEncodingError(f"{path or 'value'} has type {type(value).__name__}, "
                                 "which has no canonical encoding")


_encode = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                           allow_nan=False).encode


def canonical_text(value: Any) -> str:
    """The canonical JSON text of ``value`` (what :func:`canonical_bytes` encodes as UTF-8,
    for a caller that stores text); raises CanonicalEncodingError for unencodable values."""
    if not _encodable(value):
        _check(value, "")
    return _encode(value)


def canonical_bytes(value: Any) -> bytes:
    """Encode ``value`` canonically; raises CanonicalEncodingError for unencodable values."""
    return canonical_text(value).encode("utf-8")


def loads(data: bytes) -> Any:
    """Decode canonical bytes, refusing anything that would not re-encode to the same bytes."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CanonicalEncodingError(f"not canonical JSON: {exc}") from None
    if canonical_bytes(value) != data:
        raise CanonicalEncodingError("bytes are JSON but not in canonical form")
    return value


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_sha256_hex(value) -> bool:
    """Whether ``value`` is a sha256 digest as this project writes them: 64 lowercase hex."""
    # strip() removes every hex digit from both ends in C: nothing may be left over.
    return isinstance(value, str) and len(value) == 64 and not value.strip("0123456789abcdef")
