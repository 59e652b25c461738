"""API keys: created once (the plaintext is shown only then), stored as a SHA-256 of the
secret, and checked on every request; each has scopes (broker/auth/scopes.py), may expire,
and can be listed, revoked and rotated (``sparecycles broker keys``, the console's Keys
page, ``/v1/keys``).

Key format: ``sc_<role>_<key id>_<secret>``. The key id locates the row; the secret is
256 bits from ``secrets`` so a plain SHA-256 is enough (no password stretching needed).

A key may be exchanged for a short-lived JWT (``POST /v1/auth/token``, HS256 with the
broker's token secret, ``aud`` ``sparecycles-api``) carrying the key's id and its scopes,
or fewer; the REST API and the agent gateway take either. Every check, of a key or of a
token, reads the key's row through a cache of at most ``KEY_CACHE_S`` seconds, so a key
revoked (or expired) on any replica stops working on every replica within that time, its
tokens with it.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

import jwt

from broker.errors import Forbidden, InvalidRequest, NotFound, Unauthenticated
from .scopes import ROLE_SCOPES, parse_scopes

ROLES = ("client", "provider", "publisher", "admin")


TOKEN_AUDIENCE = "sparecycles-api"
TOKEN_ALGORITHM = "HS256"
TOKEN_TTL_S = 300          # the default life of an exchanged token
MAX_TOKEN_TTL_S = 3600
KEY_CACHE_S = 2.0          # the longest a revocation takes to reach this replica


@dataclass(frozen=True)
class Principal:
    account_id: str
    role: str
    key_id: str
    # Empty: every scope of the role (principals built by hand in tests and services).
    scopes: frozenset = field(default=frozenset())
    # Authenticated by a token exchanged for the key (POST /v1/auth/token), not the key
    # itself: such a caller may not hand out keys or tokens.
    via_token: bool = False

    def __post_init__(self):
        if not self.scopes:
            object.__setattr__(self, "scopes", frozenset(ROLE_SCOPES.get(self.role, ())))


@dataclass
class KeyRecord:
    id: str
    account_id: str
    role: str
    secret_sha256: str
    revoked_at: float | None = None
    scopes: tuple[str, ...] = ()      # empty: all of the role's
    expires_at: float | None = None
    name: str = ""
    created_at: float = 0.0

    def state(self, now: float) -> str:
        if self.revoked_at is not None and self.revoked_at <= now:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"

    def effective_scopes(self) -> tuple[str, ...]:
        return self.scopes or ROLE_SCOPES.get(self.role, ())


class AccountRepository(Protocol):
    def create_account(self, account_id: str, name: str, role: str, now: float) -> None: ...
    def add_key(self, record: KeyRecord, now: float) -> None: ...
    def get_key(self, key_id: str) -> KeyRecord | None: ...
    def revoke_key(self, key_id: str, now: float) -> bool: ...
    def list_keys(self, account_id: str | None = None) -> list[KeyRecord]: ...
    def set_key_end(self, key_id: str, revoked_at: float) -> bool: ...


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKeyService:
    CACHE_TTL_S = KEY_CACHE_S

    def __init__(self, repo: AccountRepository, clock=time.time, token_secret: str = "",
                 on_account_created: Callable[[str, str], None] | None = None):
        """``on_account_created(account_id, role)`` runs after each new account (the wiring
        opens its ledger accounts there)."""
        self.repo = repo
        self.clock = clock
        # Signs exchanged tokens; replicas share it (SPARECYCLES_ADMIN_SESSION_SECRET or the
        # data dir's admin_session.key, from which it is derived). Random: tokens of this
        # process only.
        self._token_key = hashlib.sha256(
            b"sparecycles-api-token\0" + (token_secret or secrets.token_hex(32)).encode()
        ).digest()
        self._cache: dict[str, tuple[Principal, float]] = {}
        self._records: dict[str, tuple[KeyRecord | None, float]] = {}
        self._lock = threading.Lock()
        self.on_account_created = on_account_created or (lambda account_id, role: None)

    def create_account_with_key(self, role: str, name: str = "", *, scopes=None,
                                expires_at: float | None = None) -> tuple[str, Principal]:
        """Create an account and its first key; returns (plaintext key, principal)."""
        if role not in ROLES:
            raise InvalidRequest(f"role {role!r} is not allowed; choose one of {list(ROLES)}",
                                 field="role")
        scopes = parse_scopes(role, scopes)
        account_id = str(uuid.uuid4())
        self.repo.create_account(account_id, name or f"{role}-{account_id[:8]}", role, self.clock())
        self.on_account_created(account_id, role)
        return self.add_key(account_id, role, scopes=scopes, expires_at=expires_at)

    def add_key(self, account_id: str, role: str, *, scopes=None,
                expires_at: float | None = None, name: str = "") -> tuple[str, Principal]:
        """A new key of the account: ``scopes`` (default all of the role's), expiring at
        ``expires_at`` (epoch seconds; None: never)."""
        scopes = parse_scopes(role, scopes)
        now = self.clock()
        if expires_at is not None and expires_at <= now:
            raise InvalidRequest("the key would expire before it is created; give a time "
                                 "in the future", field="expires_at")
        key_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32).replace("_", "x").replace("-", "y")
        stored = () if set(scopes) == set(ROLE_SCOPES[role]) else tuple(scopes)
        self.repo.add_key(KeyRecord(key_id, account_id, role, _sha(secret), scopes=stored,
                                    expires_at=expires_at, name=name, created_at=now), now)
        return (f"sc_{role}_{key_id}_{secret}",
                Principal(account_id, role, key_id, frozenset(scopes)))

    # ---- checking ----------------------------------------------------------------------
    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise Unauthenticated("no API key: send 'Authorization: Bearer sc_…' (create one "
                                  "with `sparecycles broker create-key --role client`)")
        now = self.clock()
        with self._lock:
            hit = self._cache.get(token)
        if hit and hit[1] > now:
            return hit[0]
        if self.is_token(token):
            principal, until = self._check_token(token, now)
        else:
            principal, until = self._check_key(token, now)
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[token] = (principal, min(until, now + self.CACHE_TTL_S))
        return principal

    def _record(self, key_id: str, now: float) -> KeyRecord | None:
        """The key's row, read again once it is KEY_CACHE_S old."""
        with self._lock:
            hit = self._records.get(key_id)
        if hit and hit[1] > now:
            return hit[0]
        record = self.repo.get_key(key_id)
        with self._lock:
            if len(self._records) > 10_000:
                self._records.clear()
            self._records[key_id] = (record, now + self.CACHE_TTL_S)
        return record

    def _live(self, record: KeyRecord | None, now: float) -> KeyRecord:
        state = record.state(now) if record is not None else "unknown"
        if state == "revoked":
            raise Unauthenticated(f"API key {record.id} was revoked; create a new one with "
                                  "`sparecycles broker create-key` (or ask an admin)",
                                  code_override="key_revoked")
        if state == "expired":
            raise Unauthenticated(f"API key {record.id} expired at "
                                  f"{time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(record.expires_at))}; "
                                  "rotate it (`sparecycles broker keys rotate`) or create a "
                                  "new one", code_override="key_expired")
        return record

    def _check_key(self, token: str, now: float) -> tuple[Principal, float]:
        parts = token.split("_")
        if len(parts) != 4 or parts[0] != "sc" or parts[1] not in ROLES:
            raise Unauthenticated("malformed API key: keys look like sc_<role>_<id>_<secret>")
        record = self._record(parts[2], now)
        if record is None or not hmac.compare_digest(record.secret_sha256, _sha(parts[3])):
            raise Unauthenticated("API key not recognised; create a new one with "
                                  "`sparecycles broker create-key`")
        self._live(record, now)
        if record.role != parts[1]:  # a key is only valid exactly as it was issued
            raise Unauthenticated(f"this key says sc_{parts[1]}_… but was issued as a "
                                  f"{record.role} key (sc_{record.role}_…); send the key "
                                  "exactly as `sparecycles broker create-key` printed it")
        principal = Principal(record.account_id, record.role, record.id,
                              frozenset(record.effective_scopes()))
        return principal, _until(record, now)

    def _check_token(self, token: str, now: float) -> tuple[Principal, float]:
        try:
            claims = jwt.decode(token, self._token_key, algorithms=[TOKEN_ALGORITHM],
                                audience=TOKEN_AUDIENCE, leeway=0,
                                options={"require": ["exp", "iat", "sub", "kid", "role",
                                                     "scope"], "verify_iat": False})
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("this token expired; exchange the API key for a new one "
                                  "(POST /v1/auth/token)", code_override="token_expired") from None
        except jwt.InvalidTokenError as exc:
            raise Unauthenticated(f"invalid token ({exc}); send an API key or a token from "
                                  "POST /v1/auth/token") from None
        record = self._live(self._record(str(claims["kid"]), now), now)
        if record.account_id != claims["sub"] or record.role != claims["role"]:
            raise Unauthenticated("this token does not match its key; exchange the key again")
        scopes = frozenset(str(claims["scope"]).split()) & set(record.effective_scopes())
        return (Principal(record.account_id, record.role, record.id, scopes, via_token=True),
                min(float(claims["exp"]), _until(record, now)))

    # ---- tokens ------------------------------------------------------------------------
    @staticmethod
    def is_token(credential: str) -> bool:
        return credential.startswith("eyJ")

    def issue_token(self, who: Principal, scopes=None, ttl_s: float = TOKEN_TTL_S) -> dict:
        """A JWT for ``who`` (a key's principal) holding ``scopes`` (default all the key's;
        never more) for ``ttl_s`` seconds. A token cannot mint tokens."""
        if who.via_token:
            raise Forbidden("send the API key itself (sc_…), not a token, to get a token",
                            code_override="token_not_allowed")
        if not 1 <= ttl_s <= MAX_TOKEN_TTL_S:
            raise InvalidRequest(f"ttl_s is {ttl_s}; give 1 to {MAX_TOKEN_TTL_S} seconds",
                                 field="ttl_s")
        wanted = parse_scopes(who.role, scopes) if scopes else tuple(sorted(who.scopes))
        beyond = sorted(set(wanted) - who.scopes)
        if beyond:
            raise Forbidden(f"this key cannot hand out {beyond}: it holds "
                            f"{' '.join(sorted(who.scopes))}", missing_scope=beyond[0],
                            code_override="missing_scope")
        now = int(self.clock())
        record = self._record(who.key_id, now)
        exp = now + int(ttl_s)
        if record is not None and record.expires_at is not None:
            exp = min(exp, int(record.expires_at))
        claims = {"sub": who.account_id, "kid": who.key_id, "role": who.role,
                  "scope": " ".join(sorted(wanted)), "iat": now, "exp": exp,
                  "aud": TOKEN_AUDIENCE, "jti": secrets.token_hex(8)}
        return {"access_token": jwt.encode(claims, self._token_key, algorithm=TOKEN_ALGORITHM),
                "token_type": "Bearer", "expires_in": exp - now,
                "scopes": sorted(wanted)}

    # ---- handing out keys ----------------------------------------------------------------
    def may_hand_out(self, caller: Principal, scopes,
                     expires_at: float | None) -> tuple[tuple[str, ...], float | None]:
        """The one check of create and rotate: the scopes and expiry a key made by
        ``caller`` gets. Only a full API key may hand out keys (never a token exchanged
        for one: ``caller.via_token``); it hands out only scopes it holds; the new key
        expires no later than the caller's own. Returns (scopes, expires_at)."""
        if caller.via_token:
            raise Forbidden("a token (from POST /v1/auth/token) cannot create or rotate keys; "
                            "use a full API key (sc_…)", code_override="token_not_allowed")
        held = set(caller.scopes)
        wanted = parse_scopes(caller.role, scopes) if scopes else tuple(sorted(held))
        if not set(wanted) & held:
            raise Forbidden(f"asked for scopes {sorted(wanted)} but this key holds "
                            f"{sorted(held) or 'none'}: none of them in common, so there is "
                            "nothing it may hand out", missing_scope=wanted[0],
                            code_override="missing_scope")
        beyond = sorted(set(wanted) - held)
        if beyond:
            raise Forbidden(f"this key cannot hand out {beyond}: asked for {sorted(wanted)}, "
                            f"it holds {sorted(held)}", missing_scope=beyond[0],
                            code_override="missing_scope")
        record = self.repo.get_key(caller.key_id)
        cap = record.expires_at if record is not None else None
        if cap is not None:
            expires_at = cap if expires_at is None else min(expires_at, cap)
        return tuple(wanted), expires_at

    # ---- lifecycle ---------------------------------------------------------------------
    def list_keys(self, account_id: str | None = None) -> list[KeyRecord]:
        return self.repo.list_keys(account_id)

    def get_key(self, key_id: str, account_id: str | None = None) -> KeyRecord:
        record = self.repo.get_key(key_id)
        if record is None or (account_id is not None and record.account_id != account_id):
            raise NotFound(f"no key {key_id!r}" + (" on this account" if account_id else "")
                           + "; list keys with `sparecycles broker keys list`")
        return record

    def revoke(self, key_id: str, account_id: str | None = None) -> bool:
        """Revoke now; False when it was revoked already. Every replica refuses it within
        KEY_CACHE_S seconds."""
        self.get_key(key_id, account_id)
        done = self.repo.revoke_key(key_id, self.clock())
        self._forget(key_id)
        return done

    def rotate(self, key_id: str, *, grace_s: float = 0.0, account_id: str | None = None,
               caller: Principal | None = None) -> tuple[str, KeyRecord]:
        """A new key with the old one's account, role, scopes and name; the old one stops
        working after ``grace_s`` seconds (0: now). Returns (new plaintext key, old record).
        ``caller`` (an API request's principal): only its own account's keys unless it is
        an admin, and through :meth:`may_hand_out` (its scopes, its expiry at most)."""
        if caller is not None and caller.role != "admin":
            account_id = caller.account_id
        old = self.get_key(key_id, account_id)
        now = self.clock()
        if old.state(now) == "revoked":
            raise InvalidRequest(f"key {key_id} is revoked; create a new key instead",
                                 field="key_id")
        if not 0 <= grace_s <= 30 * 86400:
            raise InvalidRequest(f"grace is {grace_s} s; give 0 to 30 days", field="grace_s")
        lifetime = (old.expires_at - old.created_at) if old.expires_at and old.created_at else None
        scopes, expires_at = old.scopes or None, now + lifetime if lifetime else None
        if caller is not None:
            given, expires_at = self.may_hand_out(caller, old.effective_scopes(), expires_at)
            if caller.role == old.role:
                scopes = given
        new_key, _ = self.add_key(old.account_id, old.role, scopes=scopes,
                                  expires_at=expires_at,
                                  name=old.name or f"rotated from {old.id}")
        self.repo.set_key_end(key_id, now + grace_s)
        self._forget(key_id)
        return new_key, old

    def _forget(self, key_id: str) -> None:
        with self._lock:
            self._cache.clear()
            self._records.pop(key_id, None)


def _until(record: KeyRecord, now: float) -> float:
    ends = [t for t in (record.expires_at, record.revoked_at) if t is not None and t > now]
    return min(ends) if ends else now + KEY_CACHE_S
