"""The ledger is pure domain (DESIGN §1): importing it loads no Flask, grpc or SQLAlchemy."""
from __future__ import annotations

import subprocess
import sys


def test_ledger_domain_imports_no_transport_or_storage():
    code = ("import sys, broker.ledger, broker.ledger.memory, broker.ledger.ports, "
            "broker.ledger.errors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('flask', 'grpc', 'sqlalchemy', 'alembic', 'psycopg')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_repositories_implement_the_port():
    """Every method the service may call exists on both units of work, with the same
    parameters (a missing or renamed one would only fail on the path that uses it)."""
    import inspect

    from broker.ledger.memory import _MemoryUnitOfWork
    from broker.ledger.ports import LedgerUnitOfWork
    from broker.storage.ledger_sql import _SqlUnitOfWork

    wanted = {name: inspect.signature(fn) for name, fn in vars(LedgerUnitOfWork).items()
              if callable(fn) and not name.startswith("_")}
    assert len(wanted) >= 15
    for impl in (_MemoryUnitOfWork, _SqlUnitOfWork):
        for name, signature in wanted.items():
            assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
            got = inspect.signature(getattr(impl, name))
            assert list(got.parameters) == list(signature.parameters), (impl.__name__, name)
