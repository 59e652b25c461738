"""Observability of the broker: Prometheus metrics (metrics.py), the wrappers that count
blob bytes and ledger postings (metered.py), agents' telemetry kept per provider
(telemetry.py), request ids in logs (logs.py)."""
