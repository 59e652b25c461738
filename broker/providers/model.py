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
    telemetry: dict | None = None      # the agent's latest report (broker.observability)
    telemetry_at: float | None = None
