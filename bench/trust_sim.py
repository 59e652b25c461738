"""Honest checks at scale through the broker's real verification (issue #20).

``bench/cheaters.py`` runs real agents, which costs minutes a behaviour here; this runs
thousands of checks in one process: the broker's own services (``build_services``:
storage, ledger, sampling, judging, the 2-of-3 outcome, links, escalation), with the runs
settled by hand the way an agent's receipt would settle them (echo outputs, compared byte
for byte), and the dispatcher's choice of provider played by a uniform draw among those a
run's exclusions allow. It answers: over ≥ 1,000 checks with honest providers in them,
alongside a colluding pair of accounts the broker sees linked (one payout account) and a
pair it does not, is any honest provider ever slashed?

    python bench/trust_sim.py                 # 1,200 client jobs, 8 honest operators
    python bench/trust_sim.py --jobs 300      # shorter
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.auth.service import Principal  # noqa: E402
from broker.jobs.model import Job, JobOutput, JobState  # noqa: E402
from broker.ledger.model import AccountKind  # noqa: E402
from broker.ledger.seeding import seed_earned  # noqa: E402
from broker.services import build_services  # noqa: E402
from broker.settings import Settings  # noqa: E402
from broker.verification.records import OPEN_STATUSES, CheckStatus  # noqa: E402
from sdk.protocol.signing import KeyPair  # noqa: E402

HW = "cpu:x86_64:threads=1"
GOOD, BAD = b'{"text": "the truth"}', b'{"text": "made up"}'


class Sim:
    def __init__(self, work: Path, honest: int, rng: random.Random):
        self.svc = build_services(Settings(data_dir=work, maintenance_interval_s=0,
                                           check_delay_max_s=0.0))
        self.v = self.svc.verification
        self.v.close()  # judged inside settled(): one thread, in order
        self.rng = rng
        _, client = self.svc.auth.create_account_with_key("client")
        self.client = client.account_id
        self.machines: dict[str, str] = {}   # name -> provider id
        self.owner: dict[str, str] = {}      # provider id -> account
        self.role: dict[str, str] = {}       # provider id -> honest | cheat | pal
        self.partner: dict[str, str] = {}    # pal -> its cheat's provider id
        for i in range(honest):
            self.machine(f"honest-{i}", "honest")

    def machine(self, name: str, role: str) -> str:
        _, who = self.svc.auth.create_account_with_key("provider", name)
        pid = self.svc.providers.connect(Principal(who.account_id, "provider", "k"),
                                         KeyPair.generate().public_key_hex, name,
                                         sandboxed=True, hardware={}, plugins=[]).id
        seed_earned(self.svc.ledger, who.account_id, 4_000_000)  # 4 credits at stake
        self.machines[name], self.owner[pid], self.role[pid] = pid, who.account_id, role
        return pid

    def output(self, pid: str, job: Job) -> bytes:
        role = self.role[pid]
        if role == "cheat":  # each cheat makes up its own answer
            return BAD + self.owner[pid].encode()
        if role == "pal" and job.check_of:
            primary = self.svc.jobs.repo.get(job.check_of)
            partner = self.partner[pid]
            if primary is not None and primary.provider_id == partner:
                return BAD + self.owner[partner].encode()  # agrees with its partner
        return GOOD

    def settle(self, job: Job, pid: str) -> Job:
        data = self.output(pid, job)
        sha = self.svc.jobs.blobs.put(data)
        receipt = {"outputs": [{"index": 0, "sha256": sha, "media_type": "application/json",
                                "size": len(data), "meta": {}}],
                   "repro": {"hardware_class": HW, "dtype": "float32",
                             "plugin_build": "echo@1.0.0"}}
        return self.svc.jobs.repo.transition(
            job.id, [job.state], JobState.SETTLED, provider_id=pid, receipt=receipt,
            finished_at=time.time(),
            outputs=[JobOutput(job.id, 0, sha, "application/json", len(data))])

    def eligible(self, job: Job) -> list[str]:
        ex = set(job.excluded_providers)
        return [pid for pid in self.owner
                if pid not in ex and f"operator:{self.owner[pid]}" not in ex]

    def client_job(self, pid: str, i: int) -> Job:
        now = time.time()
        job, _ = self.svc.jobs.repo.create(
            Job(id=str(uuid.uuid4()), account_id=self.client, plugin="echo",
                plugin_version="1.0.0", inputs={"text": f"job {i}"}, state=JobState.QUEUED,
                work_units=1.0, created_at=now, updated_at=now), ("queued", {}))
        job = self.settle(job, pid)
        self.v.settled(job, job.receipt)
        return job

    def drive(self, job_id: str) -> None:
        """Run the record's checks and third runs until it is final (each on a provider
        its exclusions allow, drawn at random; none allowed: the run is given up)."""
        for _ in range(20):
            rec = self.v.status(job_id)
            if rec.status not in OPEN_STATUSES or (rec.outcome or {}).get("stalled"):
                return
            current = rec.tiebreak_job_id if rec.status is CheckStatus.DISPUTED \
                else rec.checker_job_id
            run = self.svc.jobs.repo.get(current)
            if run is None or run.state is not JobState.QUEUED:
                return
            allowed = self.eligible(run)
            if not allowed:
                self.svc.jobs.give_up(run, "check_timeout", "nobody allowed")
                continue
            done = self.settle(run, self.rng.choice(allowed))
            self.v.settled(done, done.receipt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1200, help="client jobs")
    ap.add_argument("--honest-operators", type=int, default=8)
    ap.add_argument("--cv", type=int, default=25,
                    help="consecutive valid checks the honest providers start with")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="sc-trust-sim-"))
    sim = Sim(work, args.honest_operators, rng)
    pairs = {}
    for kind in ("linked", "unlinked"):
        cheat = sim.machine(f"cheat-{kind}", "cheat")
        pal = sim.machine(f"pal-{kind}", "pal")
        sim.partner[pal] = cheat
        pairs[kind] = (cheat, pal)
        if kind == "linked":  # what the broker sees: their payouts go to one account
            for pid in (cheat, pal):
                sim.svc.links.record(sim.owner[pid], "payout_account", "acct_pair", "payout")
    for pid, role in sim.role.items():  # a record of honest work to start from
        if role != "cheat":
            for _ in range(args.cv):
                sim.v.repo.record_check(pid, "echo", HW, valid=True)
    providers = list(sim.owner)
    t0 = time.monotonic()
    ids = []
    print(f"== {args.jobs} client jobs on {len(providers)} providers ({args.honest_operators} "
          f"honest operators, a linked and an unlinked colluding pair); work dir {work}",
          flush=True)
    for i in range(args.jobs):
        job = sim.client_job(rng.choice(providers), i)
        ids.append(job.id)
        sim.drive(job.id)
        if (i + 1) % 200 == 0:
            print(f"   {i + 1} jobs ({time.monotonic() - t0:.0f} s)", flush=True)
    honest_checks = slashed_honest = escalated = stalled = 0
    by_status: dict[str, int] = {}
    caught = {k: [0, 0] for k in pairs}   # [cheated primaries checked, overturned]
    for job_id in ids:
        rec = sim.v.status(job_id)
        by_status[rec.status.value] = by_status.get(rec.status.value, 0) + 1
        runs = [sim.svc.jobs.repo.get(job_id)] + sim.svc.jobs.repo.checks_of(job_id)
        judged = rec.status not in (CheckStatus.UNCHECKED,)
        if judged and any(sim.role.get(r.provider_id) == "honest" for r in runs if r.provider_id):
            honest_checks += 1
        escalated += int((rec.outcome or {}).get("escalations", 0)) > 0
        stalled += bool((rec.outcome or {}).get("stalled"))
        for p in (rec.outcome or {}).get("penalties", []):
            if p["slash_micro"] > 0 and sim.role.get(p["provider_id"]) == "honest":
                slashed_honest += 1
        primary = runs[0].provider_id
        for kind, (cheat, _) in pairs.items():
            if primary == cheat and judged:
                caught[kind][0] += 1
                caught[kind][1] += rec.status is CheckStatus.OVERTURNED
    stakes = {role: [] for role in ("honest", "cheat", "pal")}
    for pid, role in sim.role.items():
        stakes[role].append(sim.svc.ledger.balances(sim.owner[pid]).get(
            AccountKind.PROVIDER_STAKE, 0))
    print(f"\nchecks judged with an honest provider in them: {honest_checks}; "
          f"honest providers slashed: {slashed_honest}")
    print(f"statuses {by_status}; escalated to a fresh third run: {escalated}; "
          f"stalled for an admin: {stalled}")
    for kind, (n, over) in caught.items():
        print(f"{kind} pair: the cheat's checked jobs {n}, overturned {over}")
    print("stake left (credits): honest min "
          f"{min(stakes['honest']) / 1e6:.1f}, cheats {[s / 1e6 for s in stakes['cheat']]}, "
          f"pals {[s / 1e6 for s in stakes['pal']]}  ({time.monotonic() - t0:.0f} s)")
    sim.svc.engine.dispose()
    return 0 if slashed_honest == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
