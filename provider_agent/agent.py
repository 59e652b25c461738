"""The provider agent: connects to the broker, keeps warm plugin hosts, runs jobs.

Threads: the connection loop (one gRPC stream at a time, reconnecting with capped jittered
backoff), a heartbeat thread per connection, one worker per slot, and one that reports the
start of jobs still running after ``START_REPORT_DELAY_S`` (a job that ends sooner is
reported once, by its receipt or failure). A finished job's outputs and signed receipt stay
in ``undelivered`` until the broker acknowledges them, so a dropped connection never throws
work away: they are re-sent after reconnecting.
"""
from __future__ import annotations

import logging
import math
import os
import platform
import queue
import random
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from sdk import logs
from sdk.protocol import agent_pb2 as pb
from sdk.protocol import agent_pb2_grpc as pb_grpc
from sdk.protocol.canonical import canonical_bytes, sha256_hex
from sdk.protocol.envelope import (EnvelopeError, ReplayGuard, challenge_document, make_receipt,
                                   open_envelope)
from sdk.protocol.manifest import Manifest, load_manifest
from sdk.protocol.signing import KeyPair

from .availability import AVAILABLE, OWNER_ACTIVE, DeviceState, Gate
from .benchmark import benchmark_plugin, throttle
from . import transport as broker_transport
from .config import AgentConfig, pin_broker_key
from .errors import AgentError, ConfigError, HostError
from .fingerprint import machine_fingerprint
from .gpu_usage import default_source, own_pids
from .host.manager import HostFactory, PluginHost
from .launch import gpu_indices_for
from .encode import encode_outputs, pack_checkpoint, unpack_checkpoint
from .uploads import DirectUploads
from .telemetry import JobTimes, Telemetry, to_proto
from .weights import folder_digest

log = logging.getLogger("agent")
VERSION = "0.1.0"
# Finished jobs are logged one by one at DEBUG only (an INFO line each costs CPU on every
# job); at INFO a summary line comes at most this often, and with the first job.
SUMMARY_EVERY_S = 60.0
# A job's start (JobAccepted: the broker marks it running) is reported only once it has
# run this long: a job that ends sooner is told by its receipt alone, which saves the broker
# a message and a write transaction per short job (what Celery's task_track_started=False
# does). Leases do not depend on it: heartbeats extend them.
START_REPORT_DELAY_S = 0.05
# A device whose plugin host dies or cannot start this many jobs in a row is taken out:
# this agent gives its jobs back and stops (the fleet's other devices go on serving).
DEVICE_FAILURES_MAX = 3
DEVICE_FAILURE_CODES = ("host_died", "host_start_failed", "start_timeout")
# Outputs up to this size in all travel inside the receipt's message (one message, and one
# lease check at the broker, per job); larger ones go ahead of it one message each.
INLINE_OUTPUTS_BYTES = 1 << 20
MAX_UPLOADING = 256  # receipts whose ack is awaited for their upload time (telemetry)
RECEIPTS_MAX = 64    # receipts sent in one ReceiptBatch
# ... and at most this many serialized bytes of them: each receipt may carry up to
# INLINE_OUTPUTS_BYTES of outputs, and a batch past the gRPC message limit (GRPC_OPTIONS)
# would kill the stream, again on every reconnect. A receipt larger than this goes alone.
RECEIPTS_BATCH_BYTES_MAX = 16 * 1024 * 1024
_END = object()
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_permit_without_calls", 1)]


@dataclass
class RunningJob:
    envelope: dict
    envelope_bytes: bytes
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Installer keys of the registry adapters the job uses: kept from eviction while it runs.
    held: list[str] = field(default_factory=list)
    # When the assignment arrived (perf_counter): the wait before a worker ran it is the
    # receipt's "queue" timing, which the broker deducts (within a bound) from the run it times.
    received: float = field(default_factory=time.perf_counter)
    times: JobTimes | None = None  # where its time went (telemetry)

    def __post_init__(self):
        if self.times is None:
            env = self.envelope
            self.times = JobTimes(str(env.get("job_id", "")), str(env.get("plugin", "")),
                                  request_id=str(env.get("request_id") or ""),
                                  outcome="failed")  # until it is done


@dataclass
class ServedPlugin:
    manifest: Manifest
    host: PluginHost
    weights_digest: str

    @property
    def input_defaults(self) -> dict:
        """What the weights give the inputs declared ``default_from = "weights"``, as the
        plugin host reported them when it got ready (checked there against the schema)."""
        return dict(self.host.ready.get("input_defaults") or {})


