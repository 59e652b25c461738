"""The audit log: append-only, hash-chained entries for every admin action and every
money-moving event (DESIGN §7). Pure domain; storage implements :class:`AuditRepository`."""
from broker.audit.model import GENESIS, AuditEntry, ChainReport
from broker.audit.service import AuditLog

__all__ = ["GENESIS", "AuditEntry", "AuditLog", "ChainReport"]
