"""Spot redundancy against real cheating agents (issue #7, DESIGN §6).

A real broker (in this process, verification on) and real agent processes on tiny models
(sd15 and llama in their real layouts). For each cheating behaviour an agent started by
``bench/cheat_agent.py --mode <behaviour>`` (the real agent, its plugin hosts wrapped by
``bench/cheating_host.py``) runs a batch of client jobs alone; then two honest
agents of other operators run the checks (and the tiebreaks). The script reports, per
behaviour:

* **q**, the chance a single check catches it (the check's comparison is not a match),
  and how often the 2-of-3 ended with the cheater outvoted and slashed;
* the mean number of jobs until a *reputable* cheater (CV 100, cheating on a fraction of
  its jobs) is caught and slashed, simulated with the broker's own sampling rule and the
  q and slash rates just measured;

The behaviours are the cheat modes of ``bench/cheating_host.py`` (``MODES``), so a mode
appended there is run here; a few run their own scenario (issue #20): ``inflated-units``
against an honest rival of the same speed in the auction, ``fake-progress`` with the client
cancelling mid-run, the account pairs ``collude`` (linked by a payout account the broker
sees) and ``fail-checks`` (not linked), ``detect-checks`` as a checker of another
provider's jobs, and ``canary-dodger`` (an agent told which jobs are canaries that never
answers them, scripted against the broker's canary service and verification in this
process, beside an honest machine that crashes on one canary). Per behaviour it prints jobs, checks, caught, slashed, the credits the
cheater kept and the honest providers slashed, and the chance (simulated with the broker's
sampling rule and the q measured) that a reputable provider cheating on every job is
caught within 200 jobs.

It then runs ``--honest`` honest jobs, every one of them checked (``verify="always"``),
across numeric variations (one vs two torch threads, float32 vs bfloat16) and counts the
false disputes and false slashes; and finally the steady-state redundancy overhead of a
reputable honest provider under the sampling rule. ``--write`` stores q per plugin in
``broker/verification/thresholds.json`` (``catch_probability``), where the broker's
sampling reads it.

    python bench/cheaters.py                  # 8 jobs per behaviour, 1,000 honest jobs
    python bench/cheaters.py --quick          # 3 per behaviour, 20 honest (a smoke run)
    python bench/cheaters.py --quick --behaviours inflated-units,collude
    python bench/cheaters.py --write          # also commit q to thresholds.json
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from broker.ledger.model import AccountKind  # noqa: E402
from broker.ledger.seeding import seed_earned  # noqa: E402
from broker.server import BrokerServer  # noqa: E402
from broker.settings import Settings  # noqa: E402
from broker.verification.comparators import THRESHOLDS_PATH  # noqa: E402
from broker.verification.records import CheckStatus  # noqa: E402
from broker.verification.sampling import SamplingPolicy, Standing, check_probability  # noqa: E402
from bench.cheating_host import MODES  # noqa: E402
from sdk import Client  # noqa: E402
from sdk.localnet import cli  # noqa: E402

IMAGE = {"prompt": "a lighthouse at dusk", "steps": 4, "width": 64, "height": 64}
TEXT = {"prompt": "Once upon a time", "max_new_tokens": 16, "temperature": 0.7}
LONG_PROMPT = "Once upon a time there was a lighthouse"
# behaviour -> (plugin, extra inputs), for the modes that need more than the defaults
BENCH_INPUTS = {
    "wrong-seed": ("sd15", {}),
    "fewer-steps": ("sd15", {}),
    "other-model": ("sd15", {}),
    "adapter-dropped": ("sd15", {"adapters": "ink:1.0"}),
    "random-image": ("sd15", {}),
    "cached-output": ("sd15", {}),
    "truncate-text": ("llama", {}),
    "pad-text": ("llama", {}),
    "other-text-model": ("llama", {}),
    # issue #20, text: sampled as the job asked, ended where its own parameters say. (On
    # "Once upon a time" the tiny llama's greedy answer is its end-of-text token alone: a
    # one-token claim shows nothing of how it was sampled.) The cheat mode
    # colder-sampling is left out: on this tiny llama, whose next-token distributions are
    # nearly flat, half the temperature changes nothing a test could see (0 of 5 caught)
    # and saves nothing, yet its q of 0 would floor llama's q in thresholds.json;
    # bench/text_checks.py measures it on a sharpened model.
    "greedy-as-sampled": ("llama", {"prompt": LONG_PROMPT, "max_new_tokens": 32}),
    "narrow-top-p": ("llama", {"prompt": LONG_PROMPT, "max_new_tokens": 64}),
    "early-stop": ("llama", {"stop": "<END>", "ignore_eos": True}),
    "altered-text": ("llama", {}),
    # issue #20 (trust-market): claims about the work, and one person's accounts
    "inflated-units": ("sd15", {}),
    "fake-progress": ("sd15", {"steps": 40}),
    "collude": ("sd15", {}),
    "fail-checks": ("sd15", {}),
    "detect-checks": ("sd15", {}),
    # half of 64 a side is below sd15's smallest size: jobs of 128 are halved to 64
    "reduced-res": ("sd15", {"width": 128, "height": 128}),
    "duplicate-images": ("sd15", {"n": 2}),
}
#: Cheats of how text is sampled: a greedy job leaves them nothing to change, so all their
#: jobs are sampled (half greedy would only halve what their compounded evidence is built on).
SAMPLED_ONLY = {"greedy-as-sampled", "narrow-top-p"}
#: Modes of the registry this bench leaves out, and why.
SKIPPED = {"colder-sampling": "on this tiny llama half the temperature changes nothing a "
                              "test could see; bench/text_checks.py measures it"}


def bench_inputs(mode: str) -> tuple[str, dict]:
    """(plugin, extra inputs) for a cheat mode; a mode appended to the registry without an
    entry here runs on llama when its name says text, else on sd15."""
    if mode in BENCH_INPUTS:
        return BENCH_INPUTS[mode]
    return ("llama" if "text" in mode else "sd15"), {}


#: Behaviours scripted in this process, not cheat modes of an agent's plugin hosts: a
#: canary-dodger must be told which jobs are canaries (a real agent cannot tell).
SCRIPTED = {"canary-dodger": ("sd15", {})}
BEHAVIOURS = {**{m: bench_inputs(m) for m in MODES if m not in SKIPPED}, **SCRIPTED}
FINAL = {CheckStatus.VERIFIED, CheckStatus.OVERTURNED, CheckStatus.NONDETERMINISTIC,
         CheckStatus.UNCHECKED}


def log(msg: str) -> None:
    print(msg, flush=True)


def build_weights(root: Path) -> None:
    script = ("import sys; from plugins.tiny import build_tiny; r = sys.argv[1]\n"
              "build_tiny('sd15', f'{r}/honest/sd15'); build_tiny('llama', f'{r}/honest/llama')\n"
              "build_tiny('lora-sd15', f'{r}/honest/sd15/adapters/ink', seed=1)\n"
              "build_tiny('sd15', f'{r}/other-sd15', seed=7)\n"
              "build_tiny('llama', f'{r}/other-llama', seed=7)\n")
    subprocess.run([sys.executable, "-c", script, str(root)], check=True, capture_output=True)


class Network:
    """A broker in this process and agent subprocesses (sandboxed where bwrap exists)."""

    def __init__(self, work: Path, weights: Path):
        self.work, self.weights = work, weights
        settings = Settings(data_dir=work / "broker", http="127.0.0.1:0", grpc="127.0.0.1:0",
                            verification=True, check_delay_max_s=0.0, lease_timeout_s=60,
                            market_claim_factor=1.0, maintenance_interval_s=1.0,
                            http_threads=16)
        self.server = BrokerServer(settings)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.svc = self.server.services
        self.url = f"http://127.0.0.1:{self.server.http_port}"
        self.grpc = f"127.0.0.1:{self.server.grpc_port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.sandbox = shutil.which("bwrap") is not None

    def client(self, credits: int = 1_000_000) -> Client:
        key, who = self.svc.auth.create_account_with_key("client")
        self.svc.payments.grant(who.account_id, credits * 1_000_000, by="bench")
        return Client(self.url, key, timeout=120)

    def start_agent(self, name: str, plugins: str, env: dict | None = None,
                    cheat: list[str] | None = None) -> str:
        """An agent of its own operator; ``cheat``: bench/cheat_agent.py's options (a
        cheating agent), else an honest ``sparecycles agent run``."""
        key, _ = self.svc.auth.create_account_with_key("provider", name)  # one operator each
        home = self.work / f"agent-{name}"
        subprocess.run(cli("agent", "init", "--home", str(home), "--broker", self.grpc,
                           "--api-key", key, "--name", name, "--plugins", plugins,
                           "--weights-dir", str(self.weights / "honest")),
                       check=True, capture_output=True)
        args = cli("agent", "run", "--home", str(home), "--device", "cpu")
        if cheat is not None:
            args = [sys.executable, str(ROOT / "bench" / "cheat_agent.py"), *cheat, "--",
                    *args[args.index("sdk.cli") + 1:]]
        if not self.sandbox:
            args.append("--no-sandbox")
        import os

        # PYTHONPATH: this checkout's code, not whatever an editable install points at
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": str(ROOT), **(env or {})}
        out = open(self.work / f"agent-{name}.log", "ab")
        self.procs[name] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                            env=full_env, cwd=self.work)
        deadline = time.monotonic() + 600  # a bfloat16 agent benchmarks slowly on a CPU
        while time.monotonic() < deadline:
            for p in self.svc.providers.all():
                if p.name == name and self.svc.dispatcher.session(p.id) is not None:
                    return p.id
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"agent {name} exited; see {self.work}/agent-{name}.log")
            time.sleep(0.2)
        raise RuntimeError(f"agent {name} did not connect")

    def give_stake(self, provider_id: str, micro: int) -> None:
        """Stake ``micro`` for the provider's account, as earned credits would be (real
        ledger operations: see :func:`broker.ledger.seeding.seed_earned`)."""
        seed_earned(self.svc.ledger, self.svc.providers.owner_of(provider_id), micro)

    def stop_agent(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    def wait_final(self, job_ids: list[str], timeout_s: float = 900) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = {j: self.svc.verification.status(j) for j in job_ids}
            if all(v is not None and v.status in FINAL for v in records.values()):
                return records
            time.sleep(0.3)
        raise RuntimeError("verifications did not finish in time")

    def close(self) -> None:
        for name in list(self.procs):
            self.stop_agent(name)
        self.server.stop()


def first_verdict(v) -> str:
    return (v.comparisons.get("primary~checker") or {}).get("verdict", "none")


def slashed(v, provider_id: str) -> bool:
    return any(p["provider_id"] == provider_id and p["slash_micro"] > 0
               for p in (v.outcome or {}).get("penalties", []))


def run_behaviour(net: Network, client: Client, honest: list[str], behaviour: str,
                  jobs: int, stake_micro: int) -> dict:
    plugin, extra = BEHAVIOURS[behaviour]
    cheat = _cheat(net, behaviour)
    if behaviour == "other-model":
        cheat += ["--weights", str(net.weights / "other-sd15")]
    if behaviour == "other-text-model":
        cheat += ["--weights", str(net.weights / "other-llama")]
    name = f"cheater-{behaviour}"
    cheater = net.start_agent(name, plugin, cheat=cheat)
    net.give_stake(cheater, stake_micro)
    for pid in honest:
        net.svc.dispatcher.set_paused(pid, True)
    base = IMAGE if plugin == "sd15" else TEXT
    ids = []
    for i in range(jobs):
        inputs = dict(base)
        if plugin == "llama" and i % 2 == 0 and behaviour not in SAMPLED_ONLY:
            # half greedy (all 16 tokens: a tiny random model often ends at once, and a
            # one-token answer leaves a text cheat nothing to change), half sampled; the
            # SAMPLED_ONLY cheats sampled only
            inputs.update(temperature=0.0, ignore_eos=True)
        job = client.jobs.create(plugin, **{**inputs, **extra}, seed=1000 + i)
        ids.append(job.id)
        job.wait(timeout=300)
    net.stop_agent(name)
    for pid in honest:
        net.svc.dispatcher.set_paused(pid, False)
    net.svc.dispatcher.kick()
    records = net.wait_final(ids)
    truth = {}
    path = net.work / f"cheat-{behaviour}.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            truth[row.get("job_id")] = bool(row.get("cheated", True))
    cheated = [j for j in ids if truth.get(j, behaviour in ("other-model", "other-text-model"))]
    caught = [j for j in cheated if first_verdict(records[j]) != "match"]
    overturned = [j for j in cheated if records[j].status is CheckStatus.OVERTURNED]
    cut = [j for j in cheated if slashed(records[j], cheater)]
    honest_runs = [j for j in ids if j not in cheated]
    n = len(cheated)
    return {**money_and_checks(net, ids, records, {cheater}),
            "behaviour": behaviour, "plugin": plugin, "jobs": len(ids), "cheated": n,
            "caught": len(caught), "q": len(caught) / n if n else None,
            "overturned": len(overturned), "slashed": len(cut),
            "slash_rate": len(cut) / n if n else None,
            "honest_runs_disputed": sum(first_verdict(records[j]) != "match"
                                        for j in honest_runs),
            "verdicts": {j: first_verdict(records[j]) for j in ids},
            "comparisons": {j: records[j].comparisons for j in cheated}}


def kept_micro(net: Network, provider_id: str) -> int:
    """What a provider's operator holds of what it earned (vesting and vested), after
    every refund and claw-back; its stake is counted apart."""
    b = net.svc.ledger.balances(net.svc.providers.owner_of(provider_id))
    return b.get(AccountKind.PROVIDER_VESTING, 0) + b.get(AccountKind.PROVIDER_AVAILABLE, 0)


def money_and_checks(net: Network, ids: list[str], records: dict, cheaters: set[str]) -> dict:
    """checks run, credits the cheaters kept, honest providers slashed, for these jobs."""
    checks = sum(len(net.svc.jobs.repo.checks_of(j)) for j in ids)
    honest_slashed = set()
    for j in ids:
        for p in ((records.get(j) and records[j].outcome) or {}).get("penalties", []):
            if p["slash_micro"] > 0 and p["provider_id"] not in cheaters:
                honest_slashed.add(p["provider_id"])
    return {"checks": checks, "kept_micro": sum(kept_micro(net, c) for c in cheaters),
            "honest_slashed": len(honest_slashed)}


def _truth(net: Network, behaviour: str) -> list[dict]:
    path = net.work / f"cheat-{behaviour}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cheat(net: Network, behaviour: str, *more: str,
           log_name: str = "cheat") -> list[str]:
    """bench/cheat_agent.py's options for ``behaviour`` (its log: the ground truth)."""
    return ["--mode", behaviour, "--seed", "1",
            "--log", str(net.work / f"{log_name}-{behaviour}.jsonl"), *more]


