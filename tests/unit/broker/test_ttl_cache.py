"""TtlCache (broker/cache.py) and the services that share it: prices, policies and
provider facts are cached a few seconds, and a change merges onto the stored value."""
from broker.cache import TtlCache
from broker.pricing.policy import PluginPolicy, PolicyService
from broker.pricing.service import PricingService


class Repo:
    def __init__(self):
        self.rows, self.reads = {}, 0

    def get(self, key):
        self.reads += 1
        return self.rows.get(key)

    def put(self, row):
        self.rows[row.plugin] = row

    def all(self):
        return list(self.rows.values())


def test_values_live_ttl_seconds_and_invalidate_drops_them():
    now = [0.0]
    cache = TtlCache(2.0, clock=lambda: now[0])
    loads = []
    load = lambda k: loads.append(k) or f"v{len(loads)}"  # noqa: E731
    assert cache.get("a", load) == "v1" and cache.get("a", load) == "v1"
    now[0] = 2.5
    assert cache.get("a", load) == "v2"
    assert cache.get("a", load, fresh=True) == "v3"
    cache.invalidate("a")
    assert cache.get("a", load) == "v4"
    cache.invalidate()
    assert cache.get("a", load) == "v5" and loads == ["a"] * 5


def test_none_is_kept_only_when_asked_and_a_read_older_than_an_invalidation_is_not():
    cache = TtlCache(60.0, cache_none=False)
    calls = []
    assert cache.get("x", lambda k: calls.append(k)) is None
    assert cache.get("x", lambda k: calls.append(k)) is None and len(calls) == 2

    def racing(key):  # an invalidation lands while this load is under way
        cache.invalidate(key)
        return "old"

    assert cache.get("y", racing) == "old"
    assert cache.get("y", lambda k: "new") == "new"


def test_set_policy_merges_onto_the_stored_policy_not_a_cached_one():
    repo = Repo()
    policies = PolicyService(repo)
    assert policies.policy("sd15").min_stake_micro == 0  # cached now
    # another replica sets a field meanwhile
    repo.put(PluginPolicy("sd15", min_stake_micro=5_000, always_verify_above_micro=0))
    new = policies.set_policy("sd15", {"always_verify_above_micro": 9}, by="admin")
    assert (new.min_stake_micro, new.always_verify_above_micro) == (5_000, 9)
    assert policies.policy("sd15") == new


def test_set_price_merges_onto_the_stored_price_and_reports_it_as_before():
    repo = Repo()
    pricing = PricingService(repo)
    changes = []
    pricing.on_changed = lambda before, after, by: changes.append((before, after))
    pricing.set_price("echo", {"fee_bps": 100}, by="admin-1")
    pricing._cache.get("echo", lambda k: None, fresh=True)  # a stale view: "no row"
    new = pricing.set_price("echo", {"min_charge_micro": 7}, by="admin-2")
    assert (new.fee_bps, new.min_charge_micro) == (100, 7)
    assert changes[-1][0].fee_bps == 100
