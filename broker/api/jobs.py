"""/v1/jobs: submit, inspect, stream events, cancel, fetch outputs."""
from __future__ import annotations

import json
import time

from flask import Blueprint, request

from broker.errors import BrokerError
from broker.jobs.hub import HubWait, quiet_slice_s
from broker.jobs.model import Job, JobOutput
from . import waiting
from .job_request import job_request, job_requests
from .common import (idempotency_key, int_arg, internal_problem, json_body, output_response,
                     principal, request_id, seconds_arg, served_type, services)

bp = Blueprint("jobs", __name__)


def output_to_json(job_id: str, o: JobOutput, meta: dict | None = None, blobs=None,
                   expired: bool = False) -> dict:
    """An output as the API shows it. ``url`` is the broker's (the client's API key); with
    a blob store that presigns (S3), ``download_url`` is a short-lived URL anyone holding
    it may GET the bytes with straight from storage, until ``download_expires_at``.
    ``expired``: retention deleted the bytes (the output's hash and size remain)."""
    body = {"index": o.index, "media_type": o.media_type, "sha256": o.sha256, "size": o.size,
            "url": f"/v1/jobs/{job_id}/outputs/{o.index}", "meta": meta or {}}
    if expired:
        body["expired"] = True
    elif blobs is not None and blobs.presigns:
        # Served as the broker serves it: a type a provider chose is never run as script.
        served, attachment = served_type(o.media_type)
        body["download_url"], body["download_expires_at"] = blobs.presign_get(
            o.sha256, media_type=served, attachment=attachment)
    return body


def _metas(job: Job) -> dict[str, dict]:
    """The plugin's meta of each output (seed, token ids, …), as the provider's signed
    receipt states it, by output sha256 (an overturned job's outputs are another run's),
    with the seed the run was given: the broker fixed the job's seed (output ``i`` uses
    ``seed + i``), whatever a provider reports."""
    seed = (job.inputs or {}).get("seed")
    out = {}
    for i, o in enumerate((job.receipt or {}).get("outputs", [])):
        if not isinstance(o, dict):
            continue
        meta = dict(o.get("meta") or {})
        if isinstance(seed, int) and not isinstance(seed, bool):
            index = o.get("index", i)
            meta["seed"] = seed + (index if isinstance(index, int) else i)
        out[str(o.get("sha256"))] = meta
    return out


def verification_to_json(v) -> dict:
    """A job's verification status (DESIGN §6): unchecked, checking, verified, disputed,
    overturned or nondeterministic."""
    if v is None:
        return {"status": "unchecked"}
    return {"status": v.status.value, "p": round(v.p, 6), "reason": v.reason,
            "updated_at": v.updated_at,
            "note": (v.outcome or {}).get("note", "")}


def job_to_json(job: Job, outputs: list[JobOutput] | None = None,
                sandboxed: bool | None = None, verification=None, blobs=None,
                expired: bool = False) -> dict:
    body = {
        "id": job.id, "object": "job", "plugin": job.plugin, "version": job.plugin_version,
        "state": job.state.value, "attempt": job.attempt, "inputs": job.inputs,
        "work_units": job.work_units, "provider_id": job.provider_id,
        # False when the provider runs plugins without the sandbox (--no-sandbox).
        "sandboxed": sandboxed,
        "progress": {"step": job.progress_step, "total": job.progress_total},
        "created_at": job.created_at, "updated_at": job.updated_at,
        "started_at": job.started_at, "finished_at": job.finished_at,
        "error": ({"code": job.error_code, "message": job.error_message}
                  if job.error_code else None),
        "priority": job.priority, "deadline_s": job.deadline_s,
        # The auction's clearing price (micro-credits per work unit), once assigned.
        "price_micro_per_unit": job.price_micro_per_unit,
        "batch_id": job.batch_id, "batch_index": job.batch_index,
        "verify": job.verify, "weights_digest": job.weights_digest,
        "verification": verification_to_json(verification),
        "request_id": job.request_id,
    }
    if job.check_of:
        body["check_of"] = job.check_of
    if job.output_format:
        body["output_format"] = job.output_format
    if job.cache:
        # Answered from the result cache: the verified job whose outputs (and receipt) it got.
        body["cache"] = {"hit": bool(job.cached_from), "cached_from": job.cached_from}
    if outputs is not None:
        metas = _metas(job)
        body["outputs"] = [output_to_json(job.id, o, metas.get(o.sha256), blobs, expired)
                           for o in outputs]
    return body