def _pause(net: Network, pids, paused: bool) -> None:
    for pid in pids:
        net.svc.dispatcher.set_paused(pid, paused)
    net.svc.dispatcher.kick()


def run_inflated_units(net: Network, client: Client, honest: list[str], behaviour: str,
                       jobs: int, stake_micro: int) -> dict:
    """The cheater and an honest rival on the same machine (the same speed, the same ask)
    in the auction: θ timed by the broker gives the cheater about half the jobs; the
    receipt's 10× units in 1 ms used to give it all of them."""
    plugin, extra = BEHAVIOURS[behaviour]
    cheater = net.start_agent(f"cheater-{behaviour}", plugin, cheat=_cheat(net, behaviour))
    net.give_stake(cheater, stake_micro)
    rival, others = honest[0], honest[1:]
    _pause(net, others, True)
    market = net.svc.market
    ids, won = [], 0
    for i in range(jobs):
        job = client.jobs.create(plugin, **{**IMAGE, **extra}, seed=2000 + i)
        job.wait(timeout=300)
        ids.append(job.id)
        won += net.svc.jobs.repo.get(job.id).provider_id == cheater
    theta_c, theta_r = market.theta(cheater, plugin)[0], market.theta(rival, plugin)[0]
    net.stop_agent(f"cheater-{behaviour}")
    _pause(net, others, False)
    records = net.wait_final(ids)
    fair = theta_c <= 2.0 * theta_r
    return {**money_and_checks(net, ids, records, {cheater}),
            "behaviour": behaviour, "plugin": plugin, "jobs": jobs, "cheated": won,
            "caught": won if fair else 0, "q": None, "slashed": 0, "slash_rate": None,
            "overturned": 0,
            "note": f"won {won} of {jobs} against an honest rival on this machine; θ "
                    f"measured {theta_c:.3g} vs the rival's {theta_r:.3g} units/s "
                    f"({theta_c / max(theta_r, 1e-12):.2f}×; its receipts claimed "
                    f"{10:g}× the units in 1 ms)"}


