"""Scopes: what a key (or a token exchanged for one) may do, finer than its role.

A key's role says which account it acts for and caps its scopes (a client key can never
hold ``publish``); its scopes, chosen when it is created, narrow that further: a key for a
dashboard may hold only ``jobs:read`` and ``account:read``. A key created without scopes
holds all of its role's. Each REST route needs one scope (:data:`ROUTE_SCOPES`, by Flask
endpoint); the agent gateway needs ``agent:connect``. A route missing from the table is
open to keys holding every scope of their role and refused to narrowed keys, so a new
route is never opened to a narrowed key by accident.
"""
from __future__ import annotations

from broker.errors import Forbidden, InvalidRequest

SCOPES = {
    "jobs:write": "submit, quote and cancel jobs",
    "jobs:read": "read jobs, their events, batches and outputs",
    "account:read": "read the account, its transactions and payouts",
    "credits:write": "buy credits",
    "payouts:write": "ask for payouts and payout onboarding",
    "stake:write": "stake and unstake",
    "publish": "register publisher keys, upload blobs, publish plugins and adapters",
    "catalog:read": "read plugins, adapters, publishers and standing asks",
    "agent:connect": "connect a provider agent to the gateway",
    "keys:write": "list, create and revoke the account's own keys",
    "admin": "the admin API (/v1/admin/...) and the console",
}

ROLE_SCOPES: dict[str, tuple[str, ...]] = {
    "client": ("jobs:write", "jobs:read", "account:read", "credits:write", "catalog:read",
               "keys:write"),
    "provider": ("agent:connect", "account:read", "payouts:write", "stake:write",
                 "catalog:read", "keys:write"),
    "publisher": ("publish", "account:read", "catalog:read", "keys:write"),
    "admin": tuple(SCOPES),
}

ROUTE_SCOPES: dict[str, str] = {
    "jobs.create_job": "jobs:write",
    "jobs.create_jobs": "jobs:write",
    "jobs.cancel_job": "jobs:write",
    "account.create_quote": "jobs:write",
    "jobs.list_jobs": "jobs:read",
    "jobs.get_job": "jobs:read",
    "jobs.job_events": "jobs:read",
    "jobs.get_output": "jobs:read",
    "jobs.get_batch": "jobs:read",
    "account.get_account": "account:read",
    "account.list_transactions": "account:read",
    "credits.list_payouts": "account:read",
    "credits.create_checkout": "credits:write",
    "credits.create_payout": "payouts:write",
    "credits.payout_onboarding": "payouts:write",
    "stake.stake": "stake:write",
    "stake.unstake": "stake:write",
    "registry.publish_plugin": "publish",
    "registry.publish_adapter": "publish",
    "registry.put_blob": "publish",
    "registry.register_publisher": "publish",
    "registry.list_publisher_keys": "catalog:read",
    "registry.list_adapters": "catalog:read",
    "registry.adapter_version": "catalog:read",
    "registry.adapter_file": "catalog:read",
    "registry.adapter_versions": "catalog:read",
    "registry.plugin_version": "catalog:read",
    "registry.plugin_file": "catalog:read",
    "registry.plugin_versions": "catalog:read",
    "plugins.list_plugins": "catalog:read",
    "plugins.get_plugin": "catalog:read",
    "market.list_asks": "catalog:read",
    "market.get_market_rules": "admin",
    "market.set_market_rules": "admin",
    "credits.grant_credits": "admin",
    "credits.list_prices": "admin",
    "credits.get_price": "admin",
    "credits.set_price": "admin",
    "keys.list_keys": "keys:write",
    "keys.create_key": "keys:write",
    "keys.revoke_key": "keys:write",
    "keys.rotate_key": "keys:write",
    "keys.create_token": "",  # any valid key may exchange itself for a token
    "providers.list_machines": "account:read",
    "openai.list_models": "catalog:read",
    "openai.get_model": "catalog:read",
    "openai.chat_completions": "jobs:write",
    "openai.completions": "jobs:write",
    "openai.image_generations": "jobs:write",
}


def parse_scopes(role: str, scopes) -> tuple[str, ...]:
    """The scopes a new key of ``role`` holds: ``scopes`` (a list, or a comma- or
    space-separated string) checked against the role's, or all of the role's when empty."""
    allowed = ROLE_SCOPES[role]
    if isinstance(scopes, str):
        scopes = scopes.replace(",", " ").split()
    scopes = list(dict.fromkeys(s.strip() for s in (scopes or ()) if s.strip()))
    if not scopes:
        return allowed
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown:
        raise InvalidRequest(f"unknown scope(s) {unknown}; scopes are {sorted(SCOPES)}",
                             field="scopes")
    beyond = [s for s in scopes if s not in allowed]
    if beyond:
        raise InvalidRequest(f"a {role} key cannot hold {beyond}; a {role} key may hold "
                             f"{list(allowed)}", field="scopes")
    return tuple(scopes)


def require(principal, scope: str, what: str) -> None:
    """A 403 naming ``scope`` when ``principal`` lacks it."""
    if scope in principal.scopes:
        return
    held = " ".join(sorted(principal.scopes)) or "none"
    raise Forbidden(f"{what} needs the scope {scope!r}; this key holds: {held}. Create a key "
                    f"with it (`sparecycles broker keys create --scopes {scope}`) or use one "
                    "that has it", missing_scope=scope, code_override="missing_scope")


def check_route(principal, endpoint: str | None, method: str, path: str) -> None:
    """Refuse a narrowed key (or token) a route whose scope it lacks. A key holding all of
    its role's scopes passes here: what its role may not do, the route's own role check
    refuses, in the words it always used."""
    if set(ROLE_SCOPES.get(principal.role, ())) <= set(principal.scopes):
        return
    scope = ROUTE_SCOPES.get(endpoint or "")
    if scope == "":
        return
    if scope is None:
        raise Forbidden(f"{method} {path} is open only to keys holding every scope of their "
                        f"role; this key is narrowed to {' '.join(sorted(principal.scopes))}",
                        missing_scope="*", code_override="missing_scope")
    require(principal, scope, f"{method} {path}")
