"""Connects the market to the job service (called by the app wiring, broker/services.py)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from broker.catalog.registry import PluginCatalog
from broker.errors import UnknownPlugin
from broker.jobs.model import Job
from sdk.protocol.manifest import Manifest

from .canary import CanaryService
from .service import MarketService
from .throughput import timed_sample

log = logging.getLogger(__name__)


def manifests_of(catalog: PluginCatalog):
    """``manifest_of(plugin, version)`` for :class:`MarketService`: the catalog's manifest,
    None for a build it does not know."""
    def manifest_of(plugin: str, version: str) -> Manifest | None:
        try:
            return catalog.get(plugin, version)
        except UnknownPlugin:
            return None
    return manifest_of


def terms_check(market: MarketService) -> Callable[[Job, int], None]:
    """``check_terms(job, n_slots)`` for :class:`JobService`: a job with a deadline or a
    price cap is admitted only when the market could meet its terms (raises
    CannotMeetTerms)."""
    def check_terms(job: Job, n_slots: int) -> None:
        if job.deadline_s is None and not job.max_price_micro:
            return
        market.check_terms(market.spec(
            plugin=job.plugin, version=job.plugin_version, work_units=job.work_units,
            client_id=job.account_id, priority=job.priority,
            max_price_micro=job.max_price_micro or None, deadline_s=job.deadline_s,
            n_slots=n_slots, weights_digest=getattr(job, "weights_digest", None)))
    return check_terms


class MarketReceipts:
    """The market's side of the job service's receipts (a ``JobEvents`` receipt watcher,
    joined by the wiring): θ goes to the market, and each client job's inputs to the
    canaries (None: no canaries), which reuse them."""

    def __init__(self, market: MarketService, canaries: CanaryService | None = None):
        self.market = market
        self.canaries = canaries

    def receipt(self, job: Job, receipt: dict, received_at: float) -> None:
        # θ as the broker saw it: from sending the assignment to the receipt's arrival,
        # the units the broker computed for the inputs (throughput.timed_sample).
        market, canaries = self.market, self.canaries
        sample = timed_sample(receipt, job.work_units, job.matched_at, received_at)
        if sample is not None and job.provider_id is not None:
            market.observe(job.provider_id, job.plugin, *sample)
        if canaries is not None and not job.check_of and job.provider_id is not None:
            canaries.remember(job.plugin, job.plugin_version,
                              market.operator_of(job.provider_id) or "", job.inputs, job.id)
