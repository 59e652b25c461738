"""Helpers the blueprints share: the services of this app, the caller and its role, JSON
bodies, numeric query arguments.

Everything a client sends is checked here once, before any service sees it, so that no
input can reach storage that storage cannot hold: a JSON body must be UTF-8 text whose
strings are all Unicode text (no lone surrogates, which no database stores and UTF-8
cannot encode, and no NUL, which PostgreSQL's text refuses), nested at most ``MAX_JSON_DEPTH`` deep, with integers that fit 64 bits and
no NaN or infinities; numeric query arguments and headers are read by one helper with
bounds (:func:`int_arg`, :func:`seconds_arg`), at most 64-bit."""
from __future__ import annotations

import itertools
import json
import logging
import re
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager

from flask import Response, current_app, g, request

from broker.errors import Forbidden, IdempotencyConflict, InvalidRequest
from broker.ledger import errors as ledger_errors

log = logging.getLogger("broker.app")

MAX_WAIT_S = 60.0  # the longest a request may wait for a job (?wait=, Prefer: wait)
MAX_JSON_DEPTH = 32  # objects and arrays inside each other in a request body
INT64_MAX = 2**63 - 1  # what SQLite's INTEGER and PostgreSQL's BIGINT hold

# Output media types served as themselves; anything else a provider names is a download.
SAFE_OUTPUT_TYPES = {"image/png": "image/png", "image/jpeg": "image/jpeg",
                     "image/webp": "image/webp", "text/plain": "text/plain; charset=utf-8",
                     "application/json": "application/json"}


REQUEST_ID = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# New ids: random per process, then a counter (unique across replicas, and no system call
# per request as uuid4 makes).
_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count(1)


def request_id() -> str:
    """This request's id: the client's ``X-Request-Id`` when it sent a sane one (1 to 128
    of letters, digits and ``._:-``), else a new one. Every answer carries it back, every
    problem body names it, every log line written while it is handled names it, and the
    jobs it creates keep it (their envelopes carry its digest, sdk.logs)."""
    rid = g.get("request_id")
    if rid is None:
        rid = g.request_id = (sane_request_id(request.headers.get(REQUEST_ID, ""))
                              or new_request_id())
    return rid


def sane_request_id(sent: str) -> str | None:
    """``sent`` when it may serve as a request id, else None."""
    return sent if sent and _REQUEST_ID_RE.fullmatch(sent) else None


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def internal_problem(exc: BaseException, rid: str | None = None) -> dict:
    """The RFC 7807 body of an error the broker did not expect (logged with the request's
    id, which the body quotes): never a traceback, never a server's plain-text page.
    ``rid``: the request's id where there is no request context any more (a streamed
    answer's generator)."""
    if rid is None:
        rid = request_id()
        log.error("unhandled error on %s %s (request %s)", request.method, request.path, rid,
                  exc_info=exc)
    else:
        log.error("unhandled error in a streamed answer (request %s)", rid, exc_info=exc)
    return {"type": "https://sparecycles.dev/errors/internal", "title": "Internal error",
            "status": 500, "code": "internal",
            "detail": f"the broker hit an unexpected error handling request {rid}; it is "
                      "logged under that id: quote it when you report this"}


def services():
    return current_app.extensions["sparecycles"]


def principal():
    return g.principal


def require_role(*roles: str, what: str = "this"):
    """The caller, when its key has one of ``roles``; else a 403 naming them (``what``: the
    thing the roles are needed for, e.g. "setting the market's rules")."""
    who = principal()
    if who.role not in roles:
        raise Forbidden(f"{what} needs {_a(' or '.join(roles))} key; yours is "
                        f"{_a(who.role)} key")
    return who


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def idempotency_key(max_chars: int = 200) -> str | None:
    """The request's ``Idempotency-Key`` (None when it sent none): 1 to ``max_chars``
    characters, else a 400 naming the header."""
    key = request.headers.get("Idempotency-Key")
    if key is not None and (not 0 < len(key) <= max_chars or not key.isprintable()):
        raise InvalidRequest(f"Idempotency-Key must be 1 to {max_chars} printable "
                             f"characters, got {len(key)}", field="Idempotency-Key")
    return key


