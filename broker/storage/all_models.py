"""Imports every module that defines tables, so Base.metadata is complete."""
from . import (admin_sql, checkpoints_sql, ledger_sql, models, payments_sql,  # noqa: F401
               pricing_sql, verification_sql)
from . import links_sql  # noqa: F401
