"""sdk.protocol.canonical is RFC 8785 (JCS): the shipped test vectors hold, and on any
JSON value within JCS's domain (numbers that are doubles, integers within ±(2**53 − 1))
its bytes equal those of the ``rfc8785`` package, an independent implementation."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdk.protocol.canonical import canonical_bytes, canonical_text, jcs_number, loads

rfc8785 = pytest.importorskip("rfc8785")
VECTORS = json.loads((Path(__file__).parents[3] / "sdk/protocol/jcs_vectors.json").read_text())


@pytest.mark.parametrize("case", VECTORS["vectors"], ids=lambda c: c["name"])
def test_the_shipped_vectors(case):
    value = json.loads(case["input"])
    text = canonical_text(value)
    assert text == case["canonical"]
    assert hashlib.sha256(text.encode()).hexdigest() == case["sha256"]
    assert rfc8785.dumps(value).decode() == case["canonical"]
    assert loads(text.encode()) == value  # canonical bytes read back to the same value


SAFE = 2**53 - 1
scalars = (st.none() | st.booleans() | st.integers(-SAFE, SAFE)
           | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(alphabet=st.characters(codec="utf-8"), max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=5), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(values)
def test_equals_the_rfc8785_package_on_any_value(value):
    assert canonical_bytes(value) == rfc8785.dumps(value)


@settings(max_examples=3000, deadline=None, derandomize=True)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_numbers_are_written_as_ecmascript_writes_them(x):
    assert jcs_number(x) == rfc8785.dumps(x).decode()
    assert float(jcs_number(x)) == x


def test_what_today_signs_differently_from_plain_python_json():
    """The cases where Python's json (this module before JCS) and JCS part: floats with
    no fraction or an exponent, and keys past U+FFFF against keys in U+E000–U+FFFF."""
    doc = {"temperature": 1.0, "tiny": 1e-7, "\ue000": 1, "\U0001F600": 2}
    assert canonical_text(doc) == '{"temperature":1,"tiny":1e-7,"😀":2,"\ue000":1}'
    assert json.dumps(doc, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False) != canonical_text(doc)
