"""The OpenAPI 3.1 document of the client API, served at /openapi.json.

Its schemas are generated from the pydantic models of :mod:`.schemas` (declared once
there); this module lays out the paths, parameters and statuses that use them.

It states every status a route answers for the inputs it is sent (tests/integration/
test_openapi_contract.py drives the app and checks the answers against this document)
and the bounds the server enforces on parameters (``limit``, ``wait``, ``after``...)."""
import functools
import json

from flask import Blueprint, Response

from . import keys as keys_api
from . import openai_compat, registry as registry_api, schemas
from .common import INT64_MAX, MAX_WAIT_S

bp = Blueprint("openapi", __name__)

_PROBLEM = schemas.ref("Problem")


def _stake_move(operation: str, summary: str) -> dict:
    """POST /v1/account/stake and /unstake: the same request and answers."""
    return {"post": {
        "summary": summary, "operationId": operation,
        "parameters": [_key(120)],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": schemas.ref("StakeMove")}}},
        "responses": {"200": {"description": "Stake and available balances"},
                      **_errors(400, 401, 402, 403, 409, 422)}}}


def _key(max_chars: int = 200) -> dict:
    return {"name": "Idempotency-Key", "in": "header",
            "description": "names exactly one request: the same key with the same request "
                           "gives the first answer, with any other request a 409",
            "schema": {"type": "string", "minLength": 1, "maxLength": max_chars}}


def _limit(default: int, most: int) -> dict:
    return {"name": "limit", "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": most, "default": default}}


_WAIT = {"name": "wait", "in": "query", "description": "long-poll: answer once it ends or "
         "this many seconds pass", "schema": {"type": "number", "minimum": 0,
                                              "maximum": MAX_WAIT_S}}


def _errors(*codes):
    return {str(c): {"description": d, "content": {"application/problem+json": {"schema": _PROBLEM}}}
            for c, d in ((400, "Malformed request"), (401, "Missing or bad API key"),
                         (402, "Not enough credits"),
                         (403, "Not allowed for this API key's role, or a scope it lacks "
                               "(code missing_scope, field missing_scope)"),
                         (404, "No such job, output or plugin"), (409, "Conflict"),
                         (413, "Payload too large"),
                         (422, "Inputs outside the plugin's schema"),
                         (429, "Rate limited: this key's budget for the route group is spent; "
                               "retry after the Retry-After header's seconds"),
                         (502, "The payment provider failed; nothing was charged"),
                         (503, "Not ready")) if c in codes}


def _with_auth_errors(paths: dict) -> dict:
    """Every operation that needs an API key also answers 401 (no key, a bad one) and 429
    (rate limits are per key: broker/ratelimit.py): added here once rather than route by
    route."""
    for path, operations in paths.items():
        for op in operations.values():
            if path.startswith("/v1") and op.get("security") != []:
                op["responses"].setdefault("401", _errors(401)["401"])
                op["responses"].setdefault("429", _errors(429)["429"])
    return paths