def run_fake_progress(net: Network, client: Client, honest: list[str], behaviour: str,
                      jobs: int, stake_micro: int) -> dict:
    """The cheater reports 100 % at once; the client cancels a second into the run. A
    cancel pays the work shown (checkpoints), not the progress claimed."""
    plugin, extra = BEHAVIOURS[behaviour]
    cheater = net.start_agent(f"cheater-{behaviour}", plugin, cheat=_cheat(net, behaviour))
    _pause(net, honest, True)
    ids, claimed = [], 0
    for i in range(jobs):
        job = client.jobs.create(plugin, **{**IMAGE, **extra}, seed=3000 + i)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            row = net.svc.jobs.repo.get(job.id)
            if row.progress_total and row.progress_step >= row.progress_total:
                break
            time.sleep(0.05)
        time.sleep(1.0)
        row = net.svc.jobs.repo.get(job.id)
        if not row.state.terminal:
            claimed += row.max_price_micro * min(row.progress_step, row.progress_total) \
                // max(1, row.progress_total)
            job.cancel()
        ids.append(job.id)
    kept = kept_micro(net, cheater)
    net.stop_agent(f"cheater-{behaviour}")
    _pause(net, honest, False)
    cancelled = sum(net.svc.jobs.repo.get(j).state.value == "cancelled" for j in ids)
    return {"behaviour": behaviour, "plugin": plugin, "jobs": jobs, "cheated": cancelled,
            "checks": 0, "caught": cancelled if kept < claimed or not claimed else 0,
            "q": None, "slashed": 0, "slash_rate": None, "overturned": 0,
            "kept_micro": kept, "honest_slashed": 0,
            "note": f"{cancelled} cancelled after claiming 100 %: paid "
                    f"{kept / 1e6:.3f} credits for checkpoints shown; the progress claimed "
                    f"would have paid {claimed / 1e6:.3f}"}


