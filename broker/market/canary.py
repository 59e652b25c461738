"""Canary jobs: the broker's own measurements of a provider's throughput.

A canary is the plugin manifest's benchmark payload in an ordinary signed envelope, so the
agent cannot tell it from a client's job. It has no job row, account or hold: the gateway
hands its messages here (``owns``), the receipt's ``run`` timing becomes a θ sample, and
nobody is charged or paid. One goes out when a provider connects with a plugin the broker
has not measured, then every ``canary_interval_s``.
"""
from __future__ import annotations

import logging
import secrets
import uuid

from sdk.logs import new_request_digest
from sdk.protocol.envelope import EnvelopeError, make_envelope, open_receipt, sign_envelope
from sdk.protocol.signing import KeyPair

from broker.catalog.registry import PluginCatalog

from .service import Canary, MarketService
from .throughput import run_sample

log = logging.getLogger(__name__)


class CanaryService:
    def __init__(self, market: MarketService, catalog: PluginCatalog, signer: KeyPair, *,
                 lease_timeout_s: float = 30.0, envelope_ttl_s: float = 60.0):
        self.market = market
        self.catalog = catalog
        self.signer = signer
        self.lease_timeout_s = lease_timeout_s
        self.envelope_ttl_s = envelope_ttl_s
        # Verification (DESIGN §6) compares each canary's outputs with the answer known
        # for its inputs: on_answer(provider_id, plugin, version, inputs, receipt).
        self.on_answer = lambda provider_id, plugin, version, inputs, receipt: None
        self.seeds = 4  # canaries draw their seed from this many, each with a known answer

    def send_due(self, session) -> int:
        """Send the canaries due to a connected agent with a free slot (called by the
        dispatcher); returns how many went out."""
        for c in self.market.expired_canaries():
            if c.provider_id == session.provider_id:
                session.active.discard(c.job_id)
        sent = 0
        for plugin in self.market.canaries_due(session.provider_id):
            if session.free <= 0:
                break
            version = session.plugins and next(
                (k.split("@", 1)[1] for k in session.plugins if k.split("@", 1)[0] == plugin), None)
            try:
                manifest = self.catalog.get(plugin, version)
                inputs = dict(manifest.benchmark_inputs)
                if "seed" in manifest.inputs.names and self.seeds > 1:
                    inputs["seed"] = secrets.randbelow(self.seeds)
                inputs = manifest.validate_inputs(inputs)
            except Exception as exc:  # noqa: BLE001 - an unknown plugin cannot be measured
                log.warning("no canary for %s on %s: %s", plugin, session.provider_id, exc)
                continue
            job_id = str(uuid.uuid4())
            now = self.market.clock()
            envelope = make_envelope(job_id=job_id, attempt=0, plugin=manifest.name,
                                     version=manifest.version, inputs=inputs,
                                     provider_key=session.public_key,
                                     lease_timeout_s=self.lease_timeout_s,
                                     ttl_s=self.envelope_ttl_s, now=now,
                                     # as every job's envelope: a canary looks like one
                                     extra={"request_id": new_request_digest()})
            self.market.canary_sent(Canary(job_id, session.provider_id, plugin,
                                           manifest.work_units_for(inputs), now,
                                           version=manifest.version, inputs=inputs))
            session.active.add(job_id)
            data, signature = sign_envelope(self.signer, envelope)
            session.send_assignment(data, signature)
            sent += 1
        return sent

    def owns(self, job_id: str) -> bool:
        return self.market.canary(job_id) is not None

    def out_to(self, provider_id: str) -> bool:
        """Whether a canary is out to the provider: only then can a receipt be a canary's."""
        return self.market.has_canary(provider_id)

    def receipt(self, session, data: bytes, signature: str) -> str | None:
        """A receipt for a canary: verify it, record its timing; returns the job id (None
        when it is not a canary)."""
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
        session.active.discard(canary.job_id)
        if canary.version:
            try:
                self.on_answer(session.provider_id, canary.plugin, canary.version,
                               canary.inputs, rec)
            except Exception:  # noqa: BLE001 - a check must never lose the measurement
                log.exception("canary %s: comparing with the known answer failed", canary.job_id)
        sample = run_sample(rec, canary.work_units)
        if sample is None:
            log.warning("canary %s on %s: the receipt carries no run time; not measured",
                        canary.plugin, session.provider_id)
            return canary.job_id
        self.market.observe(session.provider_id, canary.plugin, *sample)
        log.info("canary %s on %s: %s units in %.0f ms", canary.plugin, session.provider_id,
                 *sample)
        return canary.job_id

    def failed(self, session, job_id: str) -> None:
        canary = self.market.canary_done(job_id)
        if canary is not None:
            session.active.discard(job_id)
            self.market.failed(session.provider_id, canary.plugin)
