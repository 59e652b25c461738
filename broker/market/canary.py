"""Canary jobs: the broker's own measurements of a provider's throughput.

A canary is an ordinary signed envelope with the inputs of a recent client job of the same
build that another operator ran (the manifest's benchmark payload only before there is
one), with the fields a job's envelope has (weights digest, checkpoint interval), so the
agent cannot tell it from a client's job. It has no job row, account or hold: the gateway
hands its messages here (``owns``), the time the broker saw from sending it to its receipt
arriving becomes a θ sample (``throughput.timed_sample``), and nobody is charged or paid. One goes out when a provider connects with a plugin the broker
has not measured, then every ``canary_interval_s``.
"""
from __future__ import annotations

import logging
import random
import secrets
import threading
import uuid
from collections import deque
from typing import Callable, Protocol

from sdk.logs import new_request_digest
from sdk.protocol.envelope import EnvelopeError, make_envelope, open_receipt, sign_envelope
from sdk.protocol.signing import KeyPair

from broker.catalog.registry import PluginCatalog
from broker.jobs.model import Job, JobState
from broker.jobs.repro import ENVELOPE_FIELD as REPRO_FIELD, declared_class

from .service import Canary, MarketService
from .throughput import timed_sample

log = logging.getLogger(__name__)


class CanaryAnswers(Protocol):
    """Who compares each canary's outputs with the answer known for its inputs
    (verification, DESIGN §6: ``VerificationService.canary_answer``). ``source``: the
    client job whose inputs the canary reused ("" for the benchmark payload);
    ``recorded``: the class its envelope recorded (``Canary.repro``). Returns what the
    comparison found ("learning", "valid", "invalid", "ambiguous"; None: nobody did)."""

    def canary_answer(self, provider_id: str, plugin: str, version: str, inputs: dict,
                      receipt: dict, source: str = "",
                      recorded: dict | None = None) -> str | None: ...

    def canary_unanswered(self, provider_id: str, plugin: str, version: str,
                          recorded: dict | None, why: str,
                          away: bool = False) -> str | None:
        """A canary not answered (``why``: no receipt in time, a failure, a give-back not
        for the owner; ``away``: given back for the owner the agent said had come back, or
        out when its stream left this replica), counted against the provider
        (``VerificationService``); None: nobody counts."""


class EnvelopeExtra(Protocol):
    """What a job's envelope says beyond its inputs (``CheckpointService.envelope_extra``:
    ``checkpoint_every``), so a canary's envelope carries exactly what a job's would."""

    def envelope_extra(self, job: Job) -> dict: ...


#: Client jobs' inputs kept per build for canaries to reuse (the newest).
RECENT_INPUTS = 64