def run_pair(net: Network, client: Client, honest: list[str], behaviour: str, jobs: int,
             stake_micro: int) -> dict:
    """One person's two accounts: the cheat runs the client jobs (a wrong seed), the pal
    is a provider like any other while they are checked. ``collude``: the pal agrees with
    the cheat, and the broker sees what links them (one payout account); ``fail-checks``:
    the pal fails the checks it gets, unlinked."""
    plugin, extra = BEHAVIOURS[behaviour]
    shared = str(net.work / f"pair-{behaviour}")
    cheater = net.start_agent(f"cheater-{behaviour}", plugin,
                              cheat=_cheat(net, behaviour, "--role", "cheat", "--shared", shared))
    pal = net.start_agent(f"pal-{behaviour}", plugin,
                          cheat=_cheat(net, behaviour, "--role", "pal", "--shared", shared,
                                       log_name="pal"))
    net.give_stake(cheater, stake_micro)
    net.give_stake(pal, stake_micro)
    if behaviour == "collude":  # what the broker sees: their payouts go to one account
        for pid in (cheater, pal):
            net.svc.links.record(net.svc.providers.owner_of(pid), "payout_account",
                                 f"acct_bench_{behaviour}", "payout account (bench)")
    _pause(net, [*honest, pal], True)
    ids = []
    for i in range(jobs):
        job = client.jobs.create(plugin, **{**IMAGE, **extra}, seed=4000 + i)
        job.wait(timeout=300)
        ids.append(job.id)
    net.stop_agent(f"cheater-{behaviour}")
    _pause(net, [*honest, pal], False)
    records = net.wait_final(ids)
    net.stop_agent(f"pal-{behaviour}")
    cheated = [r["job_id"] for r in _truth(net, behaviour) if r.get("cheated")
               and r.get("role") == "cheat" and r["job_id"] in ids]
    caught = [j for j in cheated if records[j].status is CheckStatus.OVERTURNED
              or first_verdict(records[j]) not in ("match", "none")]
    pal_rows = [json.loads(line) for line in
                (net.work / f"pal-{behaviour}.jsonl").read_text().splitlines()] \
        if (net.work / f"pal-{behaviour}.jsonl").exists() else []
    pal_checks = sum(1 for r in pal_rows if r.get("cheated"))
    cut = [j for j in cheated if slashed(records[j], cheater)]
    return {**money_and_checks(net, ids, records, {cheater, pal}),
            "behaviour": behaviour, "plugin": plugin, "jobs": jobs, "cheated": len(cheated),
            "caught": len(caught), "q": len(caught) / len(cheated) if cheated else None,
            "overturned": sum(records[j].status is CheckStatus.OVERTURNED for j in cheated),
            "slashed": len(cut), "slash_rate": len(cut) / len(cheated) if cheated else None,
            "note": (f"the pal got {pal_checks} of its partner's checks"
                     + (" (linked: none expected)" if behaviour == "collude"
                        else ", failed them non-retryably; each was re-issued"))}


