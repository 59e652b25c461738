"""Length-prefixed frames between the agent and a plugin host, over a pipe.

A frame is ``u32 header length | header (JSON object) | u32 body length | body bytes``.
Agent → host: ``init``, ``run`` (``checkpoint_every``; body = a checkpoint to resume from,
or empty), ``cancel``, ``shutdown``.
Host → agent: ``ready``, ``progress``, ``stream``, ``checkpoint`` (``step``; body = the
checkpoint), ``output`` (body = the bytes), ``result``, ``failed``.

Both ends read through ``FrameReader`` (one ``read`` takes whatever is waiting, often
several frames, instead of four reads per frame) and write whole frames (or several at
once, ``FrameWriter.send_many``) in one ``write``.
"""
from __future__ import annotations

import json
import os
import select
import struct
import threading
import time
from typing import BinaryIO

MAX_HEADER = 16 * 1024 * 1024
MAX_BODY = 1024 * 1024 * 1024
_LEN = struct.Struct(">I")
# json.dumps(header, separators=(",", ":")) builds an encoder per call; this is the same one.
_encode = json.JSONEncoder(separators=(",", ":")).encode


class ProtocolError(RuntimeError):
    pass


class FrameWriter:
    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, header: dict, body: bytes = b"") -> None:
        self._write(encode_frame(header, body))

    def send_many(self, frames: list[tuple[dict, bytes]]) -> None:
        """Several frames in one write (e.g. a job's outputs and its result); each body is
        copied once, into the joined bytes."""
        parts: list[bytes] = []
        for h, b in frames:
            parts += _frame_parts(h, b)
        self._write(b"".join(parts))

    def _write(self, data: bytes) -> None:
        with self.lock:
            written = self.stream.write(data)
            # A raw (unbuffered) stream may take part of it (e.g. interrupted by a signal):
            # the rest goes from a view, without copying it.
            if written is not None and written < len(data):
                view = memoryview(data)
                while written is not None and written < len(view):
                    view = view[written:]
                    written = self.stream.write(view)
            self.stream.flush()


def encode_frame(header: dict, body: bytes = b"") -> bytes:
    return b"".join(_frame_parts(header, body))


def _frame_parts(header: dict, body: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    h = _encode(header).encode()
    return _LEN.pack(len(h)), h, _LEN.pack(len(body)), body


class FrameReader:
    """Reads frames from a pipe through its own buffer.

    ``next(timeout_s)`` returns the next whole frame, or None when none arrived within
    ``timeout_s`` (a frame that came in part is kept for the next call); ``None`` waits
    as long as it takes. EOF raises EOFError, a frame that breaks the format ProtocolError.
    One ``read`` takes whatever the other end has written, so frames written together cost
    one system call, and no helper thread is needed to wait with a timeout.
    """

    # Under glibc's mmap threshold: os.read allocates this much for every call.
    CHUNK = 64 * 1024

    def __init__(self, stream: BinaryIO):
        self.stream = stream  # held so that its descriptor stays open while it is read
        self.fd = stream.fileno()
        self._buf = bytearray()
        self._poll: select.poll | None = None

    def next(self, timeout_s: float | None = None) -> tuple[dict, bytes] | None:
        deadline = None
        wait_s = timeout_s
        while True:
            frame = self._take()
            if frame is not None:
                return frame
            if timeout_s is not None:
                if deadline is None:
                    deadline = time.monotonic() + timeout_s
                else:  # a frame arriving in pieces must not stretch the wait
                    wait_s = deadline - time.monotonic()
                    if wait_s <= 0:
                        return None
                if self._poll is None:
                    self._poll = select.poll()
                    self._poll.register(self.fd, select.POLLIN)
                # poll() takes milliseconds; round up so a short wait is not a busy loop.
                if not self._poll.poll(max(0, int(wait_s * 1000 + 0.999))):
                    return None
            chunk = os.read(self.fd, self.CHUNK)
            if not chunk:
                raise EOFError("pipe closed")
            self._buf += chunk

    def _take(self) -> tuple[dict, bytes] | None:
        buf = self._buf
        have = len(buf)
        if have < 4:
            return None
        (hlen,) = _LEN.unpack_from(buf, 0)
        if hlen > MAX_HEADER:
            raise ProtocolError(f"header of {hlen} bytes is too large")
        if have < 8 + hlen:
            return None
        (blen,) = _LEN.unpack_from(buf, 4 + hlen)
        if blen > MAX_BODY:
            raise ProtocolError(f"body of {blen} bytes is too large")
        end = 8 + hlen + blen
        if have < end:
            return None
        header = json.loads(buf[4:4 + hlen])
        if blen:
            with memoryview(buf) as view:  # one copy of the body, not two
                body = bytes(view[8 + hlen:end])
        else:
            body = b""
        del buf[:end]  # cheap: a bytearray drops its head without moving the rest
        if not isinstance(header, dict) or "type" not in header:
            raise ProtocolError("frame header must be an object with a type")
        return header, body

