"""The SDK's requests, retries, errors and waits, written once without I/O (sans-IO).

Every operation of the client is a *plan*: a generator that yields what it needs done —
a :class:`Call` (send this HTTP request) or a :class:`Sleep` — and is sent back the
outcome (a :class:`~sdk._http.Response`, or a :class:`Failed` transport error). The sync
``Client`` drives plans with urllib3 and ``time.sleep``; ``AsyncClient`` with httpx and
``asyncio.sleep``. So both clients make the same requests with the same Idempotency-Key
on every retry, back off alike (honouring ``Retry-After``), raise the same errors and wait
for jobs the same way, from this one definition.
"""
from __future__ import annotations

import email.utils
import json
import os
import random
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator, TypeVar

from sdk._http import Response, with_query
from sdk.errors import APIConnectionError, ConfigurationError, error_for

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8080"
TERMINAL = {"settled", "failed", "cancelled", "refunded"}
RETRY_STATUS = {429, 502, 503, 504}
MAX_PREFER_WAIT_S = 60  # the longest ``Prefer: wait`` the broker accepts
MAX_RETRY_AFTER_S = 60.0  # a Retry-After longer than this is waited this long at most
USER_AGENT = "sparecycles-python/0.1"


def held_timeout(wait_s: float) -> float:
    """The read timeout of a request the broker may hold for ``wait_s`` seconds: the wait
    and 30 s more."""
    return wait_s + 30.0


class Timeout:
    """One caller's timeout across the calls it spans (follow a job's events, then wait
    for its result; the CLI's ``--timeout`` likewise), counted once from ``started``
    (``time.monotonic()``), never restarted by the next call. ``seconds`` None: no limit.
    Every ``timeout=`` of a job's ``wait()`` and ``events()`` takes one, or seconds."""

    def __init__(self, seconds: float | None, started: float | None = None):
        if seconds is not None and not (isinstance(seconds, (int, float))
                                        and seconds >= 0 and seconds == seconds):
            raise ConfigurationError(f"timeout must be a number of seconds >= 0 or None "
                                     f"(no limit), not {seconds!r}")
        self.seconds = None if seconds is None else float(seconds)
        self.started = time.monotonic() if started is None else started

    @classmethod
    def of(cls, timeout: "float | Timeout | None") -> "Timeout":
        """``timeout`` itself when it is one, else a Timeout of that many seconds from now."""
        return timeout if isinstance(timeout, Timeout) else cls(timeout)

    def left(self) -> float | None:
        """Seconds left (<= 0 once it passed); None without a limit."""
        if self.seconds is None:
            return None
        return self.started + self.seconds - time.monotonic()

    @property
    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def __repr__(self) -> str:
        return f"Timeout({self.seconds!r}, left={self.left()!r})"


@dataclass
class Call:
    """One HTTP request for a transport to send: ``target`` is the request target on the
    broker (path and query); ``body`` bytes, a seekable file (sent from ``rewind``) or
    None; ``timeout`` the connect and read timeout in seconds."""
    method: str
    target: str
    headers: dict[str, str]
    body: bytes | BinaryIO | None = None
    timeout: float = 30.0
    rewind: int | None = None
    url: str | None = None  # an absolute URL off the broker (a presigned blob-store URL),
    #                         sent without the client's headers; ``target`` is then unused


@dataclass
class Sleep:
    seconds: float


@dataclass
class Failed:
    """The transport could not get an answer (connection refused, reset, timed out);
    ``message`` says why, ``error`` is the transport's exception."""
    message: str
    error: BaseException | None = None


Plan = Generator["Call | Sleep", "Response | Failed | None", T]


