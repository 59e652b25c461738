"""Broker replicas: several broker processes on one PostgreSQL serving as one broker
(docs/architecture.md, *Replicas*). This package holds the port replicas wake each other
through (:class:`ReplicaBus`) and its in-process default; the PostgreSQL implementation
(LISTEN/NOTIFY) is in :mod:`broker.storage.notify_pg`."""
from .bus import LocalBus, ReplicaBus, new_replica_id

__all__ = ["LocalBus", "ReplicaBus", "new_replica_id"]
