"""Imports every module that defines tables, so Base.metadata is complete."""
from . import ledger_sql, models  # noqa: F401
