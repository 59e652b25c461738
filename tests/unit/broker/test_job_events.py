"""JobEventRelay and VerificationRelay: with nobody joined they answer as a broker without
that listener does; joined, every call reaches the listeners in the order they joined."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from broker.jobs.events import JobEventRelay
from broker.verification.relay import VerificationRelay

JOB = SimpleNamespace(id="j1")


class Recorder:
    def __init__(self, name: str, calls: list, opinion: str | None = None):
        self.name, self.calls, self.opinion = name, calls, opinion

    def queued(self, job, siblings=None):
        self.calls.append((self.name, "queued", job.id, siblings))

    def released(self, provider_id, job_id):
        self.calls.append((self.name, "released", provider_id, job_id))

    def cancel(self, job):
        self.calls.append((self.name, "cancel", job.id))

    def second_opinion(self, job, provider_id):
        return self.opinion

    def receipt(self, job, receipt, received_at):
        self.calls.append((self.name, "receipt", job.id, received_at))

    def settled(self, job, receipt):
        self.calls.append((self.name, "settled", job.id))

    def ended(self, job):
        self.calls.append((self.name, "ended", job.id))


def test_a_relay_nobody_joined_does_nothing_and_knows_no_other_operator():
    relay = JobEventRelay()
    relay.queued(JOB, siblings=[JOB])
    relay.released("p", "j1")
    relay.cancel(JOB)
    relay.receipt(JOB, {}, 1.0)
    relay.settled(JOB, {})
    relay.ended(JOB)
    assert relay.second_opinion(JOB, "p") is None


def test_each_event_reaches_its_listeners_in_the_order_they_joined():
    calls: list = []
    relay = JobEventRelay()
    relay.join_placement(Recorder("dispatcher", calls, opinion="op-a"))
    relay.join_receipts(Recorder("market", calls))
    relay.join_receipts(Recorder("other", calls))
    relay.join_ends(Recorder("verification", calls))
    relay.queued(JOB)
    relay.released("p", "j1")
    relay.cancel(JOB)
    relay.receipt(JOB, {}, 2.0)
    relay.settled(JOB, {})
    relay.ended(JOB)
    assert relay.second_opinion(JOB, "p") == "op-a"
    assert calls == [("dispatcher", "queued", "j1", None),
                     ("dispatcher", "released", "p", "j1"), ("dispatcher", "cancel", "j1"),
                     ("market", "receipt", "j1", 2.0), ("other", "receipt", "j1", 2.0),
                     ("verification", "settled", "j1"), ("verification", "ended", "j1")]


def test_a_second_dispatcher_is_refused():
    relay = JobEventRelay()
    first = Recorder("a", [])
    relay.join_placement(first)
    relay.join_placement(first)  # the same one again changes nothing
    with pytest.raises(ValueError, match="one dispatcher per job service"):
        relay.join_placement(Recorder("b", []))


def test_a_listeners_failure_reaches_the_job_service():
    relay = JobEventRelay()
    broken = Recorder("v", [])
    broken.settled = lambda job, receipt: (_ for _ in ()).throw(RuntimeError("down"))
    relay.join_ends(broken)
    with pytest.raises(RuntimeError, match="down"):
        relay.settled(JOB, {})


def test_verification_relay_without_verification_answers_as_verification_off():
    relay = VerificationRelay()
    assert relay.stake_ok("p", "echo") is True
    assert relay.canary_answer("p", "echo", "1.0.0", {}, {}, "", None) is None
    relay.admin_resolved(SimpleNamespace(id="d1"))  # recorded by the disputes, nothing more


def test_verification_relay_passes_each_call_to_the_joined_service():
    calls = []
    verification = SimpleNamespace(
        stake_ok=lambda pid, plugin: calls.append(("stake", pid, plugin)) or False,
        canary_answer=lambda *a: calls.append(("canary",) + a) or "valid",
        admin_resolved=lambda d: calls.append(("resolved", d.id)))
    relay = VerificationRelay()
    relay.join(verification)
    assert relay.stake_ok("p", "echo") is False
    assert relay.canary_answer("p", "echo", "1.0.0", {"x": 1}, {}, "src", {"c": 1}) == "valid"
    relay.admin_resolved(SimpleNamespace(id="d1"))
    assert calls == [("stake", "p", "echo"),
                     ("canary", "p", "echo", "1.0.0", {"x": 1}, {}, "src", {"c": 1}),
                     ("resolved", "d1")]
    with pytest.raises(ValueError):
        relay.join(SimpleNamespace())
