"""Three broker replicas (real `broker serve` processes) on one PostgreSQL serve as one
broker (issue #21). Six agents spread over them (each given all three addresses, its own
first), 200 jobs each submitted through a random replica; while they run, cancels go to
random replicas, a pause and a ban go through the console of a replica other than the
agent's (signed in on yet another: the console secret is shared), and one replica is
SIGKILLed. Every job ends settled, cancelled or failed-and-refunded exactly once, the
ledger balances to the micro-credit, the audit chain verifies, and no slot leaks."""
from __future__ import annotations

import random
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sdk import Client
from sdk.errors import APIConnectionError, APIError
from sdk.localnet import LocalNetwork

SANDBOX = shutil.which("bwrap") is not None
JOBS, AGENTS = 200, 6
pytestmark = [pytest.mark.e2e]


def _console(url: str, admin_key: str) -> httpx.Client:
    """An httpx client signed in to the console at ``url``; its cookies open the console
    of every replica (they share the session secret)."""
    c = httpx.Client(base_url=url, timeout=10)
    form = c.get("/admin/login").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)
    r = c.post("/admin/login", data={"api_key": admin_key, "csrf_token": token})
    assert r.status_code in (302, 303), r.text[:300]
    return c


def _action(url, cookies, provider_id, action) -> tuple[float, float]:
    """Post a provider action to the console at ``url``; (when it was sent, answered)."""
    c = httpx.Client(base_url=url, cookies=cookies, timeout=10)
    page = c.get(f"/admin/providers/{provider_id}").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    sent = time.time()
    r = c.post(f"/admin/providers/{provider_id}/action",
               data={"csrf_token": token, "action": action, "reason": "e2e"})
    assert r.status_code in (302, 303), r.text[:300]
    return sent, time.time()


