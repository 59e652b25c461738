"""Helpers the blueprints share: the services of this app, the caller, JSON bodies."""
from __future__ import annotations

from flask import current_app, g, request

from broker.errors import InvalidRequest


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
