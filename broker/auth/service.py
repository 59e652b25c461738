"""API keys: created once (the plaintext is shown only then), stored as a SHA-256 of the
secret, and checked on every request.

Key format: ``sc_<role>_<key id>_<secret>``. The key id locates the row; the secret is
256 bits from ``secrets`` so a plain SHA-256 is enough (no password stretching needed).
Verified keys are cached for a short time so a busy client does not pay a query per call.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from broker.errors import InvalidRequest, Unauthenticated

ROLES = ("client", "provider", "publisher", "admin")


@dataclass(frozen=True)
class Principal:
    account_id: str
    role: str
    key_id: str


@dataclass
class KeyRecord:
    id: str
    account_id: str
    role: str
    secret_sha256: str
    revoked_at: float | None = None


class AccountRepository(Protocol):
    def create_account(self, account_id: str, name: str, role: str, now: float) -> None: ...
    def add_key(self, record: KeyRecord, now: float) -> None: ...
    def get_key(self, key_id: str) -> KeyRecord | None: ...
    def revoke_key(self, key_id: str, now: float) -> bool: ...


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKeyService:
    CACHE_TTL_S = 30.0

    def __init__(self, repo: AccountRepository, clock=time.time):
        self.repo = repo
        self.clock = clock
        self._cache: dict[str, tuple[Principal, float]] = {}
        self._lock = threading.Lock()
        self.on_account_created = lambda account_id, role: None  # opens ledger accounts

    def create_account_with_key(self, role: str, name: str = "") -> tuple[str, Principal]:
        """Create an account and its first key; returns (plaintext key, principal)."""
        if role not in ROLES:
            raise InvalidRequest(f"role {role!r} is not allowed; choose one of {list(ROLES)}",
                                 field="role")
        account_id = str(uuid.uuid4())
        self.repo.create_account(account_id, name or f"{role}-{account_id[:8]}", role, self.clock())
        self.on_account_created(account_id, role)
        return self.add_key(account_id, role)

    def add_key(self, account_id: str, role: str) -> tuple[str, Principal]:
        key_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32).replace("_", "x").replace("-", "y")
        self.repo.add_key(KeyRecord(key_id, account_id, role, _sha(secret)), self.clock())
        return f"sc_{role}_{key_id}_{secret}", Principal(account_id, role, key_id)

    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise Unauthenticated("no API key: send 'Authorization: Bearer sc_…' (create one "
                                  "with `sparecycles broker create-key --role client`)")
        now = self.clock()
        with self._lock:
            hit = self._cache.get(token)
        if hit and hit[1] > now:
            return hit[0]
        parts = token.split("_")
        if len(parts) != 4 or parts[0] != "sc" or parts[1] not in ROLES:
            raise Unauthenticated("malformed API key: keys look like sc_<role>_<id>_<secret>")
        record = self.repo.get_key(parts[2])
        if (record is None or record.revoked_at is not None
                or not hmac.compare_digest(record.secret_sha256, _sha(parts[3]))):
            raise Unauthenticated("API key not recognised or revoked; create a new one with "
                                  "`sparecycles broker create-key`")
        if record.role != parts[1]:  # a key is only valid exactly as it was issued
            raise Unauthenticated(f"this key says sc_{parts[1]}_… but was issued as a "
                                  f"{record.role} key (sc_{record.role}_…); send the key "
                                  "exactly as `sparecycles broker create-key` printed it")
        principal = Principal(record.account_id, record.role, record.id)
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[token] = (principal, now + self.CACHE_TTL_S)
        return principal

    def revoke(self, key_id: str) -> bool:
        with self._lock:
            self._cache.clear()
        return self.repo.revoke_key(key_id, self.clock())
