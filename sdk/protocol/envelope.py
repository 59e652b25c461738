"""Job envelopes (signed by the broker) and receipts (signed by the agent).

An envelope tells exactly one provider to run exactly one attempt of a job before it
expires; its nonce lets the agent refuse replays. A receipt binds the outputs (by sha256)
and the work done to that envelope.
"""
from __future__ import annotations

import heapq
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .canonical import CanonicalEncodingError, canonical_bytes, loads, sha256_hex
from .signing import KeyPair, SignatureError, verify_canonical

ENVELOPE_VERSION = 1


class EnvelopeError(ValueError):
    """An envelope or receipt that must be refused; ``code`` is stable."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def make_envelope(*, job_id: str, attempt: int, plugin: str, version: str, inputs: dict,
                  provider_key: str, lease_timeout_s: float, ttl_s: float = 60.0,
                  now: float | None = None, extra: dict | None = None,
                  sealed: bool = False) -> dict:
    """``sealed``: the inputs travel as ``sealed_inputs``, encrypted to ``provider_key``
    (sdk/protocol/sealing.py), which the broker always does."""
    now = time.time() if now is None else now
    env = {
        "v": ENVELOPE_VERSION,
        "job_id": job_id,
        "attempt": attempt,
        "plugin": plugin,
        "version": version,
        "inputs": inputs,
        "provider": provider_key,
        "issued_at_ms": int(now * 1000),
        "expires_at_ms": int((now + ttl_s) * 1000),
        "lease_timeout_ms": int(lease_timeout_s * 1000),
        "nonce": secrets.token_hex(16),
    }
    if sealed:
        from .sealing import SEALED_FIELD, seal_inputs

        env[SEALED_FIELD] = seal_inputs(env.pop("inputs"), provider_key)
    if extra:
        env.update(extra)
    return env


def sign_envelope(broker: KeyPair, envelope: dict) -> tuple[bytes, str]:
    data = canonical_bytes(envelope)
    return data, broker.sign_canonical("envelope", data)


@dataclass
class ReplayGuard:
    """Remembers nonces of envelopes seen until they expire (agent side). Expired nonces
    are popped from a heap by expiry: O(log n) per envelope, where scanning every nonce
    held cost milliseconds at hundreds of envelopes a second (a minute's worth is held)."""

    seen: dict[str, int] = field(default_factory=dict)  # nonce -> expires_at_ms
    _by_expiry: list = field(default_factory=list, repr=False)  # (expires_at_ms, nonce)

    def check_and_add(self, nonce: str, expires_at_ms: int, now_ms: int) -> None:
        heap, seen = self._by_expiry, self.seen
        while heap and heap[0][0] < now_ms:
            exp, n = heapq.heappop(heap)
            if seen.get(n) == exp:
                del seen[n]
        if nonce in seen:
            raise EnvelopeError("replayed_envelope", f"envelope nonce {nonce} was already used")
        seen[nonce] = expires_at_ms
        heapq.heappush(heap, (expires_at_ms, nonce))


def open_envelope(data: bytes, signature: str, *, broker_key: str, my_key: str,
                  replay: ReplayGuard, now: float | None = None, identity=None) -> dict:
    """Verify and decode an envelope for this agent; raise EnvelopeError otherwise.
    Sealed inputs are opened with ``identity`` (this agent's KeyPair) into ``inputs``."""
    now_ms = int((time.time() if now is None else now) * 1000)
    try:
        env = loads(data)
    except CanonicalEncodingError as exc:
        raise EnvelopeError("malformed_envelope", str(exc)) from None
    if not isinstance(env, dict) or env.get("v") != ENVELOPE_VERSION:
        raise EnvelopeError("malformed_envelope", "envelope is not a v1 job envelope")
    try:
        verify_canonical(broker_key, "envelope", data, signature)
    except SignatureError as exc:
        raise EnvelopeError("bad_signature", str(exc)) from None
    if env.get("provider") != my_key:
        raise EnvelopeError("wrong_provider", "envelope is addressed to another provider")
    if int(env.get("expires_at_ms", 0)) < now_ms:
        raise EnvelopeError("expired_envelope",
                            f"envelope expired {(now_ms - env['expires_at_ms']) / 1000:.1f}s ago")
    replay.check_and_add(str(env.get("nonce", "")), int(env["expires_at_ms"]), now_ms)
    from .sealing import SEALED_FIELD, SealingError, open_inputs

    if SEALED_FIELD in env:
        if identity is None:
            raise EnvelopeError("sealed_inputs", "the inputs are sealed; open the envelope "
                                "with the provider's identity key")
        try:
            env["inputs"] = open_inputs(env[SEALED_FIELD], identity)
        except SealingError as exc:
            raise EnvelopeError("unsealable_inputs", str(exc)) from None
    return env


def make_receipt(*, envelope: dict, envelope_bytes: bytes, provider_key: str,
                 outputs: list[dict], work_units: float, timings_ms: dict[str, int],
                 extra: dict | None = None) -> dict:
    """``outputs``: [{"index", "sha256", "media_type", "size"}]."""
    rec = {
        "v": ENVELOPE_VERSION,
        "job_id": envelope["job_id"],
        "attempt": envelope["attempt"],
        "envelope_sha256": sha256_hex(envelope_bytes),
        "provider": provider_key,
        "outputs": outputs,
        # Work units are a decimal string so the signed document holds no float surprises.
        "work_units": f"{work_units:.6f}",
        "timings_ms": {k: int(v) for k, v in timings_ms.items()},
    }
    if extra:
        rec.update(extra)
    return rec


def open_receipt(data: bytes, signature: str, *, provider_key: str) -> dict:
    """Verify and decode a receipt from the agent holding ``provider_key``."""
    try:
        rec = loads(data)
    except CanonicalEncodingError as exc:
        raise EnvelopeError("malformed_receipt", str(exc)) from None
    if not isinstance(rec, dict) or rec.get("v") != ENVELOPE_VERSION:
        raise EnvelopeError("malformed_receipt", "receipt is not a v1 receipt")
    if rec.get("provider") != provider_key:
        raise EnvelopeError("wrong_provider", "receipt names another provider's key")
    try:
        verify_canonical(provider_key, "receipt", data, signature)
    except SignatureError as exc:
        raise EnvelopeError("bad_signature", str(exc)) from None
    for key in ("job_id", "attempt", "outputs", "work_units", "envelope_sha256"):
        if key not in rec:
            raise EnvelopeError("malformed_receipt", f"receipt lacks {key!r}")
    return rec


def receipt_job_id(data: bytes) -> str | None:
    """The job id a receipt names, neither verified nor checked for canonical form: for
    routing a receipt to the service that owns its job (which then opens it properly)."""
    try:
        rec = json.loads(data)
    except ValueError:
        return None
    job_id = rec.get("job_id") if isinstance(rec, dict) else None
    return job_id if isinstance(job_id, str) else None


def challenge_document(nonce: str, agent_key: str, broker_key: str) -> dict[str, Any]:
    return {"nonce": nonce, "agent_key": agent_key, "broker_key": broker_key}
