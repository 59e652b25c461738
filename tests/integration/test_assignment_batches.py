"""Assignments in batches (issue #28): what one dispatcher pass places on an agent that says
it takes them (Capabilities.assignment_batches) goes out in one AssignmentBatch, each
envelope signed and opened on its own; an agent that does not say so gets one Assignment
each; a session holding assignments sends them before anything else it sends, and sooner
once enough wait. Through the real gateway and, for the last, a real in-process agent."""
import asyncio
import json
import threading
import time

import pytest

from broker.gateway import servicer
from broker.gateway.servicer import GatewaySession, GatewayStats
from broker.jobs import presence
from broker.jobs.presence import assignments_gathered
from sdk import Client
from sdk.protocol import agent_pb2 as pb
from sdk.protocol.envelope import ReplayGuard, open_envelope
from sdk.protocol.signing import KeyPair

from test_gateway_and_sdk import RawAgent
from test_receipt_batches_gateway import _handshake, _receipt

JOBS = [{"plugin": "echo", "inputs": {"text": str(i)}} for i in range(6)]


@pytest.fixture
def patient(monkeypatch):
    """No wait bound: a pass's assignments are held to its end however slow the machine."""
    monkeypatch.setattr(servicer, "GATHER_MAX_WAIT_S", 60.0)


def _messages(raw, n_assignments):
    """The assignment messages until ``n_assignments`` assignments came: (kind, [Assignment])."""
    got, count = [], 0
    while count < n_assignments:
        msg = raw.recv()
        kind = msg.WhichOneof("body")
        if kind == "assignment":
            got.append((kind, [msg.assignment]))
        elif kind == "assignments":
            got.append((kind, list(msg.assignments.assignments)))
        else:
            continue
        count += len(got[-1][1])
    return got


def _placed(live_broker, batches: bool):
    """A raw agent of 8 slots (taking batches or not) and the JOBS submitted in one bulk
    request: (its key, its stream, the jobs, the assignment messages it got for them)."""
    key = KeyPair.generate()
    raw = RawAgent(live_broker.grpc, live_broker.key("provider"))
    _handshake(raw, key, slots=8, assignment_batches=batches)
    jobs = Client(live_broker.url, live_broker.key("client")).submit_many(JOBS)
    return key, raw, jobs, _messages(raw, len(JOBS))


def test_jobs_placed_in_one_pass_reach_a_batching_agent_in_one_message(live_broker, patient):
    key, raw, jobs, messages = _placed(live_broker, batches=True)
    assert [kind for kind, _ in messages] == ["assignments"]
    batch = messages[0][1]
    broker_key = live_broker.services.signer.public_key_hex
    replay = ReplayGuard()
    opened = [open_envelope(a.envelope, a.signature, broker_key=broker_key,
                            my_key=key.public_key_hex, replay=replay, identity=key)
              for a in batch]
    # In the order they were placed (the request's), each its own signed envelope.
    assert [e["job_id"] for e in opened] == [j.id for j in jobs]
    assert [e["inputs"]["text"] for e in opened] == [str(i) for i in range(len(JOBS))]
    raw.send(receipts=pb.ReceiptBatch(receipts=[_receipt(key, a) for a in batch]))
    assert raw.recv().WhichOneof("body") == "acks"
    assert all(j.refresh().state == "settled" for j in jobs)
    stats = live_broker.server.gateway_stats
    assert (stats.assignments, stats.assignment_messages) == (len(JOBS), 1)
    services = live_broker.services
    assert services.ledger.verify().ok and services.audit.verify().ok


def test_an_agent_that_does_not_take_batches_gets_one_assignment_each(live_broker, patient):
    _, _, jobs, messages = _placed(live_broker, batches=False)
    assert [kind for kind, _ in messages] == ["assignment"] * len(JOBS)
    assert sorted(json.loads(a.envelope)["job_id"] for _, (a,) in messages) == \
        sorted(j.id for j in jobs)


def _session(loop, **kwargs) -> GatewaySession:
    return GatewaySession(provider_id="p", public_key="00" * 32, account_id="a",
                          plugins={"echo@1.0.0": ""}, slots=8, loop=loop,
                          stats=GatewayStats(), assignment_batches=True, **kwargs)


