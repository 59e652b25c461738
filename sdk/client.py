"""The Python client: ``Client(...).generate("sd15", prompt=...)``, and its asyncio twin
``AsyncClient`` (:mod:`sdk.aio`) with the same names.

The key comes from the argument or ``SPARECYCLES_API_KEY``; the broker address from the
argument or ``SPARECYCLES_URL`` (default http://127.0.0.1:8080). An https:// broker's
certificate is verified against ``ca_file``, else ``SPARECYCLES_CA_BUNDLE``, else the
system's trust store; http:// is allowed only to loopback, or with ``insecure=True``
(``SPARECYCLES_INSECURE=1``), logged as a warning (sdk/tls.py). Every POST carries an
Idempotency-Key that retries reuse, so a retried submit never makes a second job.

Every method is written once, as a plan of :mod:`sdk._core` (what to send, what to do with
the answer) that the client's ``_run`` drives: ``Client`` sends with urllib3 and returns
the value; ``AsyncClient`` sends with httpx and returns an awaitable. The job objects
(:class:`Jobs`, :class:`Job`, :class:`Batch`, :class:`Result`) are the same classes for
both: ``job.wait()`` returns a Result from a ``Client`` and an awaitable of one from an
``AsyncClient``.
"""
from __future__ import annotations

import hashlib
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

import urllib3

from sdk import _core as core
from sdk._core import DEFAULT_URL, TERMINAL, Call, Failed, Sleep  # noqa: F401 (re-exported)
from sdk._http import Response, TransportError, describe, iter_lines
from sdk import tls
from sdk.errors import (APIConnectionError, ConfigurationError, InvalidInputError,
                        JobFailedError, JobTimeoutError, NotFoundError)
from sdk.models import Account, Event, Quote, Transaction
from sdk.protocol.schema import InputError, InputSchema

POOL_SIZE = 32  # keep-alive connections kept per broker (more threads may open more)
EVENT_READ_TIMEOUT_S = 60.0  # a stream silent this long is reopened (the broker pings at 15)


def _tls_refusal(url: str, exc: BaseException) -> str:
    """A refused TLS handshake in words that say which check failed."""
    text = describe(exc)
    if "expired" in text:
        why = "its certificate has expired (the broker's operator must renew it)"
    elif "mismatch" in text or "not valid for" in text:
        why = "its certificate is not for this host name (connect by a name it lists)"
    elif "issuer" in text or "self-signed" in text or "self signed" in text:
        why = (f"its certificate is not signed by a CA this client trusts (give the broker's "
               f"CA with ca_file= or {tls.CA_BUNDLE_ENV})")
    elif "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
        why = "it does not speak TLS there (use http:// for a plaintext loopback broker)"
    else:
        why = "the TLS handshake failed"
    return f"refused the broker at {url}: {why}: {text}"


def _plaintext_hint(url: str, exc: BaseException) -> str:
    if url.startswith("http://") and ("RemoteDisconnected" in repr(exc)
                                      or "without response" in str(exc)):
        return " (if the broker serves TLS, use https:// and trust its CA)"
    return ""

    @property
    def preview(self) -> bytes | None:
        """A "preview" event's thumbnail of the output so far (WebP bytes), else None."""
        url = self.data.get("preview") if self.kind == "preview" else None
        if not isinstance(url, str) or ";base64," not in url:
            return None
        import base64

        return base64.b64decode(url.split(";base64,", 1)[1])


