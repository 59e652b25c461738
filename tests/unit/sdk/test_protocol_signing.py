"""The wire contract: canonical bytes, purpose-bound signatures, envelopes and receipts."""
import pytest

from sdk.protocol.canonical import CanonicalEncodingError, canonical_bytes, loads
from sdk.protocol.envelope import (EnvelopeError, ReplayGuard, make_envelope, make_receipt,
                                   open_envelope, open_receipt, sign_envelope)
from sdk.protocol.signing import KeyPair, SignatureError, verify


def test_canonical_bytes_are_independent_of_key_order_and_refuse_nan():
    assert canonical_bytes({"b": 1, "a": [1, "é"]}) == canonical_bytes({"a": [1, "é"], "b": 1})
    assert canonical_bytes({"a": 1.5}) == b'{"a":1.5}'
    with pytest.raises(CanonicalEncodingError, match="finite"):
        canonical_bytes({"x": float("nan")})
    with pytest.raises(CanonicalEncodingError, match="non-string key"):
        canonical_bytes({1: 2})
    with pytest.raises(CanonicalEncodingError, match="canonical form"):
        loads(b'{"b":1, "a":2}')


def test_signature_is_bound_to_its_purpose():
    k = KeyPair.generate()
    sig = k.sign("envelope", {"x": 1})
    verify(k.public_key_hex, "envelope", {"x": 1}, sig)
    with pytest.raises(SignatureError):
        verify(k.public_key_hex, "receipt", {"x": 1}, sig)
    with pytest.raises(SignatureError):
        verify(k.public_key_hex, "envelope", {"x": 2}, sig)
    with pytest.raises(SignatureError, match="unsigned"):
        verify(k.public_key_hex, "envelope", {"x": 1}, "")


def test_key_file_is_private(tmp_path):
    path = tmp_path / "id" / "identity.key"
    k = KeyPair.load_or_create(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert KeyPair.load_or_create(path).public_key_hex == k.public_key_hex


@pytest.fixture
def keys():
    return KeyPair.generate(), KeyPair.generate()


def _envelope(broker, agent, now=1000.0, **kw):
    env = make_envelope(job_id="j1", attempt=0, plugin="echo", version="1.0.0",
                        inputs={"text": "hi"}, provider_key=agent.public_key_hex,
                        lease_timeout_s=30, ttl_s=60, now=now, **kw)
    return env, *sign_envelope(broker, env)


def test_agent_accepts_a_good_envelope_once(keys):
    broker, agent = keys
    env, data, sig = _envelope(broker, agent)
    guard = ReplayGuard()
    opened = open_envelope(data, sig, broker_key=broker.public_key_hex,
                           my_key=agent.public_key_hex, replay=guard, now=1001)
    assert opened == env
    with pytest.raises(EnvelopeError) as exc:
        open_envelope(data, sig, broker_key=broker.public_key_hex, my_key=agent.public_key_hex,
                      replay=guard, now=1002)
    assert exc.value.code == "replayed_envelope"


@pytest.mark.parametrize("case", ["forged", "tampered", "unsigned", "expired", "other_agent",
                                  "garbage"])
def test_agent_refuses_bad_envelopes(keys, case):
    broker, agent = keys
    env, data, sig = _envelope(broker, agent)
    now = 1001
    my_key = agent.public_key_hex
    if case == "forged":
        sig = KeyPair.generate().sign("envelope", env)
    elif case == "tampered":
        data = canonical_bytes({**env, "inputs": {"text": "rm -rf"}})
    elif case == "unsigned":
        sig = ""
    elif case == "expired":
        now = 1000 + 61
    elif case == "other_agent":
        my_key = KeyPair.generate().public_key_hex
    elif case == "garbage":
        data = b"{not json"
    with pytest.raises(EnvelopeError) as exc:
        open_envelope(data, sig, broker_key=broker.public_key_hex, my_key=my_key,
                      replay=ReplayGuard(), now=now)
    assert exc.value.code in {"bad_signature", "expired_envelope", "wrong_provider",
                              "malformed_envelope"}


def test_receipt_verifies_only_for_its_signer(keys):
    broker, agent = keys
    env, data, _ = _envelope(broker, agent)
    rec = make_receipt(envelope=env, envelope_bytes=data, provider_key=agent.public_key_hex,
                       outputs=[{"index": 0, "sha256": "ab" * 32, "media_type": "image/png",
                                 "size": 3}], work_units=1.25, timings_ms={"run": 5})
    blob, sig = canonical_bytes(rec), agent.sign("receipt", rec)
    assert open_receipt(blob, sig, provider_key=agent.public_key_hex)["work_units"] == "1.250000"
    thief = KeyPair.generate()
    with pytest.raises(EnvelopeError) as exc:
        open_receipt(blob, thief.sign("receipt", rec), provider_key=agent.public_key_hex)
    assert exc.value.code == "bad_signature"
    forged = {**rec, "provider": thief.public_key_hex}
    with pytest.raises(EnvelopeError) as exc:
        open_receipt(canonical_bytes(forged), thief.sign("receipt", forged),
                     provider_key=agent.public_key_hex)
    assert exc.value.code == "wrong_provider"
