"""The agent's per-job paths made cheaper keep their behaviour: the replay guard answers as
the sdk's does, frames survive any split over reads, the plugin host still sees a cancel
without a reader thread, and finished jobs still show up in an INFO summary line."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from plugins import builtin_plugin_dir
from provider_agent import agent as agent_mod
from provider_agent.agent import _DoneSummary
from provider_agent.errors import HostError
from provider_agent.host.main import Context, Inbox
from provider_agent.host.manager import PluginHost
from provider_agent.host.protocol import FrameReader, FrameWriter, ProtocolError, encode_frame
from sdk.protocol.envelope import EnvelopeError, ReplayGuard


# -- the replay guard ---------------------------------------------------------------------
class _ScanningGuard:
    """The obvious guard (every check forgets all expired nonces): the reference."""

    def __init__(self):
        self.seen = {}

    def check_and_add(self, nonce, expires_at_ms, now_ms):
        self.seen = {n: e for n, e in self.seen.items() if e >= now_ms}
        if nonce in self.seen:
            raise EnvelopeError("replayed_envelope", f"envelope nonce {nonce} was already used")
        self.seen[nonce] = expires_at_ms


def test_the_replay_guard_answers_exactly_as_the_scanning_one():
    rng = random.Random(5)
    ours, theirs = ReplayGuard(), _ScanningGuard()
    nonces = [f"n{i}" for i in range(40)]   # few nonces: many replays and re-uses
    now = 1_000
    for _ in range(5_000):
        now += rng.choice([0, 0, 1, 3, 10, 50])
        nonce, expires = rng.choice(nonces), now + rng.choice([-5, 0, 1, 20, 100, 400])
        answers = []
        for guard in (ours, theirs):
            try:
                guard.check_and_add(nonce, expires, now)
                answers.append("ok")
            except EnvelopeError as exc:
                answers.append((exc.code, str(exc)))
        assert answers[0] == answers[1]
        assert ours.seen == theirs.seen


def test_the_replay_guard_refuses_a_replay_until_it_expires():
    guard = ReplayGuard()
    guard.check_and_add("a", 2_000, 1_000)
    with pytest.raises(EnvelopeError) as exc:
        guard.check_and_add("a", 2_000, 1_999)
    assert exc.value.code == "replayed_envelope"
    guard.check_and_add("a", 3_000, 2_001)   # the first one expired: forgotten
    assert guard.seen == {"a": 3_000}


# -- frames ---------------------------------------------------------------------------------
@pytest.fixture
def pipe():
    r, w = os.pipe()
    rf, wf = os.fdopen(r, "rb"), os.fdopen(w, "wb")
    yield rf, wf
    for f in (rf, wf):
        try:
            f.close()
        except OSError:
            pass


def test_frames_written_together_and_apart_read_back_in_order(pipe):
    rf, wf = pipe
    writer, reader = FrameWriter(wf), FrameReader(rf)
    writer.send({"type": "progress", "step": 1})
    writer.send_many([({"type": "output", "index": 0}, b"\x00body"),
                      ({"type": "result", "count": 1}, b"")])
    assert reader.next(1) == ({"type": "progress", "step": 1}, b"")
    assert reader.next(1) == ({"type": "output", "index": 0}, b"\x00body")
    assert reader.next(1) == ({"type": "result", "count": 1}, b"")
    assert reader.next(0.01) is None            # nothing more: a timeout, not an error


def test_a_frame_split_across_reads_and_timeouts_is_put_together(pipe):
    rf, wf = pipe
    reader = FrameReader(rf)
    data = encode_frame({"type": "output", "job_id": "j"}, b"x" * 1000) * 2
    for cut in (1, 3, 5, 9, 30, 1020):   # inside each length and the header and body
        os.write(wf.fileno(), data[:cut])
        assert reader.next(0.01) is None
        os.write(wf.fileno(), data[cut:])
        assert reader.next(1) == ({"type": "output", "job_id": "j"}, b"x" * 1000)
        assert reader.next(1) == ({"type": "output", "job_id": "j"}, b"x" * 1000)


def test_a_frame_trickling_in_does_not_stretch_the_timeout(pipe):
    """A host dribbling a frame byte by byte must not keep the agent from its wall clock."""
    rf, wf = pipe
    data = encode_frame({"type": "output"}, b"x" * 100)
    stop = threading.Event()

    def trickle():
        for i in range(len(data)):
            if stop.wait(0.02):
                return
            os.write(wf.fileno(), data[i:i + 1])

    threading.Thread(target=trickle, daemon=True).start()
    t0 = time.monotonic()
    try:
        assert FrameReader(rf).next(0.2) is None
        assert time.monotonic() - t0 < 1.5  # (the whole frame takes about 2.5 s)
    finally:
        stop.set()


def test_a_write_the_stream_takes_in_part_is_finished():
    class Stingy:  # a raw stream that takes at most 7 bytes a call
        def __init__(self):
            self.got = bytearray()

        def write(self, data):
            self.got += bytes(data[:7])
            return min(7, len(data))

        def flush(self):
            pass

    frames = [({"type": "output", "index": 0}, b"\x00body" * 5), ({"type": "result"}, b"")]
    stream = Stingy()
    FrameWriter(stream).send_many(frames)
    assert bytes(stream.got) == b"".join(encode_frame(h, b) for h, b in frames)


def test_a_large_body_arrives_whole(pipe):
    rf, wf = pipe
    body = os.urandom(3 * 1024 * 1024 + 7)       # far more than the pipe holds
    sender = threading.Thread(target=FrameWriter(wf).send, args=({"type": "output"}, body))
    sender.start()
    assert FrameReader(rf).next(10) == ({"type": "output"}, body)
    sender.join()


def test_the_frame_format_is_unchanged(pipe):
    rf, wf = pipe
    # u32 header length | compact JSON header (ASCII) | u32 body length | body
    frame = b'\x00\x00\x00\x29{"type":"run","inputs":{"text":"\\u00e9"}}\x00\x00\x00\x02ck'
    assert encode_frame({"type": "run", "inputs": {"text": "é"}}, b"ck") == frame
    os.write(wf.fileno(), frame)
    assert FrameReader(rf).next(1) == ({"type": "run", "inputs": {"text": "é"}}, b"ck")


def test_eof_and_broken_frames_are_errors(pipe):
    rf, wf = pipe
    os.write(wf.fileno(), encode_frame({"type": "x"})[:6])
    wf.close()
    with pytest.raises(EOFError):
        FrameReader(rf).next(1)
    r, w = os.pipe()
    with os.fdopen(r, "rb") as rf2, os.fdopen(w, "wb") as wf2:
        os.write(wf2.fileno(), (2**31).to_bytes(4, "big"))
        with pytest.raises(ProtocolError):
            FrameReader(rf2).next(1)
    r, w = os.pipe()
    with os.fdopen(r, "rb") as rf3, os.fdopen(w, "wb") as wf3:
        FrameWriter(wf3).send({"no": "type"})
        with pytest.raises(ProtocolError):
            FrameReader(rf3).next(1)


# -- the plugin host's inbox -----------------------------------------------------------------
def test_the_inbox_applies_cancels_while_a_job_runs_and_keeps_the_rest_for_later(pipe):
    rf, wf = pipe
    writer, inbox = FrameWriter(wf), Inbox(FrameReader(rf))
    writer.send({"type": "cancel", "job_id": "nobody"})       # no job runs: dropped
    writer.send({"type": "run", "job_id": "j1", "inputs": {}}, b"checkpoint")
    assert inbox.next() == {"type": "run", "job_id": "j1", "inputs": {},
                            "_resume_from": b"checkpoint"}
    ctx = Context("j1", writer, None, inbox=inbox)
    inbox.current["j1"] = ctx
    assert not ctx.cancelled()
    writer.send({"type": "cancel", "job_id": "other"})
    writer.send({"type": "shutdown"})
    writer.send({"type": "cancel", "job_id": "j1"})
    ctx._next_poll = 0.0
    assert not ctx.cancelled()       # the shutdown closes the inbox: read no further
    inbox.current.pop("j1")
    assert inbox.next() == {"type": "shutdown"}

    r, w = os.pipe()
    with os.fdopen(r, "rb") as rf2, os.fdopen(w, "wb") as wf2:
        inbox = Inbox(FrameReader(rf2))
        ctx = Context("j2", None, None, inbox=inbox)
        inbox.current["j2"] = ctx
        FrameWriter(wf2).send({"type": "cancel", "job_id": "j2"})
        from plugins.api import Cancelled

        with pytest.raises(Cancelled):
            ctx.check_cancelled()
        wf2.close()
        assert inbox.next() == {"type": "shutdown"}      # EOF: the agent is gone


def test_a_cancel_reaches_a_running_plugin_and_the_host_serves_on():
    host = PluginHost(builtin_plugin_dir("echo"), None, device="cpu")
    host.start()
    try:
        cancelled = threading.Event()
        threading.Timer(0.3, cancelled.set).start()
        t0 = time.monotonic()
        with pytest.raises(HostError) as exc:
            host.run("long", {"text": "x", "sleep_ms": 20000, "steps": 100}, wall_clock_s=60,
                     cancelled=cancelled)
        assert exc.value.code == "cancelled" and time.monotonic() - t0 < 5
        result = host.run("next", {"text": "after"}, wall_clock_s=10)
        assert b'"after"' in result.outputs[0].data and host.alive()
    finally:
        host.stop()


# -- the per-job log line ------------------------------------------------------------------
def test_jobs_are_summed_up_at_info_at_most_once_a_period(monkeypatch):
    monkeypatch.setattr(agent_mod, "SUMMARY_EVERY_S", 3600.0)
    summary = _DoneSummary()
    first = summary.add(12)
    assert first is not None and first.startswith("1 job(s) done") and "1 since start" in first
    assert [summary.add(5) for _ in range(3)] == [None, None, None]
    summary._next = 0.0   # the period is over
    line = summary.add(7)
    assert line.startswith("4 job(s) done") and "mean run 6 ms" in line
    assert "5 since start" in line