def _render(job: Job) -> dict:
    svc = services()
    outputs = svc.jobs.outputs_of(job) if job.state.value == "settled" else []
    # A cache hit's outputs are its source's: so is their verification.
    verification = (svc.verification.status(job.cached_from or job.id)
                    if svc.verification is not None and job.state.value == "settled" else None)
    return job_to_json(job, outputs, sandboxed=svc.providers.sandboxed_of(job.provider_id),
                       verification=verification, blobs=svc.jobs.blobs,
                       expired=bool(outputs) and svc.jobs.outputs_expired(job))


@bp.post("/v1/jobs")
def create_job():
    """Submit a job (202; 200 when an Idempotency-Key replays an earlier one). With
    ``Prefer: wait=N`` (RFC 7240) the answer waits up to N seconds (at most 60) for the
    job, or every sibling of a split request (n > 1), to end, saving the client a second
    request; ``Preference-Applied`` then says so.
    """
    key = idempotency_key()
    wait_s = _preferred_wait(request.headers.get("Prefer"))  # checked before any row exists
    if wait_s is not None and not waiting.may_wait():
        wait_s = None  # the replica holds all the waiting clients it may: answer at once
    svc, who = services(), principal()
    body = json_body()  # JSON that cannot be read is refused first, then a key that cannot
    svc.jobs.check_submitter(who)  # submit, then what the body asks (job_request)
    job, created = svc.jobs.submit(who, job_request(body, svc.catalog),
                                   idempotency_key=key, request_id=request_id())
    status = 202 if created else 200
    applied = {"Preference-Applied": f"wait={wait_s:g}"} if wait_s is not None else {}
    if job.batch_id:
        siblings = svc.jobs.batch(who, job.batch_id)
        if wait_s is None:
            return _render_batch(siblings), status
        return waiting.answer_after(
            svc.jobs.waiting_batch(who, job.batch_id, wait_s, jobs=siblings),
            lambda siblings: (_render_batch(siblings), status, applied))
    if wait_s is None:
        return _render(job), status
    return waiting.answer_after(svc.jobs.waiting(who, job.id, wait_s, job=job),
                                lambda job: (_render(job), status, applied))


@bp.post("/v1/jobs/bulk")
def create_jobs():
    """Submit independent jobs in one request, ``{"jobs": [<job request>, ...]}`` (at most
    256 jobs, a split item counting its n): 202 with each one's answer of ``POST /v1/jobs``
    (a job, a batch for n > 1) in item order, ``{"object": "list", "data": [...]}``; 200
    when an Idempotency-Key replays an earlier one. Every item is checked first; an error
    names the item (``field`` ``jobs[i]...``, ``index`` i) and nothing is created: all
    the jobs with their holds commit in one transaction, or none (402 when the balance
    cannot hold them all). ``Prefer: wait=N`` waits for every job as on ``POST /v1/jobs``.
    """
    key = idempotency_key()
    wait_s = _preferred_wait(request.headers.get("Prefer"))  # checked before any row exists
    if wait_s is not None and not waiting.may_wait():
        wait_s = None
    svc, who = services(), principal()
    body = json_body()
    svc.jobs.check_submitter(who)
    jobs, created = svc.jobs.submit_many(who, job_requests(body, svc.catalog),
                                         idempotency_key=key, request_id=request_id())
    status = 202 if created else 200
    groups = [svc.jobs.batch(who, j.batch_id) if j.batch_id else [j] for j in jobs]
    if wait_s is None:
        return _render_list(groups), status
    applied = {"Preference-Applied": f"wait={wait_s:g}"}
    return waiting.answer_after(svc.jobs.waiting_all(who, groups, wait_s),
                                lambda groups: (_render_list(groups), status, applied))


def _render_list(groups: list[list[Job]]) -> dict:
    """A bulk submit's answer: each item as POST /v1/jobs answers it (a split: its batch)."""
    return {"object": "list", "data": [_render_batch(g) if g[0].batch_id else _render(g[0])
                                       for g in groups]}


def _preferred_wait(prefer: str | None) -> float | None:
    """The ``wait`` preference of a Prefer header (``wait=10``, among others separated by
    commas); other preferences are ignored, as RFC 7240 asks."""
    for token in (prefer or "").split(","):
        name, _, value = token.strip().partition("=")
        if name.strip().lower() == "wait":
            return seconds_arg(value.split(";")[0].strip().strip('"'), "Prefer",
                               what="Prefer: wait")
    return None


