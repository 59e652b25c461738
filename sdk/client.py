"""The Python client: ``Client(...).generate("sd15", prompt=...)``.

The key comes from the argument or ``SPARECYCLES_API_KEY``; the broker address from the
argument or ``SPARECYCLES_URL`` (default http://127.0.0.1:8080). Every POST carries an
Idempotency-Key that retries reuse, so a retried submit never makes a second job.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import urllib3

from sdk._http import Response, TransportError, describe, iter_lines, with_query
from sdk.errors import (APIConnectionError, ConfigurationError, InvalidInputError,
                        JobFailedError, JobTimeoutError, NotFoundError, error_for)
from sdk.protocol.schema import InputError, InputSchema

DEFAULT_URL = "http://127.0.0.1:8080"
TERMINAL = {"settled", "failed", "cancelled", "refunded"}
RETRY_STATUS = {429, 502, 503, 504}
POOL_SIZE = 32  # keep-alive connections kept per broker (more threads may open more)
MAX_PREFER_WAIT_S = 60  # the longest ``Prefer: wait`` the broker accepts
USER_AGENT = "sparecycles-python/0.1"


def _held_timeout(wait_s: float) -> float:
    """The read timeout of a request the broker may hold for ``wait_s`` seconds: the wait
    and 30 s more."""
    return wait_s + 30.0


@dataclass
class Event:
    id: int
    kind: str
    data: dict

    @property
    def preview(self) -> bytes | None:
        """A "preview" event's thumbnail of the output so far (WebP bytes), else None."""
        url = self.data.get("preview") if self.kind == "preview" else None
        if not isinstance(url, str) or ";base64," not in url:
            return None
        import base64

        return base64.b64decode(url.split(";base64,", 1)[1])