def test_three_replicas_serve_as_one_broker(tmp_path, pg_url):
    rng = random.Random(21)
    net = LocalNetwork(tmp_path / "net", db_url=pg_url, lease_timeout_s=2,
                       env={"SPARECYCLES_MAX_ATTEMPTS": "4",
                            "SPARECYCLES_MARKET_CLAIM_FACTOR": "1",
                            "SPARECYCLES_VERIFICATION": "off",
                            "SPARECYCLES_MAINTENANCE_INTERVAL_S": "1"})
    t_start = time.monotonic()
    try:
        net.start_broker()  # (it migrates the database; the other two start together)
        net.start_replicas(2)
        grpcs = [net.info["grpc"]] + [info["grpc"] for _, info in net.replicas]
        urls = [net.url] + [info["http"] for _, info in net.replicas]
        from broker.services import build_services
        from broker.settings import Settings

        # The test's own view of the database (keys, checks at the end): not a replica.
        view = build_services(Settings.from_env(data_dir=net.data_dir, db_url=pg_url),
                              migrate=False)
        provider_key, _ = view.auth.create_account_with_key("provider", "operator")
        client_key, who = view.auth.create_account_with_key("client", "client")
        view.payments.grant(who.account_id, 100_000 * 1_000_000, by="e2e")
        admin_key, _ = view.auth.create_account_with_key("admin", "admin")
        t_keys = time.monotonic()

        def start(i):  # each agent's first address is its home replica's (i % 3)
            r = i % 3
            net.start_agent(f"a{i}", provider_key, plugins="echo", slots=2, sandbox=SANDBOX,
                            broker=",".join(grpcs[r:] + grpcs[:r]))
        with ThreadPoolExecutor(AGENTS) as pool:
            list(pool.map(start, range(AGENTS)))
        net.wait_for_providers(AGENTS)
        t_agents = time.monotonic()
        clients = [Client(u, client_key) for u in urls]
        start_balance = clients[0].account()["available_micro"]

        # One job in ten runs for seconds, so that the cancels below find jobs still
        # running however fast a loaded or an idle machine gets through the short ones.
        sleeps = [3000 if i % 10 == 0 else rng.choice((100, 200, 400)) for i in range(JOBS)]

        def submit(i):
            client = clients[rng.randrange(3)]
            return client.jobs.create("echo", text=f"job {i}", sleep_ms=sleeps[i], steps=4,
                                      idempotency_key=f"e2e-{i}").id
        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(submit, range(JOBS)))

        t_submitted = time.monotonic()
        try:
            # Who is who: the providers of agents a0 (home replica 0) and a1 (replica 1).
            by_name = {p.name: p.id for p in view.providers.all()}
            paused_pid, banned_pid = by_name["a0"], by_name["a1"]
            # Sign in on replica 2; pause a0 (on replica 0) through replica 1 and ban a1
            # (on replica 1) through replica 2, with replica 2's session cookie.
            console = _console(urls[2], admin_key)
            paused_at = _action(urls[1], console.cookies, paused_pid, "pause")[1]
            banned_at = _action(urls[2], console.cookies, banned_pid, "ban")[1]
            cancelled = set()
            long_ones = [j for i, j in enumerate(ids) if sleeps[i] >= 3000]
            # cancels through random replicas: ten of the long jobs, ten of any
            for job_id in rng.sample(long_ones, 10) + rng.sample(ids, 10):
                try:
                    clients[rng.randrange(2)].jobs.get(job_id).cancel()
                    cancelled.add(job_id)
                except APIError:
                    pass  # it had ended already
            # Replica 2 dies mid-run: its agents move to the next address, keeping leases.
            victim = net.replicas[1][0]
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            time.sleep(1.0)
            resumed_at = _action(urls[0], console.cookies, paused_pid, "resume")[0]

            deadline = time.monotonic() + 60
            while True:
                jobs = [view.jobs.repo.get(i) for i in ids]
                if all(j.state.terminal for j in jobs):
                    break
                assert time.monotonic() < deadline, "unfinished: " + "; ".join(
                    f"{j.id[:8]} {j.state.value} attempt {j.attempt} on {j.provider_id}"
                    for j in jobs if not j.state.terminal)[:2000]
                time.sleep(0.5)
            t_ended = time.monotonic()
            _check_money_and_events(view, jobs, start_balance)
            states = {s: sum(j.state.value == s for j in jobs) for s in
                      ("settled", "cancelled", "failed")}
            assert sum(states.values()) == JOBS, states
            assert states["cancelled"] >= 1 and states["settled"] >= JOBS // 2, states
            # The pause and the ban applied on the replica holding the agent's stream:
            # no assignment to either after the command had a moment to travel.
            for pid, since, until in ((paused_pid, paused_at + 1.0, resumed_at),
                                      (banned_pid, banned_at + 1.0, float("inf"))):
                late = [e for j in jobs for e in view.jobs.repo.events_after(j.id, 0)
                        if e.kind == "assigned" and e.data.get("provider_id") == pid
                        and since < e.created_at < until]
                assert late == [], (pid, late[:3])
            # No slot leaks: the five agents left still take a full load at once.
            for client in clients[:2]:
                with ThreadPoolExecutor(8) as pool:
                    done = list(pool.map(lambda i, c=client: c.generate(
                        "echo", text=f"after {i}", timeout=30).json[0]["text"], range(8)))
                assert done == [f"after {i}" for i in range(8)]
            assert view.audit.verify().ok
            print(f"replicas: {JOBS} jobs, {states}, 1 replica SIGKILLed; brokers up "
                  f"{t_keys - t_start:.0f}s, agents {t_agents - t_keys:.0f}s, submitted "
                  f"{t_submitted - t_agents:.0f}s, all ended {t_ended - t_submitted:.0f}s, "
                  f"total {time.monotonic() - t_start:.0f}s")
        finally:
            view.close()
            for c in clients:
                try:
                    c.close()
                except APIConnectionError:
                    pass
    finally:
        net.stop()


def _check_money_and_events(view, jobs, start_balance: int) -> None:
    from sqlalchemy import func, select

    from broker.ledger.model import AccountKind, HoldState
    from broker.storage.ledger_sql import LedgerHoldRow as H

    with view.engine.connect() as conn:
        captured = dict(conn.execute(select(H.job_id, func.sum(H.captured_micro))
                                     .group_by(H.job_id)).all())
    charged = 0
    for j in jobs:
        kinds = [e.kind for e in view.jobs.repo.events_after(j.id, 0)]
        hold = view.ledger.get_hold(j.hold_id)
        ended = [k for k in kinds if k in ("done", "cancelled", "failed")]
        assert len(ended) == 1, (j.id, kinds)  # it ended exactly once
        if j.state.value == "settled":
            assert ended == ["done"] and hold.state is HoldState.POSTED
        elif j.state.value == "failed":
            assert hold.state is HoldState.VOIDED and hold.released_micro == hold.amount_micro
        else:
            assert j.state.value == "cancelled" and hold.state is not HoldState.PENDING
        charged += int(captured.get(j.id, 0))
    owner = jobs[0].account_id
    balances = view.ledger.balances(owner)
    assert balances.get(AccountKind.CLIENT_HELD, 0) == 0
    assert start_balance - balances[AccountKind.CLIENT_AVAILABLE] == charged
    assert view.ledger.verify().ok
