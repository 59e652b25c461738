"""Connects the market to the job service and the dispatcher (called by the app wiring)."""
from __future__ import annotations

import logging

from broker.jobs.dispatch import Dispatcher
from broker.jobs.model import Job
from broker.jobs.service import JobService

from .canary import CanaryService
from .service import MarketService

log = logging.getLogger(__name__)


def attach_market(market: MarketService, canaries: CanaryService | None, jobs: JobService,
                  dispatcher: Dispatcher) -> None:
    dispatcher.market = market
    if canaries is not None:
        dispatcher.canary_sender = canaries.send_due

    def check_terms(job: Job, n_slots: int) -> None:
        if job.deadline_s is None and not job.max_price_micro:
            return
        market.check_terms(market.spec(
            plugin=job.plugin, version=job.plugin_version, work_units=job.work_units,
            client_id=job.account_id, priority=job.priority,
            max_price_micro=job.max_price_micro or None, deadline_s=job.deadline_s,
            n_slots=n_slots))

    def on_receipt(job: Job, receipt: dict) -> None:
        timings = receipt.get("timings_ms") or {}
        run_ms = timings.get("run", timings.get("total"))
        if run_ms is None or job.provider_id is None:
            return
        try:
            units = float(receipt.get("work_units", job.work_units))
        except (TypeError, ValueError):
            units = job.work_units
        market.observe(job.provider_id, job.plugin, units, float(run_ms))

    jobs.check_terms = check_terms
    jobs.on_receipt = on_receipt
