"""The OpenAI-compatible surface: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/images/generations`` and ``/v1/models`` (DESIGN §3, Interoperability), so that the
official ``openai`` package, and tools built on it, work with ``base_url`` pointed at the
broker and a Sparecycles client key.

Each request becomes an ordinary job (``JobService.submit``: the same hold, auction,
settlement and verification as ``POST /v1/jobs``) for the plugin its ``model`` names; the
answer waits for the job through the waiting layer (:mod:`.waiting`: no thread is held
while it waits), and ``stream=true`` follows the job's token events as OpenAI's
``chat.completion.chunk`` server-sent events. What maps and what is refused is in
:data:`CHAT_PARAMS`, :data:`COMPLETION_PARAMS`, :data:`IMAGE_PARAMS` and the README;
a refused parameter is a 400 in OpenAI's error shape naming it (``param``).

Errors on these routes use OpenAI's body, ``{"error": {"message", "type", "param",
"code"}}`` (see :func:`openai_error_body`), so the openai client raises the matching
exception (``BadRequestError``, ``AuthenticationError``, ``NotFoundError``,
``RateLimitError``…). Where a retry cannot help (no credit, a failed or timed-out job) the
answer says ``x-should-retry: false``, which the openai client obeys.
"""
from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, request

from broker.errors import BrokerError, Forbidden, InvalidRequest, NotFound, ReplicaFull
from broker.jobs.hub import HubWait, quiet_slice_s
from sdk.protocol.signing import SignatureError, verify
from . import schemas, waiting
from .jobs import _metas
from .job_request import job_request
from .common import (idempotency_key, internal_problem, json_body, output_response,
                     principal, request_id, services)

bp = Blueprint("openai", __name__)

OPENAI_WAIT_S = 600.0   # the longest a (non-streamed) answer waits for its job
OUTPUT_URL_TTL_S = 3600  # how long an image's signed URL (response_format=url) works
MARKET_FIELDS = ("priority", "max_price_micro", "deadline_s", "verify")

# OpenAI parameter -> plugin input it maps to (None: accepted and has no effect; a
# ("refuse", allowed) pair: only values equal to ``allowed`` are accepted).
CHAT_PARAMS: dict[str, Any] = {
    "model": None, "messages": None, "stream": None, "stream_options": None, "n": None,
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature", "top_p": "top_p", "stop": "stop", "seed": "seed",
    "user": None, "metadata": None, "store": ("refuse", (None, False)),
    "presence_penalty": ("refuse", (None, 0, 0.0)),
    "frequency_penalty": ("refuse", (None, 0, 0.0)),
    "logit_bias": ("refuse", (None, {})), "logprobs": ("refuse", (None, False)),
    "top_logprobs": ("refuse", (None, 0)),
    "tools": ("refuse", (None, [])), "tool_choice": ("refuse", (None, "none")),
    "functions": ("refuse", (None, [])), "function_call": ("refuse", (None, "none")),
    "parallel_tool_calls": None,
    "response_format": ("refuse", (None, {"type": "text"})),
    "modalities": ("refuse", (None, ["text"])), "audio": ("refuse", (None,)),
    "prediction": ("refuse", (None,)), "reasoning_effort": ("refuse", (None,)),
    "service_tier": ("refuse", (None, "auto", "default")),
}
COMPLETION_PARAMS: dict[str, Any] = {
    "model": None, "prompt": None, "stream": None, "stream_options": None, "n": None,
    "max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
    "stop": "stop", "seed": "seed", "user": None, "echo": None,
    "presence_penalty": ("refuse", (None, 0, 0.0)),
    "frequency_penalty": ("refuse", (None, 0, 0.0)),
    "logit_bias": ("refuse", (None, {})), "logprobs": ("refuse", (None, 0)),
    "suffix": ("refuse", (None, "")), "best_of": ("refuse", (None, 1)),
}
IMAGE_PARAMS: dict[str, Any] = {
    "model": None, "prompt": None, "n": None, "size": None, "response_format": None,
    "user": None, "quality": ("refuse", (None, "auto", "standard")),
    "style": ("refuse", (None,)), "output_format": ("refuse", (None, "png")),
    "background": ("refuse", (None, "auto")), "moderation": ("refuse", (None, "auto", "low")),
    "output_compression": ("refuse", (None,)),
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- errors in OpenAI's shape -------------------------------------------------------
_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error",
          504: "timeout"}
