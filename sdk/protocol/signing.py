"""Ed25519 keys and signatures (PyNaCl) over canonical bytes, with domain separation.

Every signature covers ``b"sparecycles/v1/" + purpose + b"\\0" + canonical_bytes(document)``
so a signature made for one purpose (a job envelope) can never be replayed as another
(a receipt, a hello challenge).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
import os

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from .canonical import CanonicalEncodingError, canonical_bytes

# "publisher": proof that a publisher holds the key it registers (broker.registry).
# "output-url": a broker-signed, expiring URL for an output (the OpenAI surface's image url).
PURPOSES = frozenset({"envelope", "receipt", "challenge", "manifest", "adapter", "publisher",
                      "output-url"})


class SignatureError(ValueError):
    """A signature is missing, malformed or does not verify."""


def _framed(purpose: str, data: bytes) -> bytes:
    """What a signature covers: the purpose, then ``data`` (canonical bytes)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown signature purpose {purpose!r}; one of {sorted(PURPOSES)}")
    return b"sparecycles/v1/" + purpose.encode() + b"\0" + data


@dataclass(frozen=True)
class KeyPair:
    signing_key: SigningKey

    @classmethod
    def generate(cls) -> "KeyPair":
        return cls(SigningKey.generate())

    @classmethod
    def from_seed_hex(cls, seed_hex: str) -> "KeyPair":
        return cls(SigningKey(bytes.fromhex(seed_hex.strip())))

    # Computed once: a frozen dataclass without slots keeps it in the instance __dict__
    # (it is no field: equality, hash and repr ignore it).
    @cached_property
    def public_key_hex(self) -> str:
        return self.signing_key.verify_key.encode().hex()

    @property
    def seed_hex(self) -> str:
        return self.signing_key.encode().hex()

    def sign(self, purpose: str, document) -> str:
        """Sign ``document`` for ``purpose``; returns the signature as hex."""
        return self.sign_canonical(purpose, canonical_bytes(document))

    def sign_canonical(self, purpose: str, data: bytes) -> str:
        """Sign a document already encoded with ``canonical_bytes`` (the bytes that travel
        with the signature: encoded once, not once to send and again to sign)."""
        return self.signing_key.sign(_framed(purpose, data)).signature.hex()

    def save(self, path: Path) -> None:
        """Write the private seed to ``path`` readable by the owner only (0600)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.seed_hex + "\n")
        os.chmod(path, 0o600)

    @classmethod
    def load(cls, path: Path) -> "KeyPair":
        return cls.from_seed_hex(Path(path).read_text())

    @classmethod
    def load_or_create(cls, path: Path) -> "KeyPair":
        path = Path(path)
        if path.exists():
            return cls.load(path)
        pair = cls.generate()
        pair.save(path)
        return pair


def verify(public_key_hex: str, purpose: str, document, signature_hex: str) -> None:
    """Raise SignatureError unless ``signature_hex`` is ``public_key_hex``'s signature."""
    if not signature_hex:
        raise SignatureError(f"the {purpose} is unsigned")
    try:
        data = canonical_bytes(document)
    except CanonicalEncodingError as exc:  # NaN, infinities…: nothing was signed over it
        raise SignatureError(f"the signed {purpose} has no canonical encoding: {exc}") from None
    verify_canonical(public_key_hex, purpose, data, signature_hex)


def verify_canonical(public_key_hex: str, purpose: str, data: bytes, signature_hex: str) -> None:
    """:func:`verify` for a document received as canonical bytes (``canonical.loads``
    checked them): the signature is checked over those bytes, not over a re-encoding."""
    if not signature_hex:
        raise SignatureError(f"the {purpose} is unsigned")
    try:
        key = VerifyKey(bytes.fromhex(public_key_hex))
        sig = bytes.fromhex(signature_hex)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"malformed key or signature for {purpose}: {exc}") from None
    try:
        key.verify(_framed(purpose, data), sig)
    except BadSignatureError:
        raise SignatureError(f"the {purpose} signature does not verify against key "
                             f"{public_key_hex[:16]}…") from None
    except ValueError as exc:  # nacl: a signature of the wrong length
        raise SignatureError(f"malformed signature for {purpose}: {exc}") from None
