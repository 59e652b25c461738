"""ProviderService: registers agent identities under provider accounts."""
from __future__ import annotations

import time
import uuid
from typing import Protocol

from broker.auth.service import Principal
from broker.cache import TtlCache
from broker.errors import Forbidden
from .model import Provider


class ProviderAccounts(Protocol):
    """Opens a provider account's ledger accounts, idempotently (broker.ledger)."""

    def open_provider(self, provider: str) -> None: ...


class ProviderService:
    # Settling and rendering a job look up its provider's account and sandbox flag; both
    # change only when the agent reconnects (through connect(), which refreshes the cache),
    # so a short cache saves a query per lookup. Other replicas' changes show within CACHE_S.
    CACHE_S = 5.0

    def __init__(self, repo, clock=time.time, links=None,
                 ledger: ProviderAccounts | None = None):
        self.repo = repo
        self.clock = clock
        self.links = links  # broker.links.LinkService: a key presented by two accounts links them
        # Each agent that connects has its provider account's ledger accounts opened
        # (None: no ledger, as in tests of this service alone).
        self.ledger = ledger
        # id -> (account, sandboxed); an unknown id is asked again next time
        self._facts: TtlCache[str, tuple[str, bool] | None] = TtlCache(self.CACHE_S,
                                                                       cache_none=False)

    def _fact(self, provider_id: str) -> tuple[str, bool] | None:
        return self._facts.get(provider_id, self._load_fact)

    def _load_fact(self, provider_id: str) -> tuple[str, bool] | None:
        p = self.repo.get(provider_id)
        return (p.account_id, p.sandboxed) if p is not None else None

    def connect(self, who: Principal, public_key: str, name: str, *, sandboxed: bool,
                hardware: dict, plugins: list[dict]) -> Provider:
        """The provider for ``public_key``, created on first contact under ``who``'s account."""
        if who.role != "provider":
            raise Forbidden(f"a {who.role} key cannot run an agent; create one with "
                            "`sparecycles broker create-key --role provider`")
        now = self.clock()
        p = self.repo.by_key(public_key)
        if p is None:
            p = Provider(id=str(uuid.uuid4()), account_id=who.account_id, public_key=public_key,
                         name=name, sandboxed=sandboxed, hardware=hardware, plugins=plugins,
                         created_at=now, last_seen_at=now)
            self.repo.add(p)
            self._connected(p)
            return p
        if p.account_id != who.account_id:
            if self.links is not None:  # one key, two accounts: one person's, most likely
                for account in (p.account_id, who.account_id):
                    self.links.record(account, "agent_key", public_key,
                                      f"agent key {public_key[:12]}…")
            raise Forbidden("this agent key is registered to another provider account")
        if p.status == "banned":
            raise Forbidden(f"provider {p.id} is banned; contact the broker's admins")
        # availability: what the previous connection said no longer holds; an agent that
        # watches its owner's terms tells it again right after the handshake.
        self.repo.update(p.id, name=name, sandboxed=sandboxed, hardware=hardware,
                         plugins=plugins, last_seen_at=now, availability=None)
        p.name, p.sandboxed, p.hardware, p.plugins, p.last_seen_at = (name, sandboxed, hardware,
                                                                      plugins, now)
        p.availability = {}
        self._facts.invalidate(p.id)
        self._connected(p)
        return p

    def _connected(self, p: Provider) -> None:
        if self.ledger is not None:
            self.ledger.open_provider(p.account_id)

    def owner_of(self, provider_id: str) -> str | None:
        """The provider account that owns machine ``provider_id`` (it earns the credits)."""
        fact = self._fact(provider_id) if provider_id else None
        return fact[0] if fact else None

    def sandboxed_of(self, provider_id: str | None) -> bool | None:
        """Whether machine ``provider_id`` runs plugins in the sandbox (None: no provider)."""
        fact = self._fact(provider_id) if provider_id else None
        return fact[1] if fact else None

    def owners(self) -> list[str]:
        """Every provider account with a machine (the accounts that vest), one query:
        maintenance asks every few seconds, and a replica may know 10,000 machines."""
        return self.repo.owners()

    def seen(self, provider_id: str) -> None:
        self.repo.update(provider_id, last_seen_at=self.clock())

    def machines_of(self, account_id: str) -> list[Provider]:
        """The machines (agent identities) of one provider account, oldest first."""
        return self.repo.of_account(account_id)

    def all(self) -> list[Provider]:
        return self.repo.all()

    def get(self, provider_id: str) -> Provider | None:
        return self.repo.get(provider_id)

    def declared_repro(self, provider_id: str | None, plugin: str,
                       version: str) -> dict[str, str]:
        """The reproducibility class machine ``provider_id`` declared for ``plugin@version``
        when it last connected ({"hardware_class", "dtype"}; "" parts where it declared
        none) and the weights digest it served. What verification judges its runs by, not
        what a receipt says."""
        p = self.repo.get(provider_id) if provider_id else None
        for entry in (p.plugins if p is not None else []) or []:
            if (isinstance(entry, dict) and entry.get("name") == plugin
                    and entry.get("version") == version):
                return {"hardware_class": str(entry.get("hardware_class") or ""),
                        "dtype": str(entry.get("dtype") or ""),
                        "weights_digest": str(entry.get("weights_digest") or "")}
        return {"hardware_class": "", "dtype": "", "weights_digest": ""}
    def set_availability(self, provider_id: str, *, available: bool, state: str,
                         reason: str) -> dict:
        """Record what the agent says of its availability (idle-only mode, schedule,
        limits): shown to its owner and admins, from any replica."""
        doc = {"available": bool(available), "state": state[:40] or
               ("available" if available else "paused"), "reason": reason[:300],
               "since": self.clock()}
        self.repo.update(provider_id, availability=doc)
        return doc

    def set_status(self, provider_id: str, status: str) -> tuple[Provider, str]:
        """Persist ``status`` (active | paused | banned); returns (provider, previous status).
        A paused or banned provider gets no new jobs; a banned one cannot reconnect."""
        if status not in ("active", "paused", "banned"):
            raise ValueError(f"status is {status!r}; must be active, paused or banned")
        p = self.repo.get(provider_id)
        if p is None:
            from broker.errors import NotFound
            raise NotFound(f"no provider {provider_id!r}")
        before = p.status
        self.repo.update(provider_id, status=status)
        p.status = status
        return p, before
