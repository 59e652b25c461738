"""Dev and test seeding: give a provider account earned credits without running a job.

Not used by the broker itself. Tests and benchmarks (``bench/``) call it to put a provider
in the state real work would leave it in, through real ledger operations only, so every
balance and invariant stays what the ledger would produce.
"""
from __future__ import annotations

from broker.ledger.model import Splits
from broker.ledger.service import LedgerService


def seed_earned(ledger: LedgerService, owner: str, micro: int, *, stake: bool = True) -> None:
    """Give provider account ``owner`` ``micro`` credits as earned credits get there: a seed
    client account ``seed-{owner}`` is opened and funded, a hold on it is posted to
    ``owner`` with no vesting window, and the share is vested into ``owner``'s available
    balance; with ``stake`` (the default) it is then all put at stake. Seed each owner
    once: the idempotency keys derive from ``owner``."""
    seed = f"seed-{owner}"
    ledger.open_client(seed)
    ledger.deposit(seed, micro, idempotency_key=f"{seed}:deposit")
    hold = ledger.hold(seed, micro, f"{seed}-job", idempotency_key=f"{seed}:hold")
    ledger.post(hold.id, Splits(provider=owner, provider_micro=micro),
                idempotency_key=f"{seed}:post", vesting_window_s=0)
    ledger.vest(owner)
    if stake:
        ledger.stake(owner, micro, idempotency_key=f"{seed}:stake")
