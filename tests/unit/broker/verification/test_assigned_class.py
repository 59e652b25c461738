"""The reproducibility class a run is judged by is the one its machine declared when the
broker assigned it, recorded in the envelope (issue #20): a provider that reconnects
declaring another class before its check is judged changes nothing."""
from __future__ import annotations

import time
import uuid

from sdk.protocol.signing import KeyPair

from broker.jobs.model import Job, JobState
from tests.unit.broker.broker_fixtures import RecordingSession
from tests.verification_world import HW, VerificationWorld

OTHER = "cuda:sm90"


def _redeclare(world: VerificationWorld, machine: str, hardware_class: str) -> None:
    """``machine`` connects again, declaring ``hardware_class`` for every build."""
    world.services.providers.repo.update(world.machines[machine], plugins=[
        {"name": m.name, "version": m.version, "weights_digest": "",
         "hardware_class": hardware_class, "dtype": "float16"}
        for m in world.services.catalog.all()])


def test_the_class_recorded_at_assignment_judges_the_run(tmp_path):
    world = VerificationWorld(tmp_path)
    try:
        version = world.services.catalog.get("echo").version
        now = time.time()
        job, _ = world.jobs.repo.create(
            Job(id=str(uuid.uuid4()), account_id=world.client, plugin="echo",
                plugin_version=version, inputs={"text": "hi", "steps": 1, "sleep_ms": 0},
                state=JobState.QUEUED, work_units=1.0, created_at=now, updated_at=now),
            ("queued", {}))
        session = RecordingSession(
            provider_id=world.machines["a"], public_key=KeyPair.generate().public_key_hex,
            account_id=world.operators["a"], plugins={f"echo@{version}": ""},
            classes={f"echo@{version}": {"hardware_class": HW, "dtype": "float32"}})
        job = world.jobs.assign(job, session)
        assert job.envelope["repro_class"] == {"hardware_class": HW, "dtype": "float32"}
        _redeclare(world, "a", OTHER)  # after its run: another class, before the judging
        job = world.settle_output(job, "a", b'{"text": "hi"}', "application/json", {},
                                  f"echo@{version}", hardware_class=OTHER)
        world.v.settled(job, job.receipt)
        record = world.v.status(job.id)
        assert record.hardware_class == HW  # the standing it counts towards, and its class
        assert world.v.repo.standing(world.machines["a"], "echo", OTHER).consecutive_valid == 0
    finally:
        world.services.engine.dispose()


def test_a_canary_is_judged_in_the_class_recorded_when_it_went_out(tmp_path):
    """Two operators' answer is known in class HW; a machine that took a canary declaring
    HW and answers it wrong after reconnecting as another class (where nothing is known
    yet) still fails it."""
    world = VerificationWorld(tmp_path)
    try:
        v = world.v
        version = world.services.catalog.get("sd15").version
        world.machine("d")
        inputs = {"prompt": "a lighthouse", "seed": 2}
        receipt = lambda sha: {"outputs": [{"index": 0, "sha256": sha, "meta": {}}]}  # noqa: E731
        assert v.canary_answer(world.machines["a"], "sd15", version, inputs,
                               receipt("1" * 64)) == "learning"
        assert v.canary_answer(world.machines["b"], "sd15", version, inputs,
                               receipt("1" * 64)) == "learning"
        _redeclare(world, "d", OTHER)
        sent_in = {"hardware_class": HW, "dtype": "float32", "weights_digest": ""}
        assert v.canary_answer(world.machines["d"], "sd15", version, inputs, receipt("2" * 64),
                               recorded=sent_in) == "invalid"
        assert v.repo.standing(world.machines["d"], "sd15", HW).failures == 1
    finally:
        world.services.engine.dispose()
