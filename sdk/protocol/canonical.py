r"""The one canonical byte encoding that every signature in Sparecycles covers.

It is the JSON Canonicalization Scheme, RFC 8785 (JCS), so that an agent or SDK in any
language can sign and verify against a standard: UTF-8, no insignificant whitespace,
object keys sorted by their UTF-16 code units, strings escaped as ECMAScript's
JSON.stringify does (``\" \\ \b \f \n \r \t``, other controls ``\u00xx``, nothing
else), numbers in ECMAScript's shortest round-trip form (``1.0`` is ``1``, ``1e21`` is
``1e+21``, ``1e-7`` is ``1e-7``), no NaN or infinities. Money is never a float: it is
integer micro-credits. Integers are written exactly; JCS (whose numbers are IEEE
doubles) only covers those within ±(2**53 − 1), which is all the protocol signs (seeds,
steps and sizes are bounded far below; an integer beyond is still written exactly, but
another JCS implementation may refuse it).

``sdk/protocol/jcs_vectors.json`` holds test vectors (value, canonical text, sha256) that
another implementation can check itself against; tests/unit/sdk/test_canonical_jcs.py
checks this module against them and against the ``rfc8785`` package.

Documents without floats and with ASCII keys only (most envelopes and receipts) go
through Python's C JSON encoder, whose output is then byte for byte JCS; the others
through the encoder below.

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
_string = json.encoder.encode_basestring  # JCS's string form (the C one where it exists)


def _plain(value: Any) -> bool:
    """Whether the C encoder's output for ``value`` is already JCS: no float anywhere
    (Python writes 1.0 and 1e-07 where JCS writes 1 and 1e-7) and ASCII keys only (code
    point order, Python's, and UTF-16 order, JCS's, differ only past U+FFFF)."""
    t = type(value)
    if t is dict:
        for key, item in value.items():
            if not key.isascii() or not _plain(item):
                return False
        return True
    if t is list or t is tuple:
        for item in value:
            if not _plain(item):
                return False
        return True
    return t is not float


def jcs_number(value: float) -> str:
    """A finite float as ECMAScript's Number.prototype.toString writes it (RFC 8785
    §3.2.2.3): the shortest digits that round-trip (Python's repr finds the same ones),
    placed as ECMAScript places them."""
    if value == 0:
        return "0"  # -0 too
    sign = "-" if value < 0 else ""
    mantissa, _, exp = repr(abs(value)).partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    point = len(whole) + (int(exp) if exp else 0)  # the decimal point sits after `point`
    point -= len(whole + frac) - len((whole + frac).lstrip("0"))
    digits = digits.rstrip("0") or "0"
    k, n = len(digits), point  # ECMAScript's k (digit count) and n (point position)
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        e = n - 1
        text = digits[0] + ("." + digits[1:] if k > 1 else "") + \
            ("e+" if e >= 0 else "e-") + str(abs(e))
    return sign + text


def _jcs(value: Any, out: list[str]) -> None:
    t = type(value)
    if t is str:
        out.append(_string(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif t is int:
        out.append(str(value))
    elif t is float:
        out.append(jcs_number(value))
    elif t is dict:
        out.append("{")
        for i, key in enumerate(sorted(value, key=lambda k: k.encode("utf-16-be",
                                                                     "surrogatepass"))):
            if i:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _jcs(value[key], out)
        out.append("}")
    else:  # list or tuple (_encodable let nothing else through)
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _jcs(item, out)
        out.append("]")


def canonical_text(value: Any) -> str:
    """The canonical JSON text of ``value`` (what :func:`canonical_bytes` encodes as UTF-8,
    for a caller that stores text); raises CanonicalEncodingError for unencodable values."""
    if not _encodable(value):
        _check(value, "")
    if _plain(value):
        return _encode(value)
    out: list[str] = []
    _jcs(value, out)
    return "".join(out)


def legacy_bytes(value: Any) -> bytes:
    """The encoding before JCS (Python's json with sorted keys): only to check hashes
    written before the change (an audit chain's old entries); never to sign."""
    if not _encodable(value):
        _check(value, "")
    return _encode(value).encode("utf-8")


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
