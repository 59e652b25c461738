"""The gateway's inbox (issue #28): single receipts waiting one after another are settled
together in one JobService.receipts call and still acked one by one (what an agent that
sends single receipts expects); a ReceiptBatch gets one AckBatch; other messages keep
their place in the order."""
import json
import threading
from collections import deque
from types import SimpleNamespace

from broker.gateway.servicer import AgentGatewayServicer, GatewayStats
from broker.jobs.errors import ReceiptRefused
from sdk.protocol import agent_pb2 as pb


class FakeJobs:
    def __init__(self):
        self.calls = []  # ("receipts", [job ids]) / ("heartbeat", ids)

    def receipts(self, provider_id, key, items):
        ids = [json.loads(data)["job_id"] for data, *_ in items]
        self.calls.append(("receipts", ids))
        return [ReceiptRefused("bad_signature", "forged") if i == "forged"
                else SimpleNamespace(id=i) for i in ids]

    def receipt(self, provider_id, key, data, signature, uploads=(), received_at=None):
        job_id = json.loads(data)["job_id"]
        self.calls.append(("receipt", job_id))  # a receipt alone: the single path
        return SimpleNamespace(id=job_id)

    def heartbeat(self, provider_id, ids):
        self.calls.append(("heartbeat", list(ids)))


class FakeSession:
    provider_id, public_key = "p1", "ab" * 32

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def _gateway(jobs):
    gw = AgentGatewayServicer.__new__(AgentGatewayServicer)
    gw.jobs, gw.canaries, gw.telemetry, gw.market = jobs, None, None, None
    gw.stats = GatewayStats()
    return gw


def _doc(job_id):
    return json.dumps({"job_id": job_id}).encode()


def _receipt(job_id):
    return pb.AgentMessage(receipt=pb.Receipt(receipt=_doc(job_id), signature="s"))


def _drain(gw, session, messages):
    inbox = deque((m, 1.0) for m in messages)
    gw._drain(session, inbox, threading.Lock(), {"draining": True})


def test_single_receipts_waiting_together_settle_together_and_get_an_ack_each():
    jobs, session = FakeJobs(), FakeSession()
    gw = _gateway(jobs)
    beat = pb.AgentMessage(heartbeat=pb.Heartbeat(running_job_ids=["j9"]))
    _drain(gw, session, [_receipt("j1"), _receipt("forged"), _receipt("j2"), beat,
                         _receipt("j3")])
    assert jobs.calls == [("receipts", ["j1", "forged", "j2"]), ("heartbeat", ["j9"]),
                          ("receipt", "j3")]
    kinds = [(m.WhichOneof("body"), m.ack.job_id or m.refusal.job_id) for m in session.sent]
    assert kinds == [("refusal", "forged"), ("ack", "j1"), ("ack", "j2"), ("ack", "j3")]
    assert session.sent[0].refusal.code == "bad_signature"
    assert (gw.stats.receipts, gw.stats.receipt_settlements) == (4, 2)


def test_a_receipt_batch_is_acked_in_one_message():
    jobs, session = FakeJobs(), FakeSession()
    gw = _gateway(jobs)
    batch = pb.AgentMessage(receipts=pb.ReceiptBatch(receipts=[
        pb.Receipt(receipt=_doc("j1"), signature="s"), pb.Receipt(receipt=_doc("j2"),
                                                                  signature="s")]))
    _drain(gw, session, [batch])
    assert jobs.calls == [("receipts", ["j1", "j2"])]
    assert [m.WhichOneof("body") for m in session.sent] == ["acks"]
    assert [a.job_id for a in session.sent[0].acks.acks] == ["j1", "j2"]
