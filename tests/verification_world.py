"""A broker's services for verification tests, with runs settled by hand (no agents):
one client, and machines a, b and c of three operators. Checks are judged inside
``VerificationService.settled`` (no judging worker), as the tests assert."""
from __future__ import annotations

import time

from broker.jobs.model import Job, JobOutput, JobState
from broker.services import build_services
from broker.settings import Settings
from sdk.protocol.signing import KeyPair

HW = "cpu:x86_64:threads=1"


class VerificationWorld:
    def __init__(self, tmp_path, db_url: str = ""):
        self.services = build_services(Settings(data_dir=tmp_path, db_url=db_url,
                                                maintenance_interval_s=0,
                                                check_delay_max_s=0.0))
        self.v = self.services.verification
        self.v.close()  # no judging worker: checks are judged inside settled(), as asserted
        self.jobs = self.services.jobs
        _, client = self.services.auth.create_account_with_key("client")
        self.client = client.account_id
        self.operators: dict[str, str] = {}
        self.machines: dict[str, str] = {}
        for name in "abc":
            self.machine(name)

    def machine(self, name: str, operator: str | None = None, hardware_class: str = HW,
                dtype: str = "float32") -> str:
        """A machine of a new operator, or of ``operator``'s (another machine of theirs),
        serving every built-in plugin in the reproducibility class ``hardware_class`` /
        ``dtype`` (what it declares at connect: what its runs are judged by)."""
        if operator is None:
            _, who = self.services.auth.create_account_with_key("provider")
            self.operators[name] = who.account_id
        else:
            from broker.auth.service import Principal
            who = Principal(self.operators[operator], "provider", "k")
        plugins = [{"name": m.name, "version": m.version, "weights_digest": "",
                    "hardware_class": hardware_class, "dtype": dtype}
                   for m in self.services.catalog.all()]
        pid = self.services.providers.connect(who, KeyPair.generate().public_key_hex, name,
                                              sandboxed=True, hardware={}, plugins=plugins).id
        self.machines[name] = pid
        return pid

    def settle_output(self, job: Job, machine: str, data: bytes, media_type: str,
                      meta: dict, plugin_build: str, hardware_class: str = HW) -> Job:
        """``job`` (queued, or new) settled by ``machine`` with the one output ``data``, its
        receipt naming ``hardware_class`` (a provider's word: what it declared at connect
        is what counts)."""
        sha = self.jobs.blobs.put(data)
        receipt = {"outputs": [{"index": 0, "sha256": sha, "media_type": media_type,
                                "size": len(data), "meta": meta}],
                   "repro": {"hardware_class": hardware_class, "dtype": "float32",
                             "plugin_build": plugin_build}}
        return self.jobs.repo.transition(
            job.id, [job.state], JobState.SETTLED, provider_id=self.machines[machine],
            receipt=receipt, finished_at=time.time(),
            outputs=[JobOutput(job.id, 0, sha, media_type, len(data))])

    def actions(self, job_id: str) -> list[str]:
        return [e.action for e in self.services.audit.search(subject=f"job:{job_id}",
                                                             limit=500)]
