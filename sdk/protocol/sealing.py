"""Sealed job inputs: encrypted to the one provider an envelope is addressed to
(docs/architecture.md, *Security: who can read a prompt*).

The broker seals an envelope's inputs with a libsodium sealed box (PyNaCl ``SealedBox``:
an ephemeral X25519 key and XSalsa20-Poly1305) to the X25519 key derived from the provider's
Ed25519 identity, the key the envelope names in ``provider``. Only that agent's identity
key opens it; every other provider, and anyone who copies the envelope off the wire, the
database or a log, holds ciphertext. The envelope's ``sealed_inputs`` replaces ``inputs``
and is covered by the broker's signature like every other field.
"""
from __future__ import annotations

import base64

from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox
from nacl.signing import VerifyKey

from .canonical import CanonicalEncodingError, canonical_bytes, loads

SEALED_FIELD = "sealed_inputs"


class SealingError(ValueError):
    pass


def _x25519_public(ed25519_hex: str) -> PublicKey:
    try:
        return VerifyKey(bytes.fromhex(ed25519_hex)).to_curve25519_public_key()
    except (ValueError, TypeError, CryptoError) as exc:
        raise SealingError(f"provider key {ed25519_hex[:16]}… is not an Ed25519 public key "
                           f"({exc})") from None


def seal_inputs(inputs: dict, provider_key_hex: str) -> str:
    """``inputs`` (canonical JSON) sealed to the provider's identity; base64 text."""
    box = SealedBox(_x25519_public(provider_key_hex))
    return base64.b64encode(box.encrypt(canonical_bytes(inputs))).decode("ascii")


def open_inputs(sealed: str, identity) -> dict:
    """The inputs sealed to ``identity`` (a signing.KeyPair); SealingError when they were
    sealed to another key or altered."""
    private: PrivateKey = identity.signing_key.to_curve25519_private_key()
    try:
        data = SealedBox(private).decrypt(base64.b64decode(sealed, validate=True))
        inputs = loads(data)
    except (CryptoError, ValueError, CanonicalEncodingError) as exc:
        raise SealingError(f"the inputs are not sealed to this provider's key ({exc})") from None
    if not isinstance(inputs, dict):
        raise SealingError("the sealed inputs are not an object")
    return inputs
