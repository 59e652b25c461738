"""``AsyncClient``: the asyncio twin of :class:`sdk.client.Client`, with the same names.

>>> async with AsyncClient() as client:
...     result = await client.generate("sd15", prompt="a lighthouse", seed=7)
...     job = await client.jobs.create("llama", prompt="Once upon a time")
...     async for event in job.events(): ...
...     async for token in client.stream("llama", prompt="Hi"): ...

Every method runs the same plan as the sync client's (:mod:`sdk._core`: the requests,
Idempotency-Keys, retries with ``Retry-After``, errors and waits), sent with httpx on the
running event loop instead of urllib3; many calls in one loop share one connection pool
(``max_connections``, default 256). A Result comes with its output bytes, so its
``text``, ``images`` and ``output_bytes()`` need no ``await``.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import httpx
import urllib3

from sdk import _core as core
from sdk._core import Call, Failed, Sleep
from sdk._http import Response
from sdk import tls
from sdk.client import Job, _ClientBase, _Follow, _tls_refusal
from sdk.errors import APIConnectionError
from sdk.models import Event


class AsyncClient(_ClientBase):
    prefetch = True  # a Result holds its bytes: no I/O hides behind its properties

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float = 30.0, max_retries: int = 3, max_connections: int = 256,
                 ca_file: str | None = None, insecure: bool | None = None):
        super().__init__(base_url, api_key, timeout=timeout, max_retries=max_retries,
                         ca_file=ca_file, insecure=insecure)
        self._http = httpx.AsyncClient(
            base_url=self._cfg.url_root, follow_redirects=False, trust_env=False,
            verify=(tls.client_context(self._ca_file) if self.base_url.startswith("https")
                    else True),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=min(64, max_connections)))
        self._storage: httpx.AsyncClient | None = None  # for presigned blob-store URLs

    async def _run(self, plan):
        """Drive ``plan``: send its calls with httpx, sleep its sleeps on the loop."""
        try:
            step = next(plan)
            while True:
                if isinstance(step, Sleep):
                    await asyncio.sleep(max(0.0, step.seconds))
                    outcome = None
                else:
                    outcome = await self._send(step)
                step = plan.send(outcome)
        except StopIteration as stop:
            return stop.value

    async def _send(self, call: Call) -> Response | Failed:
        if call.url is not None:  # a presigned blob-store URL: no API key goes there
            if self._storage is None:  # the system's trust: the store is not the broker
                self._storage = httpx.AsyncClient(follow_redirects=False, trust_env=False)
            try:
                resp = await self._storage.request(call.method, call.url, headers=call.headers,
                                                   timeout=httpx.Timeout(call.timeout))
            except httpx.TransportError as exc:
                return Failed(str(exc) or type(exc).__name__, exc)
            return Response(resp.status_code, _headers(resp.headers), resp.content)
        body = call.body
        if hasattr(body, "read"):  # a file: read whole (uploads of big files: use Client)
            body.seek(call.rewind or 0)
            body = body.read()
        try:
            resp = await self._http.request(call.method, call.target, content=body,
                                            headers=call.headers,
                                            timeout=httpx.Timeout(call.timeout))
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.ConnectError) and isinstance(
                    exc.__context__ or exc.__cause__, ssl.SSLError):  # retrying will not help
                raise APIConnectionError(_tls_refusal(self.base_url, exc.__context__
                                                      or exc.__cause__)) from exc
            return Failed(str(exc) or type(exc).__name__, exc)
        return Response(resp.status_code, _headers(resp.headers), resp.content)

    async def _events(self, job: Job, after: int,
                      budget: core.Timeout) -> AsyncIterator[Event]:
        """Server-sent events until the job ends, reconnecting and raising the broker's
        ``error`` event as the sync client does."""
        follow = _Follow(self, job.id, after, budget)
        while not follow.over:
            try:
                async with self._http.stream(
                        "GET", follow.target(), headers=follow.headers(),
                        timeout=httpx.Timeout(30.0, read=follow.read_timeout_s())) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise core.error_from(Response(resp.status_code,
                                                       _headers(resp.headers), resp.content))
                    parser = core.SSEParser(follow.last)
                    async for line in resp.aiter_lines():
                        got = parser.feed(line)
                        if got is not None:
                            event = follow.event(got)
                            yield event
                            if event.kind in core.END_EVENTS:
                                return
                        if follow.over:
                            return
                    return
            except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                error = exc
            except httpx.TransportError as exc:
                raise APIConnectionError(f"cannot reach the broker at {self.base_url}: "
                                         f"{exc}") from exc
            if follow.over:
                return
            pause = follow.pause_s(follow.dropped(str(error) or type(error).__name__, error))
            if pause:
                await asyncio.sleep(pause)

    async def stream(self, plugin: str, *, timeout: "float | core.Timeout | None" = 600.0,
                     version: str | None = None, **inputs) -> AsyncIterator[str]:
        """Run one job and yield its text as it is made (``async for token in
        client.stream("llama", prompt=...)``); see :meth:`Client.stream`."""
        budget = core.Timeout.of(timeout)
        job = await self.jobs.create(plugin, version=version, **inputs)
        text = core.TokenText()
        async for ev in job.events(timeout=budget):
            piece = text.feed(ev.kind, ev.data)
            if piece:
                yield piece
        await job.wait(timeout=budget)  # raises JobFailedError unless the job settled

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._storage is not None:
            await self._storage.aclose()

    close = aclose

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def _headers(headers: httpx.Headers) -> urllib3.HTTPHeaderDict:
    out = urllib3.HTTPHeaderDict()
    for k, v in headers.multi_items():
        out.add(k, v)
    return out


__all__ = ["AsyncClient"]
