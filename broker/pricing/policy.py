"""Per-plugin verification and stake policy an admin sets next to the price.

``min_stake_micro``: the stake a provider must hold to be offered the plugin's jobs;
``always_verify_above_micro``: jobs whose hold is at least this are always re-run on a
second provider (DESIGN §6; 0 means never forced). Stored now; verification and the
auction read them when they are wired.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from broker.cache import TtlCache
from broker.ledger.model import MAX_AMOUNT_MICRO
from broker.pricing.errors import InvalidPrice

POLICY_FIELDS = ("min_stake_micro", "always_verify_above_micro")


@dataclass(frozen=True)
class PluginPolicy:
    plugin: str
    min_stake_micro: int = 0
    always_verify_above_micro: int = 0
    updated_at: float = 0.0
    updated_by: str = ""


class PolicyRepository(Protocol):
    def get(self, plugin: str) -> PluginPolicy | None: ...
    def put(self, policy: PluginPolicy) -> None: ...


class PolicyService:
    # Dispatch asks for a plugin's minimum stake once per connected provider per job: a
    # short cache, like the prices' (a change on this broker applies to the very next job,
    # one made on another replica within CACHE_S).
    CACHE_S = 2.0

    def __init__(self, repo: PolicyRepository, clock=time.time):
        self.repo = repo
        self.clock = clock
        self._cache: TtlCache[str, PluginPolicy] = TtlCache(self.CACHE_S)

    def policy(self, plugin: str, *, fresh: bool = False) -> PluginPolicy:
        """The plugin's policy (cached up to CACHE_S; ``fresh``: read from the store)."""
        return self._cache.get(plugin, lambda p: self.repo.get(p) or PluginPolicy(p),
                               fresh=fresh)

    def set_policy(self, plugin: str, changes: dict[str, Any], *, by: str) -> PluginPolicy:
        """Set some or all fields; the others keep their stored value (read fresh, never a
        cached one another replica may have changed since)."""
        self.check(changes)
        current = self.policy(plugin, fresh=True)
        new = PluginPolicy(plugin, **{n: changes.get(n, getattr(current, n)) for n in POLICY_FIELDS},
                           updated_at=self.clock(), updated_by=by)
        self.repo.put(new)
        self._cache.invalidate(plugin)
        return new

    @staticmethod
    def check(changes: dict[str, Any]) -> None:
        """Raise :class:`InvalidPrice` for an unknown field or a value out of range."""
        unknown = sorted(set(changes) - set(POLICY_FIELDS))
        if unknown:
            raise InvalidPrice(f"unknown field {unknown[0]!r}; allowed: {', '.join(POLICY_FIELDS)}",
                               field=unknown[0])
        for name, value in changes.items():
            if type(value) is not int or not 0 <= value <= MAX_AMOUNT_MICRO:
                raise InvalidPrice(f"{name} is {value!r}; it must be an integer from 0 to "
                                   f"{MAX_AMOUNT_MICRO:,} (micro-credits)", field=name)
