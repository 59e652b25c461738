"""What /metrics reads from the database (broker/storage/metrics_sql.py) and the telemetry a
provider's row keeps, on SQLite and PostgreSQL (issue #25)."""
from __future__ import annotations

from broker.services import build_services
from broker.settings import Settings
from broker.storage.metrics_sql import SqlMetricsReader
from sdk.protocol.signing import KeyPair
from broker.api.job_request import job_request


def test_shared_facts_and_telemetry_rows(db_url, tmp_path):
    svc = build_services(Settings(data_dir=tmp_path, db_url=db_url, unserved_expiry_s=0,
                                  verification=False, maintenance_interval_s=0))
    try:
        _, who = svc.auth.create_account_with_key("client")
        svc.payments.grant(who.account_id, 100 * 1_000_000, by="test")
        for i in range(3):
            svc.jobs.submit(who, job_request({"plugin": "echo", "inputs": {"text": str(i)}}, svc.jobs.catalog),
                            request_id=f"req-{i}")
        job, _ = svc.jobs.submit(who, job_request({"plugin": "echo", "inputs": {"text": "gone"}}, svc.jobs.catalog))
        svc.jobs.cancel(who, job.id)
        facts = SqlMetricsReader(svc.jobs.repo.sessions).read()
        assert facts.jobs == {("queued", "echo"): 3}  # the cancelled one has ended
        assert facts.oldest_queued_at["echo"] > 0
        assert facts.ledger_transactions["hold"] == 4
        assert facts.ledger_transactions["void"] == 1
        assert facts.read_s >= 0
        queued = svc.jobs.queued()
        assert sorted(j.request_id for j in queued) == ["req-0", "req-1", "req-2"]

        _, prov = svc.auth.create_account_with_key("provider")
        p = svc.providers.connect(prov, KeyPair.generate().public_key_hex, "box",
                                  sandboxed=True, hardware={}, plugins=[])
        report = {"cpu_utilization": 0.5, "gpus": [{"index": 0, "name": "A10"}]}
        svc.providers.repo.record_telemetry(p.id, report, 1234.5)
        got = svc.providers.get(p.id)
        assert got.telemetry == report and got.telemetry_at == 1234.5
        assert SqlMetricsReader(svc.jobs.repo.sessions).read().providers == {"active": 1}
    finally:
        svc.close()
