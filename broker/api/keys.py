"""/v1/keys (the caller's account's keys: list, create narrowed or expiring ones, revoke,
rotate) and /v1/auth/token (an API key exchanged for a short-lived JWT with its scopes or
fewer). Admins manage every account's keys from the console and `sparecycles broker keys`.
"""
from __future__ import annotations

import time

from flask import Blueprint, request

from broker.auth.service import MAX_TOKEN_TTL_S, TOKEN_TTL_S, KeyRecord
from broker.errors import InvalidRequest
from .common import json_body, json_object, principal, services

bp = Blueprint("keys", __name__)

MAX_KEY_LIFE_S = 5 * 365 * 86400


def key_to_json(k: KeyRecord, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    return {"object": "api_key", "id": k.id, "account_id": k.account_id, "role": k.role,
            "name": k.name, "scopes": list(k.effective_scopes()),
            "created_at": k.created_at, "expires_at": k.expires_at,
            "revoked_at": k.revoked_at, "state": k.state(now)}


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be a number of seconds from {lo:g} to {hi:g}, got "
                             f"{value!r}", field=name)
    return float(value)


@bp.get("/v1/keys")
def list_keys():
    who = principal()
    now = time.time()
    return {"object": "list", "data": [key_to_json(k, now) for k in
                                       services().auth.list_keys(who.account_id)]}


@bp.post("/v1/keys")
def create_key():
    """A new key of the caller's account: ``scopes`` (no more than the caller's own),
    ``expires_in_s``, ``name``. The plaintext is in this answer only."""
    who = principal()
    body = json_object(("scopes", "expires_in_s", "name"),
                       '{"scopes": ["jobs:read"], "expires_in_s": 86400, "name": "dashboard"}')
    scopes = body.get("scopes")
    if scopes is not None and (not isinstance(scopes, list)
                               or not all(isinstance(s, str) for s in scopes)):
        raise InvalidRequest("scopes must be a list of scope names", field="scopes")
    life = _number(body, "expires_in_s", 60, MAX_KEY_LIFE_S)
    name = body.get("name", "")
    if not isinstance(name, str) or len(name) > 200:
        raise InvalidRequest("name must be text of at most 200 characters", field="name")
    auth = services().auth
    scopes, expires_at = auth.may_hand_out(who, scopes, time.time() + life if life else None)
    key, made = auth.add_key(who.account_id, who.role, scopes=scopes, expires_at=expires_at,
                             name=name)
    return {**key_to_json(auth.get_key(made.key_id)), "key": key}, 201


@bp.delete("/v1/keys/<key_id>")
def revoke_key(key_id: str):
    """Revoke one of the account's keys now (every replica refuses it within seconds)."""
    who = principal()
    auth = services().auth
    auth.revoke(key_id, account_id=who.account_id)
    return key_to_json(auth.get_key(key_id, who.account_id))


@bp.post("/v1/keys/<key_id>/rotate")
def rotate_key(key_id: str):
    """A new key like this one; the old one works ``grace_s`` seconds more (default 0)."""
    who = principal()
    body = json_object(("grace_s",), '{"grace_s": 3600}') if _has_body() else {}
    grace = _number(body, "grace_s", 0, 30 * 86400) or 0.0
    auth = services().auth
    key, old = auth.rotate(key_id, grace_s=grace, caller=who)
    new_id = key.split("_")[2]
    return {**key_to_json(auth.get_key(new_id)), "key": key,
            "replaces": key_to_json(auth.get_key(old.id))}, 201


@bp.post("/v1/auth/token")
def create_token():
    """Exchange the API key of this request for a JWT: ``scopes`` (default the key's),
    ``ttl_s`` (default 300, at most 3600). A token cannot mint tokens."""
    who = principal()
    body = json_body() if _has_body() else {}
    if not isinstance(body, dict) or set(body) - {"scopes", "ttl_s"}:
        raise InvalidRequest('send {"scopes": ["jobs:read"], "ttl_s": 300} or no body')
    ttl = _number(body, "ttl_s", 1, MAX_TOKEN_TTL_S) or TOKEN_TTL_S
    return services().auth.issue_token(who, body.get("scopes"), ttl), 201


def _has_body() -> bool:
    return bool(request.get_data(cache=True))


def openapi_paths(errors) -> dict:
    """This module's entries of /openapi.json (broker/api/openapi.py)."""
    key_id = {"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}
    scopes = {"type": "array", "items": {"type": "string"}}
    return {
        "/v1/keys": {
            "get": {"summary": "Your account's API keys: scopes, expiry, state (scope "
                               "keys:write)", "operationId": "listKeys",
                    "responses": {"200": {"description": "Keys"}, **errors(401, 403)}},
            "post": {"summary": "A new key of your account, with no more scopes than yours; "
                                "the plaintext is in this answer only (keys:write)",
                     "operationId": "createKey",
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"type": "object", "properties": {
                             "scopes": scopes, "name": {"type": "string", "maxLength": 200},
                             "expires_in_s": {"type": "number", "minimum": 60}}}}}},
                     "responses": {"201": {"description": "The key"},
                                   **errors(400, 401, 403)}}},
        "/v1/keys/{key_id}": {"delete": {
            "summary": "Revoke one of your keys now; every replica refuses it within seconds "
                       "(keys:write)", "operationId": "revokeKey", "parameters": [key_id],
            "responses": {"200": {"description": "The revoked key"},
                          **errors(401, 403, 404)}}},
        "/v1/keys/{key_id}/rotate": {"post": {
            "summary": "A new key like this one; the old one works grace_s more seconds "
                       "(keys:write)", "operationId": "rotateKey", "parameters": [key_id],
            "requestBody": {"required": False, "content": {"application/json": {
                "schema": {"type": "object", "properties": {
                    "grace_s": {"type": "number", "minimum": 0}}}}}},
            "responses": {"201": {"description": "The new key and the one it replaces"},
                          **errors(400, 401, 403, 404)}}},
        "/v1/auth/token": {"post": {
            "summary": "Exchange this API key for a short-lived JWT holding its scopes or "
                       "fewer (ttl_s: 1..3600, default 300)", "operationId": "createToken",
            "requestBody": {"required": False, "content": {"application/json": {
                "schema": {"type": "object", "properties": {
                    "scopes": scopes, "ttl_s": {"type": "number", "minimum": 1,
                                                "maximum": MAX_TOKEN_TTL_S}}}}}},
            "responses": {"201": {"description": "The token"}, **errors(400, 401, 403)}}},
    }
