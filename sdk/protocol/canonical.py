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


#: Objects and lists inside each other: deeper documents have no canonical encoding
#: (nothing signed needs more, and the walks below recurse).
MAX_DEPTH = 64


class CanonicalEncodingError(ValueError):
    """A value cannot be encoded canonically (NaN, a non-string key, bytes, a string that
    is not Unicode text, nesting deeper than MAX_DEPTH...)."""


def _encodable(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` has a canonical encoding (strings aside: a lone surrogate is
    found when the text is encoded): a walk with no paths built, since documents are
    nearly always fine (every envelope and receipt, on both sides, passes here).
    :func:`_check` says what is wrong when it is not."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return True
    if depth >= MAX_DEPTH:
        return t is float and value - value == 0.0
    if t is dict:
        for key, item in value.items():
            if type(key) is not str or not _encodable(item, depth + 1):
                return False
        return True
    if t is list or t is tuple:
        for item in value:
            if not _encodable(item, depth + 1):
                return False
        return True
    if t is float:
        return value - value == 0.0  # False for NaN and the infinities
    return False  # subclasses and other types: _check decides, with the path


def _check(value: Any, path: str, depth: int = 0) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise CanonicalEncodingError(f"{path or 'value'} holds a lone surrogate, which is "
                                         "not Unicode text and has no UTF-8 encoding") from None
        return
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise CanonicalEncodingError(f"{path or 'value'} is {value!r}; only finite numbers "
                                         "have a canonical encoding")
        return
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_DEPTH:
        raise CanonicalEncodingError(f"{path or 'value'} nests objects and lists more than "
                                     f"{MAX_DEPTH} levels deep")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalEncodingError(f"{path or 'value'} has a non-string key {key!r}")
            _check(key, f"{path or 'value'} (a key)")
            _check(item, f"{path}.{key}" if path else key, depth + 1)
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
    text = canonical_text(value)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate somewhere: _check names where
        _check(value, "")
        raise


def loads(data: bytes) -> Any:
    """Decode canonical bytes, refusing anything that would not re-encode to the same bytes."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CanonicalEncodingError(f"not canonical JSON: {exc}") from None
    except (RecursionError, ValueError) as exc:  # nested past the stack; 5,000-digit ints
        raise CanonicalEncodingError(f"not canonical JSON: {type(exc).__name__}: "
                                     f"{str(exc)[:100]}") from None
    if canonical_bytes(value) != data:
        raise CanonicalEncodingError("bytes are JSON but not in canonical form")
    return value


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_sha256_hex(value) -> bool:
    """Whether ``value`` is a sha256 digest as this project writes them: 64 lowercase hex."""
    # strip() removes every hex digit from both ends in C: nothing may be left over.
    return isinstance(value, str) and len(value) == 64 and not value.strip("0123456789abcdef")
