"""SqlBlobReferences: which blobs the jobs still name (broker.blobs.retention reads it)."""
from __future__ import annotations

from typing import Iterable

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from broker.jobs.model import TERMINAL
from .base import read_only
from .checkpoints_sql import JobCheckpointRow
from .models import JobOutputRow, JobRow

_ENDED = [s.value for s in TERMINAL]
_O, _J, _C = JobOutputRow.__table__, JobRow.__table__, JobCheckpointRow.__table__
CHUNK = 500  # keys per IN list


class SqlBlobReferences:
    def __init__(self, sessions: sessionmaker[Session]):
        self.engine = sessions.kw["bind"]

    def _outputs(self, cutoff: float | None, keys=None):
        q = select(_O.c.sha256).distinct().join(_J, _J.c.id == _O.c.job_id)
        if cutoff is not None:
            q = q.where(or_(_J.c.state.not_in(_ENDED), _J.c.finished_at.is_(None),
                            _J.c.finished_at >= cutoff))
        if keys is not None:
            q = q.where(_O.c.sha256.in_(keys))
        return q

    def _checkpoints(self, live: bool, keys=None):
        q = select(_C.c.sha256).distinct().join(_J, _J.c.id == _C.c.job_id)
        if live:
            q = q.where(_J.c.state.not_in(_ENDED))
        if keys is not None:
            q = q.where(_C.c.sha256.in_(keys))
        return q

    def _read(self, *queries) -> set[str]:
        out: set[str] = set()
        for q in queries:
            with read_only(self.engine) as c:
                out.update(r[0] for r in c.execute(q))
        return out

    def live(self, output_cutoff: float | None) -> set[str]:
        return self._read(self._outputs(output_cutoff), self._checkpoints(live=True))

    def named(self) -> set[str]:
        return self._read(self._outputs(None), self._checkpoints(live=False))

    def live_among(self, keys: Iterable[str], output_cutoff: float | None) -> set[str]:
        keys = list(keys)
        out: set[str] = set()
        for i in range(0, len(keys), CHUNK):
            part = keys[i:i + CHUNK]
            out |= self._read(self._outputs(output_cutoff, part),
                              self._checkpoints(live=True, keys=part))
        return out
