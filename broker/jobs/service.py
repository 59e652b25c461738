"""JobService: submits, assigns, tracks and settles jobs (DESIGN §2).

Transport code (REST blueprints, the gRPC gateway) calls into this class; it never sees
Flask or grpc. Every state change is a conditional transition in the repository, so a late
receipt, a duplicate message or a racing lease reaper can never move a job twice.
"""
from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Protocol

from sdk.protocol.canonical import canonical_bytes, is_sha256_hex, sha256_hex
from sdk.protocol.envelope import EnvelopeError, make_envelope, open_receipt, sign_envelope
from sdk.protocol.schema import InputError
from sdk.protocol.signing import KeyPair
from sdk.logs import new_request_digest, request_digest

from broker.auth.service import Principal
from broker.billing.shared import cancel_shared, settle_shared
from broker.catalog.registry import PluginCatalog
from broker.errors import Forbidden, IdempotencyConflict, InvalidInput, InvalidRequest
from .errors import (JobNotCancellable, JobNotFound, NoProvider, OutputExpired, OutputNotFound,
                     ReceiptRefused)
from .checkpoints import steps_of
from .hub import EventHub, HubWait, Waiting, drive, quiet_slice_s
from .model import LEASED, Job, JobEvent, JobOutput, JobRequest, JobState
from .cache import result_cache_key
from .ports import BlobStore, JobMetrics, JobRepository, NoMetrics, Presence

log = logging.getLogger(__name__)
ASSIGNED_COPIES = 4096  # leases kept as assign() wrote them, for their receipts
MAX_UPLOADS_PER_REQUEST = 1024  # blobs one UploadRequest may name (a receipt's outputs)
MAX_UPLOAD_BYTES = 5 << 30      # one presigned PUT (S3's limit for a single PUT)
MAX_PREVIEW_BYTES = 16 * 1024   # a progress preview (a thumbnail)
PREVIEW_TYPES = ("image/webp", "image/jpeg", "image/png")
BAD_INPUT = "bad_input"            # a failure code: the plugin refused the job's input
NO_PROVIDER = "no_provider"        # a failure code: no provider served the build for long
INPUT_DISPUTED = "input_disputed"  # a requeue: another operator's provider tries that input


@dataclass
class JobSettings:
    max_attempts: int = 3
    lease_timeout_s: float = 30.0
    envelope_ttl_s: float = 60.0


class AssignmentTarget:
    """What the service needs of a connected agent to hand it a job (see dispatch.py)."""

    provider_id: str
    public_key: str

    def send_assignment(self, envelope_bytes: bytes, signature: str) -> None: ...
    def send_cancel(self, job_id: str, attempt: int, reason: str) -> None: ...


class InputDefaults(Protocol):
    """What the weights of the providers that could run a job give the inputs its
    manifest declares ``default_from = "weights"`` (broker.providers.defaults)."""

    def for_job(self, manifest, weights_digest: str | None = None) -> dict[str, Any]: ...


class Retention(Protocol):
    """Whether a job's outputs are past their retention (broker.blobs.retention)."""

    policy: Any  # its output_retention_s, for messages

    def expired(self, finished_at: float | None, now: float | None = None) -> bool: ...


