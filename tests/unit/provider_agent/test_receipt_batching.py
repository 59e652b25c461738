"""The agent sends the receipts queued together as one ReceiptBatch (issue #28), keeping the
order of everything else on the stream, and never waits for more receipts to come."""
import queue

from provider_agent.agent import (INLINE_OUTPUTS_BYTES, RECEIPTS_BATCH_BYTES_MAX, RECEIPTS_MAX,
                                  _END, batch_receipts)
from sdk.protocol import agent_pb2 as pb


def _receipt(i):
    return pb.AgentMessage(receipt=pb.Receipt(receipt=b'{"n":%d}' % i, signature=f"s{i}"))


def test_receipts_queued_together_go_as_one_batch_and_the_next_message_follows():
    q = queue.SimpleQueue()
    for i in (1, 2):
        q.put(_receipt(i))
    beat = pb.AgentMessage(heartbeat=pb.Heartbeat())
    q.put(beat)
    q.put(_receipt(3))
    msg, after = batch_receipts(_receipt(0), q)
    assert msg.WhichOneof("body") == "receipts"
    assert [r.signature for r in msg.receipts.receipts] == ["s0", "s1", "s2"]
    assert after is beat  # what stopped the batch goes next, before the later receipt
    assert q.get_nowait().receipt.signature == "s3"


def test_a_receipt_alone_goes_as_it_is_and_the_queue_end_is_kept():
    q = queue.SimpleQueue()
    first = _receipt(0)
    msg, after = batch_receipts(first, q)
    assert msg is first and after is None
    q.put(_receipt(1))
    q.put(None)
    msg, after = batch_receipts(first, q)
    assert len(msg.receipts.receipts) == 2 and after is _END


def test_a_batch_holds_at_most_receipts_max():
    q = queue.SimpleQueue()
    for i in range(RECEIPTS_MAX + 5):
        q.put(_receipt(i + 1))
    msg, after = batch_receipts(_receipt(0), q)
    assert len(msg.receipts.receipts) == RECEIPTS_MAX and after is None
    assert q.get_nowait().receipt.signature == f"s{RECEIPTS_MAX}"


def _big_receipt(i, size):
    return pb.AgentMessage(receipt=pb.Receipt(receipt=b"x" * size, signature=f"s{i}"))


def test_a_batch_stops_before_its_bytes_pass_the_cap_and_the_receipt_that_stopped_it_goes_next():
    # 1 MiB of inline outputs each: RECEIPTS_MAX of them would pass the gRPC message limit
    q = queue.SimpleQueue()
    for i in range(1, 30):
        q.put(_big_receipt(i, INLINE_OUTPUTS_BYTES))
    msg, after = batch_receipts(_big_receipt(0, INLINE_OUTPUTS_BYTES), q)
    sent = msg.receipts.receipts
    assert 1 < len(sent) < RECEIPTS_MAX
    assert msg.ByteSize() <= RECEIPTS_BATCH_BYTES_MAX + 64 * len(sent)  # per-field framing
    assert after.receipt.signature == f"s{len(sent)}"  # not lost: it goes next, in order
    assert q.get_nowait().receipt.signature == f"s{len(sent) + 1}"


def test_a_receipt_larger_than_the_cap_goes_alone():
    q = queue.SimpleQueue()
    big = _big_receipt(1, RECEIPTS_BATCH_BYTES_MAX + 1)
    q.put(big)
    q.put(_receipt(2))
    msg, after = batch_receipts(_receipt(0), q)
    assert msg.WhichOneof("body") == "receipt" and msg.receipt.signature == "s0"
    assert after is big
    q2 = queue.SimpleQueue()
    q2.put(_receipt(3))
    msg, after = batch_receipts(big, q2)
    assert msg is big and after.receipt.signature == "s3"
