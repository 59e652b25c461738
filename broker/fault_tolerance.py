"""Wires checkpoints and the stall watch into the job service (called by services.py)."""
from __future__ import annotations

from broker.jobs.checkpoints import CheckpointPolicy, CheckpointService
from broker.jobs.service import JobService
from broker.jobs.stalls import StallSettings, StallWatch
from broker.storage.checkpoints_sql import SqlCheckpointRepository, leased_jobs


def attach_fault_tolerance(jobs: JobService, sessions, catalog, settings) -> None:
    jobs.checkpoints = CheckpointService(
        jobs, SqlCheckpointRepository(sessions),
        CheckpointPolicy(min_steps=settings.checkpoint_min_steps,
                         every_steps=settings.checkpoint_every_steps))

    def wall_clock_s(job):
        try:
            return float(catalog.get(job.plugin, job.plugin_version).wall_clock_s)
        except Exception:  # noqa: BLE001 - a plugin no longer served: no manifest bound
            return None

    jobs.stalls = StallWatch(wall_clock_s, settings=StallSettings(factor=settings.stall_factor),
                             leased=lambda: leased_jobs(sessions))


def use_measured_throughput(jobs: JobService, market) -> None:
    """Stall bounds from the expected duration: work units over the throughput θ the broker
    measured for the provider and plugin (DESIGN §4); unmeasured: the manifest bound alone."""
    if jobs.stalls is None or market is None:
        return

    def expected_s(job):
        if not job.provider_id:
            return None
        theta, measured = market.tracker.theta(job.provider_id, job.plugin)
        return job.work_units / theta if measured and theta > 0 else None

    jobs.stalls.expected_s = expected_s