class _ClientBase:
    """What ``Client`` and ``AsyncClient`` share: every public method builds a plan and
    returns ``self._run(plan)``. A subclass gives ``_run`` (and ``_events`` for the
    event stream); ``prefetch`` says whether results fetch their output bytes at once
    (the async client: a Result's ``text`` and ``images`` then need no I/O)."""

    prefetch = False
    _backoff = staticmethod(core.backoff_s)  # attempt -> seconds (a seam for tests)

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float = 30.0, max_retries: int = 3, ca_file: str | None = None,
                 insecure: bool | None = None):
        self._cfg = core.Config.build(base_url, api_key, timeout, max_retries)
        self._cfg.backoff = self._backoff
        self.base_url, self.api_key = self._cfg.base_url, self._cfg.api_key
        self.max_retries = max_retries
        try:
            # https: the broker's certificate verified against ca_file, else
            # $SPARECYCLES_CA_BUNDLE, else the system's trust; http: loopback only, unless
            # insecure (sdk/tls.py).
            tls.check_url(self.base_url, tls.env_insecure() if insecure is None else insecure)
            self._ca_file = tls.ca_bundle(ca_file) if self.base_url.startswith("https") else None
        except tls.TLSConfigError as exc:
            raise ConfigurationError(str(exc)) from None
        self._schemas: dict[str, InputSchema] = {}
        self.jobs = Jobs(self)

    def _run(self, plan):  # pragma: no cover - the subclasses' business
        raise NotImplementedError

    def _events(self, job: "Job", after: int):  # pragma: no cover
        raise NotImplementedError

    def _json(self, method: str, path: str, *, key: str | None = None, wrap=None, **kw):
        """``request``'s JSON body (its ``key`` member; passed through ``wrap``)."""
        def plan():
            body = (yield from core.request(self._cfg, method, path, **kw)).json()
            body = body[key] if key else body
            return wrap(body) if wrap else body
        return self._run(plan())

    # ---- plumbing ----------------------------------------------------------------------
    def request(self, method: str, path: str, *, json_body: Any = None,
                params: dict | None = None, idempotency_key: str | None = None,
                timeout: float | None = None, content: bytes | BinaryIO | None = None,
                headers: dict | None = None):
        """One API call (a :class:`~sdk._http.Response`), retried on connection errors
        and 429/502/503/504 with the same Idempotency-Key, after the answer's
        ``Retry-After`` when it gives one; an error answer raises the matching
        ``sdk.errors`` class (429 after the retries: RateLimitError).

        ``path`` is a path under the broker's URL (``/v1/...``); an absolute URL must be on
        the broker's own origin (the API key goes to no other host). ``content`` is bytes
        or a seekable binary file, streamed from its current position (and rewound to it
        for each retry)."""
        return self._run(core.request(self._cfg, method, path, json_body=json_body,
                                      params=params, idempotency_key=idempotency_key,
                                      timeout=timeout, content=content, headers=headers))

    # ---- API ---------------------------------------------------------------------------
    def plugins(self, q: str | None = None, *, publisher: str | None = None,
                output: str | None = None) -> list[dict]:
        """Plugins jobs can run (built-in and published); ``q`` searches name and
        description, ``publisher`` and ``output`` filter."""
        params = {k: v for k, v in (("q", q), ("publisher", publisher), ("output", output)) if v}
        return self._json("GET", "/v1/plugins", params=params or None, key="data")

    def plugin_versions(self, name: str) -> list[dict]:
        return self._json("GET", f"/v1/plugins/{name}/versions", key="data")

    def adapters(self, q: str | None = None, *, base: str | None = None,
                 publisher: str | None = None) -> list[dict]:
        """Published adapters (latest version of each); ``base`` keeps one plugin's."""
        params = {k: v for k, v in (("q", q), ("base", base), ("publisher", publisher)) if v}
        return self._json("GET", "/v1/adapters", params=params or None, key="data")

    def adapter(self, name: str, version: str = "latest") -> dict:
        return self._json("GET", f"/v1/adapters/{name}/{version}")

    def _schema(self, plugin: str):
        if plugin not in self._schemas:
            body = yield from core.get_json(self._cfg, f"/v1/plugins/{plugin}")
            self._schemas[plugin] = InputSchema.from_json_schema(body["input_schema"])
        return self._schemas[plugin]

    def schema(self, plugin: str) -> InputSchema:
        return self._run(self._schema(plugin))

    def _validate(self, plugin: str, inputs: dict):
        schema = yield from self._schema(plugin)
        try:
            return schema.validate(inputs)
        except InputError as exc:
            field = f"inputs.{exc.field}" if exc.field else "inputs"
            raise InvalidInputError(422, "invalid_input", str(exc), field=field) from None

    def validate(self, plugin: str, inputs: dict) -> dict:
        """Check ``inputs`` against the plugin's schema with the broker's own messages."""
        return self._run(self._validate(plugin, inputs))

    def generate(self, plugin: str, *, timeout: "float | core.Timeout | None" = 600.0,
                 version: str | None = None, n: int = 1, priority: str | None = None,
                 max_price_micro: int | None = None, deadline_s: float | None = None,
                 verify: str | None = None, output_format: str | None = None,
                 output_quality: int | None = None, cache: bool | None = None,
                 **inputs) -> "Result":
        """Run one job and wait until its outputs are ready. ``n`` > 1 splits the request
        into n sibling jobs on different providers (one output each; all outputs in
        order in the Result). ``priority`` (economy | standard | fast), ``max_price_micro``
        (whole request) and ``deadline_s`` are the market terms; a request no provider can
        meet raises at once with the best achievable price and time. ``verify="always"``
        has every output re-run on a second provider (you pay for both runs);
        ``Result.verification`` then moves from ``checking`` to ``verified``.
        ``output_format`` (png | webp | jpeg, with ``output_quality`` 1-100) encodes image
        outputs so; ``cache=True`` lets the broker answer from a verified job with the same
        inputs (seed included) at the plugin's cache price, without running it."""
        terms = {k: v for k, v in (("n", n if n > 1 else None), ("priority", priority),
                                   ("max_price_micro", max_price_micro),
                                   ("deadline_s", deadline_s), ("verify", verify),
                                   ("output_format", output_format),
                                   ("output_quality", output_quality), ("cache", cache))
                 if v is not None}
        return self._run(self._generate(plugin, version, terms, inputs, timeout))

    def _generate(self, plugin, version, terms, inputs, timeout):
        # Submit and wait in one request (``Prefer: wait``); a broker that answers before
        # the job (or every sibling) ends leaves the rest to the wait.
        budget = core.Timeout.of(timeout)  # counted from the submit
        left = budget.left()  # a Timeout handed in may be partly spent already
        held = 30.0 if left is None else max(0.0, min(left, 30.0))
        yield from self._validate(plugin, inputs)
        data = yield from core.submit(self._cfg, plugin, version, None, terms, inputs, held)
        target = Batch(self, data) if terms.get("n", 1) > 1 else Job(self, data)
        return (yield from target._wait(budget))

    def submit_many(self, jobs: Iterable[dict], *, idempotency_key: str | None = None,
                    validate: bool = True,
                    wait: float | None = None) -> "list[Job | Batch]":
        """Submit independent jobs in one request (``POST /v1/jobs/bulk``; at most 256 jobs,
        a split item counting its ``n``). Each of ``jobs`` is a job request as the broker
        takes it: ``{"plugin": "echo", "inputs": {"text": "hi"}}``, with any of
        ``version``, ``priority``, ``max_price_micro``, ``deadline_s``, ``n``, ``verify``,
        ``output_format``, ``output_quality``, ``cache``. All are created, with their holds,
        or none: an error names the item (``field`` ``jobs[i]...``; inputs are checked here
        first, raising InvalidInputError), a balance short for all of them is an
        InsufficientCreditsError. Returns a :class:`Job` per item (a :class:`Batch` for
        ``n`` > 1), in order. ``idempotency_key`` names the whole list (a retry with it
        answers the same jobs); ``wait`` as for :meth:`Jobs.create`."""
        return self._run(self._submit_many(list(jobs), idempotency_key, validate, wait))

    def _submit_many(self, jobs: list, idempotency_key, validate, wait):
        if validate:
            for i, item in enumerate(jobs):
                if not isinstance(item, dict) or not isinstance(item.get("plugin"), str):
                    continue  # the broker says what is wrong with it, naming the item
                try:
                    yield from self._validate(item["plugin"], item.get("inputs", {}))
                except InvalidInputError as exc:
                    raise InvalidInputError(exc.status, exc.code, f"jobs[{i}]: {exc.detail}",
                                            field=f"jobs[{i}].{exc.field}") from None
        data = yield from core.submit_many(self._cfg, jobs, idempotency_key, wait)
        return [Batch(self, d) if d.get("object") == "batch" else Job(self, d) for d in data]

    def generate_many(self, jobs: Iterable[dict], *,
                      timeout: "float | core.Timeout | None" = 600.0) -> "list[Result]":
        """Run independent jobs submitted in one request (see :meth:`submit_many`) and wait
        until all are ready: a :class:`Result` per item, in order (a split item's holds all
        its outputs). ``timeout`` spans all of them; when it runs out, what still runs is
        cancelled and JobTimeoutError raised. The first item that did not settle raises
        JobFailedError (the others go on: to handle each failure, ``submit_many`` and wait
        on each)."""
        return self._run(self._generate_many(list(jobs), timeout))

    def _generate_many(self, jobs: list, timeout):
        budget = core.Timeout.of(timeout)  # counted from the submit
        left = budget.left()
        held = 30.0 if left is None else max(0.0, min(left, 30.0))
        targets = yield from self._submit_many(jobs, None, True, held)
        results = []
        for i, target in enumerate(targets):
            try:
                results.append((yield from target._wait(budget)))
            except JobTimeoutError:
                rest = [d for t in targets[i + 1:]
                        for d in (t.data["jobs"] if isinstance(t, Batch) else [t.data])]
                yield from core.cancel_quietly(self._cfg, rest)
                raise
        return results

    def quote(self, plugin: str, *, version: str | None = None, **inputs) -> Quote:
        """What a job would cost, without running it (:class:`~sdk.models.Quote`:
        ``min_micro``, ``expected_micro`` and ``max_micro``, the hold placed at submit, in
        micro-credits; 1 credit = 1,000,000)."""
        body: dict[str, Any] = {"plugin": plugin, "inputs": inputs}
        if version:
            body["version"] = version
        return self._json("POST", "/v1/quotes", json_body=body, wrap=Quote.from_json)

    def account(self) -> Account:
        """Balances in micro-credits (available, held, vesting, paid out) and ``funding``
        (``"stripe"``, or ``"dev"`` where an admin grants credits): an
        :class:`~sdk.models.Account`."""
        return self._json("GET", "/v1/account", wrap=Account.from_json)

    def transactions(self, limit: int = 100) -> list[Transaction]:
        return self._json("GET", "/v1/account/transactions", params={"limit": limit},
                          key="data", wrap=lambda rows: [Transaction.from_json(r)
                                                         for r in rows])

    def stake(self, amount_micro: int) -> dict:
        """Providers: put ``amount_micro`` of the available balance at stake (plugins may
        require a minimum stake; a provider outvoted by verification loses part of it)."""
        return self._json("POST", "/v1/account/stake", json_body={"amount_micro": amount_micro},
                          idempotency_key=str(uuid.uuid4()))

    def unstake(self, amount_micro: int) -> dict:
        """Providers: take ``amount_micro`` back from stake to the available balance."""
        return self._json("POST", "/v1/account/unstake",
                          json_body={"amount_micro": amount_micro},
                          idempotency_key=str(uuid.uuid4()))

    def buy_credits(self, credits: int) -> dict:
        """A Stripe Checkout session for ``credits``; open its ``url`` to pay."""
        return self._json("POST", "/v1/credits/checkout", json_body={"credits": credits},
                          idempotency_key=str(uuid.uuid4()))


