"""/openapi.json is generated from the pydantic models of broker/api/schemas.py: the
document validates as OpenAPI 3.1 (openapi-spec-validator), and schemathesis drives
every operation of the live app with bounded examples: no answer is a server error, and
every answer's status, content type and body conform to the document. The counts are
printed at the end of the module."""
from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from openapi_spec_validator import validate  # noqa: E402
# Imported here, at collection: schemathesis loads its OpenAPI adapters lazily, and pytest
# rewriting those modules deep inside a test's stack trips CPython 3.11's AST recursion
# check ("AST constructor recursion depth mismatch").
import schemathesis.specs.openapi.schemas  # noqa: E402,F401
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance,  # noqa: E402
                                               response_schema_conformance,
                                               status_code_conformance)

from broker.app import create_app  # noqa: E402
from broker.services import build_services  # noqa: E402
from broker.settings import Settings  # noqa: E402
from tests.integration.conftest import seen_provider  # noqa: E402

MAX_EXAMPLES = 12  # per operation: the suite stays fast
COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    # Rate limits off: hypothesis replays a case to confirm a failure, and a 429 from one
    # key's bursts would make the same case answer differently ("inconsistent results").
    services = build_services(Settings(data_dir=tmp_path_factory.mktemp("schemathesis"),
                                       rate_limits="off"))
    app = create_app(services)
    seen_provider(services, ["echo", "sd15", "llama"])  # jobs are admitted (and stay queued)
    keys = {}
    for role in ("client", "provider", "publisher", "admin"):
        keys[role], who = services.auth.create_account_with_key(role)
        if role == "client":
            services.payments.grant(who.account_id, 50 * 1_000_000, by="test")
    client = app.test_client()
    for body in ({"plugin": "echo", "inputs": {"text": "a"}},  # listed jobs to check
                 {"plugin": "echo", "inputs": {"text": "b"}, "n": 2}):
        assert client.post("/v1/jobs", json=body, headers={
            "Authorization": f"Bearer {keys['client']}"}).status_code == 202
    yield app, keys
    services.close()
    total = sum(sum(c.values()) for c in COUNTS.values())
    print(f"\nschemathesis: {len(COUNTS)} operations, {total} cases, "
          f"server errors: {sum(c['5xx'] for c in COUNTS.values())}")
    for op, counts in sorted(COUNTS.items()):
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        print(f"  {op}: {shown}")


@pytest.fixture(scope="module")
def api_schema(world):
    app, _ = world
    # /metrics is answered by the ASGI front (broker/web/front.py), not the Flask app this
    # drives; the front's own tests (tests/integration/test_metrics.py) cover it.
    return schemathesis.openapi.from_wsgi("/openapi.json", app).exclude(path="/metrics")


def test_the_document_is_valid_openapi_generated_from_the_models(world):
    app, _ = world
    doc = app.test_client().get("/openapi.json").json
    validate(doc)  # raises with the path of what is wrong
    from broker.api.schemas import MODELS
    assert {m.__name__ for m in MODELS} <= set(doc["components"]["schemas"])
    job = doc["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]["200"]
    assert job["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Job"}


def _role(path: str, method: str) -> str:
    if path.startswith("/v1/admin"):
        return "admin"
    if path in ("/v1/publishers", "/v1/adapters") or path.startswith("/v1/blobs") or (
            path == "/v1/plugins" and method == "POST"):
        return "publisher"
    if path in ("/v1/account/stake", "/v1/account/unstake") or path.startswith("/v1/payouts"):
        return "provider"
    return "client"


def test_every_operation_conforms(api_schema, world):
    """Each operation of the document, MAX_EXAMPLES generated cases each (hypothesis,
    derandomized: the same cases every run)."""
    from hypothesis import given

    _, keys = world
    failures = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 40

    for operation in operations:
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def run(case):
            # No waiting: the jobs this world queues never run (no agent), so a long poll,
            # a Prefer: wait or an OpenAI-compatible request answers at once.
            if case.query and "wait" in case.query:
                case.query["wait"] = "0"
            case.headers = {**(case.headers or {}), "Prefer": "wait=0",
                            "Authorization": f"Bearer {keys[_role(case.path, case.method)]}"}
            op = f"{case.method} {case.path}"
            try:
                response = case.call_and_validate(checks=[
                    not_a_server_error, status_code_conformance, content_type_conformance,
                    response_schema_conformance])
            except Exception:
                COUNTS[op]["failed"] += 1
                raise
            COUNTS[op][f"{response.status_code // 100}xx"] += 1
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - collect every operation's, then fail
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}"[:2000])
    assert not failures, "\n\n".join(failures)