class JobService:
    def __init__(self, repo: JobRepository, blobs: BlobStore, catalog: PluginCatalog,
                 signer: KeyPair, hub: EventHub | None = None,
                 settings: JobSettings | None = None, clock=time.time, billing=None,
                 input_defaults: InputDefaults | None = None,
                 seed_rng: random.Random | None = None,
                 metrics: JobMetrics | None = None,
                 retention: Retention | None = None, result_cache=None):
        self.repo = repo
        self.metrics = metrics or NoMetrics()  # broker.observability.metrics
        # Draws the seed of every job whose client gave none (see draw_seed)
        self.seed_rng = seed_rng or random.SystemRandom()
        self.result_cache = result_cache  # broker.jobs.cache.ResultCache; None: no cache
        self.retention = retention  # None: outputs never expire
        self.input_defaults = input_defaults  # None: the manifests' defaults only
        self.billing = billing  # broker.billing.JobBilling; None: jobs cost nothing
        self.blobs = blobs
        self.catalog = catalog
        self.signer = signer
        self.hub = hub or EventHub()
        self.settings = settings or JobSettings()
        self.clock = clock
        # set by the dispatcher; ``siblings``: a split's jobs, all just queued
        self.on_queued = lambda job, siblings=None: None
        self.on_released = lambda provider_id, job_id: None
        self.cancel_hook = lambda job: None      # pushes Cancel to the agent holding a job
        self.checkpoints = None   # broker.jobs.checkpoints.CheckpointService (resume, shares)
        self.stalls = None        # broker.jobs.stalls.StallWatch (runs far past their bound)
        # The market (set by the wiring): admission of a job's terms before any row or hold
        # (raises CannotMeetTerms), and the timings of every verified receipt (θ).
        self.check_terms = None                  # callable(job, n_slots) -> None
        # Whether anybody could run a build (set by the wiring): a job for a build no
        # provider known to the broker serves is refused at submit (409 no_provider), and
        # expire_unserved() gives up queued jobs whose build has had none for the window.
        self.presence: Presence | None = None
        # Input checks that need more than the manifest (set by the wiring): the registry
        # refuses adapters published for another plugin. callable(plugin, inputs) -> None
        self.check_inputs = lambda plugin, inputs: None
        # Every settled receipt, with when it reached the broker (epoch seconds): the market
        # times the run from the assignment (``matched_at``) to then (θ, DESIGN §4).
        self.on_receipt = lambda job, receipt, received_at: None
        # A run that failed in a way that counts against the provider's reliability.
        self.on_failure = lambda provider_id, plugin: None
        # (job, provider id) -> that provider's operator (account id) when a provider of
        # another operator is connected that could run the job, else None (see failed()).
        self.second_opinion = lambda job, provider_id: None
        # Verification (DESIGN §6, broker.verification.service): every settled job, after
        # its money moved, and every job that ended without settling (failed, cancelled).
        self.on_settled = lambda job, receipt: None
        self.on_ended = lambda job: None
        # Each lease as assign() wrote it (newest ASSIGNED_COPIES), with the sha256 of its
        # envelope as signed, so a receipt neither reads back what this process just wrote
        # nor encodes the envelope again (see receipt()).
        self._assigned: OrderedDict[str, tuple[Job, str]] = OrderedDict()
        self._assigned_lock = threading.Lock()

    # ---- clients ---------------------------------------------------------------------
    def check_submitter(self, who: Principal) -> None:
        """Refuse (403 role_cannot_submit) a key whose role does not pay for jobs."""
        if who.role not in SUBMIT_ROLES:
            raise Forbidden(
                f"submitting jobs needs a client key; yours is {_a(who.role)} key, and "
                f"{_ROLE_USES.get(who.role, 'that role does not pay for jobs')}. Submit "
                "with a client key (an admin creates one with `sparecycles broker "
                "create-key --role client`)", code_override="role_cannot_submit")

    def submit(self, who: Principal, request: JobRequest, idempotency_key: str | None = None,
               request_id: str | None = None) -> tuple[Job, bool]:
        """Queue the job ``request`` asks for (checked at the edge, broker.api.job_request).
        Returns (job, created); a repeated idempotency key with the same request returns
        the first job, with another request raises.
        ``request_id``: the X-Request-Id of the request, kept with the job (and its split
        siblings) and carried, as its digest, in each envelope (sdk.logs)."""
        self.check_submitter(who)
        manifest, terms, verify = request.manifest, request.terms, request.verify
        weights, output_format, cache = (request.weights_digest, request.output_format,
                                         request.cache)
        asked, inputs = self._inputs(manifest, request.inputs, weights)
        self.check_inputs(manifest.name, inputs)
        # The broker fixes the seed (after ``asked`` is taken: a retry of the same request
        # is the same request, and replays the first job, the seed it drew included).
        inputs = draw_seed(manifest, inputs, self.seed_rng)
        if idempotency_key is not None and (len(idempotency_key) > 200 or not idempotency_key):
            raise InvalidRequest("Idempotency-Key must be 1 to 200 characters",
                                 field="Idempotency-Key")
        # The request as the client made it: a retry is the same request even when the
        # providers' weights (and so the defaults filled in) changed in between.
        hashed = {"plugin": manifest.name, "version": manifest.version, "inputs": asked}
        hashed.update({k: v for k, v in terms.items() if v is not None and k != "n"})
        if verify != "sampled":
            hashed["verify"] = verify
        if weights is not None:
            hashed["weights_digest"] = weights
        if terms["n"] > 1:
            hashed["n"] = terms["n"]
        if output_format is not None:
            hashed["output_format"] = output_format
        if cache:
            hashed["cache"] = True
        request_hash = sha256_hex(canonical_bytes(hashed))
        now = self.clock()
        # With an idempotency key the job id is derived from it (a split's first sibling
        # gets that same id): a resubmit's hold is the first one (the ledger's key derives
        # from the job id) and its row conflicts with the first job's, so a replay writes
        # nothing and needs no read before it, and any other request with the key, split
        # or not, meets the first one's row and is refused on its request hash; one that
        # is refused on the way (the terms, the balance or the hold are not what they
        # were, say) is looked up.
        job_id = (_derived_id(f"{who.account_id}:{idempotency_key}")
                  if idempotency_key is not None else str(uuid.uuid4()))
        try:
            job = self._create(who, manifest, inputs, terms, job_id, idempotency_key,
                               request_hash, now, verify, weights, request_id, output_format,
                               cache)
        except _Taken as taken:
            return _replayed(taken.job, request_hash, idempotency_key), False
        except Exception:
            existing = self.repo.get(job_id) if idempotency_key is not None else None
            if existing is None:
                raise
            return _replayed(existing, request_hash, idempotency_key), False
        self.metrics.submitted(job.plugin, terms["n"])
        if request_id:
            log.info("job %s%s created by request %s (agents log it as %s)", job.id,
                     f" and {terms['n'] - 1} sibling(s)" if job.batch_id else "", request_id,
                     request_digest(request_id))
        if job.cached_from:  # answered from the result cache: nothing to run
            self.hub.notify(job.id, ended=True)
        elif not job.batch_id:
            self.hub.notify(job.id, relay=False)  # nobody elsewhere knows its id yet
            self.on_queued(job)
        return job, True

    def resolve_inputs(self, manifest, raw: Any, weights_digest: str | None = None) -> dict:
        """A job's inputs as it will run them: ``raw`` checked against the manifest, and
        each input left out filled with what the weights of the providers that could run
        it give (inputs declared ``default_from = "weights"``, see
        broker.providers.defaults), else the manifest's default. Raises InvalidInput."""
        return self._inputs(manifest, raw, weights_digest)[1]

    def defaults_for(self, manifest, weights_digest: str | None = None) -> dict[str, Any]:
        """What :meth:`resolve_inputs` fills in now for the inputs whose default the weights
        set, where it differs from the manifest's (what ``GET /v1/plugins`` shows)."""
        if self.input_defaults is None:
            return {}
        defaults = self.input_defaults.for_job(manifest, weights_digest)
        if defaults:
            declared = {f.name: f.default for f in manifest.inputs.fields
                        if f.default is not None}
            try:
                if (manifest.work_units_for({**declared, **defaults})
                        > manifest.work_units_for(declared)):
                    return {}  # never dearer (see _inputs): the manifest's defaults stand
            except Exception:  # noqa: BLE001 - a formula needing a required input: _inputs judges
                pass
        return defaults

    def _inputs(self, manifest, raw: Any, weights_digest: str | None) -> tuple[dict, dict]:
        """(the inputs as asked, with the manifest's defaults; as they will run). What the
        providers' weights report may make a job smaller than the manifest's defaults (tiny
        weights' 64×64 images), never dearer: a report that would add work units is not
        applied, so no provider can raise the price of a job whose client named no size."""
        try:
            asked = manifest.validate_inputs(raw)
            defaults = self.defaults_for(manifest, weights_digest)
            if not defaults:
                return asked, asked
            resolved = manifest.validate_inputs(raw, defaults)
            if manifest.work_units_for(resolved) > manifest.work_units_for(asked):
                log.info("%s: the providers' weights give %s, which would cost more than the "
                         "manifest's defaults; those stand", manifest.ref, defaults)
                return asked, asked
            return asked, resolved
        except InputError as exc:
            raise InvalidInput(str(exc), field=f"inputs.{exc.field}" if exc.field else "inputs",
                               plugin=manifest.ref) from None

    def _create(self, who: Principal, manifest, inputs: dict, terms: dict, job_id: str,
                idempotency_key: str | None, request_hash: str, now: float, verify: str,
                weights: str | None, request_id: str | None = None,
                output_format: dict | None = None, cache: bool = False) -> Job:
        """The job (or a split's first sibling) with its hold. Raises _Taken, having
        written nothing, when an earlier request with the same idempotency key has it."""
        work_units = manifest.work_units_for(inputs)
        n = terms["n"]
        cache_key = (result_cache_key(manifest, inputs, output_format)
                     if cache and self.result_cache is not None else None)
        if cache_key is not None:
            source = self.result_cache.find(cache_key, weights)
            if source is not None:  # answered from a verified job's outputs, not run
                return self._answer_from_cache(who, manifest, inputs, source, job_id,
                                               idempotency_key, request_hash, now, terms,
                                               weights, output_format, cache_key)
        if self.presence is not None and not self.presence.serves(manifest.name,
                                                                   manifest.version):
            raise NoProvider(
                f"no provider serves {manifest.ref}: none is connected, and none that "
                f"serves it was seen in the last {self.presence.window_s:g} s, so nobody "
                "could run this job; nothing was queued or held. Submit it once a provider "
                "serving it is online (GET /readyz counts providers online)",
                field="plugin", plugin=manifest.name, version=manifest.version)
        if self.check_terms is not None:
            # Refused up front (no row, no hold) when no eligible provider meets the terms.
            self.check_terms(Job(id=job_id, account_id=who.account_id, plugin=manifest.name,
                                 plugin_version=manifest.version, inputs=inputs,
                                 state=JobState.QUEUED, work_units=work_units,
                                 priority=terms["priority"], deadline_s=terms["deadline_s"],
                                 max_price_micro=terms["max_price_micro"] or 0,
                                 weights_digest=weights), n)
        if n > 1:
            return self._submit_batch(who, manifest, inputs, work_units, terms, job_id,
                                      idempotency_key, request_hash, now, verify, weights,
                                      request_id, output_format)
        cap = terms["max_price_micro"]
        # The hold and the job (with its first event and the hold's audit entry) commit as
        # one transaction: no job without its hold, no hold without its job.
        with self.repo.atomic():
            hold_id, max_price = None, 0
            if self.billing is not None:
                if verify == "always":  # two runs: refused up front unless both can be paid
                    self.billing.require(who.account_id, manifest.name, work_units,
                                         cap_micro=cap, runs=2, inputs=inputs)
                hold_id, max_price = self.billing.hold(job_id, who.account_id, manifest.name,
                                                       work_units, cap_micro=cap, inputs=inputs)
            elif cap is not None:
                max_price = cap
            job = Job(id=job_id, account_id=who.account_id, plugin=manifest.name,
                      plugin_version=manifest.version, inputs=inputs, state=JobState.QUEUED,
                      max_attempts=self.settings.max_attempts,
                      work_units=work_units, idempotency_key=idempotency_key,
                      request_hash=request_hash, created_at=now, updated_at=now,
                      hold_id=hold_id, max_price_micro=max_price, priority=terms["priority"],
                      deadline_s=terms["deadline_s"], verify=verify, weights_digest=weights,
                      request_id=request_id, output_format=output_format,
                      cache=cache, cache_key=cache_key)
            job, created = self.repo.create(job, ("queued", {"plugin": manifest.ref}))
            if not created:  # rolls back the block: the replayed hold's audit entry too
                raise _Taken(job)
            return job

    def _answer_from_cache(self, who: Principal, manifest, inputs: dict, source, job_id: str,
                           idempotency_key: str | None, request_hash: str, now: float,
                           terms: dict, weights: str | None, output_format: dict | None,
                           cache_key: str) -> Job:
        """A job answered from ``source`` (a verified job's (job, outputs), broker.jobs.cache):
        created, handed to the source's provider and settled with the source's outputs and
        receipt in one transaction, at the plugin's cache price (broker.jobs.cache says who
        is paid). Raises _Taken like _create."""
        src, outputs = source
        price = None if self.billing is None else self.billing.pricing.price(manifest.name)
        amount = 0 if price is None else price.cache_price_micro
        cap = terms["max_price_micro"]
        if cap is not None and amount > cap:
            raise InvalidRequest(f"a cache hit of {manifest.name} costs {amount} micro-credits, "
                                 f"above your max_price_micro {cap}; raise it or leave out "
                                 "cache", field="max_price_micro")
        outs = [JobOutput(job_id, o.index, o.sha256, o.media_type, o.size) for o in outputs]
        with self.repo.atomic():
            hold_id = None
            if self.billing is not None and amount > 0:
                hold_id = self.billing.hold_amount(job_id, who.account_id, amount)
            job = Job(id=job_id, account_id=who.account_id, plugin=manifest.name,
                      plugin_version=manifest.version, inputs=inputs, state=JobState.QUEUED,
                      max_attempts=self.settings.max_attempts, work_units=src.work_units,
                      idempotency_key=idempotency_key, request_hash=request_hash,
                      created_at=now, updated_at=now, hold_id=hold_id, max_price_micro=amount,
                      priority=terms["priority"], deadline_s=terms["deadline_s"],
                      verify="sampled", weights_digest=weights, output_format=output_format,
                      cache=True, cached_from=src.id)
            job, created = self.repo.create(job, ("queued", {"plugin": manifest.ref,
                                                             "cache": True}))
            if not created:
                raise _Taken(job)
            job = self.repo.transition(
                job.id, [JobState.QUEUED], JobState.MATCHED, provider_id=src.provider_id,
                event=("assigned", {"provider_id": src.provider_id, "attempt": 0,
                                    "cached_from": src.id}),
                envelope=src.envelope, matched_at=now)
            settled = self.repo.transition(
                job.id, [JobState.MATCHED], JobState.SETTLED, outputs=outs,
                events=[("done", {"outputs": [{"index": o.index, "sha256": o.sha256,
                                               "media_type": o.media_type, "size": o.size}
                                              for o in outs], "cached_from": src.id})],
                receipt=src.receipt, receipt_signature=src.receipt_signature,
                progress_step=src.progress_step, progress_total=src.progress_total,
                started_at=now, finished_at=now)
            if hold_id is not None:
                self._money("cache", settled, lambda: self.billing.settle_cached(
                    settled, amount, price))
        log.info("job %s answered from the result cache (job %s), %d micro-credits",
                 settled.id, src.id, amount)
        return settled

    def _submit_batch(self, who: Principal, manifest, inputs: dict, work_units: float,
                      terms: dict, first_id: str, idempotency_key: str | None,
                      request_hash: str, now: float, verify: str = "sampled",
                      weights: str | None = None, request_id: str | None = None,
                      output_format: dict | None = None) -> Job:
        """A split request: ``n`` sibling jobs sharing one batch id, each with its own hold
        for its share of the client's max price. The first sibling's id is ``first_id``
        (with an idempotency key, the id a one-job request with that key would get, and the
        key itself: whichever request comes second conflicts with the first on that row
        and its hold, so one key never makes two requests); the batch id and the other
        siblings' ids derive from it. Sibling ``i`` gets ``seed + i`` when the inputs carry
        an integer seed. Returns the first sibling (raises _Taken, having written nothing,
        when an earlier request with the same key has its row); the dispatcher clears the
        siblings together."""
        n = terms["n"]
        cap = terms["max_price_micro"]
        share = None if cap is None else cap // n
        batch_id = _derived_id(f"batch:{first_id}")
        created: list[Job] = []
        with self.repo.atomic():  # all siblings with their holds, or none
            for i in range(n):
                job_id = first_id if i == 0 else _derived_id(f"{batch_id}:{i}")
                sib_inputs = dict(inputs)
                if isinstance(sib_inputs.get("seed"), int) and not isinstance(
                        sib_inputs["seed"], bool):
                    sib_inputs["seed"] = sib_inputs["seed"] + i
                hold_id, max_price = None, share or 0
                if self.billing is not None:
                    hold_id, max_price = self.billing.hold(job_id, who.account_id,
                                                           manifest.name, work_units,
                                                           cap_micro=share, inputs=sib_inputs)
                job = Job(id=job_id, account_id=who.account_id, plugin=manifest.name,
                          plugin_version=manifest.version, inputs=sib_inputs,
                          state=JobState.QUEUED, max_attempts=self.settings.max_attempts,
                          work_units=work_units,
                          # the key names the request: the first sibling carries it
                          idempotency_key=idempotency_key if i == 0 else None,
                          request_hash=request_hash, created_at=now, updated_at=now,
                          hold_id=hold_id, max_price_micro=max_price,
                          priority=terms["priority"], deadline_s=terms["deadline_s"],
                          batch_id=batch_id, batch_index=i, verify=verify,
                          weights_digest=weights, request_id=request_id,
                          output_format=output_format)
                job, fresh = self.repo.create(job, ("queued", {"plugin": manifest.ref,
                                                               "batch_id": batch_id,
                                                               "batch_index": i}))
                if not fresh:  # rolls back the block: every sibling and hold written so far
                    raise _Taken(job)
                created.append(job)
        for job in created:
            self.hub.notify(job.id, relay=False)
        # One wake-up once every sibling exists, so that they clear together.
        self.on_queued(created[0], siblings=created)
        return created[0]

    def submit_check(self, primary: Job, check_id: str, account_id: str, inputs: dict,
                     excluded: list[str], *, not_before: float, fund=None) -> Job:
        """Queue a verification run of ``primary`` (DESIGN §6): a job like any other to
        the provider that gets it (fresh id, same plugin version, pinned inputs, deadline
        and price cap), held against ``account_id`` (``fund(check_id, amount)`` first
        credits that account when the platform pays), never offered to ``excluded``
        providers, and not before ``not_before``."""
        now = self.clock()
        with self.repo.atomic() as tx:  # its funding, hold and row commit together
            hold_id, max_price = None, primary.max_price_micro
            if self.billing is not None and primary.hold_id is not None:
                amount = self.billing.max_price(primary.plugin, primary.work_units,
                                                cap_micro=primary.max_price_micro or None)
                if fund is not None:
                    fund(check_id, amount)
                hold_id, max_price = self.billing.hold(check_id, account_id, primary.plugin,
                                                       primary.work_units, cap_micro=amount)
            job = Job(id=check_id, account_id=account_id, plugin=primary.plugin,
                      plugin_version=primary.plugin_version, inputs=inputs,
                      state=JobState.QUEUED, max_attempts=self.settings.max_attempts,
                      work_units=primary.work_units, created_at=now, updated_at=now,
                      hold_id=hold_id, max_price_micro=max_price, priority=primary.priority,
                      deadline_s=primary.deadline_s, excluded_providers=list(excluded),
                      check_of=primary.id, not_before=not_before,
                      # the primary's: a check's envelope looks like any job's
                      request_id=primary.request_id,
                      weights_digest=((primary.envelope or {}).get("weights_digest")
                                      or primary.weights_digest),
                      output_format=primary.output_format)
            job, _ = self.repo.create(job, ("queued", {"plugin": f"{job.plugin}@"
                                                       f"{job.plugin_version}"}))
            # The dispatcher hears of the check once it exists: after the commit of the
            # caller's block, when there is one (verification records the check with it).
            # Waking it is a hint only (it re-reads the queue every 0.5 s); ``atomic`` logs
            # a failure, which never reads as a failed submit.
            tx.after_commit(lambda: (self.hub.notify(job.id), self.on_queued(job),
                                     self.metrics.submitted(job.plugin)))
        return job

    def batch(self, who: Principal, batch_id: str) -> list[Job]:
        """The siblings of a split request, in order (404 unless they are the caller's)."""
        jobs = self.repo.batch(batch_id) if _is_uuid(batch_id) else []
        if not jobs or (jobs[0].account_id != who.account_id and who.role != "admin"):
            raise JobNotFound(f"no batch {batch_id!r} in your account")
        return jobs

    def get(self, who: Principal, job_id: str) -> Job:
        job = self.repo.get(job_id) if _is_uuid(job_id) else None
        if job is None or (job.account_id != who.account_id and who.role != "admin"):
            raise JobNotFound(f"no job {job_id!r} in your account")
        return job

    def wait(self, who: Principal, job_id: str, timeout_s: float, job: Job | None = None) -> Job:
        """The job once it is terminal, or as it is when ``timeout_s`` passes (``job``: the
        caller's fresh copy, e.g. just submitted). Blocks this thread while it waits."""
        return drive(self.waiting(who, job_id, timeout_s, job), self.hub)

    def waiting(self, who: Principal, job_id: str, timeout_s: float,
                job: Job | None = None) -> Waiting[Job]:
        """:meth:`wait` as a generator that yields each wait on the hub instead of blocking
        (see :mod:`.hub`): the asyncio front waits on its event loop, holding no thread."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        version = self.hub.version(job_id)
        # A caller's copy is from before the version was read: a fast job may have ended in
        # between, and no later notification would come to say so.
        fresh = job is None or self.hub.ended(job_id)
        if fresh:
            job = self._ended_copy(who, job_id) or self.get(who, job_id)
        while not job.state.terminal:
            left = deadline - time.monotonic()
            if left <= 0:
                return job if fresh else self.get(who, job_id)
            seen = version
            version = yield HubWait(job_id, seen, min(left, quiet_slice_s()))
            # Every change here wakes the waiter (assigned, running, progress…); the hub
            # says whether it was the end. A quiet slice re-reads the row: the job may
            # have ended on another broker replica.
            if self.hub.ended(job_id):
                job, fresh = self._ended_copy(who, job_id) or self.get(who, job_id), True
            elif version == seen:
                job, fresh = self.get(who, job_id), True
            else:
                fresh = False
        return job

    def wait_batch(self, who: Principal, batch_id: str, timeout_s: float,
                   jobs: list[Job] | None = None) -> list[Job]:
        """A split request's siblings once all are terminal, or as they are when
        ``timeout_s`` passes (``jobs``: the caller's fresh copies, e.g. just submitted)."""
        return drive(self.waiting_batch(who, batch_id, timeout_s, jobs), self.hub)

    def waiting_batch(self, who: Principal, batch_id: str, timeout_s: float,
                      jobs: list[Job] | None = None) -> Waiting[list[Job]]:
        """:meth:`wait_batch` as a waiting generator (see :meth:`waiting`)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        out = []
        for job in (jobs or self.batch(who, batch_id)):
            out.append((yield from self.waiting(who, job.id, deadline - time.monotonic(),
                                                job=job)))
        return out

    def _ended_copy(self, who: Principal, job_id: str) -> Job | None:
        """The job as its settlement wrote it, while nothing has happened to it since
        (saves reading back what this process just wrote); None: read it."""
        held = self.hub.copy(job_id)
        if held is None or (held[0].account_id != who.account_id and who.role != "admin"):
            return None
        return held[0]

    def outputs_of(self, job: Job) -> list[JobOutput]:
        """A settled job's outputs: from its settlement's copy when ``job`` is that copy
        and nothing has happened to it since, else read."""
        held = self.hub.copy(job.id)
        if held is not None and held[0] is job:
            return list(held[1])
        return self.repo.outputs(job.id)

    def events(self, who: Principal, job_id: str, after_id: int = 0) -> list[JobEvent]:
        self.get(who, job_id)
        return self.repo.events_after(job_id, after_id)

    def outputs(self, who: Principal, job_id: str) -> list[JobOutput]:
        self.get(who, job_id)
        return self.repo.outputs(job_id)

    def output(self, who: Principal, job_id: str, index: int) -> tuple[JobOutput, bytes]:
        out = self.output_meta(who, job_id, index)
        return out, self.blobs.get(out.sha256)

    def output_meta(self, who: Principal, job_id: str, index: int) -> JobOutput:
        """Output ``index`` of the job; OutputExpired once retention deleted its bytes."""
        job = self.get(who, job_id)
        for out in self.repo.outputs(job_id):
            if out.index == index:
                if self.outputs_expired(job):
                    raise OutputExpired(
                        f"output {index} of job {job_id} was deleted: outputs are kept "
                        f"{self.retention.policy.output_retention_s:g} s after their job ends "
                        "(output_retention_s); run the job again to get it",
                        field="index")
                return out
        raise OutputNotFound(f"job {job_id} has no output {index}")

    def outputs_expired(self, job: Job) -> bool:
        return self.retention is not None and self.retention.expired(job.finished_at)

    def cancel(self, who: Principal, job_id: str, reason: str = "cancelled by client") -> Job:
        job = self.get(who, job_id)
        while not job.state.terminal:
            with self.repo.atomic():  # the cancellation with its payment or release
                moved = self.repo.transition(
                    job.id, [job.state], JobState.CANCELLED, expect_attempt=job.attempt,
                    event=("cancelled", {"reason": reason}), finished_at=self.clock(),
                    error_code="cancelled", error_message=reason)
                if moved is not None:
                    parts = self.checkpoints.parts(job) if self.checkpoints is not None else []
                    shown = self.shown_fraction(job)
                    if parts:  # resumed: earlier providers keep their shares
                        resumed = self.checkpoints.base_fraction(job)
                        self._money("cancel", job, lambda: cancel_shared(
                            self.billing, job, parts, resumed, reason, shown))
                    else:
                        self._money("cancel", job,
                                    lambda: self.billing.cancelled(job, reason, shown))
            if moved is not None:
                if job.state in LEASED and job.provider_id:
                    self.cancel_hook(job)
                    self.on_released(job.provider_id, job.id)
                self.hub.notify(job.id, ended=True)
                self._ended(moved)
                self.on_ended(moved)
                return moved
            job = self.get(who, job_id)
        if job.state == JobState.CANCELLED:
            return job
        raise JobNotCancellable(f"job {job_id} is already {job.state.value}; only jobs that "
                                "have not finished can be cancelled")

    def shown_fraction(self, job: Job) -> Fraction:
        """The share of ``job`` (0..1, of its whole work) that its current attempt has
        *shown* it did: the step of the latest checkpoint the broker received from that
        attempt, or the tokens it streamed (one ``token`` event each, counted from the
        resume step, over the job's steps: Llama's ``max_new_tokens``), whichever reaches
        further. What a cancelled job pays its current provider for; reported progress
        is not counted (a provider says 100 % as easily as 10 %). 0 for a job no provider
        holds now."""
        if job.state not in LEASED or not job.provider_id:
            return Fraction(0)
        shown = Fraction(0)
        resumed = Fraction(0)
        if self.checkpoints is not None:
            resumed = self.checkpoints.base_fraction(job)
            shown = resumed
            for rec in self.checkpoints.repo.for_job(job.id):
                if rec.attempt == job.attempt and rec.total > 0:
                    shown = max(shown, Fraction(min(rec.step, rec.total), rec.total))
        steps = steps_of(job)
        if steps > 0:
            tokens = self._tokens_streamed(job, limit=steps)
            if tokens:
                shown = max(shown, min(Fraction(1), resumed + Fraction(tokens, steps)))
        return min(Fraction(1), shown)

    def _tokens_streamed(self, job: Job, limit: int) -> int:
        """``token`` events of the job's current attempt (after its ``assigned`` event),
        counted up to ``limit``."""
        count, after, attempt_started = 0, 0, False
        while True:
            events = self.repo.events_after(job.id, after)
            if not events:
                return count
            for e in events:
                if e.kind == "assigned":
                    attempt_started = e.data.get("attempt") == job.attempt
                    count = 0
                elif e.kind == "token" and attempt_started:
                    count += 1
            if count >= limit and attempt_started:
                return limit
            after = events[-1].id

    # ---- dispatch --------------------------------------------------------------------
    def queued(self, limit: int = 200) -> list[Job]:
        return self.repo.queued(limit)

    def assign(self, job: Job, target: AssignmentTarget,
               price_micro_per_unit: int | None = None) -> Job | None:
        """Lease ``job`` to ``target`` and push it the signed envelope. None when someone
        else moved the job first. ``price_micro_per_unit`` is the auction's clearing price
        (what settlement charges); None leaves the reserve."""
        now = self.clock()
        attempt = job.attempt
        # Every envelope names the weights to run on: the job's pin, else the digest the
        # agent advertises for this plugin version (what a check of this run then pins).
        served = getattr(target, "plugins", {}) or {}
        extra = {"weights_digest": job.weights_digest
                 or served.get(f"{job.plugin}@{job.plugin_version}") or "",
                 # Never the client's text (sdk.logs): its digest, or a random one of the
                 # same shape for a job no request named.
                 "request_id": (request_digest(job.request_id) if job.request_id
                                else new_request_digest())}
        if job.output_format:  # the agent encodes image outputs so (provider_agent/encode.py)
            extra["output_format"] = job.output_format
        if self.checkpoints is not None:
            extra.update(self.checkpoints.envelope_extra(job) or {})
        envelope = make_envelope(job_id=job.id, attempt=attempt, plugin=job.plugin,
                                 version=job.plugin_version, inputs=job.inputs,
                                 provider_key=target.public_key,
                                 lease_timeout_s=self.settings.lease_timeout_s,
                                 ttl_s=self.settings.envelope_ttl_s, now=now, extra=extra,
                                 sealed=True)  # only the assigned provider reads the inputs
        # Signed first, so the copy kept for the receipt holds the signed bytes' hash.
        data, signature = sign_envelope(self.signer, envelope)
        moved = self.repo.transition(
            job.id, [JobState.QUEUED], JobState.MATCHED, expect_attempt=attempt,
            event=("assigned", {"provider_id": target.provider_id, "attempt": attempt}),
            provider_id=target.provider_id, envelope=envelope, matched_at=now,
            lease_expires_at=now + self.settings.lease_timeout_s,
            price_micro_per_unit=price_micro_per_unit)
        if moved is None:
            return None
        self.metrics.placed(job.plugin, now - (job.updated_at or job.created_at or now))
        with self._assigned_lock:
            self._assigned[moved.id] = (moved, sha256_hex(data))
            self._assigned.move_to_end(moved.id)
            if len(self._assigned) > ASSIGNED_COPIES:
                self._assigned.popitem(last=False)
        target.send_assignment(data, signature)
        self.hub.notify(job.id)
        return moved

    # ---- agents ----------------------------------------------------------------------
    def _leased(self, provider_id: str, job_id: str, attempt: int, job: Job | None = None) -> Job:
        """The job if ``attempt`` of it is leased to ``provider_id`` (``job``: as just read)."""
        if job is None:
            job = self.repo.get(job_id) if _is_uuid(job_id) else None
        _check_lease(job_id, provider_id, attempt,
                     None if job is None else (job.state, job.provider_id, job.attempt))
        return job

    def accepted(self, provider_id: str, job_id: str, attempt: int) -> None:
        now = self.clock()
        moved = self.repo.transition(job_id, [JobState.MATCHED], JobState.RUNNING,
                                     expect_attempt=attempt, expect_provider=provider_id,
                                     event=("running", {"attempt": attempt}), started_at=now,
                                     lease_expires_at=now + self.settings.lease_timeout_s)
        if moved is not None:
            self.hub.notify(job_id)

    def progress(self, provider_id: str, job_id: str, attempt: int, step: int, total: int,
                 message: str = "", text: str = "") -> None:
        job = self._leased(provider_id, job_id, attempt)
        if total and not text and total == job.progress_total and step <= job.progress_step:
            return  # a re-sent or late report: progress only moves forward (idempotent)
        data: dict[str, Any] = {"step": step, "total": total}
        if message:
            data["message"] = message
        if text:
            data["text"] = text
        # A streamed token without a step count leaves the step count as it is.
        fields = {"progress_step": step, "progress_total": total} if total else {}
        self.repo.add_event(job.id, "token" if text and not total else "progress", data,
                            **fields)
        self.hub.notify(job.id)

    def preview(self, provider_id: str, job_id: str, attempt: int, step: int, total: int,
                data: bytes, media_type: str) -> None:
        """A small picture of the job's output so far: a "preview" event the client's
        event stream carries as a data: URL (previews are thumbnails: at most
        MAX_PREVIEW_BYTES, of an image type; others are refused)."""
        job = self._leased(provider_id, job_id, attempt)
        if len(data) > MAX_PREVIEW_BYTES or media_type not in PREVIEW_TYPES:
            raise InvalidRequest(f"a preview must be an image of type "
                                 f"{', '.join(PREVIEW_TYPES)} of at most {MAX_PREVIEW_BYTES} "
                                 f"bytes; got {media_type!r}, {len(data)} bytes")
        import base64

        self.repo.add_event(job.id, "preview", {
            "step": step, "total": total,
            "preview": f"data:{media_type};base64,{base64.b64encode(data).decode()}"})
        self.hub.notify(job.id)

    def store_output(self, provider_id: str, job_id: str, attempt: int, data: bytes,
                     sha256: str) -> str:
        """An output sent ahead of its receipt (a large one)."""
        # Only the lease is needed, not the whole row.
        _check_lease(job_id, provider_id, attempt,
                     self.repo.lease_of(job_id) if _is_uuid(job_id) else None)
        return self._put_output(job_id, data, sha256)

    def grant_uploads(self, provider_id: str, job_id: str, attempt: int,
                      blobs: list[tuple[str, int]]) -> list:
        """Presigned PUT URLs (broker.blobs.model.PresignedPut), one per (sha256, size) in
        ``blobs``, for the provider holding ``attempt`` of the job: each stores only the
        bytes with that sha256, straight into the blob store (S3), never through here."""
        with self._assigned_lock:  # the lease as assign() wrote it, when it is the asker's
            copy = self._assigned.get(job_id)
        if copy is None or copy[0].provider_id != provider_id or copy[0].attempt != attempt:
            # Not this process's fresh lease: read it. (A copy out of date only hands out
            # URLs; the receipt's conditional settlement still decides.)
            _check_lease(job_id, provider_id, attempt,
                         self.repo.lease_of(job_id) if _is_uuid(job_id) else None)
        return self.presign_uploads(blobs)

    def presign_uploads(self, blobs: list[tuple[str, int]]) -> list:
        """:meth:`grant_uploads` without the lease check (a canary has no job row)."""
        if not getattr(self.blobs, "presigns", False):
            raise InvalidRequest("this broker's blob store takes no direct uploads; send "
                                 "outputs and checkpoints on the stream",
                                 code_override="no_direct_uploads")
        if not 0 < len(blobs) <= MAX_UPLOADS_PER_REQUEST:
            raise InvalidRequest(f"an upload request names {len(blobs)} blobs; 1 to "
                                 f"{MAX_UPLOADS_PER_REQUEST} are allowed")
        out = []
        for sha, size in blobs:
            if not is_sha256_hex(sha):
                raise InvalidRequest(f"blob {sha!r} is no sha256: give 64 lowercase hex digits")
            if not 0 <= size <= MAX_UPLOAD_BYTES:
                raise InvalidRequest(f"blob {sha[:12]}… is {size} bytes; at most "
                                     f"{MAX_UPLOAD_BYTES} are allowed")
            out.append(self.blobs.presign_put(sha, size))
        return out

    def _check_stored(self, job_id: str, index: int, sha: str) -> None:
        """Refuse a receipt naming an output the store does not hold as those exact bytes
        (for S3, the object's stored SHA-256 checksum: a HEAD, no bytes read)."""
        state = self.blobs.check(sha)
        if state == "missing":
            raise ReceiptRefused("output_missing",
                                 f"output {index} ({sha[:12]}…) was not uploaded before the receipt")
        if state != "ok":
            raise ReceiptRefused(
                "output_checksum_mismatch",
                f"output {index} of job {job_id}: the object stored as {sha[:12]}… is not "
                f"those bytes ({'stored without a SHA-256 checksum' if state == 'no_checksum' else 'its SHA-256 checksum differs'}); "
                "upload it again with a URL from an UploadRequest")

    def _put_output(self, job_id: str, data: bytes, sha256: str) -> str:
        _check_output(job_id, data, sha256)
        return self.blobs.put(data)

    def receipt(self, provider_id: str, provider_key: str, data: bytes, signature: str,
                uploads: list[tuple[bytes, str]] = (), received_at: float | None = None) -> Job:
        """Verify a signed receipt and settle the job; idempotent for the same receipt.
        ``uploads``: (data, sha256) of outputs that came with the receipt, stored once it
        verifies and the job's lease is the sender's (each must be one the receipt names).
        ``received_at``: when the receipt reached the broker (the gateway stamps it as it
        reads the message; now when not given) — the end of the run the market times."""
        received_at = self.clock() if received_at is None else received_at
        try:
            rec = open_receipt(data, signature, provider_key=provider_key)
        except EnvelopeError as exc:
            raise ReceiptRefused(exc.code, str(exc)) from None
        job_id, attempt = str(rec["job_id"]), int(rec["attempt"])
        # The lease as assign() wrote it, when it is this sender's and this attempt's: the
        # settlement's conditional UPDATE still decides, and if the job has moved since,
        # the receipt is judged again on the row as it is now.
        with self._assigned_lock:
            copy = self._assigned.get(job_id)
            if copy is not None and (copy[0].provider_id == provider_id
                                     and copy[0].attempt == attempt):
                del self._assigned[job_id]
            else:
                copy = None
        if copy is not None:
            try:
                return self._settle(copy[0], rec, signature, uploads, envelope_sha=copy[1],
                                    received_at=received_at)
            except _Moved:
                pass
        job = self.repo.get(job_id) if _is_uuid(job_id) else None
        if job is None:
            raise ReceiptRefused("unknown_job", f"receipt names unknown job {job_id!r}")
        if (job.receipt == rec and job.provider_id == provider_id
                and job.state in (JobState.SUBMITTED, JobState.SETTLED)):
            # A re-sent receipt (e.g. after a reconnect): already settled once; the post is
            # idempotent, so this also finishes a settlement interrupted before its post.
            self._charge(job, rec)
            return job
        job = self._leased(provider_id, job_id, attempt, job)
        return self._settle(job, rec, signature, uploads, received_at=received_at)

    def _settle(self, job: Job, rec: dict, signature: str, uploads,
                envelope_sha: str | None = None, received_at: float | None = None) -> Job:
        """Settle ``job`` (leased to the receipt's sender) on its verified receipt ``rec``.
        ``envelope_sha``: ``job`` is assign()'s copy and this the hash of its envelope as
        signed; a job that has moved since then raises _Moved instead of being refused."""
        provider_id, attempt = job.provider_id, int(rec["attempt"])
        from_copy = envelope_sha is not None
        if envelope_sha is None:
            envelope_sha = sha256_hex(canonical_bytes(job.envelope))
        if rec["envelope_sha256"] != envelope_sha:
            raise ReceiptRefused("envelope_mismatch", "receipt does not cover this job's envelope")
        check_receipt_shape(rec)
        named = {out["sha256"] for out in rec["outputs"]}
        stray = next((sha for _, sha in uploads if sha not in named), None)
        if stray is not None:
            raise ReceiptRefused("output_not_in_receipt",
                                 f"an output sent with the receipt ({stray[:12]}…) is not one "
                                 "the receipt names")
        for blob, sha in uploads:
            _check_output(job.id, blob, sha)
        sent = {sha for _, sha in uploads}
        outputs = []
        for i, out in enumerate(rec["outputs"]):
            sha = out["sha256"]
            if sha not in sent:
                self._check_stored(job.id, i, sha)
            outputs.append(JobOutput(job.id, out["index"], sha, out["media_type"], out["size"]))
        now = self.clock()
        # Verification (DESIGN §6) will stop at SUBMITTED/VERIFYING; until then a verified
        # receipt settles at once, in one transaction with its outputs and both events.
        # The settlement and its ledger post (with the post's audit entry) commit as one
        # transaction; a post that fails rolls back alone (a savepoint), and the
        # settlement stands with a ledger_error event (see _money).
        with self.repo.atomic():
            settled = self.repo.transition(
                job.id, LEASED, JobState.SETTLED, expect_attempt=attempt,
                expect_provider=provider_id, outputs=outputs,
                events=[("submitted", {"attempt": attempt}),
                        ("done", {"outputs": [{"index": o.index, "sha256": o.sha256,
                                               "media_type": o.media_type, "size": o.size}
                                              for o in outputs]})],
                receipt=rec, receipt_signature=signature, lease_expires_at=None,
                finished_at=now)
            if settled is None:
                if from_copy:
                    raise _Moved()  # nothing was written: judged again on the row
                raise ReceiptRefused("not_your_job",
                                     f"job {job.id} moved before the receipt arrived")
            # Stored once the job is the sender's to settle; if storing fails, the
            # settlement rolls back with it.
            for blob, _ in uploads:
                self.blobs.put(blob)
            self._charge(settled, rec)
        try:
            self.on_receipt(settled, rec, self.clock() if received_at is None else received_at)
            if _input_disputed(settled):  # whoever called this input bad was wrong
                for refuser in self._input_refusers(job.id):
                    self.on_failure(refuser, job.plugin)
        except Exception:  # noqa: BLE001 - a measurement must never undo a settlement
            log.exception("job %s: telling the market of the receipt (timings, refusals of "
                          "its input) failed", job.id)
        self.on_released(provider_id, job.id)
        # Verification draws whether to check the job once its receipt is signed and
        # settled, before the client is woken, so it never sees a status that changes back.
        self.on_settled(settled, rec)
        self.hub.notify(job.id, ended=True, copy=(settled, tuple(outputs)))
        self._ended(settled)
        if received_at:  # the wall clock the gateway stamped the receipt with
            self.metrics.settled(job.plugin, max(0.0, self.clock() - received_at))
        return settled

    def failed(self, provider_id: str, job_id: str, attempt: int, code: str, message: str,
               retryable: bool) -> Job | None:
        try:
            job = self._leased(provider_id, job_id, attempt)
        except ReceiptRefused:
            return None  # already moved (cancelled, requeued): nothing to do
        self.on_released(provider_id, job_id)
        if code == BAD_INPUT and not retryable and not job.check_of:
            return self._input_refused(job, provider_id, message)
        self.on_failure(provider_id, job.plugin)
        if retryable:
            # (the provider's message may quote the inputs: it goes to the sealed event,
            # the log gets its code alone)
            return self._requeue(job, "failed", f"{code}: {message}", logged=code)
        return self._fail(job, code, message)

    def _input_refused(self, job: Job, provider_id: str, message: str) -> Job | None:
        """A provider says the job's input is bad (the plugin refused it): the client's
        fault, which must not count against the provider, but a provider could say so of
        any failure. So the first refusal sends the job to a provider of another operator
        (the refuser's operator is excluded for good); a second refusal there confirms it,
        and the job fails ``bad_input`` with nobody's reliability touched, while a
        settlement there proves the first refusal false and counts it as the refuser's
        failure (see _settle). With no other operator connected, the job fails at once and
        the refusal counts, as any failure does."""
        if _input_disputed(job):  # refused by a provider of another operator already
            return self._fail(job, BAD_INPUT, f"{message} (providers of two operators "
                                              "refused this input)")
        operator = self.second_opinion(job, provider_id)
        if operator is None:
            self.on_failure(provider_id, job.plugin)
            return self._fail(job, BAD_INPUT, message)
        return self._requeue(job, INPUT_DISPUTED,
                             f"{BAD_INPUT}: {message}; a provider of another operator tries it",
                             exclude=[f"operator:{operator}"])

    def _input_refusers(self, job_id: str) -> list[str]:
        """The providers whose refusal of the job's input sent it to another operator."""
        return [e.data.get("provider_id") for e in self.repo.events_after(job_id, 0)
                if e.kind == "requeued" and e.data.get("why") == INPUT_DISPUTED
                and e.data.get("provider_id")]

    def give_back(self, provider_id: str, job_id: str, attempt: int, reason: str) -> Job | None:
        try:
            job = self._leased(provider_id, job_id, attempt)
        except ReceiptRefused:
            return None
        self.on_released(provider_id, job_id)
        return self._requeue(job, "given_back", reason, count_attempt=False)

    def heartbeat(self, provider_id: str, running_job_ids: list[str]) -> None:
        ids = [j for j in running_job_ids if _is_uuid(j)]
        self.repo.extend_leases(provider_id, ids, self.clock() + self.settings.lease_timeout_s)

    def reap_expired(self) -> list[Job]:
        """Requeue (or fail) every job whose lease has expired."""
        moved = []
        for job in self.repo.expired_leases(self.clock()):
            result = self.take_back(job, "lease_expired",
                                    f"provider {job.provider_id} stopped heartbeating")
            if result is not None:
                moved.append(result)
        if self.stalls is not None:
            moved += self.stalls.reap(self)
        for job in self.repo.overdue(self.clock()):
            result = self.expire(job)
            if result is not None:
                moved.append(result)
        return moved

    def expire(self, job: Job, last: str = "") -> Job | None:
        """``job`` is past its deadline (``deadline_s`` after it was created): it fails
        ``deadline_exceeded``, the agent running it is told to stop, and the client gets
        its hold back except for the work checkpoints saved (each provider whose checkpoint
        the job holds is paid its share of it; steps reported but not checkpointed are not
        paid). None when it moved first (settled, cancelled)."""
        message = (f"the job's deadline of {job.deadline_s:g} s passed before it could be "
                   "finished; it was stopped and the hold released, except for the work "
                   "its checkpoints saved" + (f"; last: {last}" if last else ""))
        with self.repo.atomic():
            moved = self.repo.transition(
                job.id, [job.state], JobState.FAILED, expect_attempt=job.attempt,
                event=("failed", {"code": "deadline_exceeded", "message": message}),
                error_code="deadline_exceeded", error_message=message,
                finished_at=self.clock(), lease_expires_at=None)
            if moved is not None:
                parts = self.checkpoints.saved_parts(job) if self.checkpoints is not None else []
                if parts:
                    # As a cancel pays, with nothing counted past the checkpoints.
                    unreported = replace(job, progress_step=0, progress_total=0)
                    self._money("deadline", job, lambda: cancel_shared(
                        self.billing, unreported, parts, Fraction(1), message))
                else:
                    self._money("release", moved,
                                lambda: self.billing.failed(moved, f"deadline_exceeded: "
                                                            f"{message}"))
        if moved is None:
            return None
        log.info("job %s failed: its deadline of %gs passed", job.id, job.deadline_s)
        if job.state in LEASED and job.provider_id:
            self.cancel_hook(moved)
            self.on_released(job.provider_id, job.id)
        self.hub.notify(job.id, ended=True)
        self.on_ended(moved)
        return moved

    def take_back(self, job: Job, kind: str, reason: str) -> Job | None:
        """Take a leased job away from its provider (lease expired, stalled): requeue or
        fail it, and only if that move happened free the slot and tell a zombie agent to
        stop (a job that settled in the meantime keeps both)."""
        moved = self._requeue(job, kind, reason)
        if moved is not None:
            self.on_released(job.provider_id, job.id)
            self.cancel_hook(job)
        return moved

    def _requeue(self, job: Job, kind: str, reason: str, count_attempt: bool = True,
                 exclude: list[str] = (), logged: str | None = None) -> Job | None:
        """Back to the queue for another provider, or FAILED once attempts run out.
        ``exclude``: more exclusions (``operator:<account>`` ones are hard); ``logged``:
        what the log line says instead of ``reason`` (a provider's words stay out of it)."""
        used = job.attempt + 1
        if count_attempt and used >= job.max_attempts:
            return self._fail(job, "attempts_exhausted",
                              f"gave up after {used} attempts; last: {reason}")
        if job.deadline_s is not None and self.clock() > job.created_at + job.deadline_s:
            return self.expire(job, last=reason)
        excluded = sorted(set(job.excluded_providers) | {job.provider_id} | set(exclude))
        moved = self.repo.transition(
            job.id, [job.state], JobState.QUEUED, expect_attempt=job.attempt,
            expect_provider=job.provider_id,
            event=("requeued", {"reason": reason, "why": kind, "attempt": job.attempt + 1,
                                "provider_id": job.provider_id}),
            attempt=job.attempt + 1, provider_id=None, lease_expires_at=None, envelope=None,
            excluded_providers=excluded, progress_step=0, progress_total=0)
        if moved is not None:
            log.info("job %s requeued (%s): %s", job.id, kind,
                     reason if logged is None else logged)
            self.hub.notify(job.id)
            self.on_queued(moved)
        return moved

    def expire_unserved(self, limit: int = 500) -> list[Job]:
        """Fail the queued jobs (oldest ``limit``) whose build has had no provider for the
        presence window: no provider connected now serves it and none that does was seen
        within the window. Each fails ``no_provider`` with its hold voided (a full refund)
        and a ``failed`` event; the maintenance thread calls it every pass."""
        if self.presence is None:
            return []
        served: dict[tuple[str, str], bool] = {}
        gone = []
        for job in self.repo.queued(limit):
            build = (job.plugin, job.plugin_version)
            if build not in served:
                served[build] = self.presence.serves(*build)
            if served[build]:
                continue
            moved = self._fail(job, NO_PROVIDER,
                               f"no provider has served {job.plugin}@{job.plugin_version} for "
                               f"{self.presence.window_s:g} s (none connected, none seen), so "
                               "the job was given up and its hold released in full")
            if moved is not None:
                log.info("job %s failed: no provider served %s@%s for %gs", job.id,
                         job.plugin, job.plugin_version, self.presence.window_s)
                gone.append(moved)
        return gone

    def give_up(self, job: Job, code: str, message: str) -> Job | None:
        """Fail a queued job the broker will not run after all (a check no provider of
        another operator took in time): its hold is released, ``on_ended`` runs."""
        return self._fail(job, code, message)

    def _fail(self, job: Job, code: str, message: str) -> Job | None:
        with self.repo.atomic():  # the failure with its hold's release
            moved = self.repo.transition(job.id, [job.state], JobState.FAILED,
                                         expect_attempt=job.attempt,
                                         event=("failed", {"code": code, "message": message}),
                                         error_code=code, error_message=message,
                                         finished_at=self.clock(), lease_expires_at=None)
            if moved is not None:
                self._money("release", moved,
                            lambda: self.billing.failed(moved, f"{code}: {message}"))
        if moved is not None:
            self.hub.notify(job.id, ended=True)
            self._ended(moved)
            self.on_ended(moved)
        return moved

    def _ended(self, job: Job) -> None:
        """Tell the metrics a job reached its end state."""
        end = job.finished_at or self.clock()
        self.metrics.ended(job.plugin, job.state.value, end - (job.created_at or end))

    # ---- money -----------------------------------------------------------------------
    def _charge(self, job: Job, receipt: dict) -> None:
        units = receipt.get("work_units", job.work_units)
        parts = self.checkpoints.parts(job) if self.checkpoints is not None else []
        if parts:  # resumed from a checkpoint: earlier providers get their shares
            resumed = self.checkpoints.base_fraction(job)
            self._money("settle", job,
                        lambda: settle_shared(self.billing, job, units, parts, resumed))
            return
        self._money("settle", job, lambda: self.billing.settle(job, units))

    def _money(self, what: str, job: Job, action) -> None:
        """Run a billing step after the job's state change, in its ``atomic`` block (the two
        commit together). The state change stands even if the ledger fails: the ledger's
        writes are a savepoint that rolls back alone (the hold then expires back to the
        client after its TTL); the
        failure is logged and recorded as a ``ledger_error`` event on the job, with its
        cause, so an admin sees it on the job page and can reconcile it (every ledger call
        is keyed by the job id: re-running it is safe)."""
        if self.billing is None or job.hold_id is None:
            return
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the job already moved; money is reconciled
            log.exception("job %s: ledger %s failed", job.id, what)
            try:
                self.repo.add_event(job.id, "ledger_error",
                                    {"step": what, "error": f"{type(exc).__name__}: {exc}"})
            except Exception:  # noqa: BLE001 - the log line above still names the job
                log.exception("job %s: could not record the ledger failure", job.id)


def _check_output(job_id: str, data: bytes, sha256: str) -> None:
    actual = sha256_hex(data)
    if sha256 and actual != sha256:
        raise ReceiptRefused("output_hash_mismatch",
                             f"output of job {job_id} hashes to {actual}, not {sha256}")


class _Taken(Exception):
    """The job's id is an earlier request's (the same idempotency key): ``job``."""

    def __init__(self, job: Job):
        super().__init__(job.id)
        self.job = job


class _Moved(Exception):
    """assign()'s copy of a lease is out of date: the job moved since."""


def _check_lease(job_id: str, provider_id: str, attempt: int,
                 lease: tuple[JobState, str | None, int] | None) -> None:
    """Refuse unless ``lease`` (state, holder, attempt) says ``attempt`` of the job is
    leased to ``provider_id``."""
    if lease is None:
        raise ReceiptRefused("unknown_job", f"no job {job_id!r}")
    state, holder, current = lease
    if holder != provider_id or current != attempt or state not in LEASED:
        raise ReceiptRefused("not_your_job",
                             f"job {job_id} attempt {attempt} is not leased to you (it is "
                             f"{state.value}, attempt {current})")


def check_receipt_shape(rec: dict) -> None:
    """Refuse a receipt whose outputs or reproducibility class are not what the broker and
    verification read (a provider controls every byte of it): ``outputs`` a list of
    ``{index: int, sha256: 64 hex, media_type: str, size: int >= 0, meta: dict}`` with
    indexes 0..n-1, and ``repro`` (when present) a dict of strings."""
    outs = rec.get("outputs")
    if not isinstance(outs, list) or len(outs) > 1024:
        raise ReceiptRefused("malformed_receipt", "receipt outputs must be a list (at most 1024)")
    for i, out in enumerate(outs):
        where = f"receipt output {i}"
        if not isinstance(out, dict):
            raise ReceiptRefused("malformed_receipt", f"{where} is not an object")
        if not is_sha256_hex(out.get("sha256")):
            raise ReceiptRefused("malformed_receipt", f"{where}: sha256 must be 64 lowercase hex")
        if out.get("index") != i or isinstance(out.get("index"), bool):
            raise ReceiptRefused("malformed_receipt", f"{where}: index must be {i}")
        media = out.get("media_type")
        if not isinstance(media, str) or not 0 < len(media) <= 100 or "/" not in media:
            raise ReceiptRefused("malformed_receipt", f"{where}: media_type must be a MIME type")
        size = out.get("size")
        if type(size) is not int or size < 0:
            raise ReceiptRefused("malformed_receipt", f"{where}: size must be an integer >= 0")
        if not isinstance(out.get("meta", {}), dict):
            raise ReceiptRefused("malformed_receipt", f"{where}: meta must be an object")
    repro = rec.get("repro", {})
    if not isinstance(repro, dict) or not all(isinstance(v, str) for v in repro.values()):
        raise ReceiptRefused("malformed_receipt", "receipt repro must be an object of strings")


# Who pays for jobs: clients, and admins (their accounts get client ledger accounts, see
# broker/services.py, so an operator can try the broker with a granted balance). Provider
# and publisher accounts earn credits; they have nothing a job could be held against.
SUBMIT_ROLES = ("client", "admin")
_ROLE_USES = {"provider": "provider keys connect agents that run jobs and earn credits",
              "publisher": "publisher keys publish plugins and adapters and earn royalties"}


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


#: The input that seeds a plugin's random draws (an integer input without a default, as
#: sd15, sdxl and llama declare it): the broker fills it in when the client leaves it out.
SEED_INPUT = "seed"


def draw_seed(manifest, inputs: dict, rng: random.Random) -> dict:
    """``inputs`` with the job's seed fixed by the broker (DESIGN §6): a plugin that takes
    a seed (an integer ``seed`` input with no default) and a client that gave none get one
    drawn here, so every run of the job (its provider, a check, a third run, a resumed
    attempt) uses the seed the broker holds, never one a provider reports. Drawn in the
    lower half of the input's range, so that image ``i`` (``seed + i``) of a multi-image
    job or of a split stays inside it."""
    spec = next((f for f in manifest.inputs.fields if f.name == SEED_INPUT), None)
    if (spec is None or spec.type != "integer" or spec.default is not None
            or inputs.get(SEED_INPUT) is not None):
        return inputs
    low = int(spec.minimum if spec.minimum is not None else 0)
    high = int(spec.maximum if spec.maximum is not None else 2**32 - 1)
    return {**inputs, SEED_INPUT: rng.randint(low, low + max(0, high - low) // 2)}


def _replayed(existing: Job, request_hash: str, idempotency_key: str | None) -> Job:
    """The job a repeated Idempotency-Key names, if the request is the same one."""
    if existing.request_hash != request_hash:
        what = f"batch {existing.batch_id}" if existing.batch_id else f"job {existing.id}"
        raise IdempotencyConflict(f"Idempotency-Key {idempotency_key!r} was used for another "
                                  f"request ({what}); a key names exactly one request (the "
                                  "same plugin, inputs, n and options): send that request "
                                  "again to get its answer, or use a new key for a new job")
    return existing


_JOB_IDS = uuid.UUID("6f1c0c5e-8a39-4c3e-9a55-5d0b3e2f7a11")  # namespace of derived job ids


def _derived_id(name: str) -> str:
    """A job (or batch) id derived from ``name`` (an idempotency key, a batch and index),
    shaped as a random (version 4) UUID: the agents see job ids, and a derived id whose
    version said 5 told client jobs from checks and canaries (uuid4), which must look the
    same (issue #20). The bits come from the namespaced SHA-1 of ``name`` as before."""
    return str(uuid.UUID(bytes=uuid.uuid5(_JOB_IDS, name).bytes, version=4))


def _input_disputed(job: Job) -> bool:
    """Did a provider refuse this (non-check) job's input, sending it to another operator?
    (Only that puts an ``operator:`` exclusion on a job that is not a check.)"""
    return not job.check_of and any(e.startswith("operator:") for e in job.excluded_providers)


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(str(value))
        return True
    except ValueError:
        return False
