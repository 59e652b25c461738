"""Jobs and money: the hold at submit, the post at settlement, the release on failure."""
from broker.billing.service import JobBilling

__all__ = ["JobBilling"]
