"""Where the broker's own figures of each provider outlive the process (issue #21): measured
θ and the claim beside it, successes and failures (reliability), and when its last canary
ran, per (provider, plugin). With them in the database a restarted broker, or another
replica an agent reconnects to, prices and ranks the provider as before instead of
starting it cold (and sending it a canary again).

The market writes behind: each change marks its (provider, plugin) dirty and
:meth:`MarketService.flush_figures` writes the dirty ones (the maintenance thread, every
pass; a provider's at once when its agent disconnects, so a replica it reconnects to reads
them; everything when the broker stops). A SIGKILLed broker loses at most one pass of
samples, never the figures before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Figures:
    provider_id: str
    plugin: str
    claimed_units_per_s: float | None = None
    measured_units_per_s: float | None = None
    samples: int = 0
    successes: int = 0
    failures: int = 0
    last_canary_at: float | None = None


class FigureStore(Protocol):
    def load_figures(self, provider_ids: list[str] | None = None) -> list[Figures]:
        """Every stored row (or those of ``provider_ids``)."""
        ...

    def save_figures(self, rows: list[Figures], at: float) -> None:
        """Insert or replace these rows."""
        ...


class InMemoryFigureStore:
    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], Figures] = {}

    def load_figures(self, provider_ids: list[str] | None = None) -> list[Figures]:
        return [Figures(**vars(f)) for k, f in self.rows.items()
                if provider_ids is None or k[0] in provider_ids]

    def save_figures(self, rows: list[Figures], at: float) -> None:
        for f in rows:
            self.rows[(f.provider_id, f.plugin)] = Figures(**vars(f))