_PARAM_OF_INPUT = {"max_new_tokens": "max_tokens", "width": "size", "height": "size"}


def is_openai_route() -> bool:
    """Whether the request is one of this blueprint's (its errors take OpenAI's shape)."""
    return request.blueprint == bp.name


def openai_error_body(problem: dict, status: int) -> tuple[dict, int, dict]:
    """An RFC 7807 problem as OpenAI's error body: (body, status, headers). No credit is
    OpenAI's 429 ``insufficient_quota`` (what its clients look for), not to be retried;
    an input outside the plugin's schema is a 400 naming the OpenAI parameter."""
    code = str(problem.get("code") or "error")
    headers: dict[str, str] = {}
    field = problem.get("field")
    if isinstance(field, str) and field.startswith("inputs."):
        name = field.removeprefix("inputs.")
        field = _PARAM_OF_INPUT.get(name, name)
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="sparecycles"'
    if code == "insufficient_credits":
        status, kind, code = 429, "insufficient_quota", "insufficient_quota"
        headers["x-should-retry"] = "false"
    elif status == 422:
        status = 400
    if code in ("unknown_plugin", "model_not_found"):
        code = "model_not_found"
    if status in (504,) or code in ("job_failed", "job_cancelled"):
        headers["x-should-retry"] = "false"
    error = {"message": str(problem.get("detail") or problem.get("title") or code),
             "type": kind, "param": field, "code": code}
    if problem.get("request_id"):
        error["request_id"] = problem["request_id"]
    extra = {k: v for k, v in problem.items()
             if k.endswith("_micro") or k in ("job_id", "job_ids")}
    if code != problem.get("code"):
        extra["code"] = problem.get("code")  # the broker's own code (its API's problem)
    if extra:
        error["sparecycles"] = extra
    return {"error": error}, status, headers


class ModelNotFound(NotFound):
    code, title = "model_not_found", "Model not found"


class JobDidNotSettle(BrokerError):
    """The job behind an OpenAI request failed, was cancelled, or ran past the wait."""
    code, http_status, title = "job_failed", 502, "The job did not settle"


class JobTimedOut(BrokerError):
    code, http_status, title = "job_timeout", 504, "The job ran past the wait"


# ---- models ------------------------------------------------------------------------
def _kinds(manifest) -> list[str]:
    """Which OpenAI endpoints a plugin serves: chat (text output, ``messages`` input),
    completions (text output, ``prompt``), images (image output, ``prompt``)."""
    names = {s.name for s in manifest.inputs.fields}
    kinds = []
    if manifest.output == "text":
        if "messages" in names:
            kinds.append("chat.completions")
        if "prompt" in names:
            kinds.append("completions")
    elif manifest.output == "images" and "prompt" in names:
        kinds.append("images.generations")
    return kinds


def _model(name: Any, kind: str | None = None, param: str = "model"):
    """The manifest ``name`` (``plugin`` or ``plugin@version``) names, when it serves
    ``kind`` (None: any endpoint here, as ``GET /v1/models/<name>`` asks); else a 404
    ``model_not_found`` listing the models that do."""
    svc = services()

    def serves(manifest) -> bool:
        kinds = _kinds(manifest)
        return bool(kinds) if kind is None else kind in kinds

    fits = [m.name for m in svc.catalog.all() if serves(m)]
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"model is required: one of {fits} (GET /v1/models lists them)",
                             field=param)
    plugin, _, version = name.partition("@")
    try:
        manifest = svc.catalog.get(plugin, version or None)
    except NotFound:
        manifest = None
    if manifest is None or not serves(manifest):
        where = "" if kind is None else f" for /v1/{kind.replace('.', '/')}"
        raise ModelNotFound(f"the model {name!r} does not exist{where}; models here: {fits} "
                            "(GET /v1/models lists every model and what it serves)",
                            field=param)
    return manifest


