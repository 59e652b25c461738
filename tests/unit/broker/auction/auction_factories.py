"""Builders and Hypothesis strategies for the auction tests (imported by the test modules
next to it; the name is unique so it cannot shadow another test folder's helpers)."""
from __future__ import annotations

from hypothesis import strategies as st

from broker.auction import Ask, JobSpec, Priority

BUILD = ("sd15", "1.0.0", "a" * 64)
CLIENT = "client-1"


def ask(pid: str = "p1", op: str | None = None, price: int = 100, theta: float = 10.0,
        **kw) -> Ask:
    fields = dict(plugin=BUILD[0], plugin_version=BUILD[1], weights_digest=BUILD[2],
                  vram_gb=24.0)
    fields.update(kw)
    return Ask(provider_id=pid, operator_id=op or f"op-{pid}", price_micro_per_unit=price,
               throughput_units_per_s=theta, **fields)


def job(work_units: float = 10.0, reserve: int = 1_000, **kw) -> JobSpec:
    fields = dict(plugin=BUILD[0], plugin_version=BUILD[1], weights_digest=BUILD[2],
                  client_id=CLIENT)
    fields.update(kw)
    return JobSpec(work_units=work_units, reserve_micro_per_unit=reserve, **fields)


@st.composite
def asks(draw, n_min: int = 1, n_max: int = 10, operators: int | None = None,
         messy: bool = True, max_price: int = 1_000) -> list[Ask]:
    """A market: distinct providers; with ``operators`` set, machines share that many
    operators; ``messy`` adds offline, busy, linked, small and unmeasured machines."""
    n = draw(st.integers(n_min, n_max))
    out = []
    for i in range(n):
        extra = {}
        if messy:
            extra = dict(
                online=draw(st.booleans()) or draw(st.booleans()),
                slots_free=draw(st.integers(0, 2)),
                vram_gb=draw(st.sampled_from([8.0, 16.0, 24.0])),
                linked_accounts=draw(st.sampled_from([frozenset(), frozenset({CLIENT})])),
                throughput_measured=draw(st.booleans()) or draw(st.booleans()),
                reputation=draw(st.floats(0, 1)),
            )
        op = f"op-{draw(st.integers(0, operators - 1))}" if operators else f"op-{i}"
        out.append(ask(
            pid=f"p{i}", op=op,
            price=draw(st.integers(1, max_price)),
            theta=draw(st.floats(0.25, 50.0)),
            queue_s=draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
            cold_start_s=draw(st.sampled_from([0.0, 0.0, 8.0])),
            reliability=draw(st.floats(0.5, 1.0)),
            **extra))
    return out


@st.composite
def jobs(draw, max_slots: int = 3, terms: bool = True) -> JobSpec:
    return job(
        work_units=draw(st.floats(0.5, 200.0)),
        reserve=draw(st.integers(1, 1_200)),
        priority=draw(st.sampled_from(list(Priority))),
        n_slots=draw(st.integers(1, max_slots)),
        min_vram_gb=draw(st.sampled_from([0.0, 12.0, 20.0])),
        max_price_micro=draw(st.none() | st.integers(1, 500_000)) if terms else None,
        deadline_s=draw(st.none() | st.floats(1.0, 120.0)) if terms else None,
        excluded_provider_ids=draw(st.sampled_from([frozenset(), frozenset({"p1"})]))
        if terms else frozenset(),
        excluded_operator_ids=draw(st.sampled_from([frozenset(), frozenset({"op-2"})]))
        if terms else frozenset(),
    )
