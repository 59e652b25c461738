"""What an agent sends the broker for a job, in order: a job that ends within
START_REPORT_DELAY_S is told by its receipt alone (no JobAccepted); a longer one is
reported running first. Small outputs travel inside the receipt's message, large ones
ahead of it."""
from __future__ import annotations

import queue
import threading
import time
import uuid

from provider_agent import agent as agent_mod
from provider_agent.host.manager import HostOutput, HostResult
from sdk.protocol import agent_pb2 as pb
from sdk.protocol.envelope import make_envelope, open_receipt, sign_envelope
from sdk.protocol.signing import KeyPair

from test_receipt_meta_and_cheats import make_agent


class TimedHost:
    def __init__(self, run_s: float, size: int):
        self.run_s, self.size = run_s, size
        self.ready = {"hardware": {"device": "cpu"}}

    def run(self, job_id, inputs, **kw):
        time.sleep(self.run_s)
        return HostResult([HostOutput(0, "application/octet-stream", b"x" * self.size, {})],
                          int(self.run_s * 1000), 1.0)

    def alive(self):
        return True


def _job_messages(run_s: float, size: int = 10) -> list[pb.AgentMessage]:
    broker = KeyPair.generate()
    agent = make_agent("echo")
    agent.cfg.broker_public_key = broker.public_key_hex
    agent.plugins["echo"].host = TimedHost(run_s, size)
    out: queue.Queue = queue.Queue()
    agent._outq = out
    threads = [threading.Thread(target=agent._worker, daemon=True),
               threading.Thread(target=agent._report_starts, daemon=True)]
    for t in threads:
        t.start()
    env = make_envelope(job_id=str(uuid.uuid4()), attempt=0, plugin="echo",
                        version=agent.plugins["echo"].manifest.version, inputs={"text": "x"},
                        provider_key=agent.identity.public_key_hex, lease_timeout_s=30)
    data, sig = sign_envelope(broker, env)
    agent._on_assignment(pb.Assignment(envelope=data, signature=sig))
    msgs = []
    while not any(m.WhichOneof("body") == "receipt" for m in msgs):
        msgs.append(out.get(timeout=10))
    time.sleep(0.2)  # nothing comes after the receipt
    while not out.empty():
        msgs.append(out.get())
    agent.stop()
    receipt = next(m.receipt for m in msgs if m.WhichOneof("body") == "receipt")
    rec = open_receipt(receipt.receipt, receipt.signature,
                       provider_key=agent.identity.public_key_hex)
    assert rec["job_id"] == env["job_id"]
    return msgs


def test_a_short_job_is_told_by_its_receipt_alone_with_its_output_inside(monkeypatch):
    # A generous delay: a busy machine must not make an instant job look long.
    monkeypatch.setattr(agent_mod, "START_REPORT_DELAY_S", 1.0)
    msgs = _job_messages(0.0)
    assert [m.WhichOneof("body") for m in msgs] == ["receipt"]
    [chunk] = msgs[0].receipt.outputs
    assert chunk.data == b"x" * 10 and chunk.index == 0


def test_a_longer_job_is_reported_running_before_its_receipt(monkeypatch):
    monkeypatch.setattr(agent_mod, "START_REPORT_DELAY_S", 0.05)
    msgs = _job_messages(0.5)
    assert [m.WhichOneof("body") for m in msgs] == ["accepted", "receipt"]
    assert msgs[0].accepted.attempt == 0


def test_large_outputs_go_ahead_of_the_receipt(monkeypatch):
    monkeypatch.setattr(agent_mod, "START_REPORT_DELAY_S", 1.0)
    msgs = _job_messages(0.0, size=agent_mod.INLINE_OUTPUTS_BYTES + 1)
    assert [m.WhichOneof("body") for m in msgs] == ["output", "receipt"]
    assert not msgs[1].receipt.outputs