@contextmanager
def one_request_per_key(key: str | None) -> Iterator[None]:
    """Around a ledger call keyed by the client's Idempotency-Key: a key the ledger already
    holds for other arguments is the client's key reused for another request, a 409 in the
    client's terms (the ledger's own message names its internal key)."""
    try:
        yield
    except ledger_errors.IdempotencyConflict:
        raise IdempotencyConflict(f"Idempotency-Key {key!r} was used for another request "
                                  f"(another operation or amount); a key names exactly one "
                                  "request: send that request again to get its answer, or "
                                  "use a new key") from None


def json_object(allowed: Collection[str], example: str) -> dict:
    """The request's JSON body, which must be an object with keys from ``allowed`` only:
    else a 400 showing ``example``, or naming the first unknown key as its ``field``."""
    body = json_body()
    if not isinstance(body, dict):
        raise InvalidRequest(f"send a JSON object like {example}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}; allowed: "
                             f"{', '.join(allowed)} (like {example})", field=unknown[0])
    return body


def int_arg(name: str, default: int, lo: int, hi: int = INT64_MAX, *,
            header: str | None = None) -> int:
    """The integer query argument ``name`` (else the ``header``, else ``default``), from
    ``lo`` to ``hi`` (at most a signed 64-bit integer, what storage holds): else a 400
    naming it and the range."""
    raw = request.args.get(name)
    field = name
    if raw is None and header:
        raw, field = request.headers.get(header), header
    if raw is None:
        return default
    return _number(raw, field, lo, min(hi, INT64_MAX), integer=True)


def seconds_arg(raw: str | None, field: str, *, what: str | None = None) -> float | None:
    """``raw`` (a query argument or header value as sent; None: None) as a wait of 0 to
    MAX_WAIT_S seconds: else a 400 naming ``field`` (``what``: how the message names the
    value, ``field`` by default) and the range."""
    if raw is None:
        return None
    return _number(raw, field, 0, MAX_WAIT_S, integer=False, what=what)


def _number(raw: str, field: str, lo: float, hi: float, *, integer: bool,
            what: str | None = None):
    kind = "an integer" if integer else "a number of seconds"
    span = f"from {lo:,} to {hi:,}" if integer else f"from {lo:g} to {hi:g}"
    value = None
    if len(raw) <= 40:  # (int() of a long digit string costs quadratic time, then fails)
        try:
            value = int(raw) if integer else float(raw)
        except ValueError:
            pass
    if value is None or not lo <= value <= hi:  # NaN fails too
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        raise InvalidRequest(f"{what or field} must be {kind} {span}, got {shown!r}",
                             field=field)
    return value


def json_body():
    """The request's JSON value (see :func:`parse_json`), or a clear 400."""
    # get_data, not .data: .data first runs werkzeug's form parser over the body (a
    # measurable share of the per-request CPU), and a JSON body is never a form.
    raw = request.get_data(cache=True)
    if not raw:
        raise InvalidRequest("the request has no body; send a JSON object with "
                             "Content-Type: application/json")
    return parse_json(raw)


class _Refused(ValueError):
    """A number in a JSON text that the broker does not take (see parse_json)."""


def _no_constant(name: str):
    raise _Refused(f"{name} is not a JSON number; send a finite number")