class Client:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float = 30.0, max_retries: int = 3):
        self.base_url = (base_url or os.environ.get("SPARECYCLES_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key or os.environ.get("SPARECYCLES_API_KEY")
        if not self.api_key:
            raise ConfigurationError(
                "no API key: pass Client(api_key=...) or set SPARECYCLES_API_KEY "
                "(an admin creates one with `sparecycles broker create-key --role client`)")
        self.max_retries = max_retries
        self._timeout = urllib3.Timeout(connect=timeout, read=timeout)
        try:
            base = urllib3.util.parse_url(self.base_url)
            if base.scheme not in ("http", "https") or not base.host:
                raise urllib3.exceptions.LocationValueError(
                    f"the scheme is {base.scheme!r}, not http or https")
            # One pool for the broker, shared by every thread using this client
            # (thread-safe); retries and redirects are this class's business, not urllib3's.
            self._pool = urllib3.connection_from_url(self.base_url, maxsize=POOL_SIZE,
                                                     block=False, retries=False,
                                                     timeout=self._timeout)
        except urllib3.exceptions.LocationValueError as exc:
            raise ConfigurationError(f"bad broker URL {self.base_url!r} ({exc}): give one like "
                                     f"{DEFAULT_URL}") from None
        # The only origin this client sends its API key to.
        self._origin = (base.scheme, base.host.lower(),
                        base.port or (443 if base.scheme == "https" else 80))
        self._prefix = (base.path or "").rstrip("/")
        self._headers = {"Authorization": f"Bearer {self.api_key}", "User-Agent": USER_AGENT,
                         "Accept": "application/json"}
        self._schemas: dict[str, InputSchema] = {}
        self.jobs = Jobs(self)

    # ---- plumbing ----------------------------------------------------------------------
    def request(self, method: str, path: str, *, json_body: Any = None,
                params: dict | None = None, idempotency_key: str | None = None,
                timeout: float | None = None, content: bytes | BinaryIO | None = None,
                headers: dict | None = None) -> Response:
        """One API call, retried on connection errors and 429/502/503/504 (with the same
        Idempotency-Key); an error answer raises the matching ``sdk.errors`` class.

        ``path`` is a path under the broker's URL (``/v1/...``); an absolute URL must be on
        the broker's own origin (the API key goes to no other host). ``content`` is bytes
        or a seekable binary file, streamed from its current position (and rewound to it
        for each retry)."""
        target = self._target(with_query(path, params))
        hdrs = dict(self._headers)
        if idempotency_key:
            hdrs["Idempotency-Key"] = idempotency_key
        rewind = None
        if content is not None:
            hdrs["Content-Type"] = "application/octet-stream"
            body = content
            if hasattr(content, "read"):  # a file: sent as read, with its length declared
                rewind = content.tell()
                hdrs["Content-Length"] = str(content.seek(0, os.SEEK_END) - rewind)
        elif json_body is not None:
            hdrs["Content-Type"] = "application/json"
            body = json.dumps(json_body, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False).encode()
        else:
            body = None
        if headers:
            hdrs.update(headers)
        tmo = self._timeout if timeout is None else urllib3.Timeout(connect=timeout,
                                                                    read=timeout)
        for attempt in range(self.max_retries + 1):
            if rewind is not None:
                content.seek(rewind)
            try:
                raw = self._pool.urlopen(method, target, body=body, headers=hdrs, timeout=tmo,
                                         retries=False, redirect=False)
            except TransportError as exc:
                if attempt == self.max_retries:
                    raise APIConnectionError(f"cannot reach the broker at {self.base_url}: "
                                             f"{describe(exc)}; "
                                             "is `sparecycles broker serve` running?") from exc
                self._backoff(attempt)
                continue
            resp = Response(raw.status, raw.headers, raw.data)
            if resp.status_code in RETRY_STATUS and attempt < self.max_retries:
                self._backoff(attempt)
                continue
            if resp.status_code >= 400:
                raise _error(resp)
            return resp
        raise AssertionError("unreachable")

    def _open_stream(self, path: str, params: dict | None, read_timeout: float):
        """A GET whose body is read as it arrives (the caller closes it)."""
        hdrs = {**self._headers, "Accept": "text/event-stream"}
        return self._pool.urlopen("GET", self._target(with_query(path, params)),
                                  headers=hdrs, retries=False, redirect=False,
                                  preload_content=False,
                                  timeout=urllib3.Timeout(connect=30.0, read=read_timeout))

    def _target(self, url: str) -> str:
        """The request target on the broker for ``url``: a path (``/v1/...``) goes under
        the broker's URL; an absolute URL is refused unless it is on the broker's own
        origin, so the API key is never sent to another host."""
        if "://" not in url.split("?", 1)[0]:
            return self._prefix + url
        try:
            u = urllib3.util.parse_url(url)
            origin = (u.scheme, (u.host or "").lower(),
                      u.port or (443 if u.scheme == "https" else 80))
        except urllib3.exceptions.LocationValueError:
            origin = None
        if origin != self._origin:
            raise ValueError(f"refusing to send the API key to {url!r}: this client only "
                             f"talks to its broker at {self.base_url}; give a path like "
                             "/v1/jobs (fetch other hosts' URLs without the client)")
        return u.request_uri

    @staticmethod
    def _backoff(attempt: int) -> None:
        time.sleep(min(8.0, 0.25 * 2 ** attempt) * (0.5 + random.random()))

    def close(self) -> None:
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- API ---------------------------------------------------------------------------
    def plugins(self, q: str | None = None, *, publisher: str | None = None,
                output: str | None = None) -> list[dict]:
        """Plugins jobs can run (built-in and published); ``q`` searches name and
        description, ``publisher`` and ``output`` filter."""
        params = {k: v for k, v in (("q", q), ("publisher", publisher), ("output", output)) if v}
        return self.request("GET", "/v1/plugins", params=params or None).json()["data"]

    # ---- the marketplace ---------------------------------------------------------------
    def register_publisher_key(self, keys, label: str = "") -> dict:
        """Register ``keys`` (sdk.protocol.signing.KeyPair) as a publisher key of this
        account, proving it holds the private key (needs a publisher API key)."""
        from sdk.protocol.package import publisher_proof_document

        proof = keys.sign("publisher", publisher_proof_document(self.account()["id"],
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

    def plugin_versions(self, name: str) -> list[dict]:
        return self.request("GET", f"/v1/plugins/{name}/versions").json()["data"]

    def adapters(self, q: str | None = None, *, base: str | None = None,
                 publisher: str | None = None) -> list[dict]:
        """Published adapters (latest version of each); ``base`` keeps one plugin's."""
        params = {k: v for k, v in (("q", q), ("base", base), ("publisher", publisher)) if v}
        return self.request("GET", "/v1/adapters", params=params or None).json()["data"]

    def adapter(self, name: str, version: str = "latest") -> dict:
        return self.request("GET", f"/v1/adapters/{name}/{version}").json()

    def schema(self, plugin: str) -> InputSchema:
        if plugin not in self._schemas:
            body = self.request("GET", f"/v1/plugins/{plugin}").json()
            self._schemas[plugin] = InputSchema.from_json_schema(body["input_schema"])
        return self._schemas[plugin]

    def validate(self, plugin: str, inputs: dict) -> dict:
        """Check ``inputs`` against the plugin's schema with the broker's own messages."""
        try:
            schema = self.schema(plugin)
        except NotFoundError:
            raise
        try:
            return schema.validate(inputs)
        except InputError as exc:
            field = f"inputs.{exc.field}" if exc.field else "inputs"
            raise InvalidInputError(422, "invalid_input", str(exc), field=field) from None

    def generate(self, plugin: str, *, timeout: float = 600.0, version: str | None = None,
                 n: int = 1, priority: str | None = None, max_price_micro: int | None = None,
                 deadline_s: float | None = None, verify: str | None = None,
                 output_format: str | None = None, output_quality: int | None = None,
                 cache: bool | None = None, **inputs) -> "Result":
        """Run one job and block until its outputs are ready. ``n`` > 1 splits the request
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
        # Submit and wait in one request (``Prefer: wait``); a broker that answers before
        # the job (or every sibling) ends leaves the rest to wait().
        started = time.monotonic()
        held = 30.0 if timeout is None else min(timeout, 30.0)
        create = self.jobs.create_batch if n > 1 else self.jobs.create
        job = create(plugin, version=version, terms=terms, wait=held, **inputs)
        return job._wait(timeout, started)  # the user's timeout, counted from the submit

    def quote(self, plugin: str, *, version: str | None = None, **inputs) -> dict:
        """What a job would cost, without running it: ``min_micro``, ``expected_micro`` and
        ``max_micro`` (the hold placed at submit), in micro-credits (1 credit = 1,000,000)."""
        body: dict[str, Any] = {"plugin": plugin, "inputs": inputs}
        if version:
            body["version"] = version
        return self.request("POST", "/v1/quotes", json_body=body).json()

    def account(self) -> dict:
        """Balances in micro-credits (available, held, vesting, paid out) and ``funding``
        (``"stripe"``, or ``"dev"`` where an admin grants credits)."""
        return self.request("GET", "/v1/account").json()

    def transactions(self, limit: int = 100) -> list[dict]:
        return self.request("GET", "/v1/account/transactions", params={"limit": limit}).json()["data"]

    def stake(self, amount_micro: int) -> dict:
        """Providers: put ``amount_micro`` of the available balance at stake (plugins may
        require a minimum stake; a provider outvoted by verification loses part of it)."""
        return self.request("POST", "/v1/account/stake", json_body={"amount_micro": amount_micro},
                            idempotency_key=str(uuid.uuid4())).json()

    def unstake(self, amount_micro: int) -> dict:
        """Providers: take ``amount_micro`` back from stake to the available balance."""
        return self.request("POST", "/v1/account/unstake",
                            json_body={"amount_micro": amount_micro},
                            idempotency_key=str(uuid.uuid4())).json()

    def buy_credits(self, credits: int) -> dict:
        """A Stripe Checkout session for ``credits``; open its ``url`` to pay."""
        return self.request("POST", "/v1/credits/checkout", json_body={"credits": credits},
                            idempotency_key=str(uuid.uuid4())).json()

    def stream(self, plugin: str, *, timeout: float = 600.0, version: str | None = None,
               **inputs) -> Iterator[str]:
        """Run one job and yield its text as it is made (``for token in
        client.stream("llama", prompt=...)``); the pieces join to the job's final text.
        Raises JobFailedError if the job fails. If the job is requeued to another provider
        mid-way, the text already yielded is not repeated (the same seed gives the same
        tokens)."""
        job = self.jobs.create(plugin, version=version, **inputs)
        sent, skip = 0, 0  # characters yielded; characters of a new attempt to pass over
        for ev in job.events():
            if ev.kind == "token":
                text = ev.data.get("text", "")
                if skip:
                    cut = min(skip, len(text))
                    text, skip = text[cut:], skip - cut
                if text:
                    sent += len(text)
                    yield text
            elif ev.kind == "requeued":
                skip = sent
        job.wait(timeout=timeout)  # raises JobFailedError unless the job settled


class Jobs:
    def __init__(self, client: Client):
        self._c = client

    def _post(self, plugin: str, version: str | None, idempotency_key: str | None,
              validate: bool, terms: dict | None, inputs: dict,
              wait: float | None = None) -> dict:
        if validate:
            self._c.validate(plugin, inputs)
        body: dict[str, Any] = {"plugin": plugin, "inputs": inputs, **(terms or {})}
        if version:
            body["version"] = version
        headers = timeout = None
        if wait is not None:
            wait_s = min(MAX_PREFER_WAIT_S, max(1, int(wait)))
            headers, timeout = {"Prefer": f"wait={wait_s}"}, _held_timeout(wait_s)
        return self._c.request("POST", "/v1/jobs", json_body=body,
                               idempotency_key=idempotency_key or str(uuid.uuid4()),
                               headers=headers, timeout=timeout).json()

    def create(self, plugin: str, *, version: str | None = None,
               idempotency_key: str | None = None, validate: bool = True,
               terms: dict | None = None, wait: float | None = None, **inputs) -> "Job":
        """Submit a job. With ``wait`` (seconds) the broker may hold the answer until the
        job ends or the wait passes (RFC 7240 ``Prefer: wait``), so a quick job comes back
        finished; either way check ``job.done`` or call ``job.wait()``."""
        return Job(self._c, self._post(plugin, version, idempotency_key, validate, terms,
                                       inputs, wait))

    def get(self, job_id: str) -> "Job":
        return Job(self._c, self._c.request("GET", f"/v1/jobs/{job_id}").json())

    def create_batch(self, plugin: str, *, version: str | None = None,
                     idempotency_key: str | None = None, validate: bool = True,
                     terms: dict | None = None, wait: float | None = None,
                     **inputs) -> "Batch":
        """A split request (``terms["n"]`` sibling jobs). ``wait`` as for :meth:`create`:
        the answer may wait until every sibling has ended."""
        return Batch(self._c, self._post(plugin, version, idempotency_key, validate, terms,
                                         inputs, wait))

    def list(self, limit: int = 50) -> list["Job"]:
        data = self._c.request("GET", "/v1/jobs", params={"limit": limit}).json()["data"]
        return [Job(self._c, d) for d in data]


class Job:
    def __init__(self, client: Client, data: dict):
        self._c = client
        self.data = data

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def state(self) -> str:
        return self.data["state"]

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def verification(self) -> str:
        """unchecked | checking | verified | disputed | overturned | nondeterministic."""
        return (self.data.get("verification") or {}).get("status", "unchecked")

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.data.get('plugin')} {self.state}>"

    def refresh(self, wait_s: float | None = None) -> "Job":
        params = {"wait": f"{wait_s:.3f}"} if wait_s else None
        self.data = self._c.request("GET", f"/v1/jobs/{self.id}", params=params,
                                    timeout=_held_timeout(wait_s or 0)).json()
        return self

    def cancel(self) -> "Job":
        self.data = self._c.request("DELETE", f"/v1/jobs/{self.id}").json()
        return self

    def wait(self, timeout: float | None = 600.0) -> "Result":
        """Block until the job ends. Returns its Result; raises JobFailedError if it failed
        or was cancelled, and JobTimeoutError (after cancelling it) when time runs out: its
        message says what the cancel charged (a provider is paid for the steps it had done)."""
        return self._wait(timeout, time.monotonic())

    def _wait(self, timeout: float | None, started: float) -> "Result":
        """:meth:`wait` with ``timeout`` counted from ``started`` (``time.monotonic()``),
        e.g. from the submit that ``Client.generate`` made."""
        deadline = None if timeout is None else started + timeout
        while not self.done:
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                before = dict(self.data)
                try:
                    self.cancel()
                except Exception:  # noqa: BLE001 - the timeout is what the caller must see
                    pass
                if self.state == "settled":
                    break
                raise _timed_out(self._c, [(self, before)], timeout,
                                 time.monotonic() - started, f"job {self.id}")
            self.refresh(wait_s=min(left, 30.0))
        if self.state == "settled" and "outputs" not in self.data:
            # A summary (``client.jobs.list()`` lists jobs without their outputs): the
            # job's full record names them.
            self.refresh()
        if self.state != "settled":
            err = self.data.get("error") or {}
            raise JobFailedError(self, f"job {self.id} {self.state}: "
                                       f"{err.get('message', 'no result')} [{err.get('code')}]")
        return Result(self._c, self)

    def events(self, after: int = 0) -> Iterator[Event]:
        """Server-sent events until the job ends. A stream that drops or goes silent is
        reopened after the last event seen: at once when it had delivered events, with
        backoff when it had not; ``max_retries`` such empty tries in a row raise
        APIConnectionError."""
        last, failures = after, 0
        dropped = (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError)
        while True:
            fresh = False  # whether this connection delivered an event
            try:
                raw = self._c._open_stream(f"/v1/jobs/{self.id}/events", {"after": last},
                                           read_timeout=60.0)
            except dropped as exc:
                error = exc
            except TransportError as exc:
                raise APIConnectionError(f"cannot reach the broker at {self._c.base_url}: "
                                         f"{describe(exc)}") from exc
            else:
                try:
                    if raw.status >= 400:
                        raise _error(Response(raw.status, raw.headers, raw.read()))
                    for ev in _parse_sse(iter_lines(raw)):
                        last, fresh, failures = ev.id, True, 0
                        yield ev
                        if ev.kind in ("done", "failed", "cancelled", "refunded"):
                            return
                    return
                except dropped as exc:
                    error = exc  # reconnect after the last event seen
                finally:
                    # never reuse a connection whose stream may not be read to its end
                    raw.close()
                    raw.release_conn()
            if fresh:
                continue
            failures += 1
            if failures > self._c.max_retries:
                raise APIConnectionError(
                    f"lost the event stream of job {self.id} at {self._c.base_url}: "
                    f"{describe(error)} ({failures} tries in a row without an event)") from error
            self._c._backoff(failures - 1)


class Batch:
    """A split request: sibling jobs whose outputs arrive as they finish."""

    def __init__(self, client: Client, data: dict):
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
        params = {"wait": f"{wait_s:.3f}"} if wait_s else None
        self.data = self._c.request("GET", f"/v1/batches/{self.id}", params=params,
                                    timeout=_held_timeout(wait_s or 0)).json()
        return self

    def wait(self, timeout: float | None = 600.0) -> "Result":
        """Block until every sibling ends; one Result with all outputs in sibling order.
        Raises JobFailedError if a sibling failed, and JobTimeoutError (after cancelling
        the siblings still running) when time runs out."""
        return self._wait(timeout, time.monotonic())

    def _wait(self, timeout: float | None, started: float) -> "Result":
        deadline = None if timeout is None else started + timeout
        while not self.done:
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            self.refresh(wait_s=min(left, 30.0))
        if not self.done:
            running = [(job, dict(job.data)) for job in self.jobs if not job.done]
            for job, _ in running:
                try:
                    job.cancel()
                except Exception:  # noqa: BLE001 - the timeout is what the caller must see
                    pass
            raise _timed_out(self._c, running, timeout, time.monotonic() - started,
                             f"batch {self.id}: {len(running)} of {len(self.jobs)} jobs")
        outputs: list[dict] = []
        for job in self.jobs:  # raises JobFailedError for a sibling that did not settle
            outputs += job.wait(timeout=None).outputs
        result = Result(self._c, self.jobs[0])
        result.outputs = outputs
        return result


def _timed_out(client: Client, cancelled: list[tuple[Job, dict]], timeout: float | None,
               waited_s: float, what: str) -> JobTimeoutError:
    """The JobTimeoutError for jobs ``wait()`` gave up on and cancelled: (job, its data
    before the cancel) each. Its message gives the timeout the caller set, how long it
    waited, and what the cancels charged and for what, as the client's ledger lines show
    them (a provider is paid for the steps it had done; the rest of each hold is released)."""
    charged = _charged_micro(client, [job.id for job, _ in cancelled])
    done = []
    for job, before in cancelled:
        progress = job.data.get("progress") or before.get("progress") or {}
        step, total = int(progress.get("step") or 0), int(progress.get("total") or 0)
        if total > 0 and step > 0:
            done.append(f"{min(step, total)} of {total} steps")
    limit = "no timeout" if timeout is None else f"the {_secs(timeout)} timeout"
    message = (f"{what} did not finish within {limit} (waited {_secs(waited_s)}) and "
               f"{'was' if len(cancelled) == 1 else 'were'} cancelled; ")
    if charged is None:
        message += ("what the cancel charged could not be read: see "
                    "client.transactions() for the ledger lines of the job")
    elif charged > 0:
        message += (f"charged {_credits(charged)} for the work the provider had done before "
                    f"the cancel ({', '.join(done) or 'its reported progress'}); the rest of "
                    "the hold was released to your balance")
    else:
        message += ("nothing was charged" + (" (no step was done yet)" if not done else "")
                    + " and the hold was released to your balance")
    if timeout is not None:
        message += ("; pass a longer timeout= (or timeout=None) to wait for slow jobs, or "
                    "fewer steps or a smaller size for a faster one")
    return JobTimeoutError(cancelled[0][0], message, timeout_s=timeout, waited_s=waited_s,
                           charged_micro=charged)


def _charged_micro(client: Client, job_ids: list[str]) -> int | None:
    """What the client's balance lost to these jobs: minus the sum of its ledger lines for
    them (a hold nets to zero with its release; a post leaves the charge). The ledger
    names each job's hold and post "job <id>" (parts of a resumed job "job <id> (part
    i)"); a release carries the same hold id. None when the lines cannot be read."""
    try:
        lines = client.transactions(limit=1000)
    except Exception:  # noqa: BLE001 - the timeout is what the caller must see
        return None
    holds = {line.get("hold_id") for line in lines
             if any(line.get("memo") == f"job {j}" or
                    str(line.get("memo", "")).startswith(f"job {j} (part ") for j in job_ids)}
    holds.discard(None)
    if not holds:
        return 0  # no hold (a free job) or none of its lines: nothing was taken
    return -sum(int(line.get("amount_micro") or 0) for line in lines
                if line.get("hold_id") in holds)


def _secs(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def _credits(micro: int) -> str:
    whole, frac = divmod(micro, 1_000_000)
    text = f"{whole:,}" + (f".{frac:06d}".rstrip("0") if frac else "")
    return f"{text} credits ({micro:,} micro-credits)"


def _error(resp: Response) -> Exception:
    """The sdk.errors exception for an error answer (RFC 7807 body, or its text)."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"detail": resp.text[:500]}
    return error_for(resp.status_code, body, resp.headers.get("X-Request-Id"))


def _parse_sse(lines) -> Iterator[Event]:
    ev_id, kind, data = 0, "message", []
    for line in lines:
        if not line:
            if data:
                yield Event(ev_id, kind, json.loads("\n".join(data)))
            ev_id, kind, data = ev_id, "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "id":
                ev_id = int(value)
            elif name == "event":
                kind = value
            elif name == "data":
                data.append(value)


class Result:
    """The outputs of a settled job. Bytes are fetched lazily, once."""

    def __init__(self, client: Client, job: Job):
        self._c = client
        self.job = job
        self.outputs: list[dict] = job.data.get("outputs", [])
        self._bytes: dict[int, bytes] = {}

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
        deadline = time.monotonic() + timeout
        delay = 0.2  # doubling to 5 s: a re-run takes as long as the job did
        self.job.refresh()
        while self.job.verification in ("checking", "disputed"):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
            self.job.refresh()
        self.outputs, self._bytes = self.job.data.get("outputs", []), {}
        return self.job.verification

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
            out = self.outputs[index]
            if out.get("download_url"):
                data = self._download(index)
            else:
                data = self._c.request("GET", out["url"], timeout=120,
                                       headers={"Accept": "*/*"}).content
            if out.get("sha256") and hashlib.sha256(data).hexdigest() != out["sha256"]:
                raise APIConnectionError(f"output {index} of job {self.job.id} came back with "
                                         f"other bytes than its sha256 {out['sha256'][:12]}…; "
                                         "fetch it again")
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
