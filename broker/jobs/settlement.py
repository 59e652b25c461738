"""How a run ends: a provider's signed receipt checked and settled (the money moved in the
same block as the state), a failure reported by the provider, a job given up, and the
ledger steps behind them.

A part of :class:`broker.jobs.service.JobService`.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext

from sdk.protocol.canonical import canonical_bytes, is_sha256_hex, sha256_hex
from sdk.protocol.envelope import EnvelopeError, open_receipt

from broker.errors import BrokerError

from .errors import ReceiptRefused
from .model import LEASED, Job, JobOutput, JobState
from .leases import _check_output
from .lease_check import is_uuid

log = logging.getLogger(__name__)

BAD_INPUT = "bad_input"            # a failure code: the plugin refused the job's input
INPUT_DISPUTED = "input_disputed"  # a requeue: another operator's provider tries that input


class JobSettlement:
    """Receipts, failures and money (a part of JobService)."""

    def receipt(self, provider_id: str, provider_key: str, data: bytes, signature: str,
                uploads: list[tuple[bytes, str]] = (), received_at: float | None = None) -> Job:
        """Verify a signed receipt and settle the job; idempotent for the same receipt.
        ``uploads``: (data, sha256) of outputs that came with the receipt, stored once it
        verifies and the job's lease is the sender's (each must be one the receipt names).
        ``received_at``: when the receipt reached the broker (the gateway stamps it as it
        reads the message; now when not given) — the end of the run the market times."""
        received_at = self.clock() if received_at is None else received_at
        rec = _open(data, signature, provider_key)
        job_id, attempt = str(rec["job_id"]), int(rec["attempt"])
        copy = self._take_copy(provider_id, rec)
        if copy is not None:
            try:
                return self._settle(copy[0], rec, signature, uploads, envelope_sha=copy[1],
                                    received_at=received_at)
            except _Moved:
                pass
        job = self.repo.get(job_id) if is_uuid(job_id) else None
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

    def receipts(self, provider_id: str, provider_key: str,
                 items: list[tuple[bytes, str, list[tuple[bytes, str]], float | None]]
                 ) -> list[Job | BrokerError | None]:
        """Several receipts of one provider (``items``: data, signature, uploads and
        received_at of each, as :meth:`receipt` takes them), judged each alone and settled
        together: the settlements of those whose job is still leased as assign() wrote it
        (nearly all) commit as one transaction, with their outputs, events, ledger posts and
        audit entries (issue #28: one COMMIT for the batch instead of one per job; their
        events, outputs, posts and audit entries each written by one statement or a few
        for the whole batch). Each
        receipt's signature is checked on its own bytes. Any other receipt (a re-sent one,
        a job that moved since it was assigned, one of a batch whose transaction failed) is
        judged by :meth:`receipt` after that transaction, exactly as if it came alone.
        Returns, per item and in order, the settled job, the BrokerError that refused it, or
        None (it failed otherwise; logged)."""
        results: list[Job | BrokerError | None] = [None] * len(items)
        ready = []  # (index, job, rec, signature, uploads, outputs)
        alone: list[int] = []  # judged by receipt() after the batch
        for i, (data, signature, uploads, _) in enumerate(items):
            try:
                rec = _open(data, signature, provider_key)
                copy = self._take_copy(provider_id, rec)
                if copy is None:
                    alone.append(i)
                    continue
                ready.append((i, copy[0], rec, signature, uploads,
                              self._checked(copy[0], rec, uploads, copy[1])))
            except BrokerError as exc:
                results[i] = exc
            except Exception:  # noqa: BLE001 - the others' copies are taken: they go on
                log.exception("receipt %d of a batch from %s could not join the batch; "
                              "judging it alone", i, provider_id)
                alone.append(i)
        settled = []
        if ready:
            now = self.clock()
            try:
                with self.repo.atomic():
                    # the batch's events and outputs: one INSERT each, before its posts
                    with self.repo.deferred_rows():
                        for i, job, rec, signature, uploads, outputs in ready:
                            done = self._settle_write(job, rec, signature, uploads, outputs,
                                                      now, flat=True, charge=False)
                            if done is None:
                                alone.append(i)  # moved since assign(): judged on its row
                            else:
                                settled.append((i, job, done, rec, outputs))
                    self._charge_batch([(done, rec) for _, _, done, rec, _ in settled])
            except Exception:  # noqa: BLE001 - nothing of the batch committed: one by one
                log.exception("settling a batch of %d receipts from %s in one transaction "
                              "failed; settling them one at a time", len(ready), provider_id)
                settled = []
                alone = sorted(set(alone) | {r[0] for r in ready})
        self._settled_batch([(job, done, rec, outputs, items[i][3])
                             for i, job, done, rec, outputs in settled])
        for i, _, done, _, _ in settled:
            results[i] = done
        for i in sorted(alone):
            data, signature, uploads, received_at = items[i]
            try:
                results[i] = self.receipt(provider_id, provider_key, data, signature, uploads,
                                          received_at=received_at)
            except BrokerError as exc:
                results[i] = exc
            except Exception:  # noqa: BLE001 - one receipt must not stop the others
                log.exception("receipt %d of a batch from %s failed", i, provider_id)
        return results

    def _take_copy(self, provider_id: str, rec: dict) -> tuple[Job, str] | None:
        """The lease as assign() wrote it, when it is this sender's and this attempt's
        (taken: a second receipt for the job is judged on the row). The settlement's
        conditional UPDATE still decides, and if the job has moved since, the receipt is
        judged again on the row as it is now."""
        job_id, attempt = str(rec["job_id"]), int(rec["attempt"])
        with self._assigned_lock:
            copy = self._assigned.get(job_id)
            if copy is not None and (copy[0].provider_id == provider_id
                                     and copy[0].attempt == attempt):
                del self._assigned[job_id]
                return copy
        return None

    def _settle(self, job: Job, rec: dict, signature: str, uploads,
                envelope_sha: str | None = None, received_at: float | None = None) -> Job:
        """Settle ``job`` (leased to the receipt's sender) on its verified receipt ``rec``.
        ``envelope_sha``: ``job`` is assign()'s copy and this the hash of its envelope as
        signed; a job that has moved since then raises _Moved instead of being refused."""
        from_copy = envelope_sha is not None
        outputs = self._checked(job, rec, uploads, envelope_sha)
        # Verification (DESIGN §6) will stop at SUBMITTED/VERIFYING; until then a verified
        # receipt settles at once, in one transaction with its outputs and both events.
        # The settlement and its ledger post (with the post's audit entry) commit as one
        # transaction; a post that fails rolls back alone (a savepoint), and the
        # settlement stands with a ledger_error event (see _money).
        with self.repo.atomic():
            settled = self._settle_write(job, rec, signature, uploads, outputs, self.clock())
            if settled is None:
                if from_copy:
                    raise _Moved()  # nothing was written: judged again on the row
                raise ReceiptRefused("not_your_job",
                                     f"job {job.id} moved before the receipt arrived")
        self._settled(job, settled, rec, outputs, received_at)
        return settled

    def _checked(self, job: Job, rec: dict, uploads, envelope_sha: str | None) -> list[JobOutput]:
        """The receipt's outputs, once it covers the job's envelope, has the shape the broker
        reads and every output is sent with it or stored; else ReceiptRefused."""
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
        return outputs

    def _settle_write(self, job: Job, rec: dict, signature: str, uploads,
                      outputs: list[JobOutput], now: float, flat: bool = False,
                      charge: bool = True) -> Job | None:
        """Inside the caller's ``atomic`` block: the job LEASED → SETTLED with its outputs,
        events, stored blobs and ledger post; None when it is no longer the sender's lease
        (nothing written). ``flat``: the transition runs without a savepoint of its own (a
        batch: any failure rolls the whole batch back, which then settles one at a time);
        the ledger post keeps its own either way, as a failed post must roll back alone.
        ``charge`` False: no ledger post (a batch posts its jobs together, _charge_batch)."""
        attempt = int(rec["attempt"])
        with (self.repo.flat() if flat else nullcontext()):
            settled = self._transition_settled(job, rec, signature, outputs, attempt, now)
        if settled is None:
            return None
        # Stored once the job is the sender's to settle; if storing fails, the
        # settlement rolls back with it.
        for blob, _ in uploads:
            self.blobs.put(blob)
        if charge:
            self._charge(settled, rec)
        return settled

    def _transition_settled(self, job: Job, rec: dict, signature: str,
                            outputs: list[JobOutput], attempt: int, now: float) -> Job | None:
        return self.repo.transition(
            job.id, LEASED, JobState.SETTLED, expect_attempt=attempt,
            expect_provider=job.provider_id, outputs=outputs,
            events=[("submitted", {"attempt": attempt}),
                    ("done", {"outputs": [{"index": o.index, "sha256": o.sha256,
                                           "media_type": o.media_type, "size": o.size}
                                          for o in outputs]})],
            receipt=rec, receipt_signature=signature, lease_expires_at=None,
            finished_at=now)

    def _settled(self, job: Job, settled: Job, rec: dict, outputs: list[JobOutput],
                 received_at: float | None) -> None:
        """After a settlement committed: the market's timing, the freed slot, verification's
        draw, the waiting client, the metrics."""
        self._released_after(job, settled, rec, received_at)
        # Verification draws whether to check the job once its receipt is signed and
        # settled, before the client is woken, so it never sees a status that changes back.
        self.job_events.settled(settled, rec)
        self._told_after(job, settled, outputs, received_at)

    def _settled_batch(self, settled: list[tuple[Job, Job, dict, list[JobOutput],
                                                 float | None]]) -> None:
        """:meth:`_settled` for each job of a batch whose settlements committed together,
        each on its own: verification's draw (its own reads and writes: never inside a
        transaction of this thread, where SQLite lets no other connection write) and the
        waiting client. One job's failure here is logged and does not stop the others'."""
        for job, done, rec, outputs, received_at in settled:
            try:
                self._settled(job, done, rec, outputs, received_at)
            except Exception:  # noqa: BLE001 - the settlement stands; the others go on
                log.exception("job %s settled in a batch, but what follows its settlement "
                              "failed", job.id)

    def _released_after(self, job: Job, settled: Job, rec: dict,
                        received_at: float | None) -> None:
        try:
            self.job_events.receipt(settled, rec,
                                    self.clock() if received_at is None else received_at)
            if _input_disputed(settled):  # whoever called this input bad was wrong
                for refuser in self._input_refusers(job.id):
                    self.on_failure(refuser, job.plugin)
        except Exception:  # noqa: BLE001 - a measurement must never undo a settlement
            log.exception("job %s: telling the market of the receipt (timings, refusals of "
                          "its input) failed", job.id)
        self.job_events.released(job.provider_id, job.id)

    def _told_after(self, job: Job, settled: Job, outputs: list[JobOutput],
                    received_at: float | None) -> None:
        self.hub.notify(job.id, ended=True, copy=(settled, tuple(outputs)))
        self._ended(settled)
        if received_at:  # the wall clock the gateway stamped the receipt with
            self.metrics.settled(job.plugin, max(0.0, self.clock() - received_at))

    def failed(self, provider_id: str, job_id: str, attempt: int, code: str, message: str,
               retryable: bool) -> Job | None:
        try:
            job = self._leased(provider_id, job_id, attempt)
        except ReceiptRefused:
            return None  # already moved (cancelled, requeued): nothing to do
        self.job_events.released(provider_id, job_id)
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
        operator = self.job_events.second_opinion(job, provider_id)
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

    def give_up(self, job: Job, code: str, message: str) -> Job | None:
        """Fail a queued job the broker will not run after all (a check no provider of
        another operator took in time): its hold is released, ``job_events.ended`` runs."""
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
            self.job_events.ended(moved)
        return moved

    def _ended(self, job: Job) -> None:
        """Tell the metrics a job reached its end state."""
        end = job.finished_at or self.clock()
        self.metrics.ended(job.plugin, job.state.value, end - (job.created_at or end))

    # ---- money -----------------------------------------------------------------------
    def _charge(self, job: Job, receipt: dict, parts: list | None = None) -> None:
        """Charge ``job`` for ``receipt``: shared with the providers of the checkpoints it
        resumed from (``parts``, read here when the caller has not read them)."""
        units = receipt.get("work_units", job.work_units)
        if parts is None:
            parts = self.checkpoints.parts(job) if self.checkpoints is not None else []
        if parts:  # resumed from a checkpoint: earlier providers get their shares
            resumed = self.checkpoints.base_fraction(job)
            self._money("settle", job,
                        lambda: self.billing.settle_shared(job, units, parts, resumed))
            return
        self._money("settle", job, lambda: self.billing.settle(job, units))

    def _charge_batch(self, settled: list[tuple[Job, dict]]) -> None:
        """:meth:`_charge` of each ``(job, receipt)`` of a batch, in the caller's ``atomic``
        block: the plain posts (no checkpoint shares) in one ledger call that writes them
        together (``billing.settle_many``, issue #28: one claim of their keys, one write of
        their transactions, entries and balances) in one savepoint; when that call refuses
        (a key already taken, a hold not postable, a first payment to a new account …) it
        wrote nothing, and each job is charged on its own as if it came alone, which
        records its own ledger_error if its post fails."""
        alone, plain = [], []  # (job, receipt, its checkpoint parts)
        for job, rec in settled:
            if self.billing is None or job.hold_id is None:
                continue
            parts = self.checkpoints.parts(job) if self.checkpoints is not None else []
            (alone if parts else plain).append((job, rec, parts))
        if len(plain) > 1:
            try:
                self.billing.settle_many([(job, rec.get("work_units", job.work_units))
                                          for job, rec, _ in plain])
                plain = []
            except Exception as exc:  # noqa: BLE001 - nothing was written: one at a time
                log.info("posting %d settlements together failed (%s: %s); posting them one "
                         "at a time", len(plain), type(exc).__name__, exc)
        for job, rec, parts in [*plain, *alone]:
            self._charge(job, rec, parts)

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


def _open(data: bytes, signature: str, provider_key: str) -> dict:
    """The receipt's document once its signature checks; else ReceiptRefused."""
    try:
        return open_receipt(data, signature, provider_key=provider_key)
    except EnvelopeError as exc:
        raise ReceiptRefused(exc.code, str(exc)) from None


class _Moved(Exception):
    """assign()'s copy of a lease is out of date: the job moved since."""


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


def _input_disputed(job: Job) -> bool:
    """Did a provider refuse this (non-check) job's input, sending it to another operator?
    (Only that puts an ``operator:`` exclusion on a job that is not a check.)"""
    return not job.check_of and any(e.startswith("operator:") for e in job.excluded_providers)