def document() -> dict:
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Sparecycles broker API", "version": "v1",
                 "description": "Submit inference jobs to the Sparecycles network."},
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                           "description": "An API key (sc_<role>_<id>_<secret>) or a "
                                                          "token from POST /v1/auth/token"}},
            "schemas": schemas.components(),  # generated from broker/api/schemas.py
        },
        "security": [{"apiKey": []}],
        "paths": _with_auth_errors({
            "/v1/jobs": {
                "post": {"summary": "Submit a job", "operationId": "createJob",
                         "parameters": [_key(200),
                                        {"name": "Prefer", "in": "header",
                                         "description": "wait=N (RFC 7240): answer "
                                                        "once the job (a split request: "
                                                        "every sibling) ends or N seconds "
                                                        "(at most 60) pass",
                                         "schema": {"type": "string", "example": "wait=30"}}],
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": schemas.ref("JobRequest")}}},
                         "responses": {"202": {"description": "Queued (n > 1: the batch)",
                                               "content": {"application/json": {"schema": {
                                                   "oneOf": [schemas.ref("Job"),
                                                             schemas.ref("Batch")]}}}},
                             "200": {"description": "Same Idempotency-Key: the first job "
                                     "(or batch); with Prefer: wait, the job once it ended",
                                     "content": {"application/json": {"schema": {
                                         "oneOf": [schemas.ref("Job"),
                                                   schemas.ref("Batch")]}}}},
                             **_errors(400, 401, 402, 403, 404, 409, 413, 422)}},
                "get": {"summary": "Your recent jobs", "operationId": "listJobs",
                        "parameters": [_limit(50, 500)],
                        "responses": {"200": {"description": "Jobs", "content":
                                              schemas.json_content("JobList")},
                                      **_errors(400, 401)}},
            },
            "/v1/jobs/bulk": {
                "post": {"summary": "Submit independent jobs in one request (all or none)",
                         "operationId": "createJobs",
                         "description": "Each item is a job request as for POST /v1/jobs. "
                                        "Every item is checked first; an error names the "
                                        "item (field jobs[i]..., index i) and creates "
                                        "nothing. The jobs and their holds commit "
                                        "together (402: the balance cannot hold them "
                                        "all). The Idempotency-Key names the whole list.",
                         "parameters": [_key(200),
                                        {"name": "Prefer", "in": "header",
                                         "description": "wait=N (RFC 7240): answer once "
                                                        "every job ends or N seconds (at "
                                                        "most 60) pass",
                                         "schema": {"type": "string", "example": "wait=30"}}],
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": schemas.ref("BulkJobRequest")}}},
                         "responses": {"202": {"description": "Queued: each item's job (n "
                                               "> 1: its batch), in item order",
                                               "content": schemas.json_content("BulkJobs")},
                             "200": {"description": "Same Idempotency-Key: the first "
                                     "request's jobs; with Prefer: wait, once they ended",
                                     "content": schemas.json_content("BulkJobs")},
                             **_errors(400, 401, 402, 403, 404, 409, 413, 422)}},
            },
            "/v1/jobs/{job_id}": {
                "get": {"summary": "A job (long-poll with ?wait=seconds)", "operationId": "getJob",
                        "parameters": [job_id, _WAIT],
                        "responses": {"200": {"description": "The job", "content":
                                              schemas.json_content("Job")},
                            **_errors(400, 401, 404)}},
                "delete": {"summary": "Cancel a job", "operationId": "cancelJob",
                           "parameters": [job_id],
                           "responses": {"200": {"description": "Cancelled", "content":
                                                 schemas.json_content("Job")},
                                         **_errors(401, 404, 409)}},
            },
            "/v1/jobs/{job_id}/events": {
                "get": {"summary": "Server-sent events of a job (an error after the stream "
                                   "began comes as an `error` event with a problem body)",
                        "operationId": "jobEvents",
                        "parameters": [job_id] + [
                            {"name": name, "in": where, "description": "resume after "
                             "this event id", "schema": {"type": "integer", "minimum": 0,
                                                         "maximum": INT64_MAX}}
                            for name, where in (("after", "query"),
                                                ("Last-Event-ID", "header"))],
                        "responses": {"200": {"description": "text/event-stream"},
                                      **_errors(400, 401, 404)}}},
            "/v1/jobs/{job_id}/outputs/{index}": {
                "get": {"summary": "One output's bytes", "operationId": "getOutput",
                        "parameters": [job_id, {"name": "index", "in": "path", "required": True,
                                                "schema": {"type": "integer"}}],
                        "responses": {"200": {"description": "The output"},
                                      "307": {"description": "With an S3 blob store: a "
                                              "redirect to a presigned URL of the bytes"},
                                      **_errors(401, 404)}}},
            "/v1/plugins": {"get": {"summary": "Plugins and their input schemas (search: q, "
                                               "publisher, output)",
                                    "operationId": "listPlugins",
                                    "parameters": [{"name": n, "in": "query",
                                                    "schema": {"type": "string"}}
                                                   for n in ("q", "publisher", "output")],
                                    "responses": {"200": {"description": "Plugins",
                                                          "content": schemas.json_content(
                                                              "PluginList")}}},
                            "post": registry_api.publish_plugin_openapi(_errors)},
            "/v1/plugins/{name}": {"get": {"summary": "One plugin", "operationId": "getPlugin",
                                           "parameters": [{"name": "name", "in": "path",
                                                           "required": True,
                                                           "schema": {"type": "string"}}],
                                           "responses": {"200": {
                                               "description": "The plugin",
                                               "content": schemas.json_content("Plugin")},
                                                         **_errors(404)}}},
            "/v1/batches/{batch_id}": {"get": {
                "summary": "A split request: its sibling jobs, outputs as they finish "
                           "(long-poll until all end with ?wait=seconds)",
                "operationId": "getBatch",
                "parameters": [{"name": "batch_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}, _WAIT],
                "responses": {"200": {"description": "The batch",
                                      "content": schemas.json_content("Batch")},
                              **_errors(400, 401, 404)}}},
            "/v1/asks": {"get": {
                "summary": "Standing asks: a provider sees its own, an admin all",
                "operationId": "listAsks",
                "parameters": [{"name": "provider_id", "in": "query",
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "Asks with claimed and measured "
                                                     "throughput"}, **_errors(401, 403)}}},
            "/v1/quotes": {"post": {
                "summary": "What a job would cost (min, expected, max micro-credits), without "
                           "running it", "operationId": "quote",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": schemas.ref("QuoteRequest")}}},
                "responses": {"200": {"description": "The quote",
                                      "content": schemas.json_content("Quote")},
                              **_errors(400, 401, 404, 422)}}},
            "/v1/account": {"get": {"summary": "Balances: available, held, vesting, paid out; "
                                              "funding mode", "operationId": "account",
                                    "responses": {"200": {"description": "Balances",
                                                          "content": schemas.json_content(
                                                              "Account")},
                                                  **_errors(401)}}},
            "/v1/account/transactions": {"get": {
                "summary": "Ledger history of your accounts", "operationId": "transactions",
                "parameters": [_limit(100, 1000)],
                "responses": {"200": {"description": "Transactions",
                                      "content": schemas.json_content("TransactionList")},
                              **_errors(400, 401)}}},
            "/v1/account/stake": _stake_move(
                "stake", "Put available credits at stake (providers; verification slashes "
                         "part of it when the provider is outvoted)"),
            "/v1/account/unstake": _stake_move(
                "unstake", "Take credits back from stake to the available balance (refused "
                           "while any of your jobs is being checked)"),
            "/v1/credits/checkout": {"post": {
                "summary": "Buy credits: a Stripe Checkout session URL",
                "operationId": "checkout",
                "parameters": [_key(200)],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"type": "object", "required": ["credits"],
                               "properties": {"credits": {"type": "integer", "minimum": 1}}}}}},
                "responses": {"201": {"description": "The session"},
                              **_errors(400, 401, 403, 409, 502)}}},
            "/v1/stripe/webhook": {"post": {
                "summary": "Stripe events (signature checked on the raw body; 409 when this "
                           "broker has no Stripe keys)", "security": [],
                "operationId": "stripeWebhook",
                "responses": {"200": {"description": "Handled"}, **_errors(400, 409, 502)}}},
            "/v1/payouts": {
                "get": {"summary": "Your payouts", "operationId": "listPayouts",
                        "responses": {"200": {"description": "Payouts"}, **_errors(401, 403)}},
                "post": {"summary": "Pay out available credits through Stripe Connect",
                         "operationId": "payout", "parameters": [_key(150)],
                         "responses": {"201": {"description": "The payout"},
                                       **_errors(400, 401, 402, 403, 409, 422, 502)}}},
            "/v1/providers": {"get": {
                "summary": "Your machines at a glance: connection, availability, jobs today, "
                           "credits pending/vesting/available/paid, verification standing",
                "operationId": "listMachines",
                "parameters": [{"name": "account_id", "in": "query", "required": False,
                                "description": "admins: the provider account to read",
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The provider overview"},
                              **_errors(400, 401, 403)}}},
            "/v1/payouts/onboarding": {"post": {
                "summary": "A Stripe Connect onboarding link", "operationId": "onboarding",
                "responses": {"201": {"description": "The link"},
                              **_errors(401, 403, 409, 502)}}},
            "/v1/admin/prices": {"get": {"summary": "Prices of every plugin (admin)",
                                         "operationId": "listPrices",
                                         "responses": {"200": {"description": "Prices"},
                                                       **_errors(401, 403)}}},
            "/v1/admin/prices/{plugin}": {
                "get": {"summary": "One plugin's price (admin)", "operationId": "getPrice",
                        "parameters": [{"name": "plugin", "in": "path", "required": True,
                                        "schema": {"type": "string"}}],
                        "responses": {"200": {"description": "The price"},
                                      **_errors(401, 403, 404)}},
                "put": {"summary": "Set a plugin's price; applies to the next job (admin)",
                        "operationId": "setPrice",
                        "parameters": [{"name": "plugin", "in": "path", "required": True,
                                        "schema": {"type": "string"}}],
                        "responses": {"200": {"description": "The new price"},
                                      **_errors(400, 401, 403, 404, 422)}}},
            "/v1/admin/market": {
                "get": {"summary": "The market's rules: reputation floor and more (admin)",
                        "operationId": "getMarketRules",
                        "responses": {"200": {"description": "The rules"},
                                      **_errors(401, 403, 404)}},
                "put": {"summary": "Set the reputation floor (0..1; stored and audited; admin)",
                        "operationId": "setMarketRules",
                        "requestBody": {"required": True, "content": {"application/json": {
                            "schema": {"type": "object", "required": ["reputation_floor"],
                                       "properties": {"reputation_floor": {
                                           "type": "number", "minimum": 0, "maximum": 1}}}}}},
                        "responses": {"200": {"description": "The new rules"},
                                      **_errors(400, 401, 403, 404, 422)}}},
            "/v1/admin/grants": {"post": {
                "summary": "Grant credits (dev funding mode only; admin)",
                "operationId": "grant", "parameters": [_key(150)],
                "responses": {"201": {"description": "The deposit"},
                              **_errors(400, 401, 403, 404, 409, 422)}}},
            **registry_api.openapi_paths(_errors),  # the marketplace (broker/api/registry.py)
            **openai_compat.openapi_paths(),  # the OpenAI-compatible surface
            **keys_api.openapi_paths(_errors),  # keys and tokens (broker/api/keys.py)
            "/livez": {"get": {"summary": "Liveness", "security": [],
                               "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"summary": "Readiness", "security": [],
                                "description": "503 not_ready names each reason in "
                                               "`reasons` ([{check, detail}], check one "
                                               "of database, migrations, draining)",
                                "responses": {"200": {"description": "ready"},
                                              **_errors(503)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format "
                                            "0.0.4; sparecycles_*)", "security": [],
                                 "responses": {"200": {"description": "the metrics",
                                                       "content": {"text/plain": {}}},
                                               **_errors(503)}}},
        }),
    }


@functools.lru_cache(maxsize=1)
def _document_json() -> bytes:
    """The document as served: it depends on nothing but the code, so it is built once (building it
    from the pydantic schemas took 13 ms per request here)."""
    return json.dumps(document(), separators=(",", ":")).encode()


@bp.get("/openapi.json")
def openapi():
    return Response(_document_json(), mimetype="application/json")