def run_detector(net: Network, client: Client, honest: list[str], behaviour: str, jobs: int,
                 stake_micro: int) -> dict:
    """The detector runs client jobs (cheating where it thinks they are a client's), then
    is the only checker of an honest provider's checked jobs: could it tell the checks?"""
    plugin, extra = BEHAVIOURS[behaviour]
    name = f"cheater-{behaviour}"
    detector = net.start_agent(name, plugin, cheat=_cheat(net, behaviour))
    net.give_stake(detector, stake_micro)
    _pause(net, honest, True)
    own = []
    for i in range(jobs):
        job = client.jobs.create(plugin, **{**IMAGE, **extra}, seed=5000 + i)
        job.wait(timeout=300)
        own.append(job.id)
    # its own jobs' checks wait; an honest provider's checked jobs, checked by it alone
    _pause(net, [detector], True)
    _pause(net, honest[:1], False)
    theirs = []
    for i in range(jobs):
        job = client.jobs.create(plugin, **{**IMAGE, **extra}, seed=6000 + i,
                                 terms={"verify": "always"})
        job.wait(timeout=300)
        theirs.append(job.id)
    _pause(net, honest[:1], True)
    _pause(net, [detector], False)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not all(
            (net.svc.verification.status(j) or FINAL_STUB).status in FINAL for j in theirs):
        time.sleep(0.3)
    net.stop_agent(name)
    _pause(net, honest, False)
    records = net.wait_final(own + theirs)
    told = {"check": [0, 0], "canary": [0, 0], "client": [0, 0]}  # [taken for it, were]
    for r in _truth(net, behaviour):
        job = net.svc.jobs.repo.get(r["job_id"])
        truth = "canary" if job is None else ("check" if job.check_of else "client")
        told[truth][1] += 1
        told[truth][0] += r.get("looked_like") == truth
    cheated = [r["job_id"] for r in _truth(net, behaviour) if r.get("cheated")
               and r["job_id"] in own]
    caught = [j for j in cheated if first_verdict(records[j]) not in ("match", "none")]
    cut = [j for j in cheated if slashed(records[j], detector)]
    return {**money_and_checks(net, own + theirs, records, {detector}),
            "behaviour": behaviour, "plugin": plugin, "jobs": len(own), "cheated": len(cheated),
            "caught": len(caught), "q": len(caught) / len(cheated) if cheated else None,
            "overturned": sum(records[j].status is CheckStatus.OVERTURNED for j in cheated),
            "slashed": len(cut), "slash_rate": len(cut) / len(cheated) if cheated else None,
            "note": "taken for what they were: " + ", ".join(
                f"{k} {v[0]} of {v[1]}" for k, v in (("checks", told["check"]),
                                                   ("canaries", told["canary"]),
                                                   ("client jobs", told["client"])))}


#: Behaviours that run a scenario of their own (the others: run_behaviour).
def run_canary_dodger(net: Network, client: Client, honest: list[str], behaviour: str,
                      jobs: int, stake: int) -> dict:
    """Issue #20: a canary that timed out cost nothing, so an agent that could tell a
    canary dodged its known answer by not answering. Scripted, in this process: an agent
    *told* which jobs are canaries (a real one cannot tell: they look like client jobs),
    that never answers them, against the broker's own CanaryService and verification
    (its market here has a fake clock, so that canaries time out without waiting); beside
    it, an honest machine that answers every canary but one, lost to a crash. ``jobs`` x 4
    canaries each. Caught: the canaries counted failed (CV reset, quota cut); canaries
    never touch stake."""
    import random as _random
    from types import SimpleNamespace

    from broker.jobs.presence import AgentSession, Offer
    from broker.market import MarketService, MarketSettings
    from broker.market.canary import CanaryService
    from sdk.protocol.canonical import canonical_bytes, loads
    from sdk.protocol.envelope import make_receipt
    from sdk.protocol.signing import KeyPair

    svc, v = net.svc, net.svc.verification
    now = [1_000.0]
    market = MarketService(lambda plugin: 1_000, MarketSettings(canary_timeout_s=120.0,
                                                                canary_interval_s=600.0),
                           rng=_random.Random(1), clock=lambda: now[0])
    canaries = CanaryService(market, svc.catalog, KeyPair.generate(), answers=v)
    manifest = svc.catalog.get("sd15")
    rows = {}
    for name, dodge in (("canary-dodger", True), ("crashes-once", False)):
        key = KeyPair.generate()
        _, who = svc.auth.create_account_with_key("provider", name)
        pid = svc.providers.connect(who, key.public_key_hex, name, sandboxed=True, hardware={},
                                    plugins=[{"name": manifest.name, "version": manifest.version,
                                              "weights_digest": "", "hardware_class": "bench",
                                              "dtype": "float32"}]).id
        net.give_stake(pid, stake)
        sent: list[bytes] = []

        class Agent(AgentSession):  # what the gateway's session does with an assignment
            def send_assignment(self, envelope_bytes, signature, sent=sent):
                sent.append(envelope_bytes)

        session = Agent(provider_id=pid, public_key=key.public_key_hex,
                        account_id=who.account_id, plugins={manifest.ref: ""}, slots=1,
                        offer=Offer(benchmarks=((manifest.name, 5.0, None),)))
        market.presence.add(session)  # joins the market, as the gateway's register does
        rows[name] = SimpleNamespace(pid=pid, key=key, session=session, sent=sent, dodge=dodge,
                                     owner=who.account_id)
    total = max(8, jobs * 4)
    for i in range(total):
        for r in rows.values():
            before = len(r.sent)
            canaries.send_due(r.session)
            if len(r.sent) == before:
                continue
            data = r.sent[-1]
            if r.dodge or i == 2:  # the dodger never answers; the honest machine crashes once
                continue
            env = loads(data)
            rec = make_receipt(envelope=env, envelope_bytes=data, provider_key=r.key.public_key_hex,
                               outputs=[{"index": 0, "sha256": "ab" * 32, "meta": {}}],
                               work_units=1.0, timings_ms={"run": 100})
            canaries.receipt(r.session, canonical_bytes(rec), r.key.sign("receipt", rec))
        now[0] += 601.0  # past the deadline and the interval: the next call expires, resends
    for r in rows.values():
        r.session.draining = True  # no free slot: the call below sends no other canary
        market.presence.changed(r.session)
        canaries.send_due(r.session)  # expire the last one, send no other
    figures = {}
    for name, r in rows.items():
        entries = svc.audit.search(subject=f"provider:{r.pid}", limit=500)
        counted = [e.data.get("counted") for e in entries
                   if e.action == "verification.canary_unanswered"]
        st = v.repo.standing(r.pid, manifest.name, "bench")
        figures[name] = {"canaries": len(r.sent), "unanswered": len(counted),
                         "failed": counted.count("failed"), "cv": st.consecutive_valid,
                         "quota": v.repo.quota_factor(r.pid),
                         "stake": svc.ledger.balances(r.owner).get(AccountKind.PROVIDER_STAKE, 0)}
    d, h = figures["canary-dodger"], figures["crashes-once"]
    return {"behaviour": behaviour, "plugin": manifest.name, "jobs": d["canaries"],
            "cheated": d["canaries"], "checks": d["canaries"], "caught": d["failed"],
            "overturned": 0, "slashed": 0, "kept_micro": 0,
            "honest_slashed": int(h["stake"] < stake) + int(h["failed"] > 0),
            "q": None, "slash_rate": None,
            "note": (f"canaries are unpaid and never slash: the dodger left {d['unanswered']} of "
                     f"{d['canaries']} unanswered, {d['failed']} counted failed (1 excused), CV "
                     f"{d['cv']}, quota x{d['quota']:g}, stake kept {d['stake'] / 1e6:g} cr; the "
                     f"machine that crashed once: {h['unanswered']} unanswered, {h['failed']} "
                     f"failed, quota x{h['quota']:g}"), "figures": figures}