class Agent:
    def __init__(self, cfg: AgentConfig, identity: KeyPair, *, plugin_dirs: dict[str, Path],
                 sandboxed: bool, launcher=None, home: Path | None = None,
                 max_backoff_s: float = 30.0, installer=None,
                 gate: Gate | None = None, availability_poll_s: float = 1.0,
                 device: str | None = None, name: str | None = None,
                 telemetry: Telemetry | None = None,
                 host_factory: HostFactory = PluginHost):
        cfg.check()
        self._uploading: dict[str, tuple[float, JobTimes]] = {}  # receipt sent, no ack yet
        self.metrics = None      # provider_agent.metrics.AgentMetrics with metrics_addr
        self.metrics_port = 0    # where its /metrics listens
        self.cfg = cfg
        # One agent serves one device (provider_agent.fleet runs one per GPU): ``device``
        # and ``name`` override agent.toml's for it; the file stays the machine's.
        self.device = device or cfg.device
        self.name = name or cfg.name
        # GPU (NVML: this device's only), CPU and memory figures and job timings, sent in
        # heartbeats. provider_agent.fleet passes one sharing the gate's GPU source.
        self.telemetry = telemetry or Telemetry(
            default_source(gpu_indices_for(self.device)), interval_s=cfg.telemetry_interval_s)
        self.identity = identity
        self.home = home
        self.sandboxed = sandboxed
        self.max_backoff_s = max_backoff_s
        self.broker_address = (cfg.brokers or [cfg.broker])[0]  # the replica it talks to now
        # provider_agent.installer.Installer: fetches registry adapters a job names (None:
        # only what is on disk). Its adapters are advertised so the broker prefers us.
        self.installer = installer
        if sandboxed and launcher is None:
            # Never claim a sandbox to the broker while running plain subprocesses.
            from .launch import host_launcher
            launcher = host_launcher(
                sandboxed=True, home=home, cfg=cfg,
                registry_root=installer.root if installer is not None else None)
        self.launcher = launcher
        self.plugins: dict[str, ServedPlugin] = {}
        for name, folder in plugin_dirs.items():
            manifest = load_manifest(folder)
            weights = cfg.weights_for(name)
            self.plugins[name] = ServedPlugin(
                manifest, host_factory(folder, weights, device=self.device, launcher=launcher,
                                       name=name, max_vram_gb=float(cfg.max_vram_gb or 0)),
                folder_digest(weights, (home / "weights-cache.json") if home else None))
        self.replay = ReplayGuard()
        # SimpleQueue (C) rather than Queue (Python locks and conditions): cheaper hand-offs.
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.running: dict[str, RunningJob] = {}
        self.undelivered: dict[str, list[pb.AgentMessage]] = {}
        # Checkpoints: the latest of each running job (re-sent after a reconnect) and the
        # workers waiting for a checkpoint to resume from.
        self.latest_checkpoint: dict[str, pb.AgentMessage] = {}
        self._checkpoint_waiters: dict[str, queue.SimpleQueue] = {}
        self.checkpoint_fetch_timeout_s = 30.0
        self._lock = threading.Lock()
        # Jobs whose start is not reported yet: job id -> (when it is due, attempt).
        self._unreported: dict[str, tuple[float, int]] = {}
        self._report_due = threading.Condition(self._lock)
        self._outq: queue.SimpleQueue | None = None
        self._stop = threading.Event()
        self.draining = False
        self._signals = 0
        self.provider_id = ""
        # Why the last connection failed, in words (a refused certificate says which check).
        self.last_error = ""
        self.transport: broker_transport.Transport | None = None
        self._summary = _DoneSummary()
        # Outputs and checkpoints PUT straight to the broker's blob store (its Welcome says
        # so: S3) instead of travelling on the stream.
        self.direct_uploads = False
        self.receipt_batches = False  # the broker takes ReceiptBatch (its Welcome says)
        self.uploads = DirectUploads(self._send)
        self.benchmarks: dict[str, float] = {}   # plugin -> work units/s (our claim)
        self.ask_status: dict[str, pb.AskStatus] = {}  # the broker's answer per plugin
        # When this machine's owner lets it work (provider_agent.availability): None is
        # always. The watch thread looks every availability_poll_s and tells the broker.
        self.gate = gate
        self.availability_poll_s = availability_poll_s
        self.availability = DeviceState(self.device, AVAILABLE, "", time.time())
        self._given_back_for_owner = 0
        self._done_by_day: dict[str, int] = {}   # local day -> jobs finished (receipts)
        self.failed_reason = ""  # set when this device was taken out (provider_agent.fleet)
        self._device_failures = 0

    # ---- outside control ---------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self._signals += 1
        if self._signals == 1:
            log.warning("%s: draining — finishing %d running job(s); send it again to give "
                        "them back to the broker", signal.Signals(signum).name, len(self.running))
            self.drain()
        else:
            log.warning("second signal: giving running jobs back to the broker")
            self.give_back_all("agent stopped by its operator")

    def drain(self) -> None:
        self.draining = True
        self._send(pb.AgentMessage(drain=pb.Drain(reason="agent shutting down")))
        threading.Thread(target=self._stop_when_idle, daemon=True).start()

    def _stop_when_idle(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self.running and not self.undelivered and self.jobs.empty()
            if idle:
                self.stop()
                return
            time.sleep(0.1)

    def give_back_all(self, reason: str) -> None:
        with self._lock:
            running = list(self.running.items())
        for job_id, rj in running:
            rj.cancelled.set()
            self._send(pb.AgentMessage(give_back=pb.GiveBack(
                job_id=job_id, attempt=rj.envelope["attempt"], reason=reason)))
        time.sleep(0.3)  # let the stream carry the messages out
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            q = self._outq
            self._report_due.notify_all()
        if q is not None:
            q.put(None)
        for _ in range(self.cfg.slots):
            self.jobs.put(None)  # wakes the workers waiting for a job

    # ---- main loop ---------------------------------------------------------------------
    def start_hosts(self) -> None:
        for name, served in self.plugins.items():
            log.info("starting plugin host for %s (%s)", served.manifest.ref,
                     "sandboxed" if self.sandboxed else "NOT SANDBOXED")
            served.host.start()
        self.run_benchmarks()

    def run_benchmarks(self) -> None:
        """Time each served plugin on its manifest benchmark (at start, and whenever the
        plugins or hardware change); the figures go out with the capabilities."""
        if self.plugins:
            log.info("benchmarking %d plugin(s) before connecting to the broker (%s): each "
                     "runs its manifest's benchmark a few times, which can take minutes on a "
                     "CPU", len(self.plugins), ", ".join(sorted(self.plugins)))
        for name, served in self.plugins.items():
            result = benchmark_plugin(served, throttle_ms_per_unit=self._throttle(name))
            if result is not None:
                self.benchmarks[name] = result.units_per_s

    def _throttle(self, plugin: str) -> float:
        return float(self.cfg.throttle_ms_per_unit.get(plugin, 0.0))

    def post_asks(self, asks: dict[str, int]) -> bool:
        """Post or update standing asks on the live stream (micro-credits per work unit;
        never below ``min_price_micro_per_unit``)."""
        self.cfg.asks.update(asks)
        floor = self.cfg.min_price_micro_per_unit
        return self._send(pb.AgentMessage(post_asks=pb.PostAsks(asks=[
            pb.StandingAsk(plugin=p, price_micro_per_unit=max(int(v), floor))
            for p, v in asks.items()])))

    def _vram_gb(self, measured: float) -> float:
        """The VRAM advertised: the GPU's, capped by the owner's max_vram_gb (jobs whose
        plugin needs more are then never matched here)."""
        cap = float(self.cfg.max_vram_gb or 0)
        return min(measured, cap) if cap and measured else measured

    # ---- the owner's terms: idle-only, schedule, limits (issue #26) ----------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.availability_poll_s):
            try:
                self.look()
            except Exception:  # noqa: BLE001 - a bad look must not end the watch
                log.exception("could not decide whether the GPU is free")

    def look(self) -> DeviceState:
        """Ask the gate now; on a change tell the broker, and when the owner came back
        apply ``on_owner`` to the running jobs."""
        with self._lock:
            working = bool(self.running)
        st = self.gate.look(own_pids=own_pids(), working=working)
        prev = self.availability
        if (st.state, st.reason) == (prev.state, prev.reason):
            return st
        self.availability = st
        if st.available != prev.available:
            if st.available:
                log.info("the GPU is free to lend again: asking for work")
            else:
                log.warning("not taking work: %s (%s)", st.reason, st.state)
        self._send(self._availability_message())
        if st.state == OWNER_ACTIVE and prev.state != OWNER_ACTIVE \
                and self.gate.rules.on_owner != "finish":
            self._give_back_for_owner(st.reason)
        return st

    def snapshot(self) -> dict:
        """This device's state for `sparecycles agent status` (provider_agent.fleet
        writes it to <home>/status.json): connection, availability, jobs."""
        with self._lock:
            connected = self._outq is not None
            running = len(self.running)
            today = self._done_by_day.get(time.strftime("%Y-%m-%d"), 0)
        st = self.availability
        if self.failed_reason:
            state = "failed"
        elif self.draining:
            state = "draining"
        elif not st.available:
            state = st.state
        else:
            state = "working" if running else "ready"
        return {"device": self.device, "name": self.name, "provider_id": self.provider_id,
                "broker": self.cfg.broker, "connected": connected, "state": state,
                "reason": self.failed_reason or st.reason, "since": st.since,
                "running_jobs": running, "slots": self.cfg.slots, "jobs_today": today,
                "given_back_for_owner": self._given_back_for_owner,
                "gpu_hours_today": round(self.gate.hours_today(), 3) if self.gate else None,
                "plugins": sorted(self.plugins),
                "benchmarks": {p: round(u, 3) for p, u in self.benchmarks.items()},
                "asks": self.cfg.effective_asks(self.plugins)}

    def _availability_message(self) -> pb.AgentMessage:
        st = self.availability
        return pb.AgentMessage(availability=pb.Availability(
            available=st.available, state=st.state, reason=st.reason))

    def _give_back_for_owner(self, reason: str) -> None:
        """Hand the running jobs back for the owner: at once (``give_back``), or once each
        has written a fresh checkpoint, for at most ``checkpoint_wait_s`` (``checkpoint``;
        a job that does not checkpoint goes at once). The broker requeues them from their
        latest checkpoint, counting nothing against this provider."""
        with self._lock:
            running = list(self.running.items())
        for job_id, rj in running:
            rules = self.gate.rules
            wait = (rules.checkpoint_wait_s if rules.on_owner == "checkpoint"
                    and int(rj.envelope.get("checkpoint_every") or 0) > 0 else 0.0)
            threading.Thread(target=self._hand_back, args=(job_id, rj, reason, wait),
                             name=f"give-back-{job_id[:8]}", daemon=True).start()

    def _hand_back(self, job_id: str, rj: RunningJob, reason: str, wait_s: float) -> None:
        if wait_s > 0:
            with self._lock:
                before = self.latest_checkpoint.get(job_id)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not self._stop.is_set():
                with self._lock:
                    if job_id not in self.running or job_id in self.undelivered:
                        return  # it finished meanwhile: its receipt stands
                    if self.latest_checkpoint.get(job_id) is not before:
                        break
                time.sleep(0.05)
        with self._lock:
            if job_id not in self.running or job_id in self.undelivered or rj.cancelled.is_set():
                return
            rj.cancelled.set()
            self._given_back_for_owner += 1
        log.info("job %s given back for the owner (%s)", job_id, reason)
        self._send(pb.AgentMessage(give_back=pb.GiveBack(
            job_id=job_id, attempt=rj.envelope["attempt"], reason=reason, for_owner=True)))

    def run(self) -> int:
        if self.cfg.metrics_addr:  # before the hosts start: benchmarks take a while
            from .metrics import AgentMetrics

            self.metrics = AgentMetrics(self.telemetry, agent_name=self.cfg.name)
            self.metrics_port = self.metrics.serve(self.cfg.metrics_addr)
        try:
            self.start_hosts()
        except BaseException:  # e.g. this device's sandbox or model cannot start
            self._release()
            raise
        workers = [threading.Thread(target=self._worker, name=f"slot-{i}", daemon=True)
                   for i in range(self.cfg.slots)]
        workers.append(threading.Thread(target=self._report_starts, name="starts", daemon=True))
        if self.gate is not None:
            self.look()  # the first answer goes out with the connection
            workers.append(threading.Thread(target=self._watch, name="availability",
                                            daemon=True))
        for w in workers:
            w.start()
        backoff = 0.5
        addresses = self.cfg.brokers or [self.cfg.broker]
        turn = 0
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.broker_address = addresses[turn % len(addresses)]
                try:
                    self._session()
                except ConfigError:
                    raise
                except grpc.RpcError as exc:
                    code = exc.code() if hasattr(exc, "code") else None
                    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        raise ConfigError(f"the broker refused this agent: {exc.details()}") from None
                    why = (broker_transport.explain(self.transport, exc)
                           if self.transport is not None and hasattr(exc, "code") else "")
                    self.last_error = why or (exc.details() if hasattr(exc, "details")
                                              else str(exc))
                    if why:
                        log.error("cannot connect to %s: %s", self.broker_address, why)
                    else:
                        log.warning("connection to %s lost: %s", self.broker_address,
                                    self.last_error)
                except Exception as exc:  # noqa: BLE001 - keep the agent alive, reconnect
                    log.exception("connection error: %s", exc)
                if self._stop.is_set():
                    break
                turn += 1  # the next replica (the same one when there is only one)
                if len(addresses) > 1:
                    # Another replica is likely up: try it at once, backing off only once
                    # every address has failed in a row.
                    if turn % len(addresses):
                        self._stop.wait(0.1)
                        continue
                if time.monotonic() - started > 10:
                    backoff = 0.5
                delay = min(self.max_backoff_s, backoff) * (0.5 + random.random() / 2)
                log.info("reconnecting in %.1fs", delay)
                self._stop.wait(delay)
                backoff = min(self.max_backoff_s, backoff * 2)
        finally:
            self._release()
        return 0

    def _release(self) -> None:
        """What the agent holds on this machine: the plugin hosts, their cgroup, the
        registry client; and today's GPU hours, saved so they outlive a restart."""
        self._stop.set()
        if self.gate is not None:
            self.gate.meter.save()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        for served in self.plugins.values():
            served.host.stop()
        close = getattr(self.launcher, "close", None)
        if close is not None:
            close()  # the plugin hosts' shared cgroup
        if self.installer is not None:
            self.installer.close()  # the packages' last-use times, the registry client
        self.uploads.close()

    def _session(self) -> None:
        self.transport = broker_transport.choose(self.broker_address, self.cfg.ca_file,
                                                 self.cfg.insecure)
        channel = broker_transport.open_channel(self.broker_address, self.transport,
                                                GRPC_OPTIONS)
        outq: queue.SimpleQueue = queue.SimpleQueue()
        self.receipt_batches = False  # until this broker's Welcome says otherwise

        def requests():
            while True:
                msg = outq.get()
                if msg is None:
                    return
                if not (self.receipt_batches and msg.WhichOneof("body") == "receipt"):
                    yield msg
                    continue
                batch, after = batch_receipts(msg, outq)
                yield batch
                if after is None:
                    continue
                if after is _END:
                    return
                yield after

        stub = pb_grpc.AgentGatewayStub(channel)
        call = stub.Connect(requests(), metadata=[("authorization", f"Bearer {self.cfg.api_key}")])
        hb_stop = threading.Event()
        try:
            me = self.identity.public_key_hex
            outq.put(pb.AgentMessage(hello=pb.Hello(public_key=me, agent_version=VERSION,
                                                    name=self.name)))
            challenge = next(call).challenge
            broker_key = challenge.broker_public_key
            if self.cfg.broker_public_key and self.cfg.broker_public_key != broker_key:
                raise ConfigError(
                    f"the broker at {self.broker_address} presents key {broker_key[:16]}…, not the "
                    f"pinned {self.cfg.broker_public_key[:16]}…; if the broker really changed "
                    "its key, clear broker_public_key in agent.toml")
            if not self.cfg.broker_public_key:
                self.cfg.broker_public_key = broker_key
                if self.home is not None:
                    pin_broker_key(broker_key, self.home)
                log.info("pinned broker key %s…", broker_key[:16])
            signature = self.identity.sign("challenge",
                                           challenge_document(challenge.nonce, me, broker_key))
            outq.put(pb.AgentMessage(challenge_response=pb.ChallengeResponse(signature=signature)))
            outq.put(pb.AgentMessage(capabilities=self._capabilities()))
            welcome = next(call).welcome
            self.provider_id = welcome.provider_id
            self.last_error = ""
            self.direct_uploads = welcome.direct_uploads
            self.receipt_batches = welcome.receipt_batches  # an older broker: single ones
            log.info("connected to %s as provider %s (%d plugin(s), %d slot(s); %s%s)",
                     self.broker_address, welcome.provider_id, len(self.plugins),
                     self.cfg.slots, self.transport.describe(),
                     "; outputs go straight to the blob store" if self.direct_uploads else "")
            with self._lock:
                self._outq = outq
                pending = [m for msgs in self.undelivered.values() for m in msgs]
                pending += [m for job_id, m in self.latest_checkpoint.items()
                            if job_id in self.running and job_id not in self.undelivered]
            if self.gate is not None:
                outq.put(self._availability_message())
            if self.draining:
                outq.put(pb.AgentMessage(drain=pb.Drain(reason="agent shutting down")))
            for m in pending:
                outq.put(m)
            threading.Thread(target=self._heartbeats, args=(outq, hb_stop,
                             max(0.1, welcome.heartbeat_interval_s)), daemon=True).start()
            for msg in call:
                self._handle(msg)
        finally:
            hb_stop.set()
            with self._lock:
                if self._outq is outq:
                    self._outq = None
            outq.put(None)
            channel.close()

    def _capabilities(self) -> pb.Capabilities:
        hw = {}
        for served in self.plugins.values():
            if served.host.ready.get("hardware", {}).get("device") == "cuda" or not hw:
                hw = served.host.ready.get("hardware", {})
        return pb.Capabilities(
            plugins=self._plugin_capabilities(),
            hardware=pb.Hardware(device=hw.get("device", "cpu"), gpu_name=hw.get("gpu_name", ""),
                                 vram_gb=self._vram_gb(float(hw.get("vram_gb", 0.0))),
                                 cpu_count=int(hw.get("cpu_count", os.cpu_count() or 1)),
                                 memory_gb=_memory_gb(),
                                 fingerprint=machine_fingerprint()),
            slots=self.cfg.slots, sandboxed=self.sandboxed,
            benchmarks=[pb.PluginBenchmark(plugin=p, units_per_s=u, runs=3,
                                           cold_start_s=self._cold_start_s(p))
                        for p, u in self.benchmarks.items()],
            asks=[pb.StandingAsk(plugin=p, price_micro_per_unit=int(v))
                  for p, v in self.cfg.effective_asks(self.plugins).items()],
            adapters=self._installed_adapters(),
            assignment_batches=True)  # each envelope of a batch is opened on its own

    def _plugin_capabilities(self) -> list:
        return [pb.PluginCapability(name=s.manifest.name, version=s.manifest.version,
                                    weights_digest=s.weights_digest, warm=s.host.alive(),
                                    input_defaults=(canonical_bytes(s.input_defaults).decode()
                                                    if s.input_defaults else ""),
                                    **declared_repro(s))
                for s in self.plugins.values()]

    def _cold_start_s(self, plugin: str) -> float:
        """How long the plugin's host took from start to Ready (the model load): what a job
        costs when the model is not warm. 0 when not measured."""
        served = self.plugins.get(plugin)
        start_ms = served.host.ready.get("start_ms", 0) if served is not None else 0
        return float(start_ms) / 1000.0

    def _heartbeats(self, outq: queue.SimpleQueue, stop: threading.Event, interval: float) -> None:
        while not stop.wait(interval):
            with self._lock:
                ids = list(self.running) + list(self.undelivered)
            beat = pb.Heartbeat(running_job_ids=ids)
            try:
                sample = self.telemetry.due()
            except Exception:  # noqa: BLE001 - a failed reading must not stop heartbeats
                log.exception("telemetry: reading the machine failed")
                sample = None
            if sample is not None:
                beat.telemetry.CopyFrom(to_proto(sample, pb))
            outq.put(pb.AgentMessage(heartbeat=beat))

    def _send(self, msg: pb.AgentMessage) -> bool:
        with self._lock:
            q = self._outq
        if q is None:
            return False
        q.put(msg)
        return True

    # ---- broker messages ---------------------------------------------------------------
    def _handle(self, msg: pb.BrokerMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "assignment":
            self._on_assignment(msg.assignment)
        elif kind == "assignments":  # several placed in one pass, in placing order
            for assignment in msg.assignments.assignments:
                try:  # each on its own: one that fails takes none of the others with it
                    self._on_assignment(assignment)
                except Exception:  # noqa: BLE001 - its lease runs out and it is requeued
                    log.exception("an assignment of a batch could not be taken")
        elif kind == "cancel":
            with self._lock:
                rj = self.running.get(msg.cancel.job_id)
            if rj is not None and rj.envelope["attempt"] == msg.cancel.attempt:
                log.info("job %s cancelled by the broker: %s", msg.cancel.job_id, msg.cancel.reason)
                rj.cancelled.set()
        elif kind == "checkpoint_data":
            with self._lock:
                waiter = self._checkpoint_waiters.get(msg.checkpoint_data.job_id)
            if waiter is not None:
                waiter.put(msg.checkpoint_data)
        elif kind == "upload_grant":
            self.uploads.granted(msg.upload_grant)
        elif kind == "ack":
            self._on_ack(msg.ack)
        elif kind == "acks":  # the answer to a ReceiptBatch
            for ack in msg.acks.acks:
                self._on_ack(ack)
        elif kind == "ask_status":
            st = msg.ask_status
            self.ask_status[st.plugin] = st
            if st.accepted:
                log.info("standing ask for %s: %d micro-credits per work unit", st.plugin,
                         st.standing_price_micro_per_unit)
            else:
                log.error("the broker refused the ask for %s: %s (%s)", st.plugin, st.message,
                          st.code)
        elif kind == "refusal":
            log.warning("broker refused a message about job %s: %s (%s)", msg.refusal.job_id,
                        msg.refusal.message, msg.refusal.code)
            if msg.refusal.code in ("not_your_job", "unknown_job", "envelope_mismatch"):
                with self._lock:
                    self.undelivered.pop(msg.refusal.job_id, None)

    def _on_ack(self, ack: pb.Ack) -> None:
        if ack.what == "receipt":
            with self._lock:
                self.undelivered.pop(ack.job_id, None)
                uploading = self._uploading.pop(ack.job_id, None)
            if uploading is not None:
                sent_at, times = uploading
                times.upload_s = time.perf_counter() - sent_at
                self.telemetry.job_finished(times)

    def _on_assignment(self, a: pb.Assignment) -> None:
        try:
            env = open_envelope(a.envelope, a.signature, broker_key=self.cfg.broker_public_key,
                                my_key=self.identity.public_key_hex, replay=self.replay,
                                identity=self.identity)
        except EnvelopeError as exc:
            log.error("refused a job envelope (%s): %s", exc.code, exc)
            return
        if not self.availability.available:
            # Sent before the broker heard we stopped: back at once, counted against nobody.
            self._send(pb.AgentMessage(give_back=pb.GiveBack(
                job_id=env["job_id"], attempt=env["attempt"], for_owner=True,
                reason=f"not taking work: {self.availability.reason}")))
            return
        if env["plugin"] not in self.plugins:
            self._send(pb.AgentMessage(failed=pb.JobFailed(
                job_id=env["job_id"], attempt=env["attempt"], code="plugin_not_served",
                message=f"this agent does not serve {env['plugin']}", retryable=True)))
            return
        pinned = env.get("weights_digest") or ""
        served = self.plugins[env["plugin"]].weights_digest or ""
        if pinned and pinned != served:
            # The job pins other weights (e.g. a check of a run on another build): never run
            # it on ours; the broker places it elsewhere.
            self._send(pb.AgentMessage(failed=pb.JobFailed(
                job_id=env["job_id"], attempt=env["attempt"], code="weights_mismatch",
                message=f"the job pins weights {pinned[:12]}…; this agent serves "
                        f"{served[:12] or 'none'}…", retryable=True)))
            return
        with self._lock:
            self.running[env["job_id"]] = RunningJob(env, bytes(a.envelope))
            self._unreported[env["job_id"]] = (time.monotonic() + START_REPORT_DELAY_S,
                                               env["attempt"])
            if len(self._unreported) == 1:  # later entries are due later: no wake-up needed
                self._report_due.notify()
        self.jobs.put(env["job_id"])

    def _report_starts(self) -> None:
        """Send JobAccepted for each job still running ``START_REPORT_DELAY_S`` after it
        arrived (entries are due in arrival order); a job that ended first was removed."""
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                due = []
                for job_id, (when, attempt) in self._unreported.items():
                    if when > now:
                        break
                    due.append((job_id, attempt))
                for job_id, _ in due:
                    del self._unreported[job_id]
                if not due:
                    first = next(iter(self._unreported.values()), None)
                    self._report_due.wait(1.0 if first is None else first[0] - now)
                    continue
            for job_id, attempt in due:
                self._send(pb.AgentMessage(accepted=pb.JobAccepted(job_id=job_id,
                                                                   attempt=attempt)))

    # ---- the marketplace: registry adapters ------------------------------------------------
    def _installed_adapters(self) -> list:
        """Registry adapters installed for the plugins this agent serves (capabilities)."""
        if self.installer is None:
            return []
        return [pb.InstalledAdapter(**a) for a in self.installer.installed_adapters()
                if a["plugin"] in self.plugins]

    def send_inventory(self) -> bool:
        """Tell the broker what this agent holds now (after an install or an eviction)."""
        return self._send(pb.AgentMessage(inventory=pb.Inventory(
            plugins=self._plugin_capabilities(), adapters=self._installed_adapters())))

    def _prepare_job(self, job_id: str, rj: RunningJob) -> bool:
        """Install the registry adapters a job names that this agent lacks (signature and
        sha256 checked by the installer) before it runs. An install that fails fails the
        job (retryable: another provider may have it) and nothing else: the agent goes on
        serving. Adapters the registry does not know are left to the plugin to judge. The
        job's registry adapters are held (``rj.held``) against eviction until it ends."""
        if self.installer is None:
            return True
        from sdk.protocol.package import adapter_names

        from .installer import InstallError

        env = rj.envelope
        served = self.plugins.get(env["plugin"])
        names = adapter_names((env.get("inputs") or {}).get("adapters"))
        if served is None or not names or served.host.weights_dir is None:
            return True
        root = served.host.weights_dir / "adapters"
        changes = self.installer.changes
        try:
            for name in names:
                link = root / name
                if link.is_symlink():  # linked earlier: held while its entry is there
                    key = self.installer.touch_path(link.resolve(), hold=True)
                    if key is not None:
                        rj.held.append(key)
                        continue
                if link.is_dir():  # the operator's own folder (or link)
                    continue
                try:
                    installed = self.installer.install_adapter(name, base=env["plugin"],
                                                               hold=True)
                    rj.held.append(installed.key)
                    self.installer.link_adapter(installed, root)
                except InstallError as exc:
                    if exc.code == "not_found":
                        continue
                    log.warning("job %s: adapter %s not installed: %s", job_id, name, exc)
                    self._send(pb.AgentMessage(failed=pb.JobFailed(
                        job_id=job_id, attempt=env["attempt"], code=f"adapter_{exc.code}",
                        message=str(exc), retryable=True)))
                    return False
        finally:  # an install, or an eviction to make room (even for one that then failed)
            if self.installer.changes != changes:
                self.send_inventory()
        return True

    # ---- work --------------------------------------------------------------------------
    def _worker(self) -> None:
        while not self._stop.is_set():
            try:
                # stop() wakes this with None; the timeout is for a _stop set directly.
                job_id = self.jobs.get(timeout=1.0)
            except queue.Empty:
                continue
            if job_id is None:
                continue
            with self._lock:
                rj = self.running.get(job_id)
            if rj is None:
                continue
            prepared_at = time.perf_counter()
            # Every log line about the job names it and its request (sdk.logs).
            log_token = logs.bind(job_id=job_id, request_id=rj.times.request_id)
            try:
                ready = self._prepare_job(job_id, rj)
                rj.times.load_s = time.perf_counter() - prepared_at
                if ready:
                    self._run_job(job_id, rj)
            except Exception as exc:  # noqa: BLE001 - a bad job must never stop this worker
                log.exception("job %s: unexpected error in the agent", job_id)
                with self._lock:
                    delivered = job_id in self.undelivered  # its receipt stands
                if not delivered:
                    self._send(pb.AgentMessage(failed=pb.JobFailed(
                        job_id=job_id, attempt=rj.envelope.get("attempt", 0), code="agent_error",
                        message=f"the agent failed preparing or running the job: "
                                f"{type(exc).__name__}: {exc}", retryable=True)))
            finally:
                with self._lock:
                    self.running.pop(job_id, None)
                    self._unreported.pop(job_id, None)
                    self.latest_checkpoint.pop(job_id, None)
                    uploading = job_id in self._uploading
                if not uploading:  # else the receipt's ack finishes its timing
                    if rj.cancelled.is_set():
                        rj.times.outcome = "cancelled"
                    self.telemetry.job_finished(rj.times)
                if rj.held:
                    self.installer.release(rj.held)
                logs.unbind(log_token)

    def _run_job(self, job_id: str, rj: RunningJob) -> None:
        env = rj.envelope
        attempt = env["attempt"]
        served = self.plugins[env["plugin"]]
        if not self.sandboxed:
            log.warning("job %s runs WITHOUT a sandbox (--no-sandbox)", job_id)

        def progress(step, total, message):
            self._send(pb.AgentMessage(progress=pb.JobProgress(
                job_id=job_id, attempt=attempt, step=step, total=total, message=message)))

        def stream(text, _ids):
            self._send(pb.AgentMessage(progress=pb.JobProgress(job_id=job_id, attempt=attempt,
                                                               text=text)))

        last_total = [0]

        def progress_with_total(step, total, message):
            last_total[0] = total
            progress(step, total, message)

        def preview(step, data, media_type):
            self._send(pb.AgentMessage(progress=pb.JobProgress(
                job_id=job_id, attempt=attempt, step=step, total=last_total[0],
                preview=data, preview_media_type=media_type or "image/webp")))

        def checkpoint(step, data):
            data = pack_checkpoint(data)  # compressed when that is smaller
            stored = self.direct_uploads
            if stored:
                try:
                    self.uploads.upload(job_id, attempt, [(data, "checkpoint")])
                except HostError as exc:  # a checkpoint is a convenience: the job goes on
                    log.warning("job %s: checkpoint at step %d not kept: %s", job_id, step, exc)
                    return
            msg = pb.AgentMessage(checkpoint=pb.CheckpointUpload(
                job_id=job_id, attempt=attempt, step=step, total=last_total[0],
                data=b"" if stored else data, sha256=sha256_hex(data), stored=stored))
            with self._lock:
                self.latest_checkpoint[job_id] = msg
            self._send(msg)

        t0 = time.perf_counter()
        resume_from = self._fetch_checkpoint(job_id, attempt, env.get("resume"))
        run_at = time.perf_counter()
        rj.times.load_s += run_at - t0
        try:
            result = served.host.run(job_id, env["inputs"],
                                     wall_clock_s=served.manifest.wall_clock_s,
                                     on_progress=progress_with_total, on_stream=stream,
                                     cancelled=rj.cancelled,
                                     checkpoint_every=int(env.get("checkpoint_every") or 0),
                                     resume_from=resume_from, on_checkpoint=checkpoint,
                                     request_id=rj.times.request_id,
                                     on_preview=preview)
        except Exception as exc:  # noqa: BLE001 - a bad job must never stop this worker
            if not isinstance(exc, HostError):
                log.exception("job %s: unexpected error in the agent", job_id)
                exc = HostError("agent_error", f"the agent failed running the job: "
                                f"{type(exc).__name__}: {exc}", retryable=True)
            if rj.cancelled.is_set():
                log.info("job %s stopped (cancelled)", job_id)
                return
            log.warning("job %s failed: %s (%s)", job_id, exc, exc.code)
            self._send(pb.AgentMessage(failed=pb.JobFailed(
                job_id=job_id, attempt=attempt, code=exc.code, message=str(exc),
                retryable=exc.retryable)))
            self._count_device_failure(exc)
            return
        self._device_failures = 0
        rj.times.run_s = time.perf_counter() - run_at
        if rj.cancelled.is_set():
            return
        try:
            encode_outputs(result.outputs, env.get("output_format"))
        except Exception as exc:  # noqa: BLE001 - a bad image must not stop this worker
            log.warning("job %s: encoding the outputs as %s failed: %s", job_id,
                        env.get("output_format"), exc)
            self._send(pb.AgentMessage(failed=pb.JobFailed(
                job_id=job_id, attempt=attempt, code="encode_failed",
                message=f"encoding the outputs as {env.get('output_format')} failed: {exc}",
                retryable=False)))
            return
        run_ms = result.run_ms + int(throttle(self._throttle(env["plugin"]),
                                              float(result.work_units or 0)))
        messages, outputs, chunks = [], [], []
        for out in result.outputs:
            sha = sha256_hex(out.data)
            outputs.append({"index": out.index, "sha256": sha, "media_type": out.media_type,
                            "size": len(out.data), "meta": json_safe(out.meta or {})})
            chunks.append(pb.OutputChunk(job_id=job_id, attempt=attempt, index=out.index,
                                         media_type=out.media_type, data=out.data, sha256=sha))
        inline = sum(o["size"] for o in outputs) <= INLINE_OUTPUTS_BYTES
        if self.direct_uploads:  # straight to the blob store: the receipt names them
            try:
                self.uploads.upload(job_id, attempt, [(c.data, "output") for c in chunks])
            except HostError as exc:
                log.warning("job %s: %s", job_id, exc)
                self._send(pb.AgentMessage(failed=pb.JobFailed(
                    job_id=job_id, attempt=attempt, code=exc.code, message=str(exc),
                    retryable=exc.retryable)))
                return
            chunks, inline = [], True
        elif not inline:
            messages = [pb.AgentMessage(output=c) for c in chunks]
        receipt = make_receipt(envelope=env, envelope_bytes=rj.envelope_bytes,
                               provider_key=self.identity.public_key_hex, outputs=outputs,
                               work_units=result.work_units,
                               timings_ms={"run": run_ms,
                                           "total": int((time.perf_counter() - t0) * 1000),
                                           "queue": max(0, int((t0 - rj.received) * 1000))},
                               extra={"repro": repro_class(served, outputs)})
        data = canonical_bytes(receipt)
        messages.append(pb.AgentMessage(receipt=pb.Receipt(
            receipt=data, signature=self.identity.sign_canonical("receipt", data),
            outputs=chunks if inline else [])))
        rj.times.outcome = "done"
        with self._lock:
            self._unreported.pop(job_id, None)  # the receipt says it ran
            self.undelivered[job_id] = messages
            self._uploading[job_id] = (time.perf_counter(), rj.times)
            while len(self._uploading) > MAX_UPLOADING:  # acks lost to a reconnect
                self._uploading.pop(next(iter(self._uploading)))
        for m in messages:
            if not self._send(m):
                log.info("job %s done while disconnected; the receipt goes out on reconnect", job_id)
                break
        today = time.strftime("%Y-%m-%d")
        with self._lock:
            self._done_by_day[today] = self._done_by_day.get(today, 0) + 1
        log.debug("job %s done in %d ms", job_id, result.run_ms)
        line = self._summary.add(result.run_ms)
        if line is not None:
            log.info("%s", line)

    def _count_device_failure(self, exc: HostError) -> None:
        if exc.code not in DEVICE_FAILURE_CODES:
            self._device_failures = 0
            return
        self._device_failures += 1
        if self._device_failures >= DEVICE_FAILURES_MAX and not self.failed_reason:
            self.failed_reason = (f"{DEVICE_FAILURES_MAX} jobs in a row lost their plugin "
                                  f"host on {self.device}; last: {exc}")
            log.error("taking device %s out: %s", self.device, self.failed_reason)
            threading.Thread(target=self.give_back_all, args=(self.failed_reason,),
                             daemon=True).start()

    def _fetch_checkpoint(self, job_id: str, attempt: int, resume) -> bytes | None:
        """The checkpoint the envelope says to resume from, fetched from the broker and checked
        against its sha256; None (run from the start) when there is none or it cannot be had."""
        if not isinstance(resume, dict) or not resume.get("sha256"):
            return None
        want = str(resume["sha256"])
        waiter: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._checkpoint_waiters[job_id] = waiter
        try:
            deadline = time.monotonic() + self.checkpoint_fetch_timeout_s
            while time.monotonic() < deadline:
                self._send(pb.AgentMessage(fetch_checkpoint=pb.CheckpointFetch(
                    job_id=job_id, attempt=attempt, sha256=want)))
                try:
                    got = waiter.get(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                except queue.Empty:
                    continue  # lost on a reconnect: ask again
                if got.url and not got.error:  # the blob store's presigned GET
                    data = self.uploads.fetch(got.url, want)
                    got = pb.CheckpointData(data=data or b"", sha256=want,
                                            error="" if data else "not fetched from the blob store")
                if got.error or sha256_hex(got.data) != want:
                    log.warning("job %s: checkpoint %s… unavailable (%s); running from the start",
                                job_id, want[:12], got.error or "hash mismatch")
                    return None
                try:
                    data = unpack_checkpoint(bytes(got.data))
                except zlib.error as exc:
                    log.warning("job %s: checkpoint %s… does not decompress (%s); running from "
                                "the start", job_id, want[:12], exc)
                    return None
                log.info("job %s: resuming from the checkpoint at step %s", job_id,
                         resume.get("step"))
                return data
            log.warning("job %s: no answer for checkpoint %s…; running from the start", job_id,
                        want[:12])
            return None
        finally:
            with self._lock:
                self._checkpoint_waiters.pop(job_id, None)


def batch_receipts(first: pb.AgentMessage, outq: queue.SimpleQueue
                   ) -> tuple[pb.AgentMessage, object]:
    """``first`` (a receipt) with the receipts queued right behind it, up to RECEIPTS_MAX
    of them and RECEIPTS_BATCH_BYTES_MAX serialized bytes, as one message — a ReceiptBatch
    when there are several, else ``first`` itself — and what was taken from the queue after
    them and must go next: another message (a receipt too, when the bytes ran out), _END
    (the queue's end mark) or None. Nothing waits for receipts to come: only those already
    queued travel together, so a receipt is never held back."""
    receipts = [first.receipt]
    size = first.receipt.ByteSize()
    after = None
    while len(receipts) < RECEIPTS_MAX:
        try:
            msg = outq.get_nowait()
        except queue.Empty:
            break
        if msg is None:
            after = _END
            break
        if msg.WhichOneof("body") != "receipt":
            after = msg
            break
        size += msg.receipt.ByteSize()
        if size > RECEIPTS_BATCH_BYTES_MAX:
            after = msg  # it goes next, starting the following message
            break
        receipts.append(msg.receipt)
    if len(receipts) == 1:
        return first, after
    return pb.AgentMessage(receipts=pb.ReceiptBatch(receipts=receipts)), after


class _DoneSummary:
    """Counts finished jobs for the INFO summary line (see SUMMARY_EVERY_S)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self._count = 0
        self._run_ms = 0
        self._since = time.monotonic()
        self._next = 0.0  # the first job is reported at once

    def add(self, run_ms: int) -> str | None:
        """Count one job; the summary line when one is due, else None."""
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self._count += 1
            self._run_ms += run_ms
            if now < self._next:
                return None
            line = (f"{self._count} job(s) done in the last {now - self._since:.0f}s "
                    f"(mean run {self._run_ms / self._count:.0f} ms); {self.total} since start")
            self._count, self._run_ms, self._since = 0, 0, now
            self._next = now + SUMMARY_EVERY_S
            return line


def hardware_class(hardware: dict) -> str:
    """``cuda:<GPU name>`` on a GPU (e.g. "cuda:NVIDIA H200:torch=2.13.0"), else
    ``cpu:<machine>:threads=<n>`` (e.g. "cpu:x86_64:threads=1:torch=2.13.0"), from a plugin
    host's ready message: runs of one class must agree bit for bit."""
    torch = f":torch={hardware['torch']}" if hardware.get("torch") else ""
    if hardware.get("device") == "cuda":
        return f"cuda:{hardware.get('gpu_name') or 'unknown'}{torch}"
    threads = f":threads={hardware['threads']}" if hardware.get("threads") else ""
    return f"cpu:{platform.machine() or 'unknown'}{threads}{torch}"


def declared_repro(served: ServedPlugin) -> dict:
    """The reproducibility class the agent declares for ``served`` at connect
    (``PluginCapability.hardware_class`` / ``dtype``): the class its receipts' ``repro``
    names, from the plugin host's ready message; "" where the host has not started."""
    ready = served.host.ready or {}
    if not ready.get("hardware"):
        return {"hardware_class": "", "dtype": ""}
    hardware = ready["hardware"]
    dtype = ready.get("dtype") or (served.manifest.dtype if hardware.get("device") == "cuda"
                                   else "float32")
    return {"hardware_class": hardware_class(hardware), "dtype": str(dtype)}


def repro_class(served: ServedPlugin, outputs: list[dict]) -> dict:
    """The receipt's reproducibility class (DESIGN §6): two providers whose receipts carry
    equal ``repro`` must produce equal results (e.g. equal latent hashes).
    ``{"hardware_class", "dtype", "plugin_build"}`` of a job run on ``served``;
    ``dtype`` is the first output's meta "dtype", else the manifest's (GPU) or float32."""
    hardware = served.host.ready.get("hardware", {}) or {}
    dtype = next((o["meta"]["dtype"] for o in outputs
                  if isinstance(o.get("meta"), dict) and isinstance(o["meta"].get("dtype"), str)),
                 None)
    if dtype is None:
        dtype = served.manifest.dtype if hardware.get("device") == "cuda" else "float32"
    m = served.manifest
    return {"hardware_class": hardware_class(hardware), "dtype": dtype,
            "plugin_build": f"{m.name}@{m.version}+{(served.weights_digest or '')[:16]}"}


def json_safe(value):
    """``value`` as the canonical encoding takes it (sdk.protocol.canonical): str, int,
    finite float, bool, None, lists and string-keyed dicts. A non-finite float becomes
    None, a tuple a list, a numpy scalar its Python value, a key a string; anything else
    its ``str``."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return json_safe(item())
        except (TypeError, ValueError):
            pass
    return str(value)


def _memory_gb() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return 0.0


__all__ = ["Agent", "AgentError"]
