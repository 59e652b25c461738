"""Length-prefixed frames between the agent and a plugin host, over a pipe.

A frame is ``u32 header length | header (JSON object) | u32 body length | body bytes``.
Agent → host: ``init``, ``run`` (``checkpoint_every``; body = a checkpoint to resume from,
or empty), ``cancel``, ``shutdown``.
Host → agent: ``ready``, ``progress``, ``stream``, ``checkpoint`` (``step``; body = the
checkpoint), ``output`` (body = the bytes), ``result``, ``failed``.
"""
from __future__ import annotations

import json
import struct
import threading
from typing import BinaryIO

MAX_HEADER = 16 * 1024 * 1024
MAX_BODY = 1024 * 1024 * 1024
_LEN = struct.Struct(">I")


class ProtocolError(RuntimeError):
    pass


class FrameWriter:
    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, header: dict, body: bytes = b"") -> None:
        h = json.dumps(header, separators=(",", ":")).encode()
        with self.lock:
            self.stream.write(_LEN.pack(len(h)) + h + _LEN.pack(len(body)) + body)
            self.stream.flush()


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    chunks = []
    while n:
        chunk = stream.read(n)
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(stream: BinaryIO) -> tuple[dict, bytes]:
    (hlen,) = _LEN.unpack(_read_exact(stream, 4))
    if hlen > MAX_HEADER:
        raise ProtocolError(f"header of {hlen} bytes is too large")
    header = json.loads(_read_exact(stream, hlen))
    (blen,) = _LEN.unpack(_read_exact(stream, 4))
    if blen > MAX_BODY:
        raise ProtocolError(f"body of {blen} bytes is too large")
    body = _read_exact(stream, blen) if blen else b""
    if not isinstance(header, dict) or "type" not in header:
        raise ProtocolError("frame header must be an object with a type")
    return header, body
