"""The SDK's HTTP plumbing on urllib3: a small Response, query encoding and SSE lines.

urllib3 costs about a third of httpx's client CPU per keep-alive request, which matters
when many client threads share a machine with the broker (bench/dispatch.py).
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator, Mapping
from urllib.parse import urlencode

import urllib3

TransportError = urllib3.exceptions.HTTPError  # every urllib3 failure to talk to a server
_CHARSET = re.compile(r"charset=\"?([\w.:-]+)", re.I)
_NOISE = re.compile(r"^(?:HTTPS?ConnectionPool\([^)]*\): )?"
                    r"(?:<[^>]*>: |HTTPS?Connection\([^)]*\): )?")


class Response:
    """A fully read answer: ``status_code``, ``headers`` (case-insensitive), ``content``
    (bytes), ``text`` and ``json()`` (raises ValueError when the body is not JSON)."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: Mapping[str, str], content: bytes):
        self.status_code = status_code
        self.headers = headers if isinstance(headers, urllib3.HTTPHeaderDict) \
            else urllib3.HTTPHeaderDict(headers)
        self.content = content

    @property
    def encoding(self) -> str:
        m = _CHARSET.search(self.headers.get("Content-Type", ""))
        return m.group(1) if m else "utf-8"

    @property
    def text(self) -> str:
        try:
            return self.content.decode(self.encoding, errors="replace")
        except LookupError:  # an unknown charset
            return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)

    def __repr__(self) -> str:
        return f"<Response [{self.status_code}]>"


def _param(value: Any) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    return "" if value is None else str(value)


def with_query(path: str, params: Mapping[str, Any] | None) -> str:
    """``path`` with ``params`` URL-encoded into its query string (lists repeat the key)."""
    if not params:
        return path
    pairs = [(k, _param(x)) for k, v in params.items()
             for x in (v if isinstance(v, (list, tuple)) else (v,))]
    return f"{path}{'&' if '?' in path else '?'}{urlencode(pairs)}"


def describe(exc: BaseException) -> str:
    """urllib3's message without the pool and connection object reprs."""
    return _NOISE.sub("", str(exc)) or type(exc).__name__


def iter_lines(resp: urllib3.BaseHTTPResponse) -> Iterator[str]:
    """The lines of a streamed body as they arrive (``\\n`` or ``\\r\\n`` ended)."""
    if resp.chunked and resp.supports_chunked_reads():
        chunks: Iterator[bytes] = resp.read_chunked(decode_content=True)
    elif hasattr(resp, "read1"):  # urllib3 >= 2.3: whatever has arrived, without waiting
        chunks = iter(lambda: resp.read1(65536), b"")
    else:
        chunks = resp.stream(1024)
    buf = b""
    for chunk in chunks:
        buf += chunk
        if b"\n" not in chunk:
            continue
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield (line[:-1] if line.endswith(b"\r") else line).decode("utf-8", "replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")