@dataclass
class Config:
    """What every request of a client shares: where the broker is, the key, timeouts."""
    base_url: str
    api_key: str
    timeout: float = 30.0
    max_retries: int = 3
    origin: tuple[str, str, int] = ("http", "", 80)
    prefix: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    backoff: Any = None  # attempt -> seconds before the next try (default: backoff_s)

    @classmethod
    def build(cls, base_url: str | None, api_key: str | None, timeout: float,
              max_retries: int) -> "Config":
        """The argument, else ``SPARECYCLES_URL`` / ``SPARECYCLES_API_KEY``, else the
        default URL; a missing key or a bad URL is a ConfigurationError."""
        from urllib.parse import urlsplit

        url = (base_url or os.environ.get("SPARECYCLES_URL") or DEFAULT_URL).rstrip("/")
        key = api_key or os.environ.get("SPARECYCLES_API_KEY")
        if not key:
            raise ConfigurationError(
                "no API key: pass api_key=... or set SPARECYCLES_API_KEY "
                "(an admin creates one with `sparecycles broker create-key --role client`)")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ConfigurationError(f"bad broker URL {url!r} ({exc}): give one like "
                                     f"{DEFAULT_URL}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(f"bad broker URL {url!r} (the scheme is "
                                     f"{parts.scheme!r}, not http or https, or it has no "
                                     f"host): give one like {DEFAULT_URL}")
        origin = (parts.scheme, parts.hostname.lower(),
                  port or (443 if parts.scheme == "https" else 80))
        return cls(url, key, timeout, max_retries, origin, parts.path.rstrip("/"),
                   {"Authorization": f"Bearer {key}", "User-Agent": USER_AGENT,
                    "Accept": "application/json"})

    def target(self, url: str) -> str:
        """The request target on the broker for ``url``: a path (``/v1/...``) goes under
        the broker's URL; an absolute URL is refused unless it is on the broker's own
        origin, so the API key is never sent to another host."""
        from urllib.parse import urlsplit

        if "://" not in url.split("?", 1)[0]:
            return self.prefix + url
        try:
            u = urlsplit(url)
            origin = (u.scheme, (u.hostname or "").lower(),
                      u.port or (443 if u.scheme == "https" else 80))
        except ValueError:
            origin = None
        if origin != self.origin:
            raise ValueError(f"refusing to send the API key to {url!r}: this client only "
                             f"talks to its broker at {self.base_url}; give a path like "
                             "/v1/jobs (fetch other hosts' URLs without the client)")
        return (u.path or "/") + (f"?{u.query}" if u.query else "")

    @property
    def url_root(self) -> str:
        scheme, host, port = self.origin
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def backoff_s(attempt: int) -> float:
    """The pause before retry ``attempt + 1``: 0.25 s doubling to 8 s, with jitter."""
    return min(8.0, 0.25 * 2 ** attempt) * (0.5 + random.random())


def _pause(cfg: Config, attempt: int) -> float:
    return float((cfg.backoff or backoff_s)(attempt) or 0.0)


def retry_after_s(resp: Response) -> float | None:
    """The ``Retry-After`` of an answer in seconds (delta-seconds or an HTTP date), or
    None when it has none that parses."""
    raw = (resp.headers.get("Retry-After") or "").strip()
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def request(cfg: Config, method: str, path: str, *, json_body: Any = None,
            params: dict | None = None, idempotency_key: str | None = None,
            timeout: float | None = None, content: bytes | BinaryIO | None = None,
            headers: dict | None = None) -> Plan[Response]:
    """One API call, retried on transport failures and 429/502/503/504 with the same
    Idempotency-Key (after ``Retry-After`` when the answer gives one, at most
    MAX_RETRY_AFTER_S; else exponential backoff); an error answer raises the matching
    ``sdk.errors`` class (429: RateLimitError, with ``retry_after_s``)."""
    hdrs = dict(cfg.headers)
    if idempotency_key:
        hdrs["Idempotency-Key"] = idempotency_key
    rewind = None
    if content is not None:
        hdrs["Content-Type"] = "application/octet-stream"
        body: Any = content
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
    call = Call(method, cfg.target(with_query(path, params)), hdrs, body,
                cfg.timeout if timeout is None else timeout, rewind)
    for attempt in range(cfg.max_retries + 1):
        outcome = yield call
        last = attempt == cfg.max_retries
        if isinstance(outcome, Failed):
            if last:
                raise APIConnectionError(f"cannot reach the broker at {cfg.base_url}: "
                                         f"{outcome.message}; is `sparecycles broker serve` "
                                         "running?") from outcome.error
            yield Sleep(_pause(cfg, attempt))
            continue
        if outcome.status_code in RETRY_STATUS and not last:
            after = retry_after_s(outcome)
            yield Sleep(_pause(cfg, attempt) if after is None
                        else min(after, MAX_RETRY_AFTER_S))
            continue
        if outcome.status_code >= 400:
            raise error_from(outcome)
        return outcome
    raise AssertionError("unreachable")


def error_from(resp: Response) -> Exception:
    """The sdk.errors exception for an error answer (RFC 7807 body, or its text)."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"detail": resp.text[:500]}
    return error_for(resp.status_code, body, resp.headers.get("X-Request-Id"),
                     retry_after_s=retry_after_s(resp))


def get_json(cfg: Config, path: str, **kw) -> Plan[Any]:
    return (yield from request(cfg, "GET", path, **kw)).json()


# ---- jobs ------------------------------------------------------------------------------
def submit(cfg: Config, plugin: str, version: str | None, idempotency_key: str | None,
           terms: dict | None, inputs: dict, wait: float | None) -> Plan[dict]:
    """POST /v1/jobs (``wait``: seconds the broker may hold the answer, Prefer: wait)."""
    import uuid

    body: dict[str, Any] = {"plugin": plugin, "inputs": inputs, **(terms or {})}
    if version:
        body["version"] = version
    headers = timeout = None
    if wait is not None:
        wait_s = min(MAX_PREFER_WAIT_S, max(1, int(wait)))
        headers, timeout = {"Prefer": f"wait={wait_s}"}, held_timeout(wait_s)
    resp = yield from request(cfg, "POST", "/v1/jobs", json_body=body,
                              idempotency_key=idempotency_key or str(uuid.uuid4()),
                              headers=headers, timeout=timeout)
    return resp.json()


def submit_many(cfg: Config, jobs: list[Any], idempotency_key: str | None,
                wait: float | None) -> Plan[list[dict]]:
    """POST /v1/jobs/bulk: ``jobs`` (job requests as POST /v1/jobs takes them) in one
    request, all created or none; each item's answer (a job, a batch for n > 1) in order.
    ``wait`` as for :func:`submit`: the broker may hold the answer until every job ends."""
    import uuid

    headers = timeout = None
    if wait is not None:
        wait_s = min(MAX_PREFER_WAIT_S, max(1, int(wait)))
        headers, timeout = {"Prefer": f"wait={wait_s}"}, held_timeout(wait_s)
    resp = yield from request(cfg, "POST", "/v1/jobs/bulk", json_body={"jobs": jobs},
                              idempotency_key=idempotency_key or str(uuid.uuid4()),
                              headers=headers, timeout=timeout)
    return resp.json()["data"]


def cancel_quietly(cfg: Config, jobs: list[dict]) -> Plan[None]:
    """Cancel each of ``jobs`` not known to have ended; a failure is ignored (the caller is
    already raising what matters)."""
    for job in jobs:
        if job.get("state") in TERMINAL:
            continue
        try:
            yield from request(cfg, "DELETE", f"/v1/jobs/{job['id']}")
        except Exception:  # noqa: BLE001 - one that ended meanwhile answers 409
            pass


def refresh(cfg: Config, path: str, wait_s: float | None = None) -> Plan[dict]:
    """GET a job or batch (``wait_s``: the broker holds the answer until it ends)."""
    params = {"wait": f"{wait_s:.3f}"} if wait_s else None
    return (yield from get_json(cfg, path, params=params, timeout=held_timeout(wait_s or 0)))


def wait_job(cfg: Config, data: dict, timeout: float | None, started: float) -> Plan[dict]:
    """The job's record once it ends (with its outputs when it settled), long-polling; on
    timeout, cancel it and raise JobTimeoutError saying what the cancel charged.
    ``started``: ``time.monotonic()`` when the caller's timeout began."""
    from sdk.errors import JobFailedError

    path = f"/v1/jobs/{data['id']}"
    deadline = None if timeout is None else started + timeout
    while data["state"] not in TERMINAL:
        left = 30.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            before = dict(data)
            try:
                data = (yield from request(cfg, "DELETE", path)).json()
            except Exception:  # noqa: BLE001 - the timeout is what the caller must see
                pass
            if data["state"] == "settled":
                break
            raise (yield from timed_out(cfg, [(data, before)], timeout,
                                        time.monotonic() - started, f"job {data['id']}"))
        data = yield from refresh(cfg, path, min(left, 30.0))
    if data["state"] == "settled" and "outputs" not in data:
        data = yield from refresh(cfg, path)  # a list's summary: the record names outputs
    if data["state"] != "settled":
        err = data.get("error") or {}
        raise JobFailedError(data, f"job {data['id']} {data['state']}: "
                                   f"{err.get('message', 'no result')} [{err.get('code')}]")
    return data


def wait_batch(cfg: Config, data: dict, timeout: float | None, started: float) -> Plan[dict]:
    """A split request's record once every sibling ended (each with outputs); on timeout
    the siblings still running are cancelled (JobTimeoutError)."""
    path = f"/v1/batches/{data['id']}"
    deadline = None if timeout is None else started + timeout
    while not data.get("done"):
        left = 30.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            break
        data = yield from refresh(cfg, path, min(left, 30.0))
    if not data.get("done"):
        running = [j for j in data["jobs"] if j["state"] not in TERMINAL]
        cancelled = []
        for job in running:
            after = job
            try:
                after = (yield from request(cfg, "DELETE", f"/v1/jobs/{job['id']}")).json()
            except Exception:  # noqa: BLE001 - the timeout is what the caller must see
                pass
            cancelled.append((after, job))
        raise (yield from timed_out(cfg, cancelled, timeout, time.monotonic() - started,
                                    f"batch {data['id']}: {len(running)} of "
                                    f"{len(data['jobs'])} jobs"))
    jobs = []
    for job in data["jobs"]:  # raises JobFailedError for a sibling that did not settle
        jobs.append((yield from wait_job(cfg, job, None, time.monotonic())))
    return {**data, "jobs": jobs}


def fetch_outputs(cfg: Config, outputs: list[dict], job_id: str = "") -> Plan[dict[int, bytes]]:
    """Every output's bytes: from the blob store by its presigned ``download_url`` where
    the job gives one (no API key goes there), else from the broker; each checked against
    its sha256."""
    got = {}
    for i, o in enumerate(outputs):
        if o.get("download_url"):
            data = yield from download(cfg, o["download_url"], f"output {i} of job {job_id}")
        else:
            data = (yield from request(cfg, "GET", o["url"], timeout=120,
                                       headers={"Accept": "*/*"})).content
        check_output(job_id, i, o, data)
        got[i] = data
    return got


def download(cfg: Config, url: str, what: str) -> Plan[bytes]:
    """GET a presigned URL (the URL is the credential), retried on transport failures."""
    call = Call("GET", "", {"Accept": "*/*"}, timeout=120.0, url=url)
    for attempt in range(cfg.max_retries + 1):
        outcome = yield call
        if isinstance(outcome, Failed):
            if attempt == cfg.max_retries:
                raise APIConnectionError(f"cannot download {what} from the blob store: "
                                         f"{outcome.message}") from outcome.error
            yield Sleep(_pause(cfg, attempt))
            continue
        if outcome.status_code != 200:
            raise APIConnectionError(f"the blob store answered {outcome.status_code} for "
                                     f"{what}: {outcome.content[:200]!r}; if its URL "
                                     "expired, fetch the job again for new ones")
        return outcome.content
    raise AssertionError("unreachable")


def check_output(job_id: str, index: int, out: dict, data: bytes) -> None:
    """Raise unless ``data`` hashes to the sha256 the job names for output ``index``."""
    import hashlib

    if out.get("sha256") and hashlib.sha256(data).hexdigest() != out["sha256"]:
        raise APIConnectionError(f"output {index} of job {job_id} came back with other bytes "
                                 f"than its sha256 {out['sha256'][:12]}…; fetch it again")


def timed_out(cfg: Config, cancelled: list[tuple[dict, dict]], timeout: float | None,
              waited_s: float, what: str) -> Plan[Exception]:
    """The JobTimeoutError for jobs a wait gave up on and cancelled: (job after the
    cancel, before it) each. Its message gives the timeout the caller set, how long it
    waited, and what the cancels charged and for what, as the client's ledger shows it (a
    provider is paid for the work it showed: checkpoints, streamed tokens; the rest of each
    hold is released)."""
    from sdk.errors import JobTimeoutError

    charged = yield from charged_micro(cfg, [job["id"] for job, _ in cancelled])
    done = []
    for job, before in cancelled:
        progress = job.get("progress") or before.get("progress") or {}
        step, total = int(progress.get("step") or 0), int(progress.get("total") or 0)
        if total > 0 and step > 0:
            done.append(f"{min(step, total)} of {total} steps")
    limit = "no timeout" if timeout is None else f"the {secs(timeout)} timeout"
    message = (f"{what} did not finish within {limit} (waited {secs(waited_s)}) and "
               f"{'was' if len(cancelled) == 1 else 'were'} cancelled; ")
    if charged is None:
        message += ("what the cancel charged could not be read: see "
                    "client.transactions() for the ledger lines of the job")
    elif charged > 0:
        message += (f"charged {credits(charged)} for the work the provider showed before "
                    "the cancel (the checkpoints the broker received or the tokens streamed "
                    f"to you; it had reported {', '.join(done) or 'no step'}); the rest of "
                    "the hold was released to your balance")
    else:
        message += ("nothing was charged" + (" (no step was done yet)" if not done else
                                             " (no work was shown yet: no checkpoint, no "
                                             "streamed token)")
                    + " and the hold was released to your balance")
    if timeout is not None:
        message += ("; pass a longer timeout= (or timeout=None) to wait for slow jobs, or "
                    "fewer steps or a smaller size for a faster one")
    return JobTimeoutError(cancelled[0][0], message, timeout_s=timeout, waited_s=waited_s,
                           charged_micro=charged)


def charged_micro(cfg: Config, job_ids: list[str]) -> Plan[int | None]:
    """What the client's balance lost to these jobs: minus the sum of its ledger lines for
    them (a hold nets to zero with its release; a post leaves the charge). The ledger
    names each job's hold and post "job <id>" (parts of a resumed job "job <id> (part
    i)"); a release carries the same hold id. None when the lines cannot be read."""
    try:
        lines = (yield from get_json(cfg, "/v1/account/transactions",
                                     params={"limit": 1000}))["data"]
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


def secs(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def credits(micro: int) -> str:
    whole, frac = divmod(micro, 1_000_000)
    text = f"{whole:,}" + (f".{frac:06d}".rstrip("0") if frac else "")
    return f"{text} credits ({micro:,} micro-credits)"


# ---- server-sent events ----------------------------------------------------------------
END_EVENTS = ("done", "failed", "cancelled", "refunded")
ERROR_EVENT = "error"  # the broker failed after the stream began: an RFC 7807 body, the end


def stream_error(job_id: str, body: dict) -> Exception:
    """The sdk.errors exception for the broker's ``error`` event in the stream of
    ``job_id`` (its status line went out before the failure, so the problem came as the
    stream's last event): the class its ``status`` names, quoting its request id."""
    if not isinstance(body, dict):
        body = {"detail": str(body)[:500]}
    try:
        status = int(body.get("status") or 500)
    except (TypeError, ValueError):
        status = 500
    detail = body.get("detail", body.get("title", "error"))
    return error_for(status, {**body, "detail": f"the event stream of job {job_id} broke "
                                                f"off: {detail}"}, body.get("request_id"))


class SSEParser:
    """Server-sent events from lines, fed one at a time (either transport's lines):
    ``feed(line)`` returns the (id, kind, data) an empty line completes, else None."""

    def __init__(self, last_id: int = 0):
        self.id, self.kind, self.data = last_id, "message", []

    def feed(self, line: str) -> tuple[int, str, dict] | None:
        if not line:
            event = None
            if self.data:
                event = (self.id, self.kind, json.loads("\n".join(self.data)))
            self.kind, self.data = "message", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            self.id = int(value)
        elif name == "event":
            self.kind = value
        elif name == "data":
            self.data.append(value)
        return None


def parse_sse(lines) -> Iterator[tuple[int, str, dict]]:
    parser = SSEParser()
    for line in lines:
        event = parser.feed(line)
        if event is not None:
            yield event


class TokenText:
    """The text a job streams, from its events: ``feed(kind, data)`` returns the new text
    to give the caller (a requeued job's second attempt re-sends what the first had sent:
    that part is passed over, the same seed giving the same tokens)."""

    def __init__(self):
        self.sent = self.skip = 0

    def feed(self, kind: str, data: dict) -> str:
        if kind == "requeued":
            self.skip = self.sent
            return ""
        if kind != "token":
            return ""
        text = data.get("text", "")
        if self.skip:
            cut = min(self.skip, len(text))
            text, self.skip = text[cut:], self.skip - cut
        self.sent += len(text)
        return text
