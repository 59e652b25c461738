"""The marketplace: publisher keys, package files, publishing and finding signed plugin
and adapter versions (broker.registry). ``GET /v1/plugins`` and ``GET /v1/plugins/<name>``
(what jobs can run) stay in plugins.py."""
from __future__ import annotations

from flask import Blueprint, Response, request, send_file

from broker.errors import InvalidRequest
from .common import int_arg, json_object, principal, services

bp = Blueprint("registry", __name__)


def _registry():
    return services().registry


# ---- publishers ------------------------------------------------------------------------
@bp.post("/v1/publishers")
def register_publisher():
    body = json_object(("public_key", "proof", "label"),
                       '{"public_key": "<hex>", "proof": "<hex>", "label": "..."}')
    key, created = _registry().register_key(principal(), body.get("public_key"),
                                            body.get("proof"), body.get("label", ""))
    return {"object": "publisher_key", "account_id": key.account_id, **key.to_public()}, \
        (201 if created else 200)


@bp.get("/v1/publishers")
def list_publisher_keys():
    return {"object": "list",
            "data": [k.to_public() for k in _registry().keys_of(principal())]}


# ---- files -----------------------------------------------------------------------------
@bp.put("/v1/blobs/<sha256>")
def put_blob(sha256):
    registry = _registry()
    registry.check_upload(principal(), sha256)  # role, publisher key, sha256: before the body
    # Package files may exceed the JSON limit; a declared length above this is a 413 at once,
    # and a body that runs past it (chunked) is cut off with a 413 too. One byte of slack:
    # werkzeug cannot tell a body of exactly the limit from a longer one; the registry's
    # own count refuses anything past max_blob_bytes.
    request.max_content_length = registry.max_blob_bytes + 1
    out = registry.put_blob_stream(principal(), sha256, request.stream, checked=True)
    return {"object": "blob", **out}, (201 if out["created"] else 200)


# ---- packages --------------------------------------------------------------------------
def _publish(kind: str):
    body = json_object(("document", "signature"), '{"document": {...}, "signature": "<hex>"} '
                       "(`sparecycles publish` does it)")
    document = body.get("document")
    if isinstance(document, dict) and document.get("kind") != kind:
        raise InvalidRequest(f"this endpoint publishes {kind}s; the document's kind is "
                             f"{document.get('kind')!r}", field="kind")
    rec, created = _registry().publish(principal(), document, body.get("signature"))
    return {"object": kind, "created": created, **rec.summary()}, (201 if created else 200)


def _search(kind: str):
    args = request.args
    rows = _registry().search(kind, q=args.get("q"), base=args.get("base"),
                              publisher=args.get("publisher"),
                              limit=int_arg("limit", 100, 1, 1000))
    return {"object": "list", "data": [r.summary() for r in rows]}


def _file(kind: str, name: str, version: str, path: str) -> Response:
    disk, entry = _registry().file_path(kind, name, version, path)
    resp = send_file(disk, mimetype="application/octet-stream", etag=entry["sha256"],
                     max_age=31536000)  # streamed from disk, never read into memory
    resp.headers["X-Content-SHA256"] = entry["sha256"]
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Cache-Control"] = "public, max-age=31536000, immutable"
    return resp


@bp.post("/v1/plugins")
def publish_plugin():
    return _publish("plugin")


@bp.get("/v1/plugins/<name>/versions")
def plugin_versions(name):
    return {"object": "list",
            "data": [r.summary() for r in _registry().versions("plugin", name)]}


@bp.get("/v1/plugins/<name>/<version>")
def plugin_version(name, version):
    return {"object": "plugin", **_registry().get("plugin", name, version).detail()}


@bp.get("/v1/plugins/<name>/<version>/files/<path:path>")
def plugin_file(name, version, path):
    return _file("plugin", name, version, path)


@bp.post("/v1/adapters")
def publish_adapter():
    return _publish("adapter")


@bp.get("/v1/adapters")
def list_adapters():
    return _search("adapter")


@bp.get("/v1/adapters/<name>/versions")
def adapter_versions(name):
    return {"object": "list",
            "data": [r.summary() for r in _registry().versions("adapter", name)]}


@bp.get("/v1/adapters/<name>/<version>")
def adapter_version(name, version):
    return {"object": "adapter", **_registry().get("adapter", name, version).detail()}


@bp.get("/v1/adapters/<name>/<version>/files/<path:path>")
def adapter_file(name, version, path):
    return _file("adapter", name, version, path)


def _p(name: str, description: str = "") -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"},
            **({"description": description} if description else {})}


