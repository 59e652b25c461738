"""Rate limits on the REST API, per account and per route group, answered with 429 and
``Retry-After`` (docs/architecture.md, *Security: rate limits*).

Each route belongs to the group of the scope it needs (broker/auth/scopes.py): ``jobs:write``
(submits, cancels, quotes), ``jobs:read``, ``auth`` (token exchanges and key management),
``publish``, and ``default`` for the rest. An account (every key of it, and every token exchanged for
one, so minting keys does not multiply the limit) has one budget per group, counted in a sliding window by the ``limits`` library (the one under
Flask-Limiter). The counters live in ``rate_limit_storage``: ``memory://`` keeps them in
this process (one replica), ``redis://host:6379/0`` in Redis, shared by every replica that
names the same server, so the limit holds for the whole deployment. PostgreSQL is not used
for them: a write per request would cost the database more than the limit saves.

Setting (``SPARECYCLES_RATE_LIMITS``): ``group=N/unit`` pairs, comma-separated, e.g.
``jobs:write=100/second,jobs:read=600/second,default=300/second,auth=20/second``; ``off``
turns them off. A group not named keeps its default.
"""
from __future__ import annotations

import logging
import math
import time

from broker.errors import BrokerError

log = logging.getLogger("broker.ratelimit")

DEFAULT_LIMITS = {"jobs:write": "100/second", "jobs:read": "600/second",
                  "auth": "20/second", "publish": "20/second", "default": "300/second"}
_GROUP_OF_SCOPE = {"jobs:write": "jobs:write", "jobs:read": "jobs:read", "publish": "publish",
                   "keys:write": "auth", "": "auth"}


class RateLimited(BrokerError):
    code, http_status, grpc_status, title = ("rate_limited", 429, "RESOURCE_EXHAUSTED",
                                             "Too many requests")

    def __init__(self, message: str, *, retry_after_s: int, **extra):
        super().__init__(message, retry_after_s=retry_after_s, **extra)
        self.retry_after_s = retry_after_s


def parse_limits(spec: str | None) -> dict[str, str]:
    """``"jobs:write=100/second,..."`` -> {group: limit}; "" or None: the defaults; "off":
    none. A bad pair is a ValueError naming it and the form."""
    import limits

    if spec is None or not spec.strip():
        return dict(DEFAULT_LIMITS)
    if spec.strip().lower() in ("off", "0", "none", "false"):
        return {}
    out = dict(DEFAULT_LIMITS)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        group, sep, value = part.partition("=")
        group = group.strip()
        if not sep or group not in DEFAULT_LIMITS:
            raise ValueError(f"rate limit {part!r}: give GROUP=N/UNIT with GROUP one of "
                             f"{sorted(DEFAULT_LIMITS)} (e.g. jobs:write=100/second), or off")
        try:
            limits.parse(value.strip())
        except ValueError:
            raise ValueError(f"rate limit {part!r}: {value!r} is not a rate like 100/second, "
                             "600/minute or 10/2seconds") from None
        out[group] = value.strip()
    return out


class RateLimiter:
    def __init__(self, spec: dict[str, str], storage_uri: str = "memory://"):
        import limits
        from limits.storage import storage_from_string
        from limits.strategies import SlidingWindowCounterRateLimiter

        self.spec = dict(spec)
        self.limits = {g: limits.parse(v) for g, v in spec.items()}
        self.storage_uri = storage_uri
        try:
            storage = storage_from_string(storage_uri)
        except Exception as exc:  # noqa: BLE001 - the library's errors vary by backend
            raise ValueError(f"rate_limit_storage {storage_uri!r}: {exc}; give memory:// or "
                             "redis://HOST:6379/0") from None
        self._limiter = SlidingWindowCounterRateLimiter(storage)

    @staticmethod
    def group(scope: str | None) -> str:
        return _GROUP_OF_SCOPE.get(scope if scope is not None else "default", "default")

    def hit(self, account_id: str, scope: str | None) -> None:
        """Count one request of ``account_id`` on a route needing ``scope``; RateLimited when its
        group's budget is spent. A storage that fails lets the request through (logged):
        the limit protects the broker; it must not take the API down with Redis."""
        group = self.group(scope)
        limit = self.limits.get(group)
        if limit is None:
            return
        try:
            if self._limiter.hit(limit, account_id, group):
                return
            reset = self._limiter.get_window_stats(limit, account_id, group).reset_time
        except Exception:  # noqa: BLE001 - e.g. Redis unreachable
            log.exception("rate limit storage %s failed; letting the request through",
                          self.storage_uri)
            return
        retry = max(1, math.ceil(reset - time.time()))
        raise RateLimited(f"this account made more than {self.spec[group]} {group} requests; "
                          f"retry after {retry} s (the limits are per account and per "
                          "route group, all its keys together; ask an admin for more)", retry_after_s=retry,
                          limit=self.spec[group], group=group)
