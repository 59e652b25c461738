"""AdminService: what an admin can do from the console, each action audited with its
before and after values. Reads that span the whole broker go through the read model
(``queries``); writes go through the domain services."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from broker.errors import InvalidInput, NotFound
from broker.pricing.model import PluginPrice
from broker.pricing.policy import POLICY_FIELDS, PluginPolicy

PRICE_FIELDS = ("reserve_micro_per_unit", "fee_bps", "min_charge_micro", "vesting_window_s")
ACTIONS = {"pause": "paused", "ban": "banned", "unban": "active", "resume": "active"}


class AdminService:
    def __init__(self, *, pricing, policies, providers, dispatcher, audit, queries, ledger,
                 payments, jobs, catalog, disputes):
        self.pricing = pricing
        self.policies = policies
        self.providers = providers
        self.dispatcher = dispatcher
        self.audit = audit
        self.queries = queries
        self.ledger = ledger
        self.payments = payments
        self.jobs = jobs
        self.catalog = catalog
        self.disputes = disputes

    # ---- pricing --------------------------------------------------------------------
    def price_rows(self) -> list[tuple[PluginPrice, PluginPolicy]]:
        names = sorted({m.name for m in self.catalog.all()} if hasattr(self.catalog, "all")
                       else set())
        return [(p, self.policies.policy(p.plugin)) for p in self.pricing.prices(names)]

    def change_price(self, plugin: str, values: dict[str, Any], *, by: str) -> list[str]:
        """Apply the fields of ``values`` that differ from the current ones; returns the
        names changed. Everything is checked before anything is written."""
        price, policy = self.pricing.price(plugin), self.policies.policy(plugin)
        price_changes = {k: v for k, v in values.items()
                         if k in PRICE_FIELDS and v != getattr(price, k)}
        policy_changes = {k: v for k, v in values.items()
                          if k in POLICY_FIELDS and v != getattr(policy, k)}
        unknown = set(values) - set(PRICE_FIELDS) - set(POLICY_FIELDS)
        if unknown:
            raise InvalidInput(f"unknown price field {sorted(unknown)[0]!r}")
        self.policies.check(policy_changes)
        if price_changes:
            self.pricing.set_price(plugin, price_changes, by=by)  # audited by the pricing hook
        if policy_changes:
            after = self.policies.set_policy(plugin, policy_changes, by=by)
            self.audit.record(f"admin:{by}", "policy.set", f"plugin:{plugin}",
                              {"before": {k: getattr(policy, k) for k in POLICY_FIELDS},
                               "after": {k: getattr(after, k) for k in POLICY_FIELDS}})
        return sorted(price_changes) + sorted(policy_changes)

    # ---- providers ------------------------------------------------------------------
    def provider_action(self, provider_id: str, action: str, reason: str, *, by: str):
        status = ACTIONS.get(action)
        if status is None:
            raise InvalidInput(f"action is {action!r}; choose one of {sorted(ACTIONS)}")
        reason = (reason or "").strip()
        if not reason:
            raise InvalidInput(f"a reason is required to {action} a provider", field="reason")
        provider, before = self.providers.set_status(provider_id, status)
        connected = self.dispatcher.set_paused(provider_id, status != "active")
        self.audit.record(f"admin:{by}", f"provider.{action}", f"provider:{provider_id}",
                          {"before": before, "after": status, "reason": reason,
                           "connected": connected})
        return provider

    def provider_detail(self, provider_id: str) -> dict:
        p = self.providers.get(provider_id)
        if p is None:
            raise NotFound(f"no provider {provider_id!r}")
        session = self.dispatcher.session(provider_id)
        balances = {k.value: v for k, v in self.ledger.balances(p.account_id).items()}
        return {"provider": p, "online": session is not None,
                "session": session, "stats": self.queries.provider_stats(provider_id),
                "balances": balances,
                "jobs": self.queries.search_jobs(provider=provider_id, limit=25),
                "history": self.audit.search(subject=f"provider:{provider_id}", limit=20),
                "operator": self.queries.account_names([p.account_id]).get(p.account_id, "")}

    # ---- overview -------------------------------------------------------------------
    def overview(self) -> dict:
        series = self.queries.series(window_s=3600, bucket_s=60)
        counts = self.jobs.repo.counts_by_state()
        sessions = self.dispatcher.sessions()
        last5 = series["buckets"][-5:]
        return {"series": series, "counts": counts,
                "providers_online": len(sessions),
                "providers_paused": sum(1 for s in sessions if s.paused),
                "slots_free": sum(max(0, s.free) for s in sessions),
                "queue_depth": counts.get("queued", 0),
                "jobs_per_min": sum(b["finished"] for b in last5) / max(1, len(last5)),
                "spent_micro": sum(b["spent_micro"] for b in series["buckets"]),
                "earned_micro": sum(b["earned_micro"] for b in series["buckets"]),
                "fees_micro": sum(b["fees_micro"] for b in series["buckets"])}

    @staticmethod
    def asdict(obj) -> dict:
        return asdict(obj)
