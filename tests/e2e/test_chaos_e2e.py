"""Chaos: a broker on PostgreSQL, four agents and 200 jobs; random agents are SIGKILLed and
restarted and the broker is SIGKILLed and restarted once while the jobs run. Every job must
end SETTLED, or FAILED with its whole hold back with the client; none settles twice; the
ledger balances to the micro-credit. Echo jobs (sleep + checkpoints) keep it under a few
minutes on two shared cores."""
import random
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sdk.localnet import LocalNetwork

SANDBOX = shutil.which("bwrap") is not None
JOBS, AGENTS = 200, 4
pytestmark = [pytest.mark.e2e]


def test_chaos_every_job_settles_once_or_fails_with_a_full_refund(tmp_path, pg_url):
    rng = random.Random(8)
    net = LocalNetwork(tmp_path / "net", db_url=pg_url, lease_timeout_s=2, tls=True,
                       env={"SPARECYCLES_MAX_ATTEMPTS": "4",
                            # agents restarted mid-canary stay eligible on their claims
                            "SPARECYCLES_MARKET_CLAIM_FACTOR": "1",
                            # every job runs once here; checks have their own tests
                            "SPARECYCLES_VERIFICATION": "off"})
    t_start = time.monotonic()
    try:
        net.start_broker()
        provider_keys = [net.create_key("provider", f"p{i}") for i in range(AGENTS)]
        client_key = net.create_key("client", credits="100000")
        agents = [net.start_agent(f"a{i}", provider_keys[i], plugins="echo", slots=2,
                                  sandbox=SANDBOX) for i in range(AGENTS)]
        net.wait_for_providers(AGENTS)
        client = net.client(client_key)  # over TLS, trusting the network's dev CA
        start_balance = client.account()["available_micro"]

        def submit(i):
            return client.jobs.create("echo", text=f"job {i}", sleep_ms=rng_sleep[i],
                                      steps=10).id
        # work units 1 + sleep_ms/1000: values exact in binary floating point
        rng_sleep = [rng.choice((250, 500, 1000)) for _ in range(JOBS)]
        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(submit, range(JOBS)))
        client.close()

        # Chaos for ~25 s: an agent SIGKILLed every 1-3 s (restarted 1 s later), and the
        # broker SIGKILLed once, at about a third of the way.
        stop = threading.Event()
        kills = {"agents": 0, "broker": 0}

        def chaos():
            broker_at = time.monotonic() + 8
            until = time.monotonic() + 25
            while not stop.is_set() and time.monotonic() < until:
                if kills["broker"] == 0 and time.monotonic() >= broker_at:
                    net.restart_broker(hard=True)
                    kills["broker"] += 1
                    continue
                victim = rng.choice(agents)
                if victim.proc.poll() is None:
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait(10)
                    kills["agents"] += 1
                    stop.wait(1.0)
                    net.restart_agent(victim)
                stop.wait(rng.uniform(1.0, 3.0))

        chaos_thread = threading.Thread(target=chaos, daemon=True)
        chaos_thread.start()
        chaos_thread.join(60)
        assert kills["broker"] == 1 and kills["agents"] >= 5, kills

        # Everything ends: settled, or failed with the hold voided.
        from broker.ledger.model import AccountKind, HoldState
        from broker.services import build_services
        from broker.settings import Settings

        view = build_services(Settings.from_env(data_dir=net.data_dir, db_url=pg_url),
                              migrate=False)
        try:
            deadline = time.monotonic() + 90
            while True:
                jobs = [view.jobs.repo.get(i) for i in ids]
                if all(j.state.terminal for j in jobs):
                    break
                assert time.monotonic() < deadline, "unfinished: " + "; ".join(
                    f"{j.id[:8]} {j.state.value} attempt {j.attempt} excluding "
                    f"{len(j.excluded_providers)}" for j in jobs if not j.state.terminal)[:2000]
                time.sleep(1)
            states = {j.state.value for j in jobs}
            assert states <= {"settled", "failed"}, states
            charged = 0
            captured = {k: int(v) for k, v in _captured_by_job(view).items()}
            for j in jobs:
                kinds = [e.kind for e in view.jobs.repo.events_after(j.id, 0)]
                hold = view.ledger.get_hold(j.hold_id)
                if j.state.value == "settled":
                    assert kinds.count("done") == 1, (j.id, kinds)
                    assert hold.state is HoldState.POSTED
                    charged += captured.get(j.id, 0)
                else:
                    assert kinds.count("done") == 0, (j.id, kinds)
                    assert hold.state is HoldState.VOIDED
                    assert hold.released_micro == hold.amount_micro
                    assert captured.get(j.id, 0) == 0
            owner = _client_owner(view, ids[0])
            balances = view.ledger.balances(owner)
            assert balances.get(AccountKind.CLIENT_HELD, 0) == 0
            assert start_balance - balances[AccountKind.CLIENT_AVAILABLE] == charged
            holds = [view.ledger.get_hold(h) for h in _hold_ids(view, ids)]
            assert sum(h.provider_micro + h.fee_micro for h in holds) == charged
            assert view.ledger.verify().ok
            resumed = sum(1 for j in jobs if (j.envelope or {}).get("resume"))
            print(f"chaos: {len(jobs)} jobs, {sum(j.state.value == 'settled' for j in jobs)} "
                  f"settled, {sum(j.state.value == 'failed' for j in jobs)} failed, {resumed} "
                  f"resumed from a checkpoint, {kills['agents']} agent kills, 1 broker kill, "
                  f"{time.monotonic() - t_start:.0f}s")
        finally:
            view.close()
    finally:
        net.stop()


def _client_owner(view, job_id):
    return view.jobs.repo.get(job_id).account_id


def _captured_by_job(view) -> dict[str, int]:
    """Micro-credits captured per job over all its holds (its own and earlier providers'
    shares, see LedgerService.post_shared)."""
    from sqlalchemy import func, select

    from broker.storage.ledger_sql import LedgerHoldRow as H

    with view.engine.connect() as conn:
        return dict(conn.execute(select(H.job_id, func.sum(H.captured_micro))
                                 .group_by(H.job_id)).all())


def _hold_ids(view, job_ids) -> list[str]:
    from sqlalchemy import select

    from broker.storage.ledger_sql import LedgerHoldRow as H

    with view.engine.connect() as conn:
        return [r[0] for r in conn.execute(select(H.id).where(H.job_id.in_(list(job_ids))))]
