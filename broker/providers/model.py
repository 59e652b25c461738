"""A provider as the broker knows it (one agent identity key; many per operator account)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Provider:
    id: str
    account_id: str
    public_key: str
    name: str = ""
    status: str = "active"  # active | paused | banned
    sandboxed: bool = True
    hardware: dict = field(default_factory=dict)
    plugins: list = field(default_factory=list)
    created_at: float = 0.0
    last_seen_at: float = 0.0
    # What the agent said of itself last (Availability, issue #26): {"available", "state",
    # "reason", "since"}; {} until it says anything. Not available = paused by its owner's
    # terms (idle-only, schedule, limits), which is not a failure.
    availability: dict = field(default_factory=dict)
    telemetry: dict | None = None      # the agent's latest report (broker.observability)
    telemetry_at: float | None = None
