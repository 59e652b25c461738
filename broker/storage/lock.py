"""One broker process per SQLite file (issue #21).

SQLite is the embedded one-process default: the event hub, the dispatcher's queue and the
market live in that process, and a second broker on the same file would neither hear of
the first one's jobs nor coordinate its writes with it. ``broker serve`` takes an exclusive
``flock`` on ``<database>.serve.lock`` for as long as it runs (the kernel drops it when the
process dies, SIGKILL included) and a second one is refused, saying so. Tools that only read
or write a few rows while a broker runs (``create-key``, ``grant``) take no lock.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from sqlalchemy.engine import make_url


class DatabaseInUse(RuntimeError):
    """Another broker process serves this SQLite file."""


def sqlite_path(db_url: str) -> Path | None:
    url = make_url(db_url)
    if not url.drivername.startswith("sqlite") or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database)


def hold_serve_lock(db_url: str):
    """Take the serve lock of a SQLite database (None for other databases); keep the
    returned file open while serving. Raises :class:`DatabaseInUse`."""
    path = sqlite_path(db_url)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".serve.lock")
    f = open(lock, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise DatabaseInUse(
            f"another broker (pid {holder}) is serving the SQLite database {path}; SQLite is "
            "for one broker process. Stop that broker, give this one another --data-dir or "
            "--db, or run replicas on PostgreSQL (--db postgresql+psycopg://…), which is "
            "built for several") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f
