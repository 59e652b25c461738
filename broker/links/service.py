"""Operators linked by what the broker can see (issue #20, DESIGN §6).

An operator is an account id, and one person can open two: one cheats, the other checks
its jobs and outvotes honest checkers. Nothing an account says can unlink it from another,
so links come only from what the broker observes of each account:

* ``payout_account`` — the Stripe Connect account its payouts go to;
* ``stripe_customer`` — the Stripe customer that paid for its credits;
* ``ip_prefix`` — the network its agents connect from (IPv4 /24, IPv6 /48);
* ``hardware`` — the fingerprint of the machine its agent runs on (the agent reports it;
  a fingerprint two accounts share links them, a changed one unlinks nothing);
* ``agent_key`` — an agent key another account already registered, presented again;
* ``admin`` — a link an admin recorded (learnt outside the broker).

Two accounts are linked when they share a signal (the same kind and value): directly,
never through a third account, so that one busy network prefix does not chain strangers
together. A link only ever narrows who checks whom and whose word counts; it never moves
money by itself. Signals are stored hashed (the raw IP or customer id is not kept).

Agents that connect over loopback share the broker's own machine and address, and say
nothing about who runs them (a local demo or a test starts several accounts' agents
there): their address and hardware are not recorded unless ``link_loopback`` is set.
"""
from __future__ import annotations

import enum
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from sdk.protocol.canonical import sha256_hex

from broker.cache import TtlCache

log = logging.getLogger(__name__)


class LinkKind(str, enum.Enum):
    PAYOUT_ACCOUNT = "payout_account"
    STRIPE_CUSTOMER = "stripe_customer"
    IP_PREFIX = "ip_prefix"
    HARDWARE = "hardware"
    AGENT_KEY = "agent_key"
    ADMIN = "admin"


@dataclass(frozen=True)
class Signal:
    account_id: str
    kind: LinkKind
    value_sha256: str      # the observed value, hashed
    label: str             # what an admin is shown ("ip 203.0.113.0/24", "hardware 3f2a…")
    first_seen_at: float
    last_seen_at: float


class LinkRepository(Protocol):
    def record(self, account_id: str, kind: str, value_sha256: str, label: str,
               now: float) -> bool:
        """Store (or refresh) one signal; True when it is new."""

    def signals_of(self, account_id: str) -> list[Signal]: ...

    def sharing(self, kind: str, value_sha256: str) -> list[str]:
        """The accounts that showed this signal."""


@dataclass
class LinkSettings:
    link_loopback: bool = False    # count loopback peers' address and hardware
    ipv4_prefix: int = 24
    ipv6_prefix: int = 48


class LinkService:
    CACHE_S = 5.0

    def __init__(self, repo: LinkRepository, settings: LinkSettings | None = None,
                 clock=time.time, audit=None):
        self.repo = repo
        self.settings = settings or LinkSettings()
        self.clock = clock
        self.audit = audit
        self._linked: TtlCache[str, frozenset[str]] = TtlCache(self.CACHE_S)

    # ---- what the broker sees --------------------------------------------------------
    def record(self, account_id: str, kind: LinkKind, value: str, label: str = "") -> None:
        """One observation of ``account_id``. Never raises (a link is a precaution: losing
        one must not refuse a connection or a payment); a new link is audited."""
        if not account_id or not value:
            return
        try:
            kind = LinkKind(kind)
            digest = sha256_hex(f"{kind.value}:{value}".encode())
            new = self.repo.record(account_id, kind.value, digest,
                                   label or f"{kind.value} {digest[:12]}", self.clock())
            if not new:
                return
            others = [a for a in self.repo.sharing(kind.value, digest) if a != account_id]
            for other in [account_id, *others]:
                self._linked.invalidate(other)
            if others and self.audit is not None:
                self.audit.record("broker", "links.linked", f"account:{account_id}",
                                  {"kind": kind.value, "label": label, "with": others})
        except Exception:  # noqa: BLE001 - logged; see the docstring
            log.exception("could not record a %s signal of account %s", kind, account_id)

    def agent_seen(self, account_id: str, *, peer: str = "", fingerprint: str = "") -> None:
        """An agent of ``account_id`` connected from ``peer`` (gRPC's ``context.peer()``,
        e.g. ``ipv4:203.0.113.7:52311``) reporting hardware ``fingerprint``."""
        address = parse_peer(peer)
        if address is not None and address.is_loopback and not self.settings.link_loopback:
            return
        if address is not None:
            bits = (self.settings.ipv4_prefix if address.version == 4
                    else self.settings.ipv6_prefix)
            net = ipaddress.ip_network(f"{address}/{bits}", strict=False)
            self.record(account_id, LinkKind.IP_PREFIX, str(net), f"network {net}")
        if fingerprint:
            self.record(account_id, LinkKind.HARDWARE, fingerprint,
                        f"hardware {fingerprint[:12]}")

    def declare(self, accounts: list[str], reason: str, *, by: str = "admin") -> None:
        """An admin links ``accounts`` (learnt outside the broker: a support ticket, the
        same bank account); audited."""
        token = sha256_hex(f"{sorted(accounts)}:{reason}:{self.clock()}".encode())
        for account in accounts:
            self.record(account, LinkKind.ADMIN, token, f"admin: {reason}"[:200])
        if self.audit is not None:
            self.audit.record(by, "links.declared", f"accounts:{','.join(sorted(accounts))}",
                              {"accounts": sorted(accounts), "reason": reason})

    # ---- reading -----------------------------------------------------------------------
    def linked_to(self, account_id: str) -> frozenset[str]:
        """The other accounts that share a signal with ``account_id`` (not itself)."""
        if not account_id:
            return frozenset()
        return self._linked.get(account_id, self._load)

    def linked(self, a: str, b: str) -> bool:
        return bool(a) and bool(b) and a != b and b in self.linked_to(a)

    def why(self, a: str, b: str) -> list[str]:
        """The labels of the signals ``a`` and ``b`` share (for the audit log)."""
        theirs = {(s.kind, s.value_sha256) for s in self.repo.signals_of(b)}
        return [s.label for s in self.repo.signals_of(a) if (s.kind, s.value_sha256) in theirs]

    def _load(self, account_id: str) -> frozenset[str]:
        others: set[str] = set()
        for s in self.repo.signals_of(account_id):
            others.update(self.repo.sharing(s.kind.value, s.value_sha256))
        others.discard(account_id)
        return frozenset(others)


def unlinked_pair(accounts: Iterable[str],
                  linked: Callable[[str, str], bool] | None = None) -> bool:
    """Whether two of ``accounts`` are distinct and not linked to each other (``linked``:
    :meth:`LinkService.linked`; None: none are known linked). What an answer needs to be
    taken as independent confirmation, as a verdict needs (a canary's known answer: two
    accounts of one person agreeing on a wrong one would fail every honest provider)."""
    distinct = sorted({a for a in accounts if a})
    return any(linked is None or not linked(a, b)
               for i, a in enumerate(distinct) for b in distinct[i + 1:])


def parse_peer(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address in a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); None for
    anything else (a unix socket, an empty string)."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    try:
        if kind == "ipv4":
            return ipaddress.IPv4Address(rest.rsplit(":", 1)[0])
        if kind == "ipv6":
            host = rest.rsplit(":", 1)[0] if rest.startswith("[") else rest
            return ipaddress.IPv6Address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    return None
