"""Console login: an admin API key is exchanged for a short-lived JWT (HS256, PyJWT) kept in
an HttpOnly, SameSite=Strict cookie.

The JWT carries a random ``csrf`` claim; every form posts it back and the server compares
it with the claim of the (signed) cookie, so a page on another origin can neither read nor
forge it. Logging out revokes the token's ``jti`` in the database, so a copied cookie is
refused afterwards even before it expires; revoking the API key ends its sessions too.
"""
from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import jwt

from broker.errors import BrokerError, Forbidden, Unauthenticated

COOKIE = "sc_admin"
LOGIN_CSRF_COOKIE = "sc_admin_login"
ALGORITHM = "HS256"


#: Why the console sent someone to the sign-in page. ``/admin/login?why=<code>`` shows the
#: message of a code from this set and nothing for any other value: the page never prints
#: words a link chose (a crafted link could otherwise make the console say anything).
SIGN_IN_NOTICES = {
    "required": "That page needs an admin session: sign in first.",
    "expired": "Your session expired; sign in again.",
    "invalid": "Your session is not valid; sign in again.",
    "ended": "You signed out of this session; sign in again.",
    "revoked": "The API key of this session was revoked; sign in again.",
    "signed_out": "You signed out.",
}


class SessionRefused(Unauthenticated):
    """A console request without a valid session; ``why`` is its SIGN_IN_NOTICES code."""

    def __init__(self, why: str):
        super().__init__(SIGN_IN_NOTICES[why])
        self.why = why


class CsrfRefused(BrokerError):
    code, http_status, grpc_status, title = ("csrf_refused", 403, "PERMISSION_DENIED",
                                             "Form expired")


@dataclass(frozen=True)
class AdminSession:
    account_id: str
    key_id: str
    jti: str
    csrf: str
    expires_at: float


def load_or_create_secret(path: Path) -> str:
    """The console's signing secret, kept next to the broker key (0600)."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(48)
    path.touch(mode=0o600)
    path.write_text(secret)
    return secret


class AdminSessions:
    def __init__(self, auth, revocations, secret: str, ttl_s: int = 1800, clock=time.time):
        if len(secret) < 32:
            raise ValueError("the admin session secret must be at least 32 characters")
        self.auth = auth
        self.revocations = revocations
        self.secret = secret
        self.ttl_s = ttl_s
        self.clock = clock

    def login(self, api_key: str) -> tuple[str, AdminSession]:
        """A session token for an admin key; :class:`Unauthenticated` or :class:`Forbidden`."""
        who = self.auth.authenticate((api_key or "").strip())
        if who.role != "admin":
            raise Forbidden(f"this is a {who.role} key; the console needs an admin key "
                            "(`sparecycles broker create-key --role admin`)")
        if "admin" not in who.scopes:
            raise Forbidden("this admin key is narrowed to "
                            f"{' '.join(sorted(who.scopes))}; the console needs the scope "
                            "'admin'", missing_scope="admin", code_override="missing_scope")
        now = int(self.clock())
        claims = {"sub": who.account_id, "kid": who.key_id, "iat": now, "exp": now + self.ttl_s,
                  "jti": secrets.token_hex(16), "csrf": secrets.token_urlsafe(24),
                  "aud": "sparecycles-admin"}
        token = jwt.encode(claims, self.secret, algorithm=ALGORITHM)
        return token, self._session(claims)

    def check(self, token: str | None) -> AdminSession:
        if not token:
            raise SessionRefused("required")
        try:
            claims = jwt.decode(token, self.secret, algorithms=[ALGORITHM],
                                audience="sparecycles-admin", leeway=0,
                                options={"require": ["exp", "iat", "sub", "jti", "csrf", "kid"]})
        except jwt.ExpiredSignatureError:
            raise SessionRefused("expired") from None
        except jwt.InvalidTokenError:
            raise SessionRefused("invalid") from None
        if self.revocations.is_revoked(claims["jti"]):
            raise SessionRefused("ended")
        record = self.auth.repo.get_key(claims["kid"])
        if record is None or record.state(self.clock()) != "active" or record.role != "admin" \
                or "admin" not in record.effective_scopes():
            raise SessionRefused("revoked")
        return self._session(claims)

    def logout(self, session: AdminSession) -> None:
        self.revocations.revoke(session.jti, session.expires_at)

    @staticmethod
    def check_csrf(session: AdminSession, submitted: str | None) -> None:
        if not submitted or not hmac.compare_digest(session.csrf, submitted):
            raise CsrfRefused("this form is stale or did not come from the console; reload the "
                              "page and submit it again")

    @staticmethod
    def _session(claims: dict) -> AdminSession:
        return AdminSession(account_id=claims["sub"], key_id=claims["kid"], jti=claims["jti"],
                            csrf=claims["csrf"], expires_at=float(claims["exp"]))
