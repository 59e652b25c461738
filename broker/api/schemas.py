"""The wire shapes of the client API, declared once as pydantic models: the components of
``/openapi.json`` are generated from them (:func:`components`), and the tests hold the
app's answers to them (schemathesis checks every response against the document, and
tests/integration/test_openapi_generated.py validates the document itself).

Models describe what the broker sends and takes; fields a later broker adds are allowed
(``extra="allow"``: clients must ignore what they do not know). Money is integer
micro-credits (``*_micro``); times are Unix seconds unless named otherwise.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

JobState = Literal["queued", "matched", "running", "submitted", "verifying", "disputed",
                   "settled", "refunded", "cancelled", "failed"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Problem(_Open):
    """RFC 7807 problem details: every error of the API (but the OpenAI-compatible
    routes, whose errors are OpenAI's :class:`OpenAIError`)."""
    type: str
    title: str
    status: int
    code: str = Field(description="stable: clients branch on it")
    detail: str = Field(description="what was wrong and what to do next")
    field: str | None = Field(None, description="the request field at fault")
    request_id: str | None = Field(None, description="quote it when reporting a problem")


def _no_null_defaults(schema: dict) -> None:
    """A request field left out is not the same as one sent as null (which the broker
    refuses): the request models' optional fields default to absence, not null."""
    for prop in schema.get("properties", {}).values():
        if prop.get("default", 0) is None:
            del prop["default"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_no_null_defaults)


class JobRequest(_Request):
    """POST /v1/jobs."""
    model_config = ConfigDict(extra="forbid", json_schema_extra=lambda schema: (
        _no_null_defaults(schema), schema.setdefault("examples", [
            {"plugin": "echo", "inputs": {"text": "hi"}},
            {"plugin": "sd15", "inputs": {"prompt": "a lighthouse at dusk", "seed": 7},
             "priority": "fast"},
            {"plugin": "echo", "inputs": {"text": "two"}, "n": 2}])))
    plugin: str = Field(min_length=1)
    version: str = Field(None)
    inputs: dict[str, Any] = Field(default_factory=dict,
                                   description="checked against the plugin's input_schema")
    priority: Literal["economy", "standard", "fast"] = Field(None)
    max_price_micro: int = Field(None, ge=1, description="cap for the whole request")
    deadline_s: float = Field(None, gt=0)
    n: int = Field(None, ge=1, le=64, description="split into n sibling jobs (a batch)")
    verify: Literal["sampled", "always"] = Field(
        None, description="always: every output is re-run on a second provider (you pay "
                          "both runs)")
    weights_digest: str = Field(None, pattern="^[0-9a-f]{64}$",
                                description="run only on these weights")
    output_format: Literal["png", "webp", "jpeg"] = Field(
        None, description="image outputs encoded so (image plugins only)")
    output_quality: int = Field(None, ge=1, le=100,
                                description="webp and jpeg quality (default 90)")
    cache: bool = Field(None, description="answer from a settled, verified job with the "
                        "same inputs (seed included) at the plugin's cache price, without "
                        "running; default false")


class BulkJobRequest(_Request):
    """POST /v1/jobs/bulk: independent jobs in one request, created together or not at all."""
    model_config = ConfigDict(extra="forbid", json_schema_extra=lambda schema: (
        _no_null_defaults(schema), schema.setdefault("examples", [
            {"jobs": [{"plugin": "echo", "inputs": {"text": "a"}},
                      {"plugin": "echo", "inputs": {"text": "b"}, "priority": "fast"}]}])))
    jobs: list[JobRequest] = Field(min_length=1, max_length=256,
                                   description="at most 256 jobs in all (a split item "
                                               "counts its n)")


class Output(_Open):
    index: int
    media_type: str
    sha256: str
    size: int
    url: str = Field(description="GET it with your key")
    download_url: str | None = Field(None, description="with an S3 blob store: a presigned "
                                     "URL that GETs the bytes straight from storage, no API "
                                     "key, until download_expires_at")
    download_expires_at: float | None = Field(None, description="epoch seconds")
    meta: dict[str, Any] = Field(default_factory=dict, description="the plugin's meta (seed, "
                                 "token ids, latent hash …) as the provider signed it")


class Verification(_Open):
    status: Literal["unchecked", "checking", "verified", "disputed", "overturned",
                    "nondeterministic"]
    p: float | None = None
    reason: str | None = None
    updated_at: float | None = None
    note: str | None = None


class Progress(_Open):
    step: int | None = None
    total: int | None = None


class JobError(_Open):
    code: str | None = None
    message: str | None = None


class Job(_Open):
    id: str
    object: Literal["job"] = "job"
    plugin: str
    version: str
    state: JobState
    attempt: int
    inputs: dict[str, Any]
    work_units: float
    provider_id: str | None = None
    sandboxed: bool | None = Field(None, description="false: the provider runs plugins "
                                   "without the sandbox")
    progress: Progress
    created_at: float
    updated_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: JobError | None = None
    priority: str | None = None
    deadline_s: float | None = None
    price_micro_per_unit: int | float | None = Field(
        None, description="the auction's clearing price, once assigned")
    batch_id: str | None = None
    batch_index: int | None = None
    verify: str | None = None
    weights_digest: str | None = None
    verification: Verification
    check_of: str | None = None
    request_id: str | None = Field(None, description="the X-Request-Id of the request that "
                                   "created the job; agents' logs name it as its digest, "
                                   "rq_ + 24 hex digits of its SHA-256")
    output_format: dict[str, Any] | None = None
    cache: dict[str, Any] | None = Field(None, description="with cache: hit, and the job "
                                         "cached_from whose outputs a hit got")
    outputs: list[Output] | None = Field(None, description="once settled (not in lists)")


class JobList(_Open):
    object: Literal["list"] = "list"
    data: list[Job]


class Batch(_Open):
    id: str
    object: Literal["batch"] = "batch"
    n: int
    state: Literal["settled", "failed", "running"]
    done: bool
    jobs: list[Job]


class BulkJobs(_Open):
    """POST /v1/jobs/bulk's answer: each item as POST /v1/jobs answers it, in item order."""
    object: Literal["list"] = "list"
    data: list[Job | Batch]


class Plugin(_Open):
    name: str
    version: str
    publisher: str | None = None
    output: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="JSON Schema of the inputs")