def parse_json(raw: bytes):
    """``raw`` as a JSON value the broker can store: strictly UTF-8, integers within 64
    bits, finite numbers only (no NaN, Infinity, 1e999), every string and key valid
    Unicode (no lone surrogate escapes such as "\\ud800"), nested at most MAX_JSON_DEPTH
    deep. Anything else is a 400 (``malformed_json``; ``invalid_text`` naming the field of
    a string that is not text; ``nested_too_deep``), so nothing recursive over a body
    (canonical encoding, schema checks, the database's JSON) ever meets it. A NUL
    character (\\u0000) is refused too: PostgreSQL's text columns cannot hold it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the body is not UTF-8 text (byte {exc.start} is not valid "
                             "UTF-8); send JSON encoded as UTF-8",
                             code_override="malformed_json") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep() from None
    except _Refused as exc:
        raise InvalidRequest(f"the body is not JSON the broker takes: {exc}",
                             code_override="malformed_json") from None
    except ValueError as exc:  # json.JSONDecodeError among them
        raise InvalidRequest(f"the body is not valid JSON: {exc}",
                             code_override="malformed_json") from None
    _check_tree(value)
    return value


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"the body nests objects and arrays more than {MAX_JSON_DEPTH} "
                          "levels deep; nothing the broker takes needs that",
                          code_override="nested_too_deep")


def _check_tree(value) -> None:
    """Refuse a parsed body nested deeper than MAX_JSON_DEPTH, holding a string (or key)
    that is not text the broker stores, an integer beyond 64 bits or a number that is not
    finite (1e999 parses as infinity); a walk with a stack of its own, not recursion. A
    value's path (``inputs.text``) is only spelled out for containers and errors."""
    stack: list = [(value, 1, "", None)]
    while stack:
        node, depth, parent, key = stack.pop()
        t = type(node)
        if t is str:
            if "\x00" in node or not node.isascii():
                _check_text(node, _path(parent, key))
        elif t is int:
            if not -INT64_MAX - 1 <= node <= INT64_MAX:
                digits = str(node)
                raise _out_of_range(_path(parent, key), f"the integer {digits[:24]}"
                                    f"{'…' if len(digits) > 24 else ''}",
                                    f"fit 64 bits (at most {INT64_MAX:,})")
        elif t is float:
            if node - node != 0.0:
                raise _out_of_range(_path(parent, key), "a number",
                                    "be finite (at most about 1.8e308)")
        elif t is dict or t is list:
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            path = _path(parent, key)
            if t is dict:
                for k, item in node.items():
                    if "\x00" in k or not k.isascii():
                        _check_text(k, path or "the body", key=True)
                    if item is not None and type(item) is not bool:
                        stack.append((item, depth + 1, path, k))
            else:
                for i, item in enumerate(node):
                    if item is not None and type(item) is not bool:
                        stack.append((item, depth + 1, path, i))


def _path(parent: str, key) -> str:
    if key is None:
        return parent
    if type(key) is int:
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _out_of_range(path: str, what: str, must: str) -> InvalidRequest:
    return InvalidRequest(f"{_printable(path) or 'the body'} is {what} out of range: numbers "
                          f"must {must}", field=_printable(path) or None,
                          code_override="malformed_json")


def _check_text(text: str, path: str, *, key: bool = False) -> None:
    what = f"a key in {path}" if key else (path or "the body")
    field = None if key or not path else _printable(path)
    if "\x00" in text:  # PostgreSQL's text holds no NUL; no input needs one
        raise InvalidRequest(f"{what} holds a NUL character (\\u0000), which the broker "
                             "does not store; leave it out", field=field,
                             code_override="invalid_text")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"\\u{ord(text[exc.start]):04x}"
        raise InvalidRequest(f"{what} holds a lone surrogate ({bad}), which is not text: "
                             "escape characters outside the BMP as a surrogate pair "
                             "(\\ud83d\\ude00) or send them as UTF-8", field=field,
                             code_override="invalid_text") from None


def check_url_text() -> None:
    """Refuse a path or query string holding a NUL character (``%00``), which no column
    stores (PostgreSQL's text refuses it): ids, names and versions come from there."""
    if "\x00" in request.path or b"%00" in request.query_string:
        raise InvalidRequest("the URL holds a NUL character (%00), which no id, name or "
                             "argument may contain", code_override="invalid_text")


def _printable(path: str) -> str:
    """A field path as an error may quote it (a key may itself hold a lone surrogate)."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def served_type(media_type: str | None) -> tuple[str, bool]:
    """(the Content-Type an output is served with, whether as an attachment): the policy
    of :func:`output_response`, also given to presigned download URLs."""
    safe = SAFE_OUTPUT_TYPES.get((media_type or "").split(";", 1)[0].strip().lower())
    return (safe, False) if safe else ("application/octet-stream", True)


def output_response(data: bytes, media_type: str | None, headers: dict | None = None) -> Response:
    """A job output's bytes, whose media type the provider chose: only the types of
    SAFE_OUTPUT_TYPES are served as themselves; anything else (text/html, image/svg+xml…)
    is application/octet-stream as an attachment, so a provider can never run script in a
    console or API origin. ``sandbox`` and ``nosniff`` are sent on every one."""
    base = (media_type or "").split(";", 1)[0].strip().lower()
    resp = Response(data)
    safe = SAFE_OUTPUT_TYPES.get(base)
    resp.headers["Content-Type"] = safe or "application/octet-stream"
    if safe is None:
        resp.headers["Content-Disposition"] = "attachment"
    resp.headers["Content-Security-Policy"] = "sandbox"
    resp.headers["X-Content-Type-Options"] = "nosniff"
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp
