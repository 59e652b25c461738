"""The request a client sends for a job, checked at the edge into a typed
:class:`broker.jobs.model.JobRequest`: ``POST /v1/jobs``, ``POST /v1/jobs/bulk`` (a list
of them), ``POST /v1/quotes`` and the OpenAI-compatible routes all read it here, so the
job service never sees a raw body."""
from __future__ import annotations

from typing import Any, Collection

from sdk.protocol.canonical import is_sha256_hex

from broker.catalog.registry import PluginCatalog
from broker.errors import BrokerError, InvalidRequest, in_item
from broker.jobs.cache import parse_output_format
from broker.jobs.model import JobRequest

MARKET_FIELDS = ("priority", "max_price_micro", "deadline_s", "n")
OUTPUT_FIELDS = ("output_format", "output_quality", "cache")
JOB_FIELDS = ("plugin", "version", "inputs", "verify", "weights_digest") + MARKET_FIELDS \
    + OUTPUT_FIELDS
QUOTE_FIELDS = ("plugin", "version", "inputs")
MAX_SPLIT = 64
MAX_BULK = 256  # jobs one POST /v1/jobs/bulk may create (each item's n counted)


def job_request(body: Any, catalog: PluginCatalog,
                allowed: Collection[str] = JOB_FIELDS) -> JobRequest:
    """``body`` (a decoded JSON value) as a job request, or a clear 400/404 naming what was
    wrong: the fields known, ``weights_digest`` 64 hex digits, the market terms (see
    :func:`market_terms`), ``verify`` sampled or always, the plugin and version one the
    catalog holds, the output format one the plugin's outputs take, ``cache`` a boolean
    for single jobs. The inputs are checked by the job service against the manifest."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object like "
                             '{"plugin": "sd15", "inputs": {"prompt": "…"}}')
    unknown = set(body) - set(allowed)
    if unknown:
        raise InvalidRequest(f"unknown field {sorted(unknown)[0]!r}; allowed: "
                             + ", ".join(allowed), field=sorted(unknown)[0])
    weights = body.get("weights_digest")
    if weights is not None and not is_sha256_hex(weights):
        raise InvalidRequest(f"weights_digest is {weights!r}; it must be the 64 lowercase "
                             "hex digits of a weights digest (GET /v1/plugins lists the "
                             "ones providers serve)", field="weights_digest")
    terms = market_terms(body)
    verify = body.get("verify", "sampled")
    if verify not in ("sampled", "always"):
        raise InvalidRequest(f"verify is {verify!r}; use \"sampled\" (the broker checks a "
                             "sample of jobs, free) or \"always\" (every output is re-run "
                             "on a second provider; you pay for both runs)", field="verify")
    manifest = plugin_manifest(body, catalog)
    output_format = parse_output_format(body, manifest)
    cache = body.get("cache", False)
    if not isinstance(cache, bool):
        raise InvalidRequest(f"cache is {cache!r}; use true (answer from the result cache "
                             "when a verified job with the same inputs exists, at the "
                             "plugin's cache price) or false (always run; the default)",
                             field="cache")
    if cache and terms["n"] > 1:
        raise InvalidRequest("cache works on single jobs: leave out n (or set it to 1), "
                             "or leave out cache", field="cache")
    return JobRequest(manifest=manifest, inputs=body.get("inputs", {}), terms=terms,
                      verify=verify, weights_digest=weights, output_format=output_format,
                      cache=cache)


def job_requests(body: Any, catalog: PluginCatalog) -> list[JobRequest]:
    """A bulk submit's body, ``{"jobs": [<job request>, ...]}``, as its job requests, each
    read by :func:`job_request`; an error names the item (``jobs[3]: ...``, field
    ``jobs[3].inputs.text``). At most MAX_BULK jobs in all, a split item counting its n."""
    if not isinstance(body, dict) or not isinstance(body.get("jobs"), list):
        raise InvalidRequest('the request body must be a JSON object like {"jobs": '
                             '[{"plugin": "echo", "inputs": {"text": "a"}}, {"plugin": '
                             '"echo", "inputs": {"text": "b"}}]}', field="jobs")
    unknown = set(body) - {"jobs"}
    if unknown:
        raise InvalidRequest(f"unknown field {sorted(unknown)[0]!r}; a bulk submit has only "
                             '"jobs" (options go in each job request)',
                             field=sorted(unknown)[0])
    items = body["jobs"]
    if not 1 <= len(items) <= MAX_BULK:
        raise InvalidRequest(f"jobs has {len(items)} job requests; send 1 to {MAX_BULK} "
                             "(more in several requests)", field="jobs")
    requests = []
    for i, item in enumerate(items):
        try:
            requests.append(job_request(item, catalog))
        except BrokerError as exc:
            raise in_item(exc, i) from None
    total = sum(r.terms["n"] for r in requests)
    if total > MAX_BULK:
        raise InvalidRequest(f"these job requests make {total} jobs (each n counted); one "
                             f"request makes at most {MAX_BULK}: send the rest in another",
                             field="jobs")
    return requests


def plugin_manifest(body: dict, catalog: PluginCatalog):
    """The manifest of the body's ``plugin`` at its ``version`` (else the newest)."""
    plugin = body.get("plugin")
    if not isinstance(plugin, str) or not plugin:
        raise InvalidRequest(f"plugin must be a plugin name; available: {catalog.names()}",
                             field="plugin")
    version = body.get("version")
    if version is not None and not isinstance(version, str):
        raise InvalidRequest("version must be a string like 1.0.0", field="version")
    return catalog.get(plugin, version)


def market_terms(body: dict) -> dict:
    """The request's market fields, checked: ``priority`` (economy | standard | fast),
    ``max_price_micro`` (int micro-credits for the whole request), ``deadline_s`` (seconds
    the client will wait for completion), ``n`` (split into n sibling jobs)."""
    priority = body.get("priority", "standard")
    if priority not in ("economy", "standard", "fast"):
        raise InvalidRequest(f"priority is {priority!r}; use economy, standard or fast",
                             field="priority")
    cap = body.get("max_price_micro")
    if cap is not None and (type(cap) is not int or cap <= 0):
        raise InvalidRequest(f"max_price_micro is {cap!r}; it must be a positive integer "
                             "(micro-credits for the whole request)", field="max_price_micro")
    deadline = body.get("deadline_s")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not 0 < deadline <= 7 * 86_400):
        raise InvalidRequest(f"deadline_s is {deadline!r}; it must be a number of seconds "
                             "above 0 (at most a week)", field="deadline_s")
    n = body.get("n", 1)
    if type(n) is not int or not 1 <= n <= MAX_SPLIT:
        raise InvalidRequest(f"n is {n!r}; it must be an integer from 1 to {MAX_SPLIT}",
                             field="n")
    return {"priority": priority, "max_price_micro": cap,
            "deadline_s": None if deadline is None else float(deadline), "n": n}