def _model_json(manifest) -> dict:
    served = services().jobs.builds_served
    return {"id": manifest.name, "object": "model", "created": 0,
            "owned_by": manifest.publisher,
            "sparecycles": {"version": manifest.version, "output": manifest.output,
                            "endpoints": _kinds(manifest), "description": manifest.description,
                            "online": (served.serves(manifest.name, manifest.version)
                                       if served is not None else None)}}


@bp.get("/v1/models")
def list_models():
    """The plugins the OpenAI surface can run, as OpenAI model objects."""
    return {"object": "list",
            "data": [_model_json(m) for m in services().catalog.all() if _kinds(m)]}


@bp.get("/v1/models/<name>")
def get_model(name):
    return _model_json(_model(name))


# ---- request mapping ---------------------------------------------------------------
def _body() -> dict:
    body = json_body()
    if not isinstance(body, dict):
        raise InvalidRequest("send a JSON object like {\"model\": \"llama\", ...}")
    return body


def _map(body: dict, params: dict, manifest, skip: set[str] = frozenset()) -> tuple[dict, dict]:
    """(plugin inputs, market terms) from an OpenAI body: each OpenAI parameter mapped
    through ``params``; an extra field naming one of the plugin's own inputs (steps,
    negative_prompt, ignore_eos…) or a market term (priority, max_price_micro,
    deadline_s, verify) passes as it is (the openai client sends them with
    ``extra_body``). Anything else is a 400 naming it."""
    names = {s.name for s in manifest.inputs.fields}
    inputs: dict[str, Any] = {}
    terms: dict[str, Any] = {}
    for key, value in body.items():
        if key in skip:
            continue
        if key in params:
            rule = params[key]
            if isinstance(rule, tuple):
                if value not in rule[1]:
                    allowed = ", ".join(json.dumps(v) for v in rule[1] if v is not None)
                    raise InvalidRequest(
                        f"{key} is not supported by this broker (models run as Sparecycles "
                        f"jobs on {manifest.name})" + (f"; leave it out or send {allowed}"
                                                        if allowed else "; leave it out"),
                        field=key, code_override="unsupported_parameter")
            elif rule is not None and value is not None:
                if rule not in names:
                    raise InvalidRequest(f"{key} has no equivalent in model {manifest.name}; "
                                         "leave it out", field=key,
                                         code_override="unsupported_parameter")
                inputs[rule] = value
        elif key in MARKET_FIELDS:
            terms[key] = value
        elif key in names and key not in ("messages", "prompt", "score_tokens"):
            inputs[key] = value
        else:
            extra = sorted(names - {"messages", "prompt", "score_tokens"} - set(inputs))
            raise InvalidRequest(
                f"unknown parameter {key!r}; this endpoint takes the OpenAI parameters "
                f"{', '.join(k for k, r in params.items() if not isinstance(r, tuple))}, "
                f"and as extra fields the inputs of {manifest.name} ({', '.join(extra)}) and "
                f"the market terms ({', '.join(MARKET_FIELDS)})", field=key,
                code_override="unknown_parameter")
    if "stop" in inputs:
        inputs["stop"] = _one_stop(inputs["stop"])
        if inputs["stop"] is None:
            del inputs["stop"]
    return inputs, terms


def _one_stop(stop: Any) -> str | None:
    if isinstance(stop, list):
        if len(stop) > 1:
            raise InvalidRequest(f"stop holds {len(stop)} sequences; this broker's models "
                                 "stop on one: send a string or a list of one",
                                 field="stop", code_override="unsupported_parameter")
        stop = stop[0] if stop else None
    if stop is not None and not isinstance(stop, str):
        raise InvalidRequest("stop must be a string or a list of one string", field="stop")
    return stop or None


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}", field=name)
    return value


def _n(body: dict, most: int = 4) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= most:
        raise InvalidRequest(f"n must be an integer from 1 to {most}, got {n!r}", field="n")
    return n


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise InvalidRequest("stream_options takes only include_usage (true or false)",
                             field="stream_options")
    if opts and not body.get("stream"):
        raise InvalidRequest("stream_options needs stream: true", field="stream_options")
    return bool(opts.get("include_usage"))