class Client(_ClientBase):
    """The blocking client (urllib3: one connection pool per broker, shared by every
    thread using the client)."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float = 30.0, max_retries: int = 3, ca_file: str | None = None,
                 insecure: bool | None = None):
        super().__init__(base_url, api_key, timeout=timeout, max_retries=max_retries,
                         ca_file=ca_file, insecure=insecure)
        tls_kw = ({"ca_certs": self._ca_file, "cert_reqs": "CERT_REQUIRED"}
                  if self.base_url.startswith("https") else {})
        try:
            # Retries and redirects are this class's business, not urllib3's.
            self._pool = urllib3.connection_from_url(
                self._cfg.url_root, maxsize=POOL_SIZE, block=False, retries=False,
                timeout=urllib3.Timeout(connect=timeout, read=timeout), **tls_kw)
        except urllib3.exceptions.LocationValueError as exc:
            raise ConfigurationError(f"bad broker URL {self.base_url!r} ({exc}): give one "
                                     f"like {DEFAULT_URL}") from None

    def _run(self, plan):
        """Drive ``plan``: send its calls with urllib3, sleep its sleeps, return its value."""
        try:
            step = next(plan)
            while True:
                if isinstance(step, Sleep):
                    if step.seconds > 0:
                        time.sleep(step.seconds)
                    outcome = None
                else:
                    outcome = self._send(step)
                step = plan.send(outcome)
        except StopIteration as stop:
            return stop.value

    def _send(self, call: Call) -> Response | Failed:
        if call.url is not None:  # a presigned blob-store URL: no API key goes there
            try:
                raw = _storage_pool().request(call.method, call.url, headers=call.headers,
                                              timeout=urllib3.Timeout(connect=call.timeout,
                                                                      read=call.timeout),
                                              retries=False, redirect=False)
            except urllib3.exceptions.HTTPError as exc:
                return Failed(describe(exc), exc)
            return Response(raw.status, raw.headers, raw.data)
        if call.rewind is not None:
            call.body.seek(call.rewind)
        try:
            raw = self._pool.urlopen(call.method, call.target, body=call.body,
                                     headers=call.headers, retries=False, redirect=False,
                                     timeout=urllib3.Timeout(connect=call.timeout,
                                                             read=call.timeout))
        except TransportError as exc:
            if isinstance(exc, urllib3.exceptions.SSLError):  # retrying will not help
                raise APIConnectionError(_tls_refusal(self.base_url, exc)) from exc
            return Failed(describe(exc) + _plaintext_hint(self.base_url, exc), exc)
        return Response(raw.status, raw.headers, raw.data)

    def _events(self, job: "Job", after: int, budget: core.Timeout) -> Iterator[Event]:
        """Server-sent events until the job ends. A stream that drops or goes silent is
        reopened after the last event seen: at once when it had delivered events, with
        backoff when it had not; ``max_retries`` such empty tries in a row raise
        APIConnectionError. The broker's ``error`` event (it failed once the stream had
        begun) raises the APIError its problem names."""
        follow = _Follow(self, job.id, after, budget)
        dropped = (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError)
        while not follow.over:
            try:
                raw = self._pool.urlopen(
                    "GET", follow.target(), headers=follow.headers(), retries=False,
                    redirect=False, preload_content=False,
                    timeout=urllib3.Timeout(connect=30.0, read=follow.read_timeout_s()))
            except dropped as exc:
                error = exc
            except TransportError as exc:
                raise APIConnectionError(f"cannot reach the broker at {self.base_url}: "
                                         f"{describe(exc)}") from exc
            else:
                try:
                    if raw.status >= 400:
                        raise core.error_from(Response(raw.status, raw.headers, raw.read()))
                    parser = core.SSEParser(follow.last)
                    for line in iter_lines(raw):
                        got = parser.feed(line)
                        if got is not None:
                            event = follow.event(got)
                            yield event
                            if event.kind in core.END_EVENTS:
                                return
                        if follow.over:
                            return
                    return
                except dropped as exc:
                    error = exc  # reconnect after the last event seen
                finally:
                    # never reuse a connection whose stream may not be read to its end
                    raw.close()
                    raw.release_conn()
            if follow.over:
                return
            pause = follow.pause_s(follow.dropped(describe(error), error))
            if pause:
                time.sleep(pause)

    def stream(self, plugin: str, *, timeout: "float | core.Timeout | None" = 600.0,
               version: str | None = None, **inputs) -> Iterator[str]:
        """Run one job and yield its text as it is made (``for token in
        client.stream("llama", prompt=...)``); the pieces join to the job's final text.
        Raises JobFailedError if the job fails, JobTimeoutError (after cancelling it) when
        ``timeout``, counted from the submit over the stream and the wait, passes. If the
        job is requeued to another provider mid-way, the text already yielded is not
        repeated (the same seed gives the same tokens)."""
        budget = core.Timeout.of(timeout)
        job = self.jobs.create(plugin, version=version, **inputs)
        text = core.TokenText()
        for ev in job.events(timeout=budget):
            piece = text.feed(ev.kind, ev.data)
            if piece:
                yield piece
        job.wait(timeout=budget)  # raises JobFailedError unless the job settled

    # ---- the marketplace (blocking only: files are read as they are sent) -------------
    def register_publisher_key(self, keys, label: str = "") -> dict:
        """Register ``keys`` (sdk.protocol.signing.KeyPair) as a publisher key of this
        account, proving it holds the private key (needs a publisher API key)."""
        from sdk.protocol.package import publisher_proof_document

        proof = keys.sign("publisher", publisher_proof_document(self.account().id,
                                                                keys.public_key_hex))
        return self.request("POST", "/v1/publishers", json_body={
            "public_key": keys.public_key_hex, "proof": proof, "label": label}).json()

    def publish(self, path: str | Path, keys, *, royalty_micro: int | None = None) -> dict:
        """Sign and publish the plugin or adapter folder at ``path``: uploads each file
        (content-addressed, so unchanged files cost one round trip), then the signed
        document. Publishing the same version again with the same content is a no-op; with
        other content it raises ConflictError (versions are immutable)."""
        from sdk.protocol.package import build_document, sign_document

        folder = Path(path)
        document = build_document(folder, keys.public_key_hex, royalty_micro=royalty_micro)
        signature = sign_document(keys, document)
        for f in document["files"]:
            with open(folder / f["path"], "rb") as fh:  # streamed: weights may be GBs
                self.request("PUT", f"/v1/blobs/{f['sha256']}", content=fh, timeout=600.0)
        return self.request("POST", f"/v1/{document['kind']}s", json_body={
            "document": document, "signature": signature}).json()

    def close(self) -> None:
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Follow:
    """What both clients' event streams share: where to reconnect (after the last event
    seen), when to give up (``max_retries`` reconnects in a row without an event) and when
    to stop (the caller's ``budget`` passed: the job goes on, its wait decides)."""

    def __init__(self, client: _ClientBase, job_id: str, after: int, budget: core.Timeout):
        self.c, self.job_id, self.last, self.failures = client, job_id, after, 0
        self.budget = budget
        self.fresh = False

    @property
    def over(self) -> bool:
        return self.budget.passed

    def read_timeout_s(self) -> float:
        """How long one read of the stream may block: the reopen interval, or what is left
        of the budget when that is less (so a silent stream cannot outlast it)."""
        left = self.budget.left()
        return EVENT_READ_TIMEOUT_S if left is None else max(0.05, min(EVENT_READ_TIMEOUT_S,
                                                                       left))

    def pause_s(self, pause: float) -> float:
        left = self.budget.left()
        return pause if left is None else max(0.0, min(pause, left))

    def target(self) -> str:
        self.fresh = False
        return self.c._cfg.target(f"/v1/jobs/{self.job_id}/events?after={self.last}")

    def headers(self) -> dict:
        return {**self.c._cfg.headers, "Accept": "text/event-stream"}

    def event(self, got: tuple[int, str, dict]) -> Event:
        """The next event of the stream; the broker's ``error`` event raises its error."""
        if got[1] == core.ERROR_EVENT:
            raise core.stream_error(self.job_id, got[2])
        ev = Event(*got)
        self.last, self.fresh, self.failures = ev.id, True, 0
        return ev

    def dropped(self, why: str, error: BaseException) -> float:
        """The stream dropped: the pause before reopening it (0: at once), or raise."""
        if self.fresh:
            return 0.0
        self.failures += 1
        if self.failures > self.c.max_retries:
            raise APIConnectionError(
                f"lost the event stream of job {self.job_id} at {self.c.base_url}: {why} "
                f"({self.failures} tries in a row without an event)") from error
        return float(self.c._backoff(self.failures - 1) or 0.0)


class Jobs:
    """``client.jobs``: submit, look up and list jobs."""

    def __init__(self, client: _ClientBase):
        self._c = client

    def _post(self, plugin, version, idempotency_key, validate, terms, inputs, wait, wrap):
        if validate:
            yield from self._c._validate(plugin, inputs)
        data = yield from core.submit(self._c._cfg, plugin, version, idempotency_key, terms,
                                      inputs, wait)
        return wrap(self._c, data)

    def create(self, plugin: str, *, version: str | None = None,
               idempotency_key: str | None = None, validate: bool = True,
               terms: dict | None = None, wait: float | None = None, **inputs) -> "Job":
        """Submit a job. With ``wait`` (seconds) the broker may hold the answer until the
        job ends or the wait passes (RFC 7240 ``Prefer: wait``), so a quick job comes back
        finished; either way check ``job.done`` or call ``job.wait()``."""
        return self._c._run(self._post(plugin, version, idempotency_key, validate, terms,
                                       inputs, wait, Job))

    def create_batch(self, plugin: str, *, version: str | None = None,
                     idempotency_key: str | None = None, validate: bool = True,
                     terms: dict | None = None, wait: float | None = None,
                     **inputs) -> "Batch":
        """A split request (``terms["n"]`` sibling jobs). ``wait`` as for :meth:`create`:
        the answer may wait until every sibling has ended."""
        return self._c._run(self._post(plugin, version, idempotency_key, validate, terms,
                                       inputs, wait, Batch))

    def get(self, job_id: str) -> "Job":
        return self._c._json("GET", f"/v1/jobs/{job_id}", wrap=lambda d: Job(self._c, d))

    def list(self, limit: int = 50) -> list["Job"]:
        """The account's newest jobs (summaries: no outputs; ``job.refresh()`` reads one)."""
        return self._c._json("GET", "/v1/jobs", params={"limit": limit}, key="data",
                             wrap=lambda rows: [Job(self._c, d) for d in rows])

    def wait(self, job_id: str, timeout: "float | core.Timeout | None" = 600.0) -> "Result":
        """Wait for the job ``job_id`` (submitted earlier, maybe elsewhere) to end."""
        budget = core.Timeout.of(timeout)

        def plan():
            job = Job(self._c, (yield from core.get_json(self._c._cfg, f"/v1/jobs/{job_id}")))
            return (yield from job._wait(budget))
        return self._c._run(plan())

    def cancel(self, job_id: str) -> "Job":
        return self._c._json("DELETE", f"/v1/jobs/{job_id}", wrap=lambda d: Job(self._c, d))


class Job:
    """A job as the broker last said it was. ``data`` is the broker's JSON record; the
    typed view of it is :attr:`info` (:class:`sdk.models.JobInfo`), and the properties
    below read the fields most callers need."""

    def __init__(self, client: _ClientBase, data: dict):
        self._c = client
        self.data = data

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def state(self) -> str:
        """queued | matched | running | submitted | verifying | disputed | settled |
        failed | cancelled | refunded."""
        return self.data["state"]

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def info(self):
        """The record as a typed :class:`sdk.models.JobInfo`."""
        from sdk.models import JobInfo
        return JobInfo.from_json(self.data)

    @property
    def request_id(self) -> str | None:
        """The X-Request-Id of the request that created the job (quote it when reporting
        a problem; the provider's agent logs it as ``sdk.logs.request_digest`` of it)."""
        return self.data.get("request_id")

    @property
    def verification(self) -> str:
        """unchecked | checking | verified | disputed | overturned | nondeterministic."""
        return (self.data.get("verification") or {}).get("status", "unchecked")

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.data.get('plugin')} {self.state}>"

    def _refresh(self, wait_s: float | None = None):
        self.data = yield from core.refresh(self._c._cfg, f"/v1/jobs/{self.id}", wait_s)
        return self

    def refresh(self, wait_s: float | None = None) -> "Job":
        """Re-read the job; with ``wait_s`` the broker holds the answer until it ends or
        ``wait_s`` passes (a long poll)."""
        return self._c._run(self._refresh(wait_s))

    def cancel(self) -> "Job":
        def plan():
            self.data = (yield from core.request(self._c._cfg, "DELETE",
                                                 f"/v1/jobs/{self.id}")).json()
            return self
        return self._c._run(plan())

    def wait(self, timeout: "float | core.Timeout | None" = 600.0) -> "Result":
        """Wait until the job ends. Returns its Result; raises JobFailedError if it failed
        or was cancelled, and JobTimeoutError (after cancelling it) when time runs out: its
        message says what the cancel charged (a provider is paid for the work it showed).
        ``timeout``: seconds, or the :class:`~sdk.Timeout` that following its events
        already spent from."""
        return self._c._run(self._wait(core.Timeout.of(timeout)))

    def _wait(self, budget: core.Timeout):
        try:
            self.data = yield from core.wait_job(self._c._cfg, self.data, budget.seconds,
                                                 budget.started)
        except JobFailedError as exc:
            if isinstance(exc.job, dict):
                self.data, exc.job = exc.job, self
            raise
        return (yield from Result._of(self._c, self, self.data.get("outputs", [])))

    def events(self, after: int = 0, timeout: "float | core.Timeout | None" = None):
        """Server-sent events until the job ends (``for ev in job.events()``; from an
        AsyncClient ``async for ev in job.events()``), reconnecting after the last one
        seen when the stream drops. With ``timeout`` (seconds, or a :class:`~sdk.Timeout`
        to pass on to :meth:`wait`) the events stop when it passes, the job still running:
        ``job.wait(timeout=that Timeout)`` then cancels it and says what it cost. An
        ``error`` event from the broker raises its APIError (ServerError for an internal
        failure), never passes as an event."""
        return self._c._events(self, after, core.Timeout.of(timeout))


