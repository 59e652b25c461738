"""Builds the console's services (called by broker.services.build_services, which stays the
one place that chooses implementations: this module only groups the admin part of it). It
sits beside services.py, not in broker/admin, so that the console imports no storage code
(broker/storage imports the console's records: the loop is gone)."""
from __future__ import annotations

from broker.admin.disputes import DisputeService, Resolutions
from broker.admin.service import PRICE_FIELDS, AdminService
from broker.admin.session import AdminSessions
from broker.pricing.policy import PolicyService
from broker.storage.admin_sql import (SqlAdminQueries, SqlDisputeRepository, SqlPolicyRepository,
                                      SqlSessionRevocations)

def audit_price_changes(audit):
    """The pricing hook: each change is audited with its before and after values."""
    def hook(before, after, by):
        audit.record(f"admin:{by}", "pricing.set", f"plugin:{after.plugin}",
                     {"before": {k: getattr(before, k) for k in PRICE_FIELDS},
                      "after": {k: getattr(after, k) for k in PRICE_FIELDS},
                      "was_default": before.is_default})
    return hook


def audit_market_rules(audit):
    """The market's hook: each rule an admin changes is audited with before and after."""
    def hook(rule, before, after, by):
        audit.record(f"admin:{by}", "market.set", f"market:{rule}",
                     {"before": before, "after": after})
    return hook


def build_admin(settings, sessions, *, secret: str, audit, pricing, providers, dispatcher,
                ledger, payments, jobs, catalog, auth, resolutions: Resolutions | None = None
                ) -> dict:
    """``resolutions``: who carries out an admin's override of a dispute (verification,
    through the relay built before it; None: the override is recorded, nothing more)."""
    disputes = DisputeService(SqlDisputeRepository(sessions), audit, resolutions=resolutions)
    admin = AdminService(pricing=pricing, policies=PolicyService(SqlPolicyRepository(sessions)),
                         providers=providers, dispatcher=dispatcher, audit=audit,
                         queries=SqlAdminQueries(sessions), ledger=ledger, payments=payments,
                         jobs=jobs, catalog=catalog, disputes=disputes)
    return {"audit": audit, "disputes": disputes, "admin": admin,
            "admin_sessions": AdminSessions(auth, SqlSessionRevocations(sessions), secret,
                                            ttl_s=settings.admin_session_ttl_s)}
