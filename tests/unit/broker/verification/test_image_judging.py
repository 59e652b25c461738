"""Image checks that a cheat cannot steer (issue #20), on real outputs of the tiny sd15 run
by the plugin itself, settled and judged by the verification service:

* half the steps (30 → 15) checked across classes: the final images look alike (SSIM
  ~0.9997), the latent trace does not, even relabelled as the job's schedule;
* half the steps on the checker's own class with a false hardware class in the receipt:
  the class the machine declared at connect decides, so the latents are compared exactly;
* a cached image returned for jobs whose clients gave no seed: the broker fixed each job's
  seed, and the check re-runs with it, not with the seed the cheat reports;
* an honest float32 run checked by an honest bfloat16 one: verified.
"""
from __future__ import annotations

import time
import uuid

import pytest

from broker.jobs.model import Job, JobState
from broker.verification.records import CheckStatus
from bench.cheating_host import FALSE_CLASS, claim_schedule
from tests.verification_world import HW, VerificationWorld

from .conftest import RecordingContext, load_plugin
from broker.api.job_request import job_request

JOB = {"prompt": "a lighthouse at dusk", "steps": 30, "width": 64, "height": 64, "seed": 11}
OTHER_CLASS = "cpu:x86_64:threads=2"


def run(plugin, inputs: dict):
    return plugin.run(plugin.manifest.validate_inputs(dict(inputs)), RecordingContext())[0]


