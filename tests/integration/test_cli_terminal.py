"""The `sparecycles` CLI in a real terminal (tmux): a per-step progress bar that moves
while the job runs, text printed token by token as it streams, and `jobs list|show|
cancel|wait` with `--json` for scripts; against a live broker and an echo agent."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tests.integration.conftest import LiveBroker, agent_starter

TMUX = shutil.which("tmux")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    b = LiveBroker(tmp_path_factory.mktemp("cli"))
    start, stop_all = agent_starter(b)
    start("cli", slots=4)
    env = {**os.environ, "SPARECYCLES_URL": b.url, "SPARECYCLES_API_KEY": b.key("client"),
           "PYTHONPATH": os.getcwd()}
    yield b, env
    stop_all()
    b.stop()


def cli(env, *args, check=True):
    done = subprocess.run([sys.executable, "-m", "sdk.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def in_terminal(env, command: str, until: str, timeout_s: float = 60.0) -> list[str]:
    """Run ``command`` in a detached tmux session (a real pty, 100×20) and return every
    distinct screen seen, polling until one contains ``until``."""
    name = f"sc-{uuid.uuid4().hex[:8]}"
    exports = " ".join(f"{k}={v}" for k, v in env.items()
                       if k in ("SPARECYCLES_URL", "SPARECYCLES_API_KEY", "PYTHONPATH"))
    subprocess.run([TMUX, "new-session", "-d", "-s", name, "-x", "100", "-y", "20",
                    f"env {exports} {sys.executable} -m sdk.cli {command}; "
                    "echo EXIT=$?; sleep 120"], check=True)
    frames: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = subprocess.run([TMUX, "capture-pane", "-p", "-t", name],
                                    capture_output=True, text=True).stdout
            if not frames or frames[-1] != screen:
                frames.append(screen)
            if until in screen:
                return frames
            time.sleep(0.05)
        raise AssertionError(f"{until!r} never showed; last screen:\n{frames[-1]}")
    finally:
        subprocess.run([TMUX, "kill-session", "-t", name], capture_output=True)


pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (`make "
                                "system-deps` installs it): the terminal checks need a pty")


def test_an_image_like_job_shows_a_progress_bar_that_moves(world):
    _, env = world
    frames = in_terminal(env, "generate echo --set steps=10 --set sleep_ms=4000 "
                              "--set text=drawn", until="EXIT=")
    steps = {int(m) for f in frames for m in re.findall(r"█[█·]* (\d+)/10", f)}
    assert {s for s in steps if 0 < s < 10}, "no partial bar was drawn:\n" + frames[-1]
    assert 10 in steps and '"text": "drawn"' in frames[-1] and "EXIT=0" in frames[-1]
    print(f"\nterminal frames: {len(frames)}; bar steps seen: {sorted(steps)}")


def test_text_is_printed_token_by_token_as_it_streams(world):
    _, env = world
    words = "one two three four five six seven eight"
    frames = in_terminal(env, f"generate echo --set stream=true --set steps=8 "
                              f"--set sleep_ms=4000 --set 'text=\"{words}\"'", until="EXIT=")
    partial = [f for f in frames if "one two" in f and "eight" not in f]
    assert partial, "the text never showed before it was whole"
    assert words in frames[-1] and "EXIT=0" in frames[-1]


def test_jobs_list_show_cancel_wait_with_json(world):
    _, env = world
    made = json.loads(cli(env, "generate", "echo", "--set", "text=hello", "--json").stdout)
    assert made["state"] == "settled" and made["outputs"][0]["media_type"] == "application/json"
    listed = json.loads(cli(env, "jobs", "list", "--json").stdout)
    assert made["id"] in [j["id"] for j in listed]
    shown = json.loads(cli(env, "jobs", "show", made["id"], "--json").stdout)
    assert shown["id"] == made["id"] and shown["state"] == "settled"
    assert made["id"] in cli(env, "jobs", "list").stdout  # the table, for people
    # a long job: cancel it from the CLI, then `jobs wait` says it did not settle
    from sdk import Client
    with Client(env["SPARECYCLES_URL"], env["SPARECYCLES_API_KEY"]) as client:
        long = client.jobs.create("echo", sleep_ms=30000, steps=100)
    cancelled = json.loads(cli(env, "jobs", "cancel", long.id, "--json").stdout)
    assert cancelled["state"] == "cancelled"
    waited = cli(env, "jobs", "wait", long.id, "--json", check=False)
    assert waited.returncode == 1 and json.loads(waited.stdout)["error"]["code"] == "cancelled"
    missing = cli(env, "jobs", "show", str(uuid.uuid4()), "--json", check=False)
    err = json.loads(missing.stdout)["error"]
    assert missing.returncode == 1 and err["code"] == "job_not_found" and err["request_id"]


def _event_streams(url: str) -> float:
    """How many job event streams the broker has answered (its /metrics)."""
    from tests.integration.test_metrics import scrape

    return sum(v for name, labels, v in scrape(url).get("sparecycles_http_requests", [])
               if labels.get("route") == "/v1/jobs/<job_id>/events")


def test_json_waits_for_the_record_without_following_the_stream(world):
    """--json shows no progress, so it opens no event stream: the job's record comes from
    the wait (a long poll) and is the one document printed."""
    b, env = world
    before = _event_streams(b.url)
    made = json.loads(cli(env, "generate", "echo", "--set", "text=quiet", "--set",
                          "sleep_ms=300", "--json").stdout)
    assert made["state"] == "settled" and made["outputs"]
    waited = json.loads(cli(env, "jobs", "wait", made["id"], "--json").stdout)
    assert waited["id"] == made["id"] and waited["state"] == "settled"
    assert _event_streams(b.url) == before


def test_the_timeout_covers_following_and_waiting(world):
    """--timeout is one budget from the submit over following the stream and waiting: a
    job longer than it is cancelled when it passes, not followed to its end first."""
    _, env = world
    done = cli(env, "generate", "echo", "--set", "steps=20", "--set", "sleep_ms=8000",
               "--set", "text=slow", "--timeout", "1.5", check=False)
    # followed to its end first, the 8 s job would have settled and the command succeeded
    assert done.returncode == 1 and "timeout" in done.stderr, done.stderr
