"""Receipts in batches through the real gateway (issue #28): a broker says it takes them,
a ReceiptBatch gets one AckBatch for the receipts that settled and a Refusal for each that
did not, and an agent that sends single receipts still gets one Ack each."""
import json

from sdk import Client
from sdk.protocol import agent_pb2 as pb
from sdk.protocol.canonical import canonical_bytes, sha256_hex
from sdk.protocol.envelope import make_receipt
from sdk.protocol.signing import KeyPair

from test_gateway_and_sdk import RawAgent


def _handshake(raw, key, slots, assignment_batches=False):
    """Connect ``raw`` as an echo agent of ``slots`` (taking AssignmentBatch messages when
    ``assignment_batches``); returns the broker's Welcome."""
    from sdk.protocol.envelope import challenge_document
    raw.send(hello=pb.Hello(public_key=key.public_key_hex, name="raw"))
    ch = raw.recv().challenge
    doc = challenge_document(ch.nonce, key.public_key_hex, ch.broker_public_key)
    raw.send(challenge_response=pb.ChallengeResponse(signature=key.sign("challenge", doc)))
    raw.send(capabilities=pb.Capabilities(
        plugins=[pb.PluginCapability(name="echo", version="1.0.0")], slots=slots,
        sandboxed=True, assignment_batches=assignment_batches))
    return raw.recv().welcome


def _receipt(key, assignment, signer=None) -> pb.Receipt:
    env = json.loads(assignment.envelope)
    data = b'{"ok":true}'
    rec = make_receipt(envelope=env, envelope_bytes=assignment.envelope,
                       provider_key=key.public_key_hex,
                       outputs=[{"index": 0, "sha256": sha256_hex(data),
                                 "media_type": "application/json", "size": len(data)}],
                       work_units=1, timings_ms={"run": 1})
    return pb.Receipt(receipt=canonical_bytes(rec), signature=(signer or key).sign("receipt", rec),
                      outputs=[pb.OutputChunk(job_id=env["job_id"], attempt=env["attempt"],
                                              index=0, media_type="application/json",
                                              data=data, sha256=sha256_hex(data))])


def _assignments(raw, n):
    got = []
    while len(got) < n:
        msg = raw.recv()
        if msg.WhichOneof("body") == "assignment":
            got.append(msg.assignment)
    return got


def test_a_receipt_batch_is_acked_in_one_message_and_a_forged_one_refused(live_broker):
    key = KeyPair.generate()
    raw = RawAgent(live_broker.grpc, live_broker.key("provider"))
    welcome = _handshake(raw, key, slots=4)
    assert welcome.receipt_batches
    client = Client(live_broker.url, live_broker.key("client"))
    jobs = [client.jobs.create("echo", text=str(i)) for i in range(4)]
    assignments = _assignments(raw, 4)
    forged = _receipt(key, assignments[1], signer=KeyPair.generate())
    raw.send(receipts=pb.ReceiptBatch(receipts=[
        _receipt(key, assignments[0]), forged, _receipt(key, assignments[2]),
        _receipt(key, assignments[3])]))
    replies = [raw.recv(), raw.recv()]
    kinds = sorted(m.WhichOneof("body") for m in replies)
    assert kinds == ["acks", "refusal"]
    refusal = next(m.refusal for m in replies if m.WhichOneof("body") == "refusal")
    acks = next(m.acks for m in replies if m.WhichOneof("body") == "acks")
    by_job = {json.loads(a.envelope)["job_id"]: a for a in assignments}
    forged_job = json.loads(assignments[1].envelope)["job_id"]
    assert refusal.code == "bad_signature" and refusal.job_id == forged_job
    assert sorted(a.job_id for a in acks.acks) == sorted(set(by_job) - {forged_job})
    assert all(a.what == "receipt" for a in acks.acks)
    for job in jobs:
        assert job.refresh().state == ("settled" if job.id != forged_job else "matched")
    # The forged job's real receipt, sent alone as an older agent would: one Ack.
    raw.send(receipt=_receipt(key, assignments[1]))
    ack = raw.recv()
    assert ack.WhichOneof("body") == "ack" and ack.ack.job_id == forged_job
    assert client.jobs.get(forged_job).state == "settled"
    services = live_broker.services
    assert services.ledger.verify().ok and services.audit.verify().ok
    raw.close()
    client.close()