class CanaryService:
    def __init__(self, market: MarketService, catalog: PluginCatalog, signer: KeyPair, *,
                 lease_timeout_s: float = 30.0, envelope_ttl_s: float = 60.0,
                 extra: EnvelopeExtra | None = None, rng: random.Random | None = None,
                 linked_to: Callable[[str], frozenset[str]] | None = None,
                 answers: CanaryAnswers | None = None):
        self.market = market
        # the operator accounts the broker sees tied to one (broker.links): their jobs'
        # inputs are no canary's for it, as its own are not
        self.linked_to = linked_to or (lambda account: frozenset())
        self.catalog = catalog
        self.signer = signer
        self.lease_timeout_s = lease_timeout_s
        self.envelope_ttl_s = envelope_ttl_s
        self.extra = extra
        self.rng = rng or random.SystemRandom()
        # (plugin, version) -> [(operator that ran it, inputs, job id)]: what canaries
        # look like
        self._recent: dict[tuple[str, str], deque] = {}
        self._recent_lock = threading.Lock()
        # Verification compares each canary's outputs with the answer known for its
        # inputs, and counts a canary not answered (no receipt within
        # ``canary_timeout_s``, a failure, a give-back not for the owner) against the
        # provider, so that not answering is no way to dodge the known answer (None:
        # nobody compares or counts them; canaries still measure θ).
        self.answers = answers
        self.seeds = 4  # canaries draw their seed from this many, each with a known answer

    def send_due(self, session) -> int:
        """Send the canaries due to a connected agent with a free slot (called by the
        dispatcher); returns how many went out."""
        # every provider's expired canaries, not only this session's: each one's slot is
        # given back where its stream is held, or that provider keeps a dead id in ``active``
        for c in self.market.expired_canaries():
            if c.provider_id == session.provider_id:
                self.market.presence.give_back(session, c.job_id)
                held = True
            else:
                held = self.market.presence.release(c.provider_id, c.job_id) is not None
            if held:
                self._unanswered(c, "no receipt within "
                                    f"{self.market.settings.canary_timeout_s:g} s")
            else:  # its stream left this replica: it may have answered where it went
                self._unanswered(c, "no receipt here within "
                                    f"{self.market.settings.canary_timeout_s:g} s; its agent's "
                                    "stream left this replica meanwhile", away=True)
        sent = 0
        for plugin in self.market.canaries_due(session.provider_id):
            if session.free <= 0:
                break
            version = session.plugins and next(
                (k.split("@", 1)[1] for k in session.plugins if k.split("@", 1)[0] == plugin), None)
            try:
                manifest = self.catalog.get(plugin, version)
                inputs, source = self._inputs_for(manifest,
                                                  getattr(session, "account_id", None))
            except Exception as exc:  # noqa: BLE001 - an unknown plugin cannot be measured
                log.warning("no canary for %s on %s: %s", plugin, session.provider_id, exc)
                continue
            job_id = str(uuid.uuid4())
            now = self.market.clock()
            # as every job's envelope: a canary looks like one
            extra = {**self._extra(session, manifest, inputs, job_id, now),
                     "request_id": new_request_digest()}
            envelope = make_envelope(job_id=job_id, attempt=0, plugin=manifest.name,
                                     version=manifest.version, inputs=inputs,
                                     provider_key=session.public_key,
                                     lease_timeout_s=self.lease_timeout_s,
                                     ttl_s=self.envelope_ttl_s, now=now, extra=extra,
                                     sealed=True)
            # its slot, in the presence (the one record of slots), before the envelope goes
            if not self.market.presence.take(session, job_id):
                break
            self.market.canary_sent(Canary(job_id, session.provider_id, plugin,
                                           manifest.work_units_for(inputs), now,
                                           version=manifest.version, inputs=inputs,
                                           source=source,
                                           repro={**extra[REPRO_FIELD],
                                                  "weights_digest": extra["weights_digest"]},
                                           unavailable_reports=getattr(
                                               session, "unavailable_reports", 0)))
            data, signature = sign_envelope(self.signer, envelope)
            session.send_assignment(data, signature)
            sent += 1
        return sent

    def remember(self, plugin: str, version: str, operator: str, inputs: dict,
                 job_id: str = "") -> None:
        """A client job of the build settled with these inputs (run by ``operator``'s
        provider): canaries reuse such inputs, so that they look like the jobs they measure
        (the benchmark payload, a few fixed prompts, told them apart)."""
        with self._recent_lock:
            self._recent.setdefault((plugin, version), deque(maxlen=RECENT_INPUTS)).append(
                (operator, dict(inputs), job_id))

    def _inputs_for(self, manifest, operator: str | None) -> tuple[dict, str]:
        """A canary's inputs and the client job they come from: a recent client job's of
        the build, one another operator ran, not linked to its own (the agent never sees
        its own job again, nor a partner's it could tell from a shared record);
        before there is any, the benchmark payload with a seed from a few (each with an
        answer that becomes known), and no job ("")."""
        ours = {operator, *self.linked_to(operator)} if operator else {operator}
        with self._recent_lock:
            pool = [(i, job_id) for op, i, job_id in
                    self._recent.get((manifest.name, manifest.version), ()) if op not in ours]
        if pool:
            inputs, job_id = self.rng.choice(pool)
            return manifest.validate_inputs(dict(inputs)), job_id
        inputs = dict(manifest.benchmark_inputs)
        if "seed" in manifest.inputs.names and self.seeds > 1:
            inputs["seed"] = secrets.randbelow(self.seeds)
        return manifest.validate_inputs(inputs), ""

    def _extra(self, session, manifest, inputs: dict, job_id: str, now: float) -> dict:
        """The envelope fields a job of the build would carry: the weights digest the agent
        serves it with, the class it declared for the build (what the canary is judged
        in, recorded now as a job's is at assignment), and what checkpoints it would be
        asked for."""
        served = getattr(session, "plugins", {}) or {}
        digest = served.get(manifest.ref, "") if isinstance(served, dict) else ""
        extra: dict = {"weights_digest": digest or "",
                       REPRO_FIELD: declared_class(session, manifest.name, manifest.version)}
        if self.extra is not None:
            extra.update(self.extra.envelope_extra(Job(
                id=job_id, account_id="", plugin=manifest.name, plugin_version=manifest.version,
                inputs=inputs, state=JobState.QUEUED, created_at=now)) or {})
        return extra

    def owns(self, job_id: str) -> bool:
        return self.market.canary(job_id) is not None

    def out_to(self, provider_id: str) -> bool:
        """Whether a canary is out to the provider: only then can a receipt be a canary's."""
        return self.market.has_canary(provider_id)

    def receipt(self, session, data: bytes, signature: str,
                received_at: float | None = None) -> str | None:
        """A receipt for a canary: verify it, time it (sent → ``received_at``, the broker's
        clock; now when not given); returns the job id (None when it is not a canary)."""
        received_at = self.market.clock() if received_at is None else received_at
        try:
            rec = open_receipt(data, signature, provider_key=session.public_key)
        except EnvelopeError:
            return None
        canary = self.market.canary(str(rec.get("job_id")))
        if canary is None or canary.provider_id != session.provider_id:
            return None
        canary = self.market.canary_done(canary.job_id)
        if canary is None:  # a duplicate receipt handled meanwhile
            return str(rec.get("job_id"))
        self.market.presence.give_back(session, canary.job_id)
        if canary.version and self.answers is not None:
            try:
                self.answers.canary_answer(session.provider_id, canary.plugin, canary.version,
                                           canary.inputs, rec, canary.source, canary.repro)
            except Exception:  # noqa: BLE001 - a check must never lose the measurement
                log.exception("canary %s: comparing with the known answer failed", canary.job_id)
        sample = timed_sample(rec, canary.work_units, canary.sent_at, received_at)
        if sample is None:
            log.warning("canary %s on %s: its receipt came before it was sent by the "
                        "broker's clock; not measured", canary.plugin, session.provider_id)
            return canary.job_id
        self.market.observe(session.provider_id, canary.plugin, *sample)
        log.info("canary %s on %s: %s units in %.0f ms", canary.plugin, session.provider_id,
                 *sample)
        return canary.job_id

    def withdrawn(self, session, job_id: str) -> bool:
        """The agent gave the canary back "for its machine's owner" (idle-only mode). That
        is taken only from an agent that said it takes no work (``availability``: its owner
        came back) while the canary was out, or says so now: then the canary is done with
        and measured nothing; another comes in time. Otherwise it is given back as for any
        other reason, a failure: an agent that named its owner at will would refuse every
        canary, and the known answer it is judged by, for free. Even when taken it is
        counted (``canary_unanswered(away=True)``), with an allowance of its own: an
        agent that says its owner came back around every canary dodges none of them.
        Returns whether it was taken as for the owner."""
        canary = self.market.canary(job_id)
        if canary is None or canary.provider_id != session.provider_id:
            return False
        if not (getattr(session, "unavailable", "")
                or getattr(session, "unavailable_reports", 0) > canary.unavailable_reports):
            log.warning("canary %s on %s given back for the owner by an agent that has not "
                        "said it takes no work: counted as failed", canary.plugin,
                        session.provider_id)
            self.failed(session, job_id, "given back for its owner, who was never said to "
                                         "have come back")
            return False
        if self.market.canary_done(job_id) is not None:
            self.market.presence.give_back(session, job_id)
            self._unanswered(canary, "given back for its owner", away=True)
        return True

    def failed(self, session, job_id: str, why: str = "failed or given back") -> None:
        canary = self.market.canary(job_id)
        if canary is None or canary.provider_id != session.provider_id:
            return  # not a canary of this agent's: nothing to count against anyone
        canary = self.market.canary_done(job_id)
        if canary is not None:
            self.market.presence.give_back(session, job_id)
            self.market.failed(session.provider_id, canary.plugin)
            self._unanswered(canary, why)

    def _unanswered(self, canary: Canary, why: str, away: bool = False) -> None:
        if not canary.version or self.answers is None:
            return
        try:
            self.answers.canary_unanswered(canary.provider_id, canary.plugin, canary.version,
                                           canary.repro or None, why, away)
        except Exception:  # noqa: BLE001 - counting it must never break the dispatcher
            log.exception("canary %s on %s: counting it unanswered failed", canary.plugin,
                          canary.provider_id)
