"""Agents joining a market in unit tests as the gateway joins them: a session held by the
market's presence, carrying what it offers the market (benchmarks, asks)."""
from __future__ import annotations

from broker.jobs.presence import AgentSession, Lease, Offer


def connect(market, provider_id: str, operator_id: str, plugins: dict[str, str], *,
            vram_gb: float = 0.0, slots: int = 1, digests: dict[str, str] | None = None,
            benchmarks: dict[str, float] | None = None,
            asks: dict[str, int] | None = None,
            kind: type[AgentSession] = AgentSession, **fields) -> AgentSession:
    """Hold a session (a ``kind``, with ``fields``) of ``provider_id`` serving ``plugins``
    (name -> version) in the market's presence; returns it, with the market's answers in
    ``offer_replies``."""
    digests = digests or {}
    fields.setdefault("public_key", "")
    session = kind(
        provider_id=provider_id, account_id=operator_id,
        plugins={f"{name}@{version}": digests.get(name, "") for name, version in plugins.items()},
        slots=slots, vram_gb=vram_gb,
        offer=Offer(benchmarks=tuple((p, u, None) for p, u in (benchmarks or {}).items()),
                    asks=tuple((asks or {}).items())), **fields)
    market.presence.add(session)
    return session


def occupy(market, provider_id: str) -> None:
    """Take every free slot of the provider with a job of no work (busy, no queue)."""
    session = market.presence.get(provider_id)
    n = 0
    while market.presence.take(session, f"busy-{n}", Lease("echo", 0.0, market.clock())):
        n += 1


def leave(market, provider_id: str) -> None:
    """The provider's stream ends."""
    market.presence.remove(market.presence.get(provider_id))
