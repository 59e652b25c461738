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
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from sdk.protocol.canonical import canonical_bytes, sha256_hex
from sdk.protocol.schema import InputError
from sdk.protocol.signing import KeyPair
from sdk.logs import request_digest

from broker.auth.service import Principal
from broker.catalog.registry import PluginCatalog
from broker.billing.errors import InsufficientCredits
from broker.errors import (BrokerError, Forbidden, IdempotencyConflict, InvalidInput,
                           InvalidRequest, in_item)
from .errors import NoProvider
from .hub import EventHub
from .model import Job, JobOutput, JobRequest, JobState
from .cache import result_cache_key
from .checkpoints import CheckpointService
from .events import JobEventRelay, JobEvents
from .ports import BlobStore, BuildsServed, JobMetrics, JobRepository, NoMetrics
from .stalls import StallWatch
from .leases import JobLeases
from .queries import JobQueries
from .settlement import JobSettlement

log = logging.getLogger(__name__)


@dataclass
class JobSettings:
    max_attempts: int = 3
    lease_timeout_s: float = 30.0
    envelope_ttl_s: float = 60.0


class InputDefaults(Protocol):
    """What the weights of the providers that could run a job give the inputs its
    manifest declares ``default_from = "weights"`` (broker.providers.defaults)."""

    def for_job(self, manifest, weights_digest: str | None = None) -> dict[str, Any]: ...


class Retention(Protocol):
    """Whether a job's outputs are past their retention (broker.blobs.retention)."""

    policy: Any  # its output_retention_s, for messages

    def expired(self, finished_at: float | None, now: float | None = None) -> bool: ...



def dearer(manifest, asked: dict[str, Any], resolved: dict[str, Any]) -> bool | None:
    """The never-dearer rule of the weights' defaults: whether ``resolved`` (with what the
    providers' weights give) costs more work units than ``asked`` (the manifest's
    defaults). None when the formula cannot be worked out on these inputs (it names an
    input neither gives: a required one the client has to send), which judges nothing."""
    try:
        return manifest.work_units_for(resolved) > manifest.work_units_for(asked)
    except (ValueError, TypeError, ArithmeticError):
        return None