def _outbox(loop, session) -> list[str]:
    loop.run_until_complete(asyncio.sleep(0))  # run the queued puts
    out = []
    while not session._outbox.empty():
        msg, _ = session._outbox.get_nowait()
        kind = msg.WhichOneof("body")
        out.append(kind if kind != "assignments"
                   else f"assignments:{len(msg.assignments.assignments)}")
    return out


def test_held_assignments_go_before_anything_else_and_once_enough_wait(monkeypatch, patient):
    loop = asyncio.new_event_loop()
    try:
        session = _session(loop)
        with assignments_gathered():
            session.send_assignment(b'{"a":1}', "s1")
            session.send_assignment(b'{"a":2}', "s2")
            assert _outbox(loop, session) == []  # held for the pass's end
            session.send_cancel("j", 0, "cancelled by the client")  # never before its job
            assert _outbox(loop, session) == ["assignments:2", "cancel"]
            session.send_assignment(b'{"a":3}', "s3")
        assert _outbox(loop, session) == ["assignment"]  # one left: sent as it ends
        # Outside a pass nothing is held.
        session.send_assignment(b'{"a":4}', "s4")
        assert _outbox(loop, session) == ["assignment"]
        # Past GATHER_MAX held, they go at once, in batches of that many.
        monkeypatch.setattr(servicer, "GATHER_MAX", 2)
        with assignments_gathered():
            for i in range(5):
                session.send_assignment(b'{"b":%d}' % i, "s")
            assert _outbox(loop, session) == ["assignments:2", "assignments:2"]
        assert _outbox(loop, session) == ["assignment"]
        assert (session._stats.assignments, session._stats.assignment_messages) == (9, 6)
        # Another thread's send is never held by this thread's pass.
        with assignments_gathered():
            t = threading.Thread(target=session.send_assignment, args=(b'{"c":1}', "s"))
            t.start()
            t.join()
            assert _outbox(loop, session) == ["assignment"]
    finally:
        loop.close()


def test_the_first_held_assignment_waits_at_most_the_bound(monkeypatch):
    monkeypatch.setattr(servicer, "GATHER_MAX_WAIT_S", 0.0)  # every one is due at once
    loop = asyncio.new_event_loop()
    try:
        session = _session(loop)
        with assignments_gathered():
            session.send_assignment(b'{"a":1}', "s1")
            session.send_assignment(b'{"a":2}', "s2")
            assert _outbox(loop, session) == ["assignment", "assignment"]
    finally:
        loop.close()


def test_a_batch_stays_under_its_byte_bound(monkeypatch, patient):
    monkeypatch.setattr(servicer, "GATHER_MAX_BYTES", 2500)
    loop = asyncio.new_event_loop()
    try:
        session = _session(loop)
        with assignments_gathered():
            for _ in range(3):
                session.send_assignment(b"x" * 1000, "s")  # the third would pass the bound
            assert _outbox(loop, session) == ["assignments:2"]
        assert _outbox(loop, session) == ["assignment"]
    finally:
        loop.close()


def test_a_real_agent_runs_every_job_of_a_batch(live_broker, start_agent, patient):
    start_agent("batching", slots=8)
    client = Client(live_broker.url, live_broker.key("client"))
    results = client.generate_many(JOBS, timeout=60)
    assert [r.json[0]["text"] for r in results] == [str(i) for i in range(len(JOBS))]
    stats = live_broker.server.gateway_stats
    assert stats.assignment_messages < stats.assignments  # some came together
    services = live_broker.services
    assert services.ledger.verify().ok and services.audit.verify().ok


def test_one_agents_held_assignment_goes_once_due_while_the_pass_serves_others(monkeypatch):
    monkeypatch.setattr(servicer, "GATHER_MAX_WAIT_S", 0.05)
    monkeypatch.setattr(presence, "GATHER_SCAN_S", 0.0)
    loop = asyncio.new_event_loop()
    try:
        first, other = _session(loop), _session(loop)
        with assignments_gathered():
            first.send_assignment(b'{"a":1}', "s1")
            assert _outbox(loop, first) == []
            time.sleep(0.06)  # past its bound, and no more jobs come for it
            other.send_assignment(b'{"b":1}', "s2")
            assert _outbox(loop, first) == ["assignment"]
            assert _outbox(loop, other) == []  # held: its own wait has only begun
        assert _outbox(loop, other) == ["assignment"]
    finally:
        loop.close()