class Batch:
    """A split request: sibling jobs whose outputs arrive as they finish."""

    def __init__(self, client: _ClientBase, data: dict):
        self._c = client
        self.data = data

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def jobs(self) -> list[Job]:
        return [Job(self._c, d) for d in self.data["jobs"]]

    @property
    def done(self) -> bool:
        return bool(self.data.get("done"))

    def refresh(self, wait_s: float | None = None) -> "Batch":
        """Re-read the batch; with ``wait_s`` the broker holds the answer until every
        sibling has ended or ``wait_s`` passes."""
        def plan():
            self.data = yield from core.refresh(self._c._cfg, f"/v1/batches/{self.id}",
                                                wait_s)
            return self
        return self._c._run(plan())

    def wait(self, timeout: "float | core.Timeout | None" = 600.0) -> "Result":
        """Wait until every sibling ends; one Result with all outputs in sibling order.
        Raises JobFailedError if a sibling failed, and JobTimeoutError (after cancelling
        the siblings still running) when time runs out."""
        return self._c._run(self._wait(core.Timeout.of(timeout)))

    def _wait(self, budget: core.Timeout):
        try:
            self.data = yield from core.wait_batch(self._c._cfg, self.data, budget.seconds,
                                                   budget.started)
        except JobFailedError as exc:
            if isinstance(exc.job, dict):
                exc.job = Job(self._c, exc.job)
            raise
        jobs = self.jobs
        outputs = [o for j in jobs for o in j.data.get("outputs", [])]
        return (yield from Result._of(self._c, jobs[0], outputs))