def openapi_paths(errors) -> dict:
    """This blueprint's part of /openapi.json (``errors`` is openapi._errors)."""
    name, version = _p("name"), _p("version", "a semantic version, or 'latest'")
    path = _p("path", "the file's path inside the package")
    search = [{"name": "q", "in": "query", "schema": {"type": "string"},
               "description": "matches name and description"},
              {"name": "publisher", "in": "query", "schema": {"type": "string"},
               "description": "publisher account id or key"},
              {"name": "limit", "in": "query", "schema": {"type": "integer"}}]
    signed = {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["document", "signature"],
        "properties": {"document": {"type": "object",
                                    "description": "the package document (sdk.protocol.package)"},
                       "signature": {"type": "string",
                                     "description": "Ed25519 signature, hex"}}}}}}
    publish_errors = errors(400, 401, 403, 409, 422)
    return {
        "/v1/publishers": {
            "post": {"summary": "Register an Ed25519 publisher key for your account "
                                "(publisher or admin keys)", "operationId": "registerPublisherKey",
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"type": "object", "required": ["public_key", "proof"],
                                    "properties": {
                                        "public_key": {"type": "string"},
                                        "proof": {"type": "string", "description":
                                                  "signature (purpose 'publisher') of "
                                                  "{account_id, public_key}"},
                                        "label": {"type": "string"}}}}}},
                     "responses": {"201": {"description": "Registered"},
                                   "200": {"description": "Already registered to you"},
                                   **errors(400, 401, 403, 409)}},
            "get": {"summary": "Your publisher keys", "operationId": "listPublisherKeys",
                    "responses": {"200": {"description": "Keys"}, **errors(401)}}},
        "/v1/blobs/{sha256}": {"put": {
            "summary": "Upload one package file, addressed by its sha256 (checked)",
            "operationId": "putBlob", "parameters": [_p("sha256")],
            "requestBody": {"required": True, "content": {"application/octet-stream": {}}},
            "responses": {"201": {"description": "Stored"}, "200": {"description": "Had it"},
                          **errors(400, 401, 403, 413, 422)}}},
        "/v1/plugins/{name}/versions": {"get": {
            "summary": "Published versions of a plugin, newest first",
            "operationId": "pluginVersions", "parameters": [name],
            "responses": {"200": {"description": "Versions"}, **errors(401, 404)}}},
        "/v1/plugins/{name}/{version}": {"get": {
            "summary": "One published plugin version: its signed document and files",
            "operationId": "pluginVersion", "parameters": [name, version],
            "responses": {"200": {"description": "The version"}, **errors(401, 404)}}},
        "/v1/plugins/{name}/{version}/files/{path}": {"get": {
            "summary": "Download a file of a published plugin version",
            "operationId": "pluginFile", "parameters": [name, version, path],
            "responses": {"200": {"description": "The bytes (X-Content-SHA256)"},
                          **errors(401, 404)}}},
        "/v1/adapters": {
            "post": {"summary": "Publish a signed adapter version (files uploaded first)",
                     "operationId": "publishAdapter", "requestBody": signed,
                     "responses": {"201": {"description": "Published"},
                                   "200": {"description": "Identical version already published"},
                                   **publish_errors}},
            "get": {"summary": "Search adapters (latest version of each)",
                    "operationId": "listAdapters",
                    "parameters": search + [{"name": "base", "in": "query",
                                             "schema": {"type": "string"},
                                             "description": "only adapters for this plugin"}],
                    "responses": {"200": {"description": "Adapters"}, **errors(400, 401)}}},
        "/v1/adapters/{name}/versions": {"get": {
            "summary": "Published versions of an adapter, newest first",
            "operationId": "adapterVersions", "parameters": [name],
            "responses": {"200": {"description": "Versions"}, **errors(401, 404)}}},
        "/v1/adapters/{name}/{version}": {"get": {
            "summary": "One adapter version: base, royalty, signed document, files",
            "operationId": "adapterVersion", "parameters": [name, version],
            "responses": {"200": {"description": "The version"}, **errors(401, 404)}}},
        "/v1/adapters/{name}/{version}/files/{path}": {"get": {
            "summary": "Download a file of a published adapter version",
            "operationId": "adapterFile", "parameters": [name, version, path],
            "responses": {"200": {"description": "The bytes (X-Content-SHA256)"},
                          **errors(401, 404)}}},
    }


def publish_plugin_openapi(errors) -> dict:
    """POST /v1/plugins (the GET of that path lives in plugins.py)."""
    return {"summary": "Publish a signed plugin version (files uploaded first)",
            "operationId": "publishPlugin",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["document", "signature"],
                "properties": {"document": {"type": "object"},
                               "signature": {"type": "string"}}}}}},
            "responses": {"201": {"description": "Published"},
                          "200": {"description": "Identical version already published"},
                          **errors(400, 401, 403, 409, 422)}}
