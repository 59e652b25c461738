"""Checkpoints and the stall watch of the job service (called by services.py)."""
from __future__ import annotations

from broker.jobs.checkpoints import CheckpointPolicy, CheckpointService
from broker.jobs.hub import EventHub
from broker.jobs.ports import BlobStore, JobRepository
from broker.jobs.stalls import StallSettings, StallWatch
from broker.storage.checkpoints_sql import SqlCheckpointRepository, leased_jobs


def checkpoint_service(sessions, settings, *, jobs: JobRepository, blobs: BlobStore,
                       hub: EventHub) -> CheckpointService:
    """The job service's checkpoints (built before it and passed to it): kept in the
    database, their bytes in the jobs' blob store, each one an event on its job."""
    return CheckpointService(
        SqlCheckpointRepository(sessions),
        CheckpointPolicy(min_steps=settings.checkpoint_min_steps,
                         every_steps=settings.checkpoint_every_steps),
        jobs=jobs, blobs=blobs, hub=hub)


def stall_watch(sessions, catalog, settings, market=None) -> StallWatch:
    """Stall bounds from the manifest's wall-clock bound and from the expected duration:
    work units over the throughput θ the broker measured for the provider and plugin
    (DESIGN §4; unmeasured, or no ``market``: the manifest bound alone)."""
    def wall_clock_s(job):
        try:
            return float(catalog.get(job.plugin, job.plugin_version).wall_clock_s)
        except Exception:  # noqa: BLE001 - a plugin no longer served: no manifest bound
            return None

    def expected_s(job):
        if not job.provider_id or market is None:
            return None
        theta, measured = market.tracker.theta(job.provider_id, job.plugin)
        return job.work_units / theta if measured and theta > 0 else None

    return StallWatch(wall_clock_s, expected_s,
                      settings=StallSettings(factor=settings.stall_factor),
                      leased=lambda: leased_jobs(sessions))
