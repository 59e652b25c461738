"""Helpers the blueprints share: the services of this app, the caller, JSON bodies."""
from __future__ import annotations

from flask import Response, current_app, g, request

from broker.errors import InvalidRequest

# Output media types served as themselves; anything else a provider names is a download.
SAFE_OUTPUT_TYPES = {"image/png": "image/png", "image/jpeg": "image/jpeg",
                     "image/webp": "image/webp", "text/plain": "text/plain; charset=utf-8",
                     "application/json": "application/json"}


def services():
    return current_app.extensions["sparecycles"]


def principal():
    return g.principal


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