def _messages(raw: Any) -> str:
    """OpenAI chat messages as the plugin's ``messages`` input (a JSON array of
    {role, content} with text content), or a 400 naming the message."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty array of {\"role\", \"content\"} "
                             "objects", field="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where} must be an object with role and content",
                                 field=where)
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise InvalidRequest(f"{where}.role is {role!r}; this broker's chat models take "
                                 "system, developer, user and assistant messages (no tool or "
                                 "function messages)", field=f"{where}.role",
                                 code_override="unsupported_parameter")
        unknown = set(m) - {"role", "content", "name", "refusal"}
        if m.get("tool_calls") or m.get("function_call") or unknown - {"tool_calls",
                                                                      "function_call"}:
            bad = sorted(unknown)[0] if unknown else "tool_calls"
            raise InvalidRequest(f"{where}.{bad} is not supported (no tool calls here); "
                                 "send role and content", field=f"{where}.{bad}",
                                 code_override="unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or \
                        not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"{where}.content[{j}] must be a text part "
                                         "({\"type\": \"text\", \"text\": …}); images and "
                                         "audio are not supported by these models",
                                         field=f"{where}.content",
                                         code_override="unsupported_parameter")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"{where}.content must be a string or an array of text "
                                 "parts", field=f"{where}.content")
        out.append({"role": role, "content": content})
    return json.dumps(out, ensure_ascii=False)


def _prompt(raw: Any) -> str:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if not isinstance(raw, str) or not raw:
        raise InvalidRequest("prompt must be a non-empty string (or a list of one string; "
                             "token arrays and several prompts are not supported)",
                             field="prompt")
    return raw


def _submit(manifest, inputs: dict, terms: dict, n: int):
    """Queue the job (n > 1: a split request of n siblings) as POST /v1/jobs would, and
    return its jobs (the first, or every sibling)."""
    if not waiting.may_wait():
        raise ReplicaFull("this broker replica holds all the waiting clients it may; retry "
                          "in a second, or send the request to another replica")
    svc, who = services(), principal()
    body: dict[str, Any] = {"plugin": manifest.name, "version": manifest.version,
                            "inputs": inputs, **terms}
    if n > 1:
        body["n"] = n
    svc.jobs.check_submitter(who)  # before the terms are judged, as for POST /v1/jobs
    job, _ = svc.jobs.submit(who, job_request(body, svc.catalog),
                             idempotency_key=idempotency_key(),
                             request_id=request_id())
    if job.batch_id:
        return svc.jobs.batch(who, job.batch_id)
    return [job]


def _wait_all(svc, who, jobs: list, timeout_s: float):
    """A waiting generator: every job of ``jobs`` once it ends (or as it is when
    ``timeout_s`` passes)."""
    deadline = time.monotonic() + timeout_s
    out = []
    for job in jobs:
        out.append((yield from svc.jobs.waiting(who, job.id, deadline - time.monotonic(),
                                                job=job)))
    return out


def _settled(svc, who, jobs: list) -> list:
    """``jobs`` when every one settled; else cancel those still running and raise
    (``svc``, ``who``: passed in, as a stream's generator has no request context)."""
    running = [j for j in jobs if not j.state.terminal]
    for job in running:
        try:
            svc.jobs.cancel(who, job.id, reason="the OpenAI-compatible request's wait ran out")
        except BrokerError:
            pass
    if running:
        raise JobTimedOut(f"the job {running[0].id} did not finish within the wait "
                          "and was cancelled (you pay only for work done); ask for fewer "
                          "tokens or steps, or submit it with POST /v1/jobs and follow it",
                          job_ids=[j.id for j in jobs])
    for job in jobs:
        if job.state.value != "settled":
            why = f": {job.error_message}" if job.error_message else ""
            raise JobDidNotSettle(f"the job {job.id} ended {job.state.value}{why}; what was "
                                  "not earned was refunded", job_id=job.id,
                                  code_override=("job_cancelled"
                                                 if job.state.value == "cancelled"
                                                 else "job_failed"))
    return jobs


def _outputs(svc, job) -> list[tuple[Any, bytes, dict]]:
    """(output, bytes, meta) of a settled job, in order."""
    metas = _metas(job)
    return [(o, svc.jobs.blobs.get(o.sha256), metas.get(o.sha256, {}))
            for o in svc.jobs.outputs_of(job)]


def _fingerprint(job) -> str | None:
    digest = (job.envelope or {}).get("weights_digest") or job.weights_digest
    return f"fp_{digest[:16]}" if digest else None


MAX_TOKEN_COUNT = 1 << 31  # a count past this is no count a model made


def _count(value: Any) -> int:
    """A token count from a provider's result meta as OpenAI's ``usage`` has it: a whole
    number >= 0. The meta is the provider's word: anything else (text, a fraction, NaN,
    infinity, a negative, true, an absurd size) counts 0, never a float in the answer nor
    a failed answer for a job that ran."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value < MAX_TOKEN_COUNT:
        return value
    return 0


def usage_of(metas: list[dict]) -> dict:
    """OpenAI's ``usage`` of an answer from its jobs' result metas: the prompt once (every
    choice saw the same), the completions summed; integers always (:func:`_count`)."""
    prompt = max((_count(m.get("prompt_tokens")) for m in metas), default=0)
    completion = sum(_count(m.get("generated_tokens")) for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sc(jobs: list) -> dict:
    return {"job_ids": [j.id for j in jobs], "plugin": f"{jobs[0].plugin}@"
            f"{jobs[0].plugin_version}", "price_micro_per_unit": jobs[0].price_micro_per_unit}


def _finish(meta: dict) -> str:
    return "length" if meta.get("finish_reason") == "length" else "stop"


# ---- text ---------------------------------------------------------------------------
@bp.post("/v1/chat/completions")
def chat_completions():
    body = _body()
    manifest = _model(body.get("model"), "chat.completions")
    inputs, terms = _map(body, CHAT_PARAMS, manifest)
    inputs["messages"] = _messages(body.get("messages"))
    return _text(body, manifest, inputs, terms, chat=True)


@bp.post("/v1/completions")
def completions():
    body = _body()
    manifest = _model(body.get("model"), "completions")
    inputs, terms = _map(body, COMPLETION_PARAMS, manifest)
    prompt = inputs["prompt"] = _prompt(body.get("prompt"))
    inputs.setdefault("max_new_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    return _text(body, manifest, inputs, terms, chat=False,
                 echo=prompt if _flag(body, "echo") else "")


def _text(body: dict, manifest, inputs: dict, terms: dict, *, chat: bool, echo: str = ""):
    stream = _flag(body, "stream")
    usage = _include_usage(body)
    n = _n(body)
    if stream and n > 1:
        raise InvalidRequest("stream with n > 1 is not supported; stream one choice, or "
                             "send n without stream", field="n",
                             code_override="unsupported_parameter")
    model = body["model"]
    svc, who = services(), principal()  # ``answer`` runs in a request context of its own
    wait_s = _wait_s(terms)  # a bad Prefer header is refused before any job exists
    jobs = _submit(manifest, inputs, terms, n)
    if stream:
        return _stream(jobs[0], model, chat=chat, usage=usage, echo=echo, wait_s=wait_s)

    def answer(ended: list):
        ended = _settled(svc, who, ended)
        choices, metas = [], []
        for i, job in enumerate(ended):
            out = _outputs(svc, job)
            text = "".join(data.decode("utf-8", "replace") for _, data, _ in out)
            meta = out[0][2] if out else {}
            metas.append(meta)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text,
                                                        "refusal": None},
                                "logprobs": None, "finish_reason": _finish(meta)})
            else:
                choices.append({"index": i, "text": echo + text, "logprobs": None,
                                "finish_reason": _finish(meta)})
        first = ended[0]
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{first.id}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(first.created_at), "model": model,
                "system_fingerprint": _fingerprint(first), "choices": choices,
                "usage": usage_of(metas), "sparecycles": _sc(ended)}
    return waiting.answer_after(_wait_all(svc, who, jobs, wait_s), answer)


def _wait_s(terms: dict) -> float:
    """How long the answer waits for its job: OPENAI_WAIT_S, less when the request says
    ``Prefer: wait=N`` (0 to 60 s, as on POST /v1/jobs) or has a ``deadline_s``."""
    from .jobs import _preferred_wait

    wait = OPENAI_WAIT_S
    preferred = _preferred_wait(request.headers.get("Prefer"))
    if preferred is not None:
        wait = preferred
    deadline = terms.get("deadline_s")
    if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) and deadline > 0:
        wait = min(wait, float(deadline) + 30.0)
    return wait


def _stream(job, model: str, *, chat: bool, usage: bool, echo: str,
            wait_s: float = OPENAI_WAIT_S) -> Response:
    """The job's tokens as OpenAI's streamed chunks (``data: {...}`` lines, then
    ``data: [DONE]``), followed through the job's events like GET /v1/jobs/<id>/events:
    the generator yields a HubWait where it waits, so no thread is held meanwhile."""
    svc, who, rid = services(), principal(), request_id()
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{job.id}"
    base = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(job.created_at), "model": model}

    def chunk(text: str | None = None, finish: str | None = None, role: bool = False,
              **extra) -> str:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish}
        return _sse({**base, "choices": [choice], **extra})

    def follow() -> Iterator[str | HubWait]:
        yield chunk("" if chat else echo, role=True) if chat or echo else ": started\n\n"
        last, idle_since = 0, time.monotonic()
        deadline = time.monotonic() + wait_s
        while True:
            version = svc.jobs.hub.version(job.id)
            events = svc.jobs.repo.events_after(job.id, last)
            for ev in events:
                last = ev.id
                if ev.kind == "token" and ev.data.get("text"):
                    yield chunk(str(ev.data["text"]))
                elif ev.kind in ("done", "failed", "cancelled", "refunded"):
                    ended = svc.jobs.get(who, job.id)
                    _settled(svc, who, [ended])  # raises for a job that did not settle
                    metas = [meta for _, _, meta in _outputs(svc, ended)]
                    meta = metas[0] if metas else {}
                    yield chunk(None if chat else "", finish=_finish(meta),
                                system_fingerprint=_fingerprint(ended))
                    if usage:
                        yield _sse({**base, "choices": [], "usage": usage_of(metas),
                                    "sparecycles": _sc([ended])})
                    yield "data: [DONE]\n\n"
                    return
            now = time.monotonic()
            if now > deadline:
                svc.jobs.cancel(who, job.id, reason="the streamed request's wait ran out")
                raise JobTimedOut(f"the job {job.id} did not finish within "
                                  f"{wait_s:g} s and was cancelled")
            if events:
                idle_since = now
            elif now - idle_since > 15:
                idle_since = now
                yield ": keep-alive\n\n"
            yield HubWait(job.id, version, quiet_slice_s())

    def stream():
        try:
            yield from follow()
        except Exception as exc:  # noqa: BLE001 - the answer has begun: say so in the stream
            problem = exc.problem() if isinstance(exc, BrokerError) else internal_problem(exc,
                                                                                          rid)
            err, _, _ = openai_error_body({**problem, "request_id": rid},
                                          int(problem.get("status") or 500))
            yield _sse(err)  # the openai client raises APIError on an "error" chunk
            yield "data: [DONE]\n\n"

    return waiting.stream(stream(), mimetype="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- images -------------------------------------------------------------------------
@bp.post("/v1/images/generations")
def image_generations():
    body = _body()
    manifest = _model(body.get("model"), "images.generations")
    inputs, terms = _map(body, IMAGE_PARAMS, manifest)
    inputs["prompt"] = body.get("prompt")
    if not isinstance(inputs["prompt"], str) or not inputs["prompt"]:
        raise InvalidRequest("prompt is required: a description of the image", field="prompt")
    names = {s.name for s in manifest.inputs.fields}
    size = body.get("size")
    if size not in (None, "auto"):
        w, _, h = str(size).partition("x")
        if not (isinstance(size, str) and w.isdigit() and h.isdigit()):
            raise InvalidRequest(f"size is {size!r}; send WIDTHxHEIGHT in pixels (multiples "
                                 "of 8, like 512x512) or auto (the model's own size)",
                                 field="size")
        inputs["width"], inputs["height"] = int(w), int(h)
    fmt = body.get("response_format") or "url"
    if fmt not in ("url", "b64_json"):
        raise InvalidRequest(f"response_format is {fmt!r}; use url or b64_json",
                             field="response_format")
    n = _n(body, 4)
    split = 1
    if "n" in names:
        inputs["n"] = n  # one job draws n images (seed, seed + 1, …)
    else:
        split = n
    svc, who = services(), principal()  # ``answer`` runs in a request context of its own
    wait_s = _wait_s(terms)  # a bad Prefer header is refused before any job exists
    jobs = _submit(manifest, inputs, terms, split)

    def answer(ended: list):
        ended = _settled(svc, who, ended)
        data = []
        for job in ended:
            for out, raw, meta in _outputs(svc, job):
                item: dict[str, Any] = {"revised_prompt": None}
                if fmt == "b64_json":
                    item["b64_json"] = base64.b64encode(raw).decode()
                else:
                    item["url"] = signed_output_url(job.id, out.index)
                data.append(item)
        return {"created": int(ended[0].created_at), "data": data,
                "output_format": "png", "sparecycles": _sc(ended)}
    return waiting.answer_after(_wait_all(svc, who, jobs, wait_s), answer)


def _url_document(job_id: str, index: int, expires: int) -> dict:
    return {"job_id": job_id, "index": index, "expires": expires}


def signed_output_url(job_id: str, index: int) -> str:
    """An absolute URL for an output that works without an API key until it expires
    (OpenAI's image ``url``: clients fetch it with a plain GET), signed with the broker's
    key (purpose ``output-url``)."""
    expires = int(time.time()) + OUTPUT_URL_TTL_S
    sig = services().signer.sign("output-url", _url_document(job_id, index, expires))
    return (f"{request.host_url.rstrip('/')}/v1/images/outputs/{job_id}/{index}"
            f"?expires={expires}&signature={sig}")


@bp.get("/v1/images/outputs/<job_id>/<int:index>")
def signed_output(job_id, index):
    """An output by a signed URL (no API key): 403 once it expired or when the signature
    is not the broker's."""
    svc = services()
    raw_exp, sig = request.args.get("expires", ""), request.args.get("signature", "")
    if not raw_exp.isdigit() or len(raw_exp) > 12 or not sig:
        raise InvalidRequest("this URL needs the expires and signature the image response "
                             "gave; ask for the image again", field="signature")
    expires = int(raw_exp)
    try:
        verify(svc.signer.public_key_hex, "output-url", _url_document(job_id, index, expires),
               sig)
    except SignatureError:
        raise Forbidden("this image URL's signature is not valid; use the URL exactly as "
                        "the image response gave it", code_override="bad_signature") from None
    if expires < time.time():
        raise Forbidden(f"this image URL expired {int(time.time()) - expires} s ago (they "
                        f"last {OUTPUT_URL_TTL_S} s); fetch the output with your API key at "
                        f"/v1/jobs/{job_id}/outputs/{index}", code_override="url_expired")
    for out in svc.jobs.repo.outputs(job_id):
        if out.index == index:
            return output_response(svc.jobs.blobs.get(out.sha256), out.media_type,
                                   headers={"ETag": f'"{out.sha256}"',
                                            "Cache-Control": "private, max-age=3600"})
    from broker.jobs.errors import OutputNotFound
    raise OutputNotFound(f"job {job_id} has no output {index}")


PUBLIC_ENDPOINTS = frozenset({f"{bp.name}.signed_output"})


# ---- the OpenAPI document's part (broker/api/openapi.py) -----------------------------
_OPENAI_ERROR = schemas.ref("OpenAIError")
_DESCRIPTIONS = {400: "A parameter this broker refuses or a malformed body (param names it)",
                 401: "Missing or bad API key", 403: "Not allowed for this key's role, or "
                 "a signed URL that is not valid or expired", 404: "No such model or output",
                 409: "No provider serves the model, or an Idempotency-Key reused",
                 413: "Payload too large",
                 429: "No credit (insufficient_quota: not retried), or a rate limit",
                 502: "The job failed or was cancelled (not retried)",
                 503: "The replica holds all the waiting clients it may",
                 504: "The job ran past the wait and was cancelled (not retried)"}


def _oa_errors(*codes) -> dict:
    return {str(c): {"description": _DESCRIPTIONS[c], "content": {"application/json": {
        "schema": _OPENAI_ERROR}}} for c in codes}


def _json_body(required: list[str], props: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": required, "properties": props,
        "additionalProperties": True,
        "description": "OpenAI's parameters; extra fields: the model's plugin inputs and "
                       "the market terms (priority, max_price_micro, deadline_s, verify)"}}}}


