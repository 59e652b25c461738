"""Verification is pure domain (DESIGN §1): importing it loads no Flask, grpc or
SQLAlchemy, and the comparators load no torch (only the checker's re-scoring does)."""
from __future__ import annotations

import subprocess
import sys


def test_verification_imports_no_transport_storage_or_torch():
    code = ("import sys, broker.verification, broker.verification.sampling, "
            "broker.verification.comparators, broker.verification.outcomes; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'flask', 'grpc', 'sqlalchemy', 'alembic', 'psycopg', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