RUNNERS = {"inflated-units": run_inflated_units, "fake-progress": run_fake_progress,
           "collude": run_pair, "fail-checks": run_pair, "detect-checks": run_detector,
           "canary-dodger": run_canary_dodger}


class _Stub:
    status = None


FINAL_STUB = _Stub()


def caught_within(q: float, *, broker_q: float | None, gain: int, stake: int,
                  jobs: int = 200, cv0: int = 1000, runs: int = 4000, seed: int = 3) -> float:
    """The chance that a reputable provider (CV ``cv0``) that cheats on every job from now
    on has one caught (a check that catches with probability ``q``) within ``jobs`` jobs,
    under the broker's sampling rule (which assumes ``broker_q``, thresholds.json's)."""
    rng = random.Random(seed)
    policy = SamplingPolicy()
    caught = 0
    for _ in range(runs):
        cv = cv0
        for _ in range(jobs):
            p = check_probability(Standing(cv, stake // 2, 0), gain_micro=gain,
                                  job_value_micro=gain,
                                  catch_probability=max(broker_q if broker_q is not None
                                                        else q, 1e-6), policy=policy).p
            if rng.random() < p:
                if rng.random() < q:
                    caught += 1
                    break
                cv += 1
    return caught / runs


def run_honest(net: Network, client: Client, total: int, bf16: bool = True) -> dict:
    """``total`` honest jobs, each checked, across three numeric configurations (two
    without ``bf16``: a bfloat16 agent benchmarks for minutes on a CPU)."""
    # two agents in one reproducibility class (their images are compared by exact latent
    # hashes), and two others that differ from them in thread count or dtype
    variants = {"fp32-1thread": {"OMP_NUM_THREADS": "1"},
                "fp32-1thread-b": {"OMP_NUM_THREADS": "1"},
                "fp32-2threads": {"OMP_NUM_THREADS": "2"},
                "bf16-1thread": {"OMP_NUM_THREADS": "1", "SPARECYCLES_DTYPE": "bfloat16"}}
    if not bf16:
        variants.pop("bf16-1thread")
    pids = {net.start_agent(f"honest-{k}", "sd15,llama", env): k for k, env in variants.items()}
    rng = random.Random(5)
    t0 = time.monotonic()

    def one(i: int) -> str:
        if rng.random() < 0.7:
            job = client.jobs.create("sd15", **IMAGE, seed=i, terms={"verify": "always"})
        else:
            text = ({**TEXT, "temperature": 0.0, "ignore_eos": True} if i % 2
                    else TEXT)  # greedy and sampled
            job = client.jobs.create("llama", **text, seed=i, terms={"verify": "always"})
        job.wait(timeout=600)
        return job.id

    with ThreadPoolExecutor(6) as pool:
        ids = []
        for n, job_id in enumerate(pool.map(one, range(total)), 1):
            ids.append(job_id)
            if n % 50 == 0 or n == total:
                log(f"    honest jobs {n}/{total}  ({time.monotonic() - t0:.0f} s)")
    records = net.wait_final(ids, timeout_s=3600)
    disputes = [j for j in ids if first_verdict(records[j]) != "match"]
    slashes = [j for j in ids if (records[j].outcome or {}).get("penalties")
               and any(p["slash_micro"] > 0 for p in records[j].outcome["penalties"])]
    overturned = [j for j in ids if records[j].status is CheckStatus.OVERTURNED]
    methods: dict[str, int] = {}
    pairs: dict[str, int] = {}
    for j in ids:
        figs = records[j].comparisons.get("primary~checker") or {}
        outs = figs.get("outputs") or [{}]
        key = outs[0].get("method", figs.get("method", "?"))
        methods[key] = methods.get(key, 0) + 1
        check = net.svc.jobs.repo.checks_of(j)
        if check:
            a = pids.get(net.svc.jobs.repo.get(j).provider_id, "?")
            b = pids.get(check[0].provider_id, "?")
            pair = " vs ".join(sorted((a, b)))
            pairs[pair] = pairs.get(pair, 0) + 1
    for name in list(net.procs):
        if name.startswith("honest-"):
            net.stop_agent(name)
    reasons: dict[str, int] = {}
    for j in disputes:
        figs = records[j].comparisons.get("primary~checker") or {}
        for r in figs.get("reasons") or ["(grey zone)"]:
            key = r.split(":")[-1].strip()
            key = "".join(c if not c.isdigit() else "#" for c in key)
            reasons[key] = reasons.get(key, 0) + 1
    return {"jobs": len(ids), "false_disputes": len(disputes), "false_slashes": len(slashes),
            "overturned": len(overturned), "methods": methods, "pairs": pairs,
            "dispute_reasons": reasons,
            "disputed": [{"job": j, "plugin": net.svc.jobs.repo.get(j).plugin,
                          "status": records[j].status.value,
                          "figures": records[j].comparisons} for j in disputes],
            "seconds": round(time.monotonic() - t0, 1)}


def wilson_lower(k: int, n: int, z: float = 1.96) -> float:
    """The lower end of the 95% Wilson interval of k successes in n: the q the broker may
    rely on after so few samples (8 of 8 caught is not proof that q = 1)."""
    if n == 0:
        return 0.0
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5
    return max(0.0, (centre - spread) / (1 + z * z / n))


def simulate_until_slashed(q: float, slash_rate: float, *, cheat_rate: float, gain: int,
                           stake: int, cv0: int = 100, runs: int = 2000,
                           seed: int = 1, broker_q: float | None = None) -> float:
    """Mean jobs until a reputable cheater (CV ``cv0``) is slashed, under the broker's
    sampling rule (which assumes ``broker_q``, the q in thresholds.json) with the measured
    q and slash rate."""
    rng = random.Random(seed)
    policy = SamplingPolicy()
    caught_p = q
    total = 0
    for _ in range(runs):
        cv, n = cv0, 0
        while True:
            n += 1
            p = check_probability(Standing(cv, stake // 2, 0), gain_micro=gain,
                                  job_value_micro=gain,
                                  catch_probability=max(broker_q if broker_q is not None
                                                        else q, 1e-6), policy=policy).p
            cheats = rng.random() < cheat_rate
            if rng.random() < p:
                if cheats and rng.random() < caught_p:
                    if rng.random() < slash_rate / max(q, 1e-9):
                        break
                    cv = 0
                else:
                    cv += 1
            if n > 10_000_000:
                break
        total += n
    return total / runs


def overhead(q: float, *, gain: int, stake: int, jobs: int = 20_000, seed: int = 2) -> dict:
    """Fraction of an honest provider's jobs re-run: over its first ``jobs`` jobs (from
    CV 0) and in the steady state (the last quarter)."""
    rng = random.Random(seed)
    cv, checked, tail = 0, 0, 0
    for n in range(jobs):
        p = check_probability(Standing(cv, stake // 2, 0), gain_micro=gain,
                              job_value_micro=gain, catch_probability=q).p
        if rng.random() < p:
            checked += 1
            tail += n >= jobs * 3 // 4
            cv += 1
    return {"first_jobs": jobs, "overall": checked / jobs, "steady_state": tail / (jobs / 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-behaviour", type=int, help="cheated jobs per behaviour (8)")
    ap.add_argument("--honest", type=int, help="honest checked jobs (1000)")
    ap.add_argument("--quick", action="store_true",
                    help="3 per behaviour, 20 honest, no bfloat16 agent (unless given)")
    ap.add_argument("--behaviours", default=",".join(BEHAVIOURS),
                    help=f"comma-separated, from the cheat registry: {', '.join(BEHAVIOURS)}")
    ap.add_argument("--cheat-rate", type=float, default=0.2,
                    help="fraction of its jobs a reputable cheater cheats on (simulation)")
    ap.add_argument("--stake-credits", type=float, default=10.0,
                    help="a reputable provider's stake (half of it is slashed when caught)")
    ap.add_argument("--job-credits", type=float, default=0.05)
    ap.add_argument("--write", action="store_true", help="store q in thresholds.json")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    quick = {"per_behaviour": 3, "honest": 20} if args.quick else {}
    for name, full in (("per_behaviour", 8), ("honest", 1000)):
        if getattr(args, name) is None:
            setattr(args, name, quick.get(name, full))
    unknown = [b for b in args.behaviours.split(",") if b and b not in BEHAVIOURS]
    if unknown:
        ap.error(f"unknown behaviour {unknown[0]!r}; the registry has: {', '.join(BEHAVIOURS)}"
                 + "".join(f" ({k} is left out: {v})" for k, v in SKIPPED.items()
                           if k == unknown[0]))
    work = Path(tempfile.mkdtemp(prefix="sc-cheaters-"))
    log(f"== verification against cheaters (work dir {work})")
    t0 = time.monotonic()
    build_weights(work / "weights")
    log(f"   tiny weights built in {time.monotonic() - t0:.0f} s")
    net = Network(work, work / "weights")
    results: dict = {"behaviours": [], "honest": None}
    try:
        client = net.client()
        honest = [net.start_agent(f"checker-{i}", "sd15,llama") for i in (1, 2)]
        log(f"   two honest checkers connected ({time.monotonic() - t0:.0f} s)")
        for behaviour in [b for b in args.behaviours.split(",") if b]:
            tb = time.monotonic()
            runner = RUNNERS.get(behaviour, run_behaviour)
            row = runner(net, client, honest, behaviour, args.per_behaviour,
                         int(args.stake_credits * 1_000_000))
            results["behaviours"].append(row)
            log(f"   {behaviour:<17} cheated {row['cheated']:>2}/{row['jobs']}  checks "
                f"{row['checks']:>2}  caught {row['caught']:>2}  overturned "
                f"{row['overturned']:>2}  slashed {row['slashed']:>2}  kept "
                f"{row['kept_micro'] / 1e6:.3f} cr  honest slashed {row['honest_slashed']}"
                f"  ({time.monotonic() - tb:.0f} s)" + (f"\n      {row['note']}"
                                                       if row.get("note") else ""))
        for pid in honest:
            net.svc.dispatcher.set_paused(pid, True)
        if args.honest:
            log(f"   {args.honest} honest jobs, each checked, across numeric variations …")
            results["honest"] = run_honest(net, client, args.honest, bf16=not args.quick)
    finally:
        net.close()
    gain = int(args.job_credits * 1_000_000)
    stake = int(args.stake_credits * 1_000_000)
    per_plugin: dict[str, float] = {}   # what the broker relies on: the lower 95% bound
    for row in results["behaviours"]:
        if row["q"] is not None:
            row["q_lower"] = wilson_lower(row["caught"], row["cheated"])
            per_plugin[row["plugin"]] = min(per_plugin.get(row["plugin"], 1.0), row["q_lower"])
    from broker.verification.service import load_catch_probabilities

    broker_q = load_catch_probabilities()  # what the broker's sampling assumes now
    print()
    print(f"{'behaviour':<17} {'plugin':<6} {'jobs':>4} {'checks':>6} {'caught':>6} "
          f"{'slashed':>7} {'kept cr':>8} {'honest slashed':>14} {'q':>5} {'q 95% low':>9} "
          f"{'caught in 200†':>14} {'jobs until slashed*':>19}")
    honest_slashed = 0
    for row in results["behaviours"]:
        honest_slashed += row["honest_slashed"]
        q, s = row["q"], row["slash_rate"]
        head = (f"{row['behaviour']:<17} {row['plugin']:<6} {row['jobs']:>4} {row['checks']:>6} "
                f"{row['caught']:>6} {row['slashed']:>7} {row['kept_micro'] / 1e6:>8.3f} "
                f"{row['honest_slashed']:>14}")
        if q is None:
            print(f"{head} {'—':>5} {'—':>9} {'—':>14} {'—':>19}  {row.get('note', '')}")
            continue
        within = caught_within(q, broker_q=broker_q.get(row["plugin"]), gain=gain,
                               stake=stake)
        mean = (simulate_until_slashed(q, s, cheat_rate=args.cheat_rate, gain=gain, stake=stake,
                                       broker_q=broker_q.get(row["plugin"]))
                if s and s > 0 else float("inf"))
        row["caught_within_200"], row["mean_jobs_until_slashed"] = within, mean
        print(f"{head} {q:>5.2f} {row['q_lower']:>9.2f} {within:>14.1%} {mean:>19,.0f}"
              + (f"  {row['note']}" if row.get("note") else ""))
    print(f"† simulated: a provider with CV 1000 that cheats on every job from then on, "
          f"caught by a check (the q measured) within 200 jobs, under the broker's sampling "
          f"rule with its q from thresholds.json {broker_q}")
    print(f"* simulated: a cheater with CV 100 cheating on {args.cheat_rate:.0%} of its jobs, "
          f"{args.job_credits} credits a job, {args.stake_credits:g} credits at stake, "
          f"under the broker's sampling rule with the q and slash rate measured above")
    if results["honest"]:
        h = results["honest"]
        honest_slashed += h["false_slashes"]
        print(f"\nhonest: {h['jobs']} checked jobs in {h['seconds']} s — false disputes "
              f"{h['false_disputes']}, false slashes {h['false_slashes']}, overturned "
              f"{h['overturned']}; comparisons by method {h['methods']}; pairs {h['pairs']}")
    print(f"honest providers slashed, all runs above: {honest_slashed}")
    for plugin in sorted(set(per_plugin) | set(broker_q)):
        q = broker_q.get(plugin, per_plugin.get(plugin))
        o = overhead(q, gain=gain, stake=stake)
        results.setdefault("overhead", {})[plugin] = o
        print(f"overhead ({plugin}, q={q:.2f}): {o['overall']:.1%} of the first "
              f"{o['first_jobs']:,} jobs re-run, {o['steady_state']:.1%} in the steady state "
              f"(target ≤ 5%)")
    results["catch_probability"] = per_plugin
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.write and per_plugin:
        data = json.loads(THRESHOLDS_PATH.read_text())
        old = (data.get("catch_probability") or {})
        merged = {**old.get("per_plugin", {}), **{k: round(v, 4) for k, v in per_plugin.items()}}
        behaviours = {**old.get("behaviours", {}),
                      **{r["behaviour"]: {"plugin": r["plugin"], "cheated": r["cheated"],
                                          "caught": r["caught"], "slashed": r["slashed"]}
                         for r in results["behaviours"]}}
        data["catch_probability"] = {
            "per_plugin": merged,
            "basis": "bench/cheaters.py: over the behaviours of each plugin, the lowest "
                     "lower end of the 95% Wilson interval of its single-check catch rate",
            "behaviours": behaviours,
            "honest": ({k: v for k, v in results["honest"].items()
                        if k in ("jobs", "false_disputes", "false_slashes")}
                       if results["honest"] else old.get("honest", {})),
        }
        from calibrate import write_record  # bench/calibrate.py keeps the file's layout

        write_record(THRESHOLDS_PATH, data)
        log(f"wrote catch_probability to {THRESHOLDS_PATH}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
