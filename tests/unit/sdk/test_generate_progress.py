"""`sparecycles generate` follows the job's progress events (issue #25): a tqdm bar on a
terminal, plain lines elsewhere; a stream that cannot be followed is not an error."""
from __future__ import annotations

import io

from sdk.client import Event
from sdk.commands import follow_progress
from sdk.errors import APIConnectionError


class _Job:
    id = "0123456789abcdef"

    def __init__(self, events, fail=None):
        self._events, self._fail = events, fail

    def events(self):
        yield from self._events
        if self._fail:
            raise self._fail


EVENTS = [Event(1, "queued", {}), Event(2, "assigned", {"provider_id": "p"}),
          *(Event(3 + i, "progress", {"step": i, "total": 4}) for i in range(1, 5)),
          Event(9, "done", {})]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    follow_progress(_Job(EVENTS), out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "job 01234567: assigned"
    assert "job 01234567: step 1/4" in lines and lines[-1] == "job 01234567: step 4/4"


def test_a_bar_on_a_terminal():
    out = _Tty()
    follow_progress(_Job(EVENTS), out)
    assert "4/4" in out.getvalue() and "job 0123" in out.getvalue()


def test_a_lost_stream_says_so_and_returns():
    out = io.StringIO()
    follow_progress(_Job(EVENTS[:3], fail=APIConnectionError("gone")), out)
    assert "cannot follow its progress (gone); waiting for it" in out.getvalue()
