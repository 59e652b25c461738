"""AdminService.change_price through the real wiring (SQLite): only fields that differ
from the stored ones are written and audited, and nothing is written when any field is
refused."""
import pytest

from broker.errors import BrokerError
from broker.services import build_services
from broker.settings import Settings


@pytest.fixture
def svc(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0))
    yield services
    services.engine.dispose()


def _audited(svc, action):
    return svc.audit.search(action=action, limit=50)


def test_change_price_writes_and_audits_only_what_differs(svc):
    admin = svc.admin
    stored = svc.pricing.price("echo")
    changed = admin.change_price("echo", {"fee_bps": stored.fee_bps + 1,
                                          "min_charge_micro": stored.min_charge_micro,
                                          "min_stake_micro": 5_000,
                                          "always_verify_above_micro": 0}, by="root")
    assert changed == ["fee_bps", "min_stake_micro"]
    assert svc.pricing.price("echo").fee_bps == stored.fee_bps + 1
    assert svc.admin.policies.policy("echo").min_stake_micro == 5_000
    (price_entry,) = _audited(svc, "pricing.set")
    assert price_entry.data["before"]["fee_bps"] == stored.fee_bps
    (policy_entry,) = _audited(svc, "policy.set")
    assert policy_entry.data["before"]["min_stake_micro"] == 0
    assert policy_entry.data["after"]["min_stake_micro"] == 5_000
    # The same values again: nothing changes, nothing more is audited.
    assert admin.change_price("echo", {"fee_bps": stored.fee_bps + 1,
                                       "min_stake_micro": 5_000}, by="root") == []
    assert len(_audited(svc, "pricing.set")) == 1 and len(_audited(svc, "policy.set")) == 1


def test_change_price_refuses_before_writing_anything(svc):
    before = svc.pricing.price("echo")
    with pytest.raises(BrokerError) as e:  # a bad policy value: the price is not written
        svc.admin.change_price("echo", {"fee_bps": 5, "min_stake_micro": -1}, by="root")
    assert e.value.field == "min_stake_micro"
    with pytest.raises(BrokerError) as e:  # a bad price value: the policy is not written
        svc.admin.change_price("echo", {"fee_bps": 10_000, "min_stake_micro": 7}, by="root")
    assert e.value.field == "fee_bps"
    with pytest.raises(BrokerError) as e:
        svc.admin.change_price("echo", {"fee": 5}, by="root")
    assert e.value.field == "fee" and "allowed: reserve_micro_per_unit" in str(e.value)
    assert "min_stake_micro" in str(e.value)
    assert svc.pricing.price("echo", fresh=True) == before
    assert svc.admin.policies.policy("echo", fresh=True).min_stake_micro == 0
    assert _audited(svc, "pricing.set") == [] and _audited(svc, "policy.set") == []
