"""What a provider operator sees of its machines at a glance (`sparecycles agent status`,
``GET /v1/providers``): each machine's connection and its own word on its availability
(idle-only, schedule, limits), jobs today, credits pending, and verification standing.

Plain Python over collaborators passed in: ``queries.provider_jobs(ids, since)`` (job
counts and the unsettled jobs, from storage), ``pricing`` (what an unsettled job will
pay), ``standings(provider_id)`` (verification), ``connected(provider_id)`` (this
replica holds its stream).
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from .model import Provider

#: A machine seen this recently by any replica counts as connected (presence refreshes
#: ``last_seen_at`` while the stream stays open).
ONLINE_WINDOW_S = 60.0


def day_start(now: float) -> float:
    """Midnight UTC of ``now``: "today" for job counts (the broker's clock, one for all)."""
    d = datetime.fromtimestamp(now, timezone.utc)
    return d.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


def pending_micro(jobs: list[dict], pricing) -> int:
    """The provider's share of its unsettled jobs (leased, submitted, being verified or
    disputed), each at its clearing price (else the reserve) on the work units it was
    admitted with, net of the platform fee: an estimate until each settles."""
    total = 0
    for j in jobs:
        price = pricing.price(j["plugin"])
        rate = j["price_micro_per_unit"] or price.reserve_micro_per_unit
        cap = j["max_price_micro"] or 1 << 62
        charge = price.charge_micro(rate, j["work_units"] or 0.0, cap_micro=cap)
        total += charge - price.fee_of(charge)
    return total


def machine_view(p: Provider, *, jobs: dict, standings: list, connected: bool,
                 now: float, pricing) -> dict:
    unsettled = jobs.get("unsettled", [])
    online = connected or (now - (p.last_seen_at or 0.0)) < ONLINE_WINDOW_S
    checks = sum(s.checks for s in standings)
    lost = sum(s.failures for s in standings)
    return {
        "id": p.id, "name": p.name, "status": p.status, "online": online,
        "last_seen_at": p.last_seen_at, "sandboxed": p.sandboxed,
        "hardware": p.hardware, "availability": p.availability or None,
        "jobs_today": {"settled": jobs.get("settled_today", 0),
                       "failed": jobs.get("failed_today", 0),
                       "given_back": jobs.get("given_back_today", 0)},
        "running_jobs": sum(1 for j in unsettled if j["state"] in ("matched", "running")),
        "unsettled_jobs": len(unsettled),
        "pending_micro": pending_micro(unsettled, pricing),
        "verification": {
            "checks": checks, "lost": lost,
            "standing": "new" if not checks else ("good" if not lost else "disputed"),
            "quota_factor": min((s.quota_factor for s in standings), default=1.0),
            "by_plugin": [{"plugin": s.plugin, "hardware_class": s.hardware_class,
                           "consecutive_valid": s.consecutive_valid, "checks": s.checks,
                           "lost": s.failures, "quota_factor": s.quota_factor}
                          for s in standings]},
    }


def overview(account_id: str, machines: list[Provider], *, queries, pricing,
             standings: Callable[[str], list], connected: Callable[[str], bool],
             balances: dict, now: float) -> dict:
    """Every machine of ``account_id`` and the account's credits: ``balances`` holds
    ``vesting_micro``, ``available_micro``, ``paid_out_micro`` (the ledger's)."""
    ids = [p.id for p in machines]
    per = queries.provider_jobs(ids, since=day_start(now)) if ids else {}
    views = [machine_view(p, jobs=per.get(p.id, {}), standings=standings(p.id),
                          connected=connected(p.id), now=now, pricing=pricing)
             for p in machines]
    return {"object": "provider_overview", "account_id": account_id,
            "credits": {"pending_micro": sum(v["pending_micro"] for v in views),
                        "vesting_micro": balances.get("vesting_micro", 0),
                        "available_micro": balances.get("available_micro", 0),
                        "paid_out_micro": balances.get("paid_out_micro", 0)},
            "jobs_today": {k: sum(v["jobs_today"][k] for v in views)
                           for k in ("settled", "failed", "given_back")},
            "machines": views}
