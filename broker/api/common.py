"""Helpers the blueprints share: the services of this app, the caller and its role, JSON
bodies, numeric query arguments."""
from __future__ import annotations

from collections.abc import Collection

from flask import Response, current_app, g, request

from broker.errors import Forbidden, InvalidRequest

MAX_WAIT_S = 60.0  # the longest a request may wait for a job (?wait=, Prefer: wait)

# Output media types served as themselves; anything else a provider names is a download.
SAFE_OUTPUT_TYPES = {"image/png": "image/png", "image/jpeg": "image/jpeg",
                     "image/webp": "image/webp", "text/plain": "text/plain; charset=utf-8",
                     "application/json": "application/json"}


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


def int_arg(name: str, default: int, lo: int, hi: int | None, *,
            header: str | None = None) -> int:
    """The integer query argument ``name`` (else the ``header``, else ``default``), from
    ``lo`` to ``hi`` (None: no upper bound): else a 400 naming it and the range."""
    raw = request.args.get(name)
    if raw is None and header:
        raw = request.headers.get(header)
    if raw is None:
        return default
    return _number(raw, name, lo, hi, integer=True)


def seconds_arg(raw: str | None, field: str, *, what: str | None = None) -> float | None:
    """``raw`` (a query argument or header value as sent; None: None) as a wait of 0 to
    MAX_WAIT_S seconds: else a 400 naming ``field`` (``what``: how the message names the
    value, ``field`` by default) and the range."""
    if raw is None:
        return None
    return _number(raw, field, 0, MAX_WAIT_S, integer=False, what=what)


def _number(raw: str, field: str, lo: float, hi: float | None, *, integer: bool,
            what: str | None = None):
    kind = "an integer" if integer else "a number of seconds"
    span = f"from {lo:g} to {hi:g}" if hi is not None else f"of {lo:g} or more"
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not (lo <= value and (hi is None or value <= hi)):  # NaN fails too
        raise InvalidRequest(f"{what or field} must be {kind} {span}, got {raw!r}", field=field)
    return value


def json_body():
    """The request's JSON object, or a clear 400 (malformed JSON, wrong content type)."""
    # get_data, not .data: .data first runs werkzeug's form parser over the body (a
    # measurable share of the per-request CPU), and a JSON body is never a form.
    if not request.get_data(cache=True):
        raise InvalidRequest("the request has no body; send a JSON object with "
                             "Content-Type: application/json")
    body = request.get_json(silent=True, force=True)
    if body is None:
        raise InvalidRequest("the body is not valid JSON", code_override="malformed_json")
    return body


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
