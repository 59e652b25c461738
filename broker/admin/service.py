"""AdminService: what an admin can do from the console, each action audited with its
before and after values. Reads that span the whole broker go through the read model
(``queries``); writes go through the domain services."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from broker.errors import InvalidInput, NotFound, UnknownPlugin
from broker.pricing.model import PluginPrice
from broker.pricing.policy import POLICY_FIELDS, PluginPolicy

PRICE_FIELDS = ("reserve_micro_per_unit", "fee_bps", "min_charge_micro", "vesting_window_s",
                 "cache_price_micro")
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
        names changed. Everything is checked before anything is written, the plugin first:
        only a plugin of the catalog is priced (a price row for a name no job can use is
        a typo that would sit on the pricing page for ever)."""
        known = self.catalog.names()
        if plugin not in known:
            raise UnknownPlugin(
                f"there is no plugin {plugin!r} to price; this broker's plugins are "
                f"{', '.join(known) or 'none'} (a published plugin joins them when it is "
                "published)", field="plugin")
        # The stored values, not cached ones: they decide what changes and what is audited.
        price = self.pricing.price(plugin, fresh=True)
        policy = self.policies.policy(plugin, fresh=True)
        price_changes = {k: v for k, v in values.items()
                         if k in PRICE_FIELDS and v != getattr(price, k)}
        policy_changes = {k: v for k, v in values.items()
                          if k in POLICY_FIELDS and v != getattr(policy, k)}
        unknown = sorted(set(values) - set(PRICE_FIELDS) - set(POLICY_FIELDS))
        if unknown:
            raise InvalidInput(f"unknown price field {unknown[0]!r}; allowed: "
                               f"{', '.join(PRICE_FIELDS + POLICY_FIELDS)}", field=unknown[0])
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

    def provider_detail(self, provider_id: str, *, market=None, verification=None) -> dict:
        """Everything the provider page shows. ``market`` (MarketService) gives claimed and
        measured θ per plugin; ``verification`` (VerificationService, None when off) the
        standing per (plugin, hardware class)."""
        p = self.providers.get(provider_id)
        if p is None:
            raise NotFound(f"no provider {provider_id!r}")
        session = self.dispatcher.session(provider_id)
        balances = {k.value: v for k, v in self.ledger.balances(p.account_id).items()}
        standings = verification.repo.standings(provider_id) if verification is not None else []
        new_checks = (verification.settings.new_provider_checks
                      if verification is not None else None)
        return {"provider": p, "online": session is not None,
                "session": session, "stats": self.queries.provider_stats(provider_id),
                "balances": balances, "earnings": self.queries.provider_earnings(provider_id),
                "throughput": self._throughput(provider_id, market),
                "verification_on": verification is not None,
                "standings": standings, "new_provider_checks": new_checks,
                "cv_min": min((s.consecutive_valid for s in standings), default=None),
                "quota_factor": min((s.quota_factor for s in standings), default=1.0),
                "jobs": self.queries.search_jobs(provider=provider_id, limit=25),
                "history": self.audit.search(subject=f"provider:{provider_id}", limit=20),
                "operator": self.queries.account_names([p.account_id]).get(p.account_id, "")}

    @staticmethod
    def _throughput(provider_id: str, market) -> list[dict]:
        """Per plugin: the agent's benchmark claim beside the broker's measured θ."""
        if market is None:
            return []
        rows = []
        for a in market.asks({provider_id}):
            claimed, measured = a.get("claimed_units_per_s"), a.get("measured_units_per_s")
            rows.append({**a, "ratio": (measured / claimed) if claimed and measured else None})
        return sorted(rows, key=lambda r: r["plugin"])

    # ---- verification ----------------------------------------------------------------
    def job_verification(self, job_id: str, verification) -> dict:
        """The job's verification as the job page shows it: its record, every run (the
        client's and the checks) with its provider and signed outputs, the comparison
        figures as table rows, the outcome; for a check job, the job it checks."""
        from .verification_view import REASONS, STATUS_TEXT, comparison_rows, thresholds_caption
        if verification is None:
            return {"enabled": False}
        job = self.jobs.repo.get(job_id)
        out: dict[str, Any] = {"enabled": True, "record": None, "parent": None, "runs": []}
        if job is None:
            return out
        if job.check_of:
            pv = verification.repo.get(job.check_of)
            role = ("checker" if pv and pv.checker_job_id == job.id else
                    "tiebreaker" if pv and pv.tiebreak_job_id == job.id else "check")
            out["parent"] = {"job_id": job.check_of, "role": role,
                             "status": pv.status.value if pv else None}
            return out
        v = verification.repo.get(job_id)
        if v is None:
            return out
        outcome = dict(v.outcome or {})
        losers = {p.get("provider_id"): p for p in outcome.get("penalties") or []}
        confirmed = set(outcome.get("credits") or [])
        roles = {v.checker_job_id: "checker", v.tiebreak_job_id: "tiebreaker"}
        runs = [self._run_view(job, "primary", losers, confirmed)]
        for check in self.jobs.repo.checks_of(job_id):
            runs.append(self._run_view(check, roles.get(check.id, "check"), losers, confirmed))
        cmp = comparison_rows(v.comparisons)
        out.update(record=v, status=v.status.value,
                   status_text=STATUS_TEXT.get(v.status.value, ""),
                   reason_text=REASONS.get(v.reason, v.reason), runs=runs,
                   comparisons=cmp, thresholds=thresholds_caption(cmp), outcome=outcome,
                   penalties=[{**p, "name": self._provider_name(p.get("provider_id"))}
                              for p in outcome.get("penalties") or []],
                   images=any(o["media_type"].startswith("image/")
                              for r in runs for o in r["outputs"]))
        return out

    def _provider_name(self, provider_id: str | None) -> str:
        if not provider_id:
            return ""
        p = self.providers.get(provider_id)
        return (p.name if p else "") or ""

    def run_outputs(self, job) -> list[dict]:
        """A run's outputs as its provider signed them in the receipt (an overturned job's
        output rows point at the majority's outputs since; its receipt still names its
        own). Falls back to the job's output rows when there is no receipt."""
        listed = [o for o in ((job.receipt or {}).get("outputs") or []) if o.get("sha256")]
        if listed:
            return [{"index": int(o.get("index", i)), "sha256": o["sha256"],
                     "media_type": str(o.get("media_type") or "application/octet-stream"),
                     "size": o.get("size")} for i, o in enumerate(listed)]
        return [{"index": o.index, "sha256": o.sha256, "media_type": o.media_type,
                 "size": o.size} for o in self.jobs.repo.outputs(job.id)]

    def output_text(self, sha256: str, limit: int = 2000) -> str:
        try:
            return self.jobs.blobs.get(sha256)[:limit].decode("utf-8", "replace")
        except Exception as exc:  # noqa: BLE001 - shown in place of the text
            return f"(output unavailable: {exc})"

    def _run_view(self, job, role: str, losers: dict, confirmed: set) -> dict:
        outputs = self.run_outputs(job)
        for o in outputs:
            if not o["media_type"].startswith("image/"):
                o["text"] = self.output_text(o["sha256"])
        pid = job.provider_id or ""
        verdict = ("outvoted" if pid in losers else "confirmed" if pid in confirmed else "")
        state = job.state.value if hasattr(job.state, "value") else str(job.state)
        return {"role": role, "job_id": job.id, "provider_id": pid,
                "provider_name": self._provider_name(pid), "state": state,
                "run_ms": ((job.receipt or {}).get("timings_ms") or {}).get("run"),
                "hardware_class": ((job.receipt or {}).get("repro") or {}).get("hardware_class"),
                "outputs": outputs, "verdict": verdict}

    def verification_overview(self, verification, *, window_s: int = 3600) -> dict:
        """The overview's verification panel: checks in the window, outcomes by status,
        and the redundancy overhead (check jobs ÷ client jobs)."""
        import time
        from .verification_view import ratio
        if verification is None:
            return {"enabled": False}
        s = self.queries.verification_summary(time.time() - window_s)
        recent = verification.repo.recent(8)
        recent = [r for r in recent if r.status.value != "unchecked"][:6] or recent[:6]
        return {"enabled": True, **s,
                "overhead_recent": ratio(s["checks_recent"], s["client_jobs_recent"]),
                "overhead_total": ratio(s["checks_total"], s["client_jobs_total"]),
                "recent": recent}

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
