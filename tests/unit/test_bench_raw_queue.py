"""bench/raw_queue.py, the yardstick bench/dispatch.py divides by: a worker woken for a job
its claim does not see yet (on PostgreSQL: the release of another job woke it while this
one was committing, and the worker woken for this one took the other) claims again instead
of taking the empty claim for the stop signal, which cost the bench a slot and left a
client waiting for good (seen in make bench, 4 workers on PostgreSQL)."""
from __future__ import annotations

import json
import threading
import time
import uuid

from bench import raw_queue  # the package, not bench/ on sys.path: its names would shadow


def test_a_release_whose_row_is_not_visible_yet_is_claimed_again(tmp_path):
    queue = raw_queue.RawQueue(raw_queue.sqlite_target(tmp_path), workers=1, slots=1)
    try:
        job_id = str(uuid.uuid4())
        done = threading.Event()
        with queue._lock:
            queue._waiting[job_id] = done
        queue.queued.release()  # woken before its row is there to see
        time.sleep(0.3)
        db = raw_queue.Database(queue.target)
        db.run("INSERT INTO raw_jobs (id, inputs, state, created_at) VALUES (?, ?, 'queued', ?)",
               (job_id, json.dumps({"text": "late"}), time.time()))
        db.close()
        assert done.wait(20), "the worker took the empty claim for the stop signal"
        queue.submit_and_wait({"text": "after"}, timeout=20)  # its one slot still serves
    finally:
        queue.stop()
    assert [p.exitcode for p in queue.procs] == [0]  # the real stop still stops it