class JobService(JobQueries, JobLeases, JobSettlement):
    """Jobs from submit to their end. This file holds creation (submit, a split's siblings,
    verification's check runs, cache answers); reading is in queries.py, leases in leases.py,
    receipts, failures and money in settlement.py."""

    def __init__(self, repo: JobRepository, blobs: BlobStore, catalog: PluginCatalog,
                 signer: KeyPair, hub: EventHub | None = None,
                 settings: JobSettings | None = None, clock=time.time, billing=None,
                 input_defaults: InputDefaults | None = None,
                 seed_rng: random.Random | None = None,
                 metrics: JobMetrics | None = None,
                 retention: Retention | None = None, result_cache=None,
                 check_inputs: Callable[[str, dict], None] | None = None,
                 check_terms: Callable[[Job, int], None] | None = None,
                 on_failure: Callable[[str, str], None] | None = None,
                 stalls: StallWatch | None = None,
                 builds_served: BuildsServed | None = None,
                 job_events: JobEvents | None = None,
                 checkpoints: CheckpointService | None = None):
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
        # What this service tells the rest: the dispatcher (queued, released, cancel, a
        # second opinion), the market (receipts) and verification (settled, ended), joined
        # to the relay by the wiring (broker.jobs.events; None: a relay nobody joined).
        self.job_events: JobEvents = (job_events if job_events is not None
                                      else JobEventRelay())
        # Resuming from checkpoints and the shares of earlier attempts (None: none kept)
        self.checkpoints = checkpoints
        self.stalls = stalls      # runs far past their bound are taken back (None: never)
        # The market: admission of a job's terms before any row or hold (raises
        # CannotMeetTerms; None: every job's terms are admitted).
        self.check_terms = check_terms
        # Whether some provider known to the broker serves a build (broker.providers.
        # presence.BuildsServed; None: never asked): a job for a build no provider known to
        # the broker serves is refused at submit (409 no_provider), and expire_unserved()
        # gives up queued jobs whose build has had none for the window.
        self.builds_served = builds_served
        # Input checks that need more than the manifest: the registry refuses adapters
        # published for another plugin (raises InvalidInput).
        self.check_inputs = check_inputs or (lambda plugin, inputs: None)
        # A run that failed in a way that counts against the provider's reliability.
        self.on_failure = on_failure or (lambda provider_id, plugin: None)
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
        _check_key(idempotency_key)
        inputs, request_hash = self._prepare(request)
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
            jobs = self._create(who, request, inputs, job_id, idempotency_key, request_hash,
                                now, request_id)
        except _Taken as taken:
            return _replayed(taken.job, request_hash, idempotency_key), False
        except Exception:
            existing = None
            if idempotency_key is not None:
                with self.repo.atomic():  # as a write sees it (see _earlier)
                    existing = self.repo.get(job_id)
            if existing is None:
                raise
            return _replayed(existing, request_hash, idempotency_key), False
        job = jobs[0]
        self.metrics.submitted(job.plugin, request.terms["n"])
        if request_id:
            log.info("job %s%s created by request %s (agents log it as %s)", job.id,
                     f" and {len(jobs) - 1} sibling(s)" if job.batch_id else "", request_id,
                     request_digest(request_id))
        self._announce(jobs)
        return job, True

    def submit_many(self, who: Principal, requests: list[JobRequest],
                    idempotency_key: str | None = None,
                    request_id: str | None = None) -> tuple[list[Job], bool]:
        """Queue independent jobs in one request (``POST /v1/jobs/bulk``): each of
        ``requests`` as :meth:`submit` would queue it, all with their holds in one
        transaction or none. Every request's inputs are checked before anything is
        written; an error (an input, no provider, the terms, the balance) names the item
        (``jobs[i]``) and leaves nothing behind. Returns (the job of each request, its
        first sibling for a split, in order; created).

        ``idempotency_key`` names the whole request: the first item's job takes the id a
        one-job request with the key gets and carries the key, the other items' ids derive
        from it, and every row holds the hash of all the items, so a replay of the same
        list answers the first jobs (writing nothing, charging nothing twice) and any
        other request with the key (another list, a single job, a split) is a 409."""
        self.check_submitter(who)
        _check_key(idempotency_key)
        prepared = []
        for i, request in enumerate(requests):  # every item checked before any write
            try:
                prepared.append(self._prepare(request))
            except BrokerError as exc:
                raise in_item(exc, i) from None
        request_hash = sha256_hex(canonical_bytes({"jobs": [h for _, h in prepared]}))
        if idempotency_key is not None:
            first = _derived_id(f"{who.account_id}:{idempotency_key}")
            ids = [first] + [_derived_id(f"bulk:{first}:{i}") for i in range(1, len(requests))]
        else:
            ids = [str(uuid.uuid4()) for _ in requests]
        now = self.clock()
        created: list[list[Job]] = []
        try:
            with self.repo.atomic():  # every item's jobs and holds, or none
                for i, (request, (inputs, _)) in enumerate(zip(requests, prepared)):
                    try:
                        # Item order is queue order: each item a microsecond after the last.
                        created.append(self._create(
                            who, request, inputs, ids[i], idempotency_key if i == 0 else None,
                            request_hash, now + i * 1e-6, request_id))
                    except BrokerError as exc:
                        raise in_item(exc, i) from None
        except Exception as exc:
            # A replay (an item's row is the earlier request's: _Taken, or a conflict on
            # an id without a key), or one refused on the way (the balance, the terms or
            # the providers are not what they were): the earlier request's jobs.
            taken = exc.job if isinstance(exc, _Taken) else None
            earlier = (self._earlier(ids, taken) if idempotency_key is not None
                       and not isinstance(exc, IdempotencyConflict) else None)
            if earlier is None:
                if isinstance(exc, InsufficientCredits):
                    raise self._short_for_all(who, requests, prepared, exc) from None
                raise
            return [_replayed(j, request_hash, idempotency_key) for j in earlier], False
        for request, jobs in zip(requests, created):
            self.metrics.submitted(jobs[0].plugin, request.terms["n"])
        every = [j for jobs in created for j in jobs]
        if request_id:
            log.info("%d job(s) of %d request(s), from job %s, created by request %s (agents "
                     "log it as %s)", len(every), len(created), every[0].id, request_id,
                     request_digest(request_id))
        self._announce(every)  # one wake-up for all of them
        return [jobs[0] for jobs in created], True

    def _earlier(self, ids: list[str], taken: Job | None) -> list[Job] | None:
        """The jobs an earlier bulk request with the same key made (None: there are none,
        or not all of them, so it was another request)."""
        # Read as a write would (an atomic block): on SQLite's group commit the earlier
        # request's rows may be written and not yet committed, seen only from the writer.
        with self.repo.atomic():
            first = (taken if taken is not None and taken.id == ids[0]
                     else self.repo.get(ids[0]))
            if first is None:
                return None
            rest = [self.repo.get(job_id) for job_id in ids[1:]]
        if any(j is None for j in rest):
            raise IdempotencyConflict(
                f"Idempotency-Key was used for another request (job {first.id}); a key "
                "names exactly one request: send that request again to get its answer, or "
                "use a new key")
        return [first, *rest]

    def _short_for_all(self, who: Principal, requests: list[JobRequest],
                       prepared: list[tuple[dict, str]],
                       refused: InsufficientCredits) -> InsufficientCredits:
        """The 402 of a bulk request the balance cannot hold: what all of its holds would
        reserve against what is available (none of them was placed). A job with
        ``verify="always"`` counts twice, as its hold's check does. Where that sum does not
        exceed the balance (an item answered from the result cache at its own price),
        ``refused``, the item's own error that names it, is the answer."""
        need = 0
        for request, (inputs, _) in zip(requests, prepared):
            n, cap = request.terms["n"], request.terms["max_price_micro"]
            work_units = request.manifest.work_units_for(inputs)
            runs = 2 if request.verify == "always" else 1
            need += runs * n * self.billing.max_price(
                request.manifest.name, work_units,
                cap_micro=None if cap is None else cap // n, inputs=inputs)
        available = self.billing.available(who.account_id)
        if need <= available:
            return refused
        return InsufficientCredits(needed_micro=need, available_micro=available,
                                   how_to_fund=self.billing.how_to_fund,
                                   jobs=sum(r.terms["n"] for r in requests))

    def _prepare(self, request: JobRequest) -> tuple[dict, str]:
        """(the inputs ``request``'s job runs with, its request hash): the inputs checked
        against the manifest (InvalidInput) and the seed drawn."""
        manifest, terms, verify = request.manifest, request.terms, request.verify
        weights, output_format, cache = (request.weights_digest, request.output_format,
                                         request.cache)
        asked, inputs = self._inputs(manifest, request.inputs, weights)
        self.check_inputs(manifest.name, inputs)
        # The broker fixes the seed (after ``asked`` is taken: a retry of the same request
        # is the same request, and replays the first job, the seed it drew included).
        inputs = draw_seed(manifest, inputs, self.seed_rng)
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
        return inputs, sha256_hex(canonical_bytes(hashed))

    def _announce(self, jobs: list[Job]) -> None:
        """Tell the hub and the dispatcher of jobs just committed: a cache answer has ended,
        the rest are queued, with one wake-up for all (a split's siblings and a bulk
        request's jobs are offered together)."""
        queued = []
        for job in jobs:
            if job.cached_from:  # answered from the result cache: nothing to run
                self.hub.notify(job.id, ended=True)
            else:
                self.hub.notify(job.id, relay=False)  # nobody elsewhere knows its id yet
                queued.append(job)
        if len(queued) == 1 and not queued[0].batch_id:
            self.job_events.queued(queued[0])
        elif queued:
            self.job_events.queued(queued[0], siblings=queued)

    def resolve_inputs(self, manifest, raw: Any, weights_digest: str | None = None) -> dict:
        """A job's inputs as it will run them: ``raw`` checked against the manifest, and
        each input left out filled with what the weights of the providers that could run
        it give (inputs declared ``default_from = "weights"``, see
        broker.providers.defaults), else the manifest's default. Raises InvalidInput."""
        return self._inputs(manifest, raw, weights_digest)[1]

    def defaults_for(self, manifest, weights_digest: str | None = None) -> dict[str, Any]:
        """What :meth:`resolve_inputs` fills in now for the inputs whose default the weights
        set, where it differs from the manifest's (what ``GET /v1/plugins`` shows): none
        where they would make a job of the manifest's defaults dearer (:func:`dearer`)."""
        if self.input_defaults is None:
            return {}
        defaults = self.input_defaults.for_job(manifest, weights_digest)
        if defaults:
            declared = {f.name: f.default for f in manifest.inputs.fields
                        if f.default is not None}
            if dearer(manifest, declared, {**declared, **defaults}):
                return {}
        return defaults

    def _inputs(self, manifest, raw: Any, weights_digest: str | None) -> tuple[dict, dict]:
        """(the inputs as asked, with the manifest's defaults; as they will run). What the
        providers' weights report may make a job smaller than the manifest's defaults (tiny
        weights' 64×64 images), never dearer (:func:`dearer`, judged on this job's own
        inputs), so no provider can raise the price of a job whose client named no size."""
        try:
            asked = manifest.validate_inputs(raw)
            defaults = self.defaults_for(manifest, weights_digest)
            if not defaults:
                return asked, asked
            resolved = manifest.validate_inputs(raw, defaults)
            if dearer(manifest, asked, resolved) is not False:
                log.info("%s: the providers' weights give %s, which would cost more than the "
                         "manifest's defaults; those stand", manifest.ref, defaults)
                return asked, asked
            return asked, resolved
        except InputError as exc:
            raise InvalidInput(str(exc), field=f"inputs.{exc.field}" if exc.field else "inputs",
                               plugin=manifest.ref) from None

    def _create(self, who: Principal, request: JobRequest, inputs: dict, job_id: str,
                idempotency_key: str | None, request_hash: str, now: float,
                request_id: str | None = None) -> list[Job]:
        """The job (or a split's siblings, in order) with its hold. Raises _Taken, having
        written nothing, when an earlier request with the same idempotency key has it."""
        manifest, terms, verify = request.manifest, request.terms, request.verify
        weights, output_format, cache = (request.weights_digest, request.output_format,
                                         request.cache)
        work_units = manifest.work_units_for(inputs)
        n = terms["n"]
        cache_key = (result_cache_key(manifest, inputs, output_format)
                     if cache and self.result_cache is not None else None)
        if cache_key is not None:
            source = self.result_cache.find(cache_key, weights)
            if source is not None:  # answered from a verified job's outputs, not run
                return [self._answer_from_cache(who, manifest, inputs, source, job_id,
                                                idempotency_key, request_hash, now, terms,
                                                weights, output_format, cache_key)]
        served = self.builds_served
        if served is not None and not served.serves(manifest.name, manifest.version):
            raise NoProvider(
                f"no provider serves {manifest.ref}: none is connected, and none that "
                f"serves it was seen in the last {served.window_s:g} s, so nobody "
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
            return [job]

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
                      output_format: dict | None = None) -> list[Job]:
        """A split request: ``n`` sibling jobs sharing one batch id, each with its own hold
        for its share of the client's max price. The first sibling's id is ``first_id``
        (with an idempotency key, the id a one-job request with that key would get, and the
        key itself: whichever request comes second conflicts with the first on that row
        and its hold, so one key never makes two requests); the batch id and the other
        siblings' ids derive from it. Sibling ``i`` gets ``seed + i`` when the inputs carry
        an integer seed. Returns the siblings (raises _Taken, having written nothing,
        when an earlier request with the same key has its row); the caller tells the
        dispatcher of them together (:meth:`_announce`), which clears them together."""
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
        return created

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
            tx.after_commit(lambda: (self.hub.notify(job.id), self.job_events.queued(job),
                                     self.metrics.submitted(job.plugin)))
        return job

class _Taken(Exception):
    """The job's id is an earlier request's (the same idempotency key): ``job``."""

    def __init__(self, job: Job):
        super().__init__(job.id)
        self.job = job


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


def _check_key(idempotency_key: str | None) -> None:
    if idempotency_key is not None and (len(idempotency_key) > 200 or not idempotency_key):
        raise InvalidRequest("Idempotency-Key must be 1 to 200 characters",
                             field="Idempotency-Key")


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