class PluginList(_Open):
    object: Literal["list"] = "list"
    data: list[Plugin]


class QuoteRequest(_Request):
    model_config = ConfigDict(extra="forbid", json_schema_extra=lambda schema: (
        _no_null_defaults(schema), schema.setdefault("examples", [
            {"plugin": "sd15", "inputs": {"prompt": "a cube", "steps": 20}},
            {"plugin": "echo"}])))
    plugin: str = Field(min_length=1)
    version: str = Field(None)
    inputs: dict[str, Any] = Field(default_factory=dict)


class Quote(_Open):
    object: Literal["quote"] = "quote"
    plugin: str
    version: str
    work_units: float
    min_micro: int
    expected_micro: int
    max_micro: int
    held_at_submit_micro: int
    royalty_micro: int


class Account(_Open):
    object: Literal["account"] = "account"
    id: str
    role: Literal["client", "provider", "publisher", "admin"]
    funding: str = Field(description="stripe, or dev (an admin grants credits)")
    available_micro: int
    held_micro: int
    vesting_micro: int
    stake_micro: int
    paid_out_micro: int


class Transaction(_Open):
    transaction_id: str
    kind: str
    account: str
    amount_micro: int
    created_at: str = Field(description="ISO 8601")
    memo: str
    hold_id: str | None = None


class TransactionList(_Open):
    object: Literal["list"] = "list"
    data: list[Transaction]


class StakeMove(_Request):
    amount_micro: int = Field(ge=1)


class OpenAIErrorDetail(_Open):
    message: str
    type: str
    param: str | None = None
    code: str
    request_id: str | None = None


class OpenAIError(_Open):
    """The error body of the OpenAI-compatible routes (what OpenAI's clients parse)."""
    error: OpenAIErrorDetail


class Model(_Open):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(_Open):
    object: Literal["list"] = "list"
    data: list[Model]


class ChatMessage(_Open):
    role: str
    content: str | None = None


class ChatChoice(_Open):
    index: int
    message: ChatMessage
    finish_reason: str


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str


class Completion(_Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Image(_Open):
    url: str | None = None
    b64_json: str | None = None


class ImagesResponse(_Open):
    created: int
    data: list[Image]


MODELS: tuple[type[BaseModel], ...] = (
    Problem, JobRequest, BulkJobRequest, Output, Verification, Job, JobList, Batch,
    BulkJobs, Plugin, PluginList,
    QuoteRequest, Quote, Account, Transaction, TransactionList, StakeMove, OpenAIError,
    Model, ModelList, ChatCompletion, Completion, ImagesResponse)


def components() -> dict[str, dict]:
    """``components.schemas`` of /openapi.json: every model of MODELS and the models they
    use, each once, referenced as ``#/components/schemas/<Name>``."""
    out: dict[str, dict] = {}
    template = "#/components/schemas/{model}"
    for model in MODELS:
        mode = "validation" if issubclass(model, _Request) else "serialization"
        schema = model.model_json_schema(ref_template=template, mode=mode)
        for name, sub in schema.pop("$defs", {}).items():
            out.setdefault(name, sub)
        out[model.__name__] = schema
    return out


def ref(name: str) -> dict:
    if name not in {m.__name__ for m in MODELS}:
        raise KeyError(f"no schema {name!r}; declare it in broker/api/schemas.py")
    return {"$ref": f"#/components/schemas/{name}"}


def json_content(name: str, media_type: str = "application/json") -> dict:
    return {media_type: {"schema": ref(name)}}