def _render_batch(jobs: list[Job]) -> dict:
    """A split request: its sibling jobs in order, each with its outputs once settled."""
    states = {j.state.value for j in jobs}
    done = all(j.state.terminal for j in jobs)
    return {"id": jobs[0].batch_id, "object": "batch", "n": len(jobs),
            "state": ("settled" if states == {"settled"} else
                      "failed" if done else "running"),
            "done": done, "jobs": [_render(j) for j in jobs]}


@bp.get("/v1/batches/<batch_id>")
def get_batch(batch_id):
    """A split request; with ``?wait=N`` (seconds, at most 60) the answer waits until every
    sibling has ended or N seconds pass (a long poll, like ``GET /v1/jobs/<id>?wait=N``)."""
    wait_s = seconds_arg(request.args.get("wait"), "wait")
    svc, who = services(), principal()
    if wait_s is not None:
        return waiting.answer_after(svc.jobs.waiting_batch(who, batch_id, wait_s),
                                    _render_batch)
    return _render_batch(svc.jobs.batch(who, batch_id))


@bp.get("/v1/jobs")
def list_jobs():
    limit = int_arg("limit", 50, 1, 500)
    jobs = services().jobs.repo.list_for_account(principal().account_id, limit)
    return {"object": "list", "data": [job_to_json(j) for j in jobs]}


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id):
    wait_s = seconds_arg(request.args.get("wait"), "wait")
    if wait_s is not None:
        return waiting.answer_after(services().jobs.waiting(principal(), job_id, wait_s),
                                    _render)
    return _render(services().jobs.get(principal(), job_id))


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id):
    job = services().jobs.cancel(principal(), job_id)
    return _render(job)


@bp.get("/v1/jobs/<job_id>/outputs/<int:index>")
def get_output(job_id, index):
    jobs = services().jobs
    if jobs.blobs.presigns:  # the bytes come from storage, never through the broker
        out = jobs.output_meta(principal(), job_id, index)
        served, attachment = served_type(out.media_type)
        url, _ = jobs.blobs.presign_get(out.sha256, media_type=served, attachment=attachment)
        return "", 307, {"Location": url, "Cache-Control": "private, no-store",
                         "X-Content-SHA256": out.sha256}
    out, data = jobs.output(principal(), job_id, index)
    return output_response(data, out.media_type,
                           headers={"ETag": f'"{out.sha256}"', "X-Content-SHA256": out.sha256,
                                    "Cache-Control": "private, max-age=31536000, immutable"})


@bp.get("/v1/jobs/<job_id>/events")
def job_events(job_id):
    """Server-sent events: one event per lifecycle step (queued, assigned, running,
    progress, token, requeued, done, failed, cancelled); the stream ends after the last."""
    svc = services().jobs
    who = principal()
    svc.get(who, job_id)  # 404 before the stream starts
    after = int_arg("after", 0, 0, header="Last-Event-ID")
    terminal = {"done", "failed", "cancelled", "refunded"}

    rid = request_id()  # the generators below run after the view returned: no context

    def stream():
        # A comment first, so that the status line and headers go out now, not with the
        # first event (which may be a while: a stream resumed after the last one).
        yield f": events of job {job_id}\n\n"
        try:
            yield from follow(after)
        except Exception as exc:  # noqa: BLE001 - the answer has begun: say so in the stream
            # The status line went out with the first event: an error now is one more
            # event, an RFC 7807 body, and the end of the stream (never a torn connection
            # or a server's plain-text page).
            body = exc.problem() if isinstance(exc, BrokerError) else internal_problem(exc, rid)
            yield f"event: error\ndata: {json.dumps({**body, 'request_id': rid})}\n\n"

    def follow(last):
        idle_since = time.monotonic()
        while True:
            version = svc.hub.version(job_id)
            events = svc.repo.events_after(job_id, last)
            for ev in events:
                last = ev.id
                payload = {"job_id": job_id, "at": ev.created_at, **ev.data}
                yield f"id: {ev.id}\nevent: {ev.kind}\ndata: {json.dumps(payload)}\n\n"
                if ev.kind in terminal:
                    return
            if events:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 15:
                idle_since = time.monotonic()
                yield ": keep-alive\n\n"
            yield HubWait(job_id, version, quiet_slice_s())

    return waiting.stream(stream(), mimetype="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