_TEXT = {"model": {"type": "string", "minLength": 1}, "n": {"type": "integer", "minimum": 1,
                                                            "maximum": 4},
         "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number"},
         "top_p": {"type": "number"}, "seed": {"type": "integer"},
         "stop": {"type": ["string", "array", "null"]}, "stream": {"type": "boolean"}}


def openapi_paths() -> dict:
    """This surface's entries of /openapi.json (its errors are OpenAI's shape)."""
    waits = (400, 401, 403, 404, 409, 413, 429, 502, 503, 504)
    def completion(name: str) -> dict:
        return {"200": {"description": "The completion (JSON), or with stream=true its "
                        "chunks as server-sent events ending with data: [DONE]",
                        "content": {**schemas.json_content(name),
                                    "text/event-stream": {"schema": {"type": "string"}}}}}
    return {
        "/v1/chat/completions": {"post": {
            "summary": "OpenAI-compatible chat completion (a job on the model's plugin)",
            "operationId": "openaiChatCompletion", "parameters": [_IDEMPOTENCY],
            "requestBody": _json_body(["model", "messages"], {
                **_TEXT, "messages": {"type": "array", "minItems": 1,
                                      "items": {"type": "object"}},
                "max_completion_tokens": {"type": "integer", "minimum": 1}}),
            "responses": {**completion("ChatCompletion"), **_oa_errors(*waits)}}},
        "/v1/completions": {"post": {
            "summary": "OpenAI-compatible text completion (a job on the model's plugin)",
            "operationId": "openaiCompletion", "parameters": [_IDEMPOTENCY],
            "requestBody": _json_body(["model", "prompt"], {
                **_TEXT, "prompt": {"type": ["string", "array"]},
                "echo": {"type": "boolean"}}),
            "responses": {**completion("Completion"), **_oa_errors(*waits)}}},
        "/v1/images/generations": {"post": {
            "summary": "OpenAI-compatible image generation (a job on sd15, sdxl…)",
            "operationId": "openaiImageGeneration", "parameters": [_IDEMPOTENCY],
            "requestBody": _json_body(["model", "prompt"], {
                "model": {"type": "string"}, "prompt": {"type": "string", "minLength": 1},
                "n": {"type": "integer", "minimum": 1, "maximum": 4},
                "size": {"type": "string", "description": "WIDTHxHEIGHT or auto"},
                "response_format": {"type": "string", "enum": ["url", "b64_json"]}}),
            "responses": {"200": {"description": "The images",
                                  "content": schemas.json_content("ImagesResponse")},
                          **_oa_errors(*waits)}}},
        "/v1/images/outputs/{job_id}/{index}": {"get": {
            "summary": "An image by the signed URL an images response gave (no API key)",
            "operationId": "openaiSignedOutput", "security": [],
            "parameters": [
                {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "index", "in": "path", "required": True,
                 "schema": {"type": "integer"}},
                {"name": "expires", "in": "query", "schema": {"type": "integer"}},
                {"name": "signature", "in": "query", "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The image"}, **_oa_errors(400, 403, 404)}}},
        "/v1/models": {"get": {
            "summary": "OpenAI-compatible model list: the plugins these routes run",
            "operationId": "openaiListModels",
            "responses": {"200": {"description": "The models",
                                  "content": schemas.json_content("ModelList")},
                          **_oa_errors(401)}}},
        "/v1/models/{name}": {"get": {
            "summary": "One model", "operationId": "openaiGetModel",
            "parameters": [{"name": "name", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The model",
                                  "content": schemas.json_content("Model")},
                          **_oa_errors(401, 404)}}},
    }


_IDEMPOTENCY = {"name": "Idempotency-Key", "in": "header",
                "schema": {"type": "string", "minLength": 1, "maxLength": 200}}