class Result:
    """The outputs of a settled job (or of every sibling of a split request). From a
    ``Client`` the bytes are fetched lazily, once; from an ``AsyncClient`` they come with
    the Result, so ``text``, ``images`` and ``output_bytes`` never wait."""

    def __init__(self, client: _ClientBase, job: Job, outputs: list[dict] | None = None):
        self._c = client
        self.job = job
        self.outputs: list[dict] = job.data.get("outputs", []) if outputs is None else outputs
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def _of(cls, client: _ClientBase, job: Job, outputs: list[dict]):
        result = cls(client, job, outputs)
        if client.prefetch:
            result._bytes = yield from core.fetch_outputs(client._cfg, outputs, job.id)
        return result

    @property
    def verification(self) -> str:
        """The output's verification status as of the last refresh: ``unchecked`` (not
        sampled), ``checking`` (a second provider is re-running it), ``verified``,
        ``disputed`` (a third provider decides), ``overturned`` (it was wrong: you were
        refunded and the outputs are now the majority's) or ``nondeterministic``."""
        return self.job.verification

    def wait_verified(self, timeout: float = 600.0) -> str:
        """Wait until the verification status is final (not checking or disputed), then
        refetch the outputs (an overturned job's outputs are replaced). Returns it."""
        def plan():
            deadline = time.monotonic() + timeout
            delay = 0.2  # doubling to 5 s: a re-run takes as long as the job did
            yield from self.job._refresh()
            while self.job.verification in ("checking", "disputed"):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                yield Sleep(min(delay, left))
                delay = min(delay * 2, 5.0)
                yield from self.job._refresh()
            self.outputs, self._bytes = self.job.data.get("outputs", []), {}
            if self._c.prefetch:
                self._bytes = yield from core.fetch_outputs(self._c._cfg, self.outputs, self.job.id)
            return self.job.verification
        return self._c._run(plan())

    @property
    def meta(self) -> list[dict]:
        """Each output's plugin meta (seed used, token ids, …) as the provider signed it."""
        return [o.get("meta", {}) for o in self.outputs]

    @property
    def urls(self) -> list[str | None]:
        """Each output's presigned download URL, straight from the broker's blob store (S3):
        anyone holding one may GET the bytes, without an API key, until it expires
        (``download_expires_at`` in :attr:`outputs`; :meth:`refresh_urls` gets new ones).
        None where the broker keeps outputs itself (fetch those with :meth:`output_bytes`)."""
        return [o.get("download_url") for o in self.outputs]

    def refresh_urls(self) -> list[str | None]:
        """New download URLs (the old ones expire after a few minutes)."""
        self.job.refresh()
        self.outputs = self.job.data.get("outputs", [])
        return self.urls

    def output_bytes(self, index: int) -> bytes:
        """Output ``index``'s bytes, checked against its sha256: from the blob store by its
        presigned URL when the job gives one (new URLs are fetched once if it expired),
        else from the broker."""
        if index not in self._bytes:
            if self._c.prefetch:  # the async client fetched them all: this one is new
                raise IndexError(f"no output {index}; this result has {len(self.outputs)}")
            out = self.outputs[index]
            if out.get("download_url"):
                data = self._download(index)
            else:
                data = self._c.request("GET", out["url"], timeout=120,
                                       headers={"Accept": "*/*"}).content
            core.check_output(self.job.id, index, out, data)
            self._bytes[index] = data
        return self._bytes[index]

    def _download(self, index: int) -> bytes:
        for fresh in (False, True):
            if fresh:
                self.refresh_urls()
            url = self.outputs[index]["download_url"]
            try:
                # No API key goes to the blob store: the URL is the credential.
                r = _storage_pool().request("GET", url, timeout=urllib3.Timeout(connect=30,
                                                                                 read=120),
                                            retries=urllib3.Retry(3, backoff_factor=0.2,
                                                                  redirect=False))
            except urllib3.exceptions.HTTPError as exc:
                raise APIConnectionError(f"cannot download output {index} of job "
                                         f"{self.job.id} from the blob store: {exc}") from None
            if r.status == 200:
                return r.data
            if r.status != 403 or fresh:  # 403: the URL expired; one new URL is worth a try
                raise APIConnectionError(
                    f"the blob store answered {r.status} for output {index} of job "
                    f"{self.job.id}: {r.data[:200]!r}; call result.refresh_urls() and retry")
        raise AssertionError("unreachable")

    @property
    def images(self) -> list:
        from PIL import Image

        return [Image.open(io.BytesIO(self.output_bytes(i)))
                for i, o in enumerate(self.outputs) if o["media_type"].startswith("image/")]

    @property
    def text(self) -> str:
        return "".join(self.output_bytes(i).decode()
                       for i, o in enumerate(self.outputs) if o["media_type"].startswith("text/"))

    @property
    def json(self) -> list:
        return [json.loads(self.output_bytes(i)) for i, o in enumerate(self.outputs)
                if o["media_type"] == "application/json"]

    def save(self, path: str | Path) -> list[Path]:
        """Write the outputs: ``out.png`` for one output, ``out-0.png``, ``out-1.png`` … for
        several. Returns the paths written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        written = []
        for i, o in enumerate(self.outputs):
            target = path if len(self.outputs) == 1 else path.with_name(
                f"{path.stem}-{i}{path.suffix or _suffix(o['media_type'])}")
            if not target.suffix:
                target = target.with_suffix(_suffix(o["media_type"]))
            target.write_bytes(self.output_bytes(i))
            written.append(target)
        return written


_STORAGE_POOL: urllib3.PoolManager | None = None


def _storage_pool() -> urllib3.PoolManager:
    """One pool for downloads from blob stores (presigned URLs carry their own auth)."""
    global _STORAGE_POOL
    if _STORAGE_POOL is None:
        _STORAGE_POOL = urllib3.PoolManager(maxsize=8)
    return _STORAGE_POOL


def _suffix(media_type: str) -> str:
    return {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp", "text/plain": ".txt",
            "application/json": ".json"}.get(media_type, ".bin")


def _parse_sse(lines) -> Iterator[Event]:
    """Server-sent events from lines (kept for callers of the old name)."""
    for got in core.parse_sse(lines):
        yield Event(*got)


def __getattr__(name):  # the asyncio twin, imported on first use (it needs httpx)
    if name == "AsyncClient":
        from sdk.aio import AsyncClient
        return AsyncClient
    raise AttributeError(f"module 'sdk.client' has no attribute {name!r}")