def half_steps(plugin, inputs: dict):
    """The half-steps cheat: half the steps, the trace claimed as the job's schedule."""
    out = run(plugin, {**inputs, "steps": inputs["steps"] // 2})
    return claim_schedule(out, inputs)


class World(VerificationWorld):
    """sd15 jobs, settled with real outputs of the tiny model."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.machine("d", hardware_class=OTHER_CLASS)  # another reproducibility class

    def settle(self, job: Job, machine: str, out, hardware_class: str | None = None) -> Job:
        declared = OTHER_CLASS if machine == "d" else HW
        job = self.settle_output(job, machine, out.data, "image/png", out.meta,
                                 "sd15@1.1.0+", hardware_class or declared)
        self.v.settled(job, job.receipt)
        return job

    def primary(self, machine: str, out, inputs: dict = JOB, **kw) -> Job:
        now = time.time()
        job, _ = self.jobs.repo.create(
            Job(id=str(uuid.uuid4()), account_id=self.client, plugin="sd15",
                plugin_version="1.1.0", inputs=dict(inputs), state=JobState.QUEUED,
                work_units=1.0, created_at=now, updated_at=now), ("queued", {}))
        job = self.settle(job, machine, out, **kw)
        assert self.v.status(job.id).status is CheckStatus.CHECKING  # new: always checked
        return job

    def check(self, job: Job) -> Job:
        return self.jobs.repo.get(self.v.status(job.id).checker_job_id)


@pytest.fixture
def world(tmp_path):
    w = World(tmp_path)
    yield w
    w.services.engine.dispose()


@pytest.fixture(scope="module")
def sd15_bf16(sd15_weights):
    """The sd15 plugin in bfloat16 (SPARECYCLES_DTYPE, as a provider sets it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARECYCLES_DTYPE", "bfloat16")
    try:
        plugin = load_plugin("sd15", sd15_weights)
    finally:
        mp.undo()
    yield plugin
    plugin.teardown()


def test_half_the_steps_checked_across_classes_is_caught_by_the_latent_trace(world, sd15):
    claim = half_steps(sd15, JOB)
    job = world.primary("a", claim)
    check = world.check(job)
    world.settle(check, "d", run(sd15, check.inputs))  # an honest checker of another class
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED, rec.comparisons
    [figures] = rec.comparisons["primary~checker"]["outputs"]
    assert figures["method"] == "structural" and figures["verdict"] == "mismatch"
    assert figures["ssim"] > 0.99  # the images alone look alike
    assert any("latent trace" in r for r in figures["reasons"]), figures


def test_a_false_hardware_class_in_the_receipt_does_not_switch_the_comparison(world, sd15):
    claim = half_steps(sd15, JOB)
    job = world.primary("a", claim, hardware_class=FALSE_CLASS)  # a declared HW at connect
    check = world.check(job)
    world.settle(check, "b", run(sd15, check.inputs))  # b declared HW too
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.DISPUTED, rec.comparisons
    [figures] = rec.comparisons["primary~checker"]["outputs"]
    assert (figures["method"], figures["verdict"]) == ("latent_hash", "mismatch")


def test_a_cached_image_for_unseeded_jobs_is_checked_with_the_brokers_seed(world, sd15):
    from broker.auth.service import Principal

    inputs = {k: v for k, v in JOB.items() if k != "seed"} | {"steps": 4}
    clients = [Principal(world.client, "client", "k")]
    _, other = world.services.auth.create_account_with_key("client")
    clients.append(other)
    from broker.ledger.model import FundingSource

    for who in clients:  # dev grants: the jobs are held against them
        world.services.ledger.deposit(who.account_id, 10_000_000,
                                      idempotency_key=f"grant:{who.account_id}",
                                      source=FundingSource.DEV_GRANT, memo="test credits")
    first, _ = world.jobs.submit(clients[0], job_request({"plugin": "sd15", "inputs": inputs}, world.jobs.catalog))
    second, _ = world.jobs.submit(clients[1], job_request({"plugin": "sd15", "inputs": inputs}, world.jobs.catalog))
    seeds = first.inputs["seed"], second.inputs["seed"]
    assert seeds[0] != seeds[1]  # the broker drew each job's seed
    cached = run(sd15, first.inputs)  # the cheat's one honest run, kept for both jobs
    assert cached.meta["seed"] == seeds[0]
    for job in (first, second):
        world.settle(job, "a", cached)
    check = world.check(second)
    assert check.inputs["seed"] == seeds[1]  # the broker's seed, not the one reported
    world.settle(check, "b", run(sd15, check.inputs))
    rec = world.v.status(second.id)
    assert rec.status is CheckStatus.DISPUTED, rec.comparisons
    assert rec.comparisons["primary~checker"]["verdict"] == "mismatch"


def test_an_honest_run_checked_by_a_bfloat16_run_is_verified(world, sd15, sd15_bf16):
    job = world.primary("a", run(sd15, JOB))
    check = world.check(job)
    honest_bf16 = run(sd15_bf16, check.inputs)
    assert honest_bf16.meta["dtype"] == "bfloat16"
    world.settle(check, "d", honest_bf16)
    rec = world.v.status(job.id)
    assert rec.status is CheckStatus.VERIFIED, rec.comparisons
    [figures] = rec.comparisons["primary~checker"]["outputs"]
    assert figures["method"] == "structural" and figures["trace_distance"] > 0


def test_a_job_queued_before_the_broker_fixed_seeds_is_not_checked_on_a_reported_seed(world):
    """A job without a seed in its inputs (queued by an older broker) could only be
    re-run with the seed its provider reports, which proves nothing: it is not sampled."""
    now = time.time()
    job, _ = world.jobs.repo.create(
        Job(id=str(uuid.uuid4()), account_id=world.client, plugin="sd15",
            plugin_version="1.1.0", inputs={k: v for k, v in JOB.items() if k != "seed"},
            state=JobState.QUEUED, work_units=1.0, created_at=now, updated_at=now),
        ("queued", {}))
    job = world.settle_output(job, "a", b"\x89PNG not judged", "image/png", {"seed": 5},
                              "sd15@1.1.0+")
    world.v.settled(job, job.receipt)
    rec = world.v.status(job.id)
    assert (rec.status, rec.reason, rec.checker_job_id) == (CheckStatus.UNCHECKED,
                                                             "unseeded", None)
