"""Helpers the blueprints share: the services of this app, the caller and its role, JSON
bodies."""
from __future__ import annotations

from collections.abc import Collection

from flask import Response, current_app, g, request

from broker.errors import Forbidden, InvalidRequest

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


def json_object(allowed: Collection[str] | None, example: str) -> dict:
    """The request's JSON body, which must be an object with keys from ``allowed`` only
    (None: any key): else a 400 showing ``example``, or naming the first unknown key as
    its ``field``."""
    body = json_body()
    if not isinstance(body, dict):
        raise InvalidRequest(f"send a JSON object like {example}")
    if allowed is not None:
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise InvalidRequest(f"unknown field {unknown[0]!r}; allowed: "
                                 f"{', '.join(allowed)} (like {example})", field=unknown[0])
    return body


def json_body():
    """The request's JSON object, or a clear 400 (malformed JSON, wrong content type)."""
    if not request.data:
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
