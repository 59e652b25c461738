"""AgentGatewayServicer: one bidirectional stream per agent, on grpc's asyncio server.

The handshake proves the agent holds its Ed25519 key (a fresh challenge signed with the
purpose "challenge"); the provider API key in the call metadata says which provider account
it belongs to. After that the stream is two tasks on the event loop: a reader hands the
agent's messages, one at a time and in order, to the job service in a bounded thread pool
(the domain is synchronous; a heartbeat that renews no lease costs no thread at all), and
a writer drains the session's outbox, into which the dispatcher and the job service put
messages from any thread. A connected agent costs a socket and a little memory, no thread.
A refused message (a forged receipt, progress for a job it no longer holds) gets a
Refusal; the stream stays.

Limits: at most ``max_streams`` streams (the next agent is refused with RESOURCE_EXHAUSTED
and retries with backoff); each outbox holds at most ``outbox_max`` messages and
OUTBOX_MAX_BYTES: an agent that stops reading its stream while messages for it pile up is
cut off (RESOURCE_EXHAUSTED), its queued messages dropped. What it sends is read at most
INBOX_MAX messages ahead of its handling, so gRPC's flow control holds back an agent that
sends faster.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Executor

import grpc

from sdk.protocol import agent_pb2 as pb
from sdk.protocol import agent_pb2_grpc as pb_grpc
from sdk.protocol.envelope import challenge_document, receipt_job_id
from sdk.protocol.signing import KeyPair, SignatureError, verify

from broker.auth import scopes
from broker.auth.service import KEY_CACHE_S, ApiKeyService
from broker.errors import BrokerError
from broker.jobs.dispatch import Dispatcher
from broker.jobs.presence import AgentSession, Offer, gathering
from broker.jobs.service import JobService
from broker.observability.telemetry import TelemetryStore
from broker.providers.service import ProviderService

log = logging.getLogger(__name__)
_CLOSE = object()
HANDSHAKE_TIMEOUT_S = 30.0  # for each handshake message: a silent connection is let go
ABORT_TIMEOUT_S = 5.0       # a cut-off agent that reads nothing gets no status: the call ends
OUTBOX_MAX_BYTES = 64 << 20  # per stream (a larger message alone is still taken)
KEY_RECHECK_S = KEY_CACHE_S  # how often connected agents' keys are checked again
INBOX_MAX = 32  # messages read ahead of their handling, per stream (then reading stops)
RECEIPTS_MAX = 64  # receipts settled in one transaction (a ReceiptBatch may hold more)
# Assignments a dispatcher pass holds for one agent (issue #28): sent as one AssignmentBatch
# when the pass ends, or sooner once this many (or bytes) wait or the first waited this long.
GATHER_MAX = 32
GATHER_MAX_BYTES = 4 << 20
GATHER_MAX_WAIT_S = 0.010


class GatewayStats:
    """Counters of the gateway (shown at /metrics); changed on the event loop only."""

    def __init__(self):
        self.streams = 0      # open now, handshakes included
        self.heartbeats = 0
        self.messages = 0     # from agents, heartbeats included
        self.refused = 0      # streams refused: the replica held max_streams
        self.cut_off = 0      # streams cut off: the agent stopped reading
        self.outbox_peak = 0  # the most messages any outbox held
        self.cut_offs: deque[tuple[str, str]] = deque(maxlen=64)  # (provider id, why)
        # Receipts handed to the job service, and the calls that handed them over, a batch
        # or one receipt each (issue #28: receipts ÷ settlements is the mean batch);
        # changed in the pool.
        self.receipts = 0
        self.receipt_settlements = 0
        self._receipts_lock = threading.Lock()
        # Assignments sent to agents, and the messages that carried them (one each, or an
        # AssignmentBatch): assignments ÷ messages is the mean batch; changed in any thread.
        self.assignments = 0
        self.assignment_messages = 0

    def settled_together(self, receipts: int, settlements: int) -> None:
        with self._receipts_lock:
            self.receipts += receipts
            self.receipt_settlements += settlements

    def sent_together(self, assignments: int) -> None:
        with self._receipts_lock:
            self.assignments += assignments
            self.assignment_messages += 1

    def collect(self):
        """These counters as Prometheus metric families (at scrape time)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, doc, value, family in (
                ("sparecycles_agent_streams", "Agent streams open now, handshakes included.",
                 self.streams, GaugeMetricFamily),
                ("sparecycles_agent_outbox_peak_messages", "The most messages any agent's "
                 "outbox held.", self.outbox_peak, GaugeMetricFamily),
                ("sparecycles_agent_heartbeats", "Heartbeats from agents.", self.heartbeats,
                 CounterMetricFamily),
                ("sparecycles_agent_messages", "Messages from agents, heartbeats included.",
                 self.messages, CounterMetricFamily),
                ("sparecycles_agent_streams_refused", "Agent streams refused: the replica "
                 "held max_agent_streams.", self.refused, CounterMetricFamily),
                ("sparecycles_agent_streams_cut_off", "Agent streams cut off: the agent "
                 "stopped reading.", self.cut_off, CounterMetricFamily),
                ("sparecycles_agent_receipts", "Agents' job receipts handed to the job "
                 "service (canaries' aside), alone or in batches.", self.receipts,
                 CounterMetricFamily),
                ("sparecycles_agent_receipt_settlements", "The calls that handed those "
                 "receipts to the job service, a batch or one receipt each (a batch is one "
                 "transaction unless it failed and fell back to one receipt at a time): "
                 "receipts ÷ settlements is the mean batch.",
                 self.receipt_settlements, CounterMetricFamily),
                ("sparecycles_agent_assignments", "Job and canary assignments sent to "
                 "agents.", self.assignments, CounterMetricFamily),
                ("sparecycles_agent_assignment_messages", "The messages that carried them, "
                 "one assignment each or an AssignmentBatch of those one dispatcher pass "
                 "placed on the agent: assignments ÷ messages is the mean batch.",
                 self.assignment_messages, CounterMetricFamily)):
            f = family(name, doc)
            f.add_metric([], value)
            yield f


class GatewaySession(AgentSession):
    """An agent's session; :meth:`send` may be called from any thread."""

    def __init__(self, *args, loop: asyncio.AbstractEventLoop, outbox_max: int = 256,
                 stats: GatewayStats | None = None, name: str = "",
                 assignment_batches: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = name  # the operator's name for the machine (its hello)
        # The agent takes AssignmentBatch (its Capabilities say): assignments a dispatcher
        # pass sends it are held and go out together (broker.jobs.presence.gathering).
        self.assignment_batches = assignment_batches
        self._held: list[pb.Assignment] = []
        self._held_bytes = 0
        self._held_since = 0.0
        self._loop = loop
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._lock = threading.Lock()
        self._queued = 0       # messages sent and not yet handed to gRPC
        self._bytes = 0
        self._outbox_max = outbox_max
        self._stats = stats or GatewayStats()
        self._closed = False
        self.cut_off: str | None = None  # why the broker cut the stream off
        self.revoked: str | None = None  # why its key stopped working meanwhile
        self._writer: asyncio.Task | None = None

    def send(self, msg: pb.BrokerMessage | None) -> None:
        """Queue ``msg`` for the agent (any thread; None: only what is held), after the
        assignments this session holds (they go first, so that a cancel never overtakes
        the job it cancels)."""
        cut = None
        peak = 0
        with self._lock:
            if self._closed:
                self._held.clear()
                return  # as with a dead stream: a job sent now comes back with its lease
            msgs = self._take_held()
            if msg is not None:
                msgs.append(msg)
            for m in msgs:
                size = m.ByteSize()
                if self._queued >= self._outbox_max or (
                        self._queued and self._bytes + size > OUTBOX_MAX_BYTES):
                    self._closed = True
                    cut = (f"the agent stopped reading its stream: {self._queued} messages "
                           f"({self._bytes} bytes) wait for it, the limit is "
                           f"{self._outbox_max} messages and {OUTBOX_MAX_BYTES} bytes; "
                           "reconnect and read the stream")
                    break
                self._queued += 1
                self._bytes += size
                peak = self._queued
                # In the lock: messages reach the outbox in the order they were sent.
                self._loop.call_soon_threadsafe(self._outbox.put_nowait, (m, size))
        if cut is not None:
            self._loop.call_soon_threadsafe(self._cut, cut)
            return
        if peak > self._stats.outbox_peak:
            self._stats.outbox_peak = peak  # (a racy max: a gauge, not an account)

    def _take_held(self) -> list[pb.BrokerMessage]:
        """The held assignments as one message (a batch of several), now no longer held;
        the caller holds the lock."""
        held, self._held, self._held_bytes = self._held, [], 0
        if not held:
            return []
        self._stats.sent_together(len(held))
        if len(held) == 1:
            return [pb.BrokerMessage(assignment=held[0])]
        return [pb.BrokerMessage(assignments=pb.AssignmentBatch(assignments=held))]

    def send_assignment(self, envelope_bytes: bytes, signature: str) -> None:
        assignment = pb.Assignment(envelope=envelope_bytes, signature=signature)
        if not (self.assignment_batches and gathering(self)):
            self._stats.sent_together(1)
            self.send(pb.BrokerMessage(assignment=assignment))
            return
        # Held for the pass's end, which sends each agent's in one AssignmentBatch; sooner
        # once many wait, or the first has waited long enough.
        size = assignment.ByteSize()
        with self._lock:
            full = bool(self._held) and self._held_bytes + size > GATHER_MAX_BYTES
        if full:  # what is held goes first: a batch stays far under gRPC's message limit
            self.send(None)
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            if not self._held:
                self._held_since = now
            self._held.append(assignment)
            self._held_bytes += size
            due = (len(self._held) >= GATHER_MAX or self._held_bytes >= GATHER_MAX_BYTES
                   or now - self._held_since >= GATHER_MAX_WAIT_S)
        if due:
            self.send(None)

    def flush_assignments(self) -> None:
        self.send(None)  # what is held, if anything

    def flush_if_due(self) -> None:
        with self._lock:
            due = bool(self._held) and time.monotonic() - self._held_since >= GATHER_MAX_WAIT_S
        if due:
            self.send(None)

    def send_cancel(self, job_id: str, attempt: int, reason: str) -> None:
        self.send(pb.BrokerMessage(cancel=pb.Cancel(job_id=job_id, attempt=attempt, reason=reason)))

    def close(self) -> None:
        """End the stream once what is queued (and held) is written (any thread)."""
        self.flush_assignments()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, (_CLOSE, 0))

    def queued(self) -> int:
        """Messages waiting to be written to the agent."""
        with self._lock:
            return self._queued

    # ---- on the event loop ---------------------------------------------------------
    def _cut(self, why: str, *, revoked: bool = False) -> None:
        if revoked:
            self.revoked = why
        else:
            self.cut_off = why
        while not self._outbox.empty():  # drop what was queued: that memory goes now
            self._outbox.get_nowait()
        with self._lock:
            self._queued = self._bytes = 0
            self._held.clear()
        if self._writer is not None:
            self._writer.cancel()
        else:
            self._outbox.put_nowait((_CLOSE, 0))

    async def write_all(self, context) -> None:
        """Write the outbox to the agent until the session closes."""
        while True:
            msg, size = await self._outbox.get()
            if msg is _CLOSE:
                return
            await context.write(msg)
            with self._lock:
                self._queued -= 1
                self._bytes -= size


def _adapters(adapters) -> list[dict]:
    """InstalledAdapter messages as the WarmIndex takes them."""
    return [{"plugin": a.plugin, "name": a.name, "version": a.version, "digest": a.digest}
            for a in adapters]


def _retrieved(task: asyncio.Task) -> None:
    """Take a finished task's exception (a write to an agent that went away), so that
    asyncio does not report it as never retrieved: the stream's end says enough."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("agent stream task ended: %r", task.exception())


def _code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class AgentGatewayServicer(pb_grpc.AgentGatewayServicer):
    def __init__(self, *, jobs: JobService, providers: ProviderService, auth: ApiKeyService,
                 dispatcher: Dispatcher, signer: KeyPair, heartbeat_interval_s: float,
                 lease_timeout_s: float, executor: Executor, market=None, canaries=None,
                 warm=None, max_streams: int = 20_000, outbox_max: int = 256,
                 stats: GatewayStats | None = None, links=None,
                 telemetry: TelemetryStore | None = None):
        self.links = links          # broker.links.LinkService: address and hardware link accounts
        self.market = market        # broker.market.MarketService: standing asks, θ
        self.warm = warm            # broker.registry.WarmIndex: what each agent holds warm
        self.canaries = canaries    # broker.market.canary.CanaryService
        self.jobs = jobs
        self.providers = providers
        self.auth = auth
        self.dispatcher = dispatcher
        self.signer = signer
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lease_timeout_s = lease_timeout_s
        self.executor = executor    # the bounded pool agents' messages are handled in
        self.max_streams = max_streams
        self.outbox_max = outbox_max
        self.stats = stats or GatewayStats()
        self.telemetry = telemetry  # heartbeats' telemetry, per provider (None: dropped)
        # The live streams by the credential they connected with: checked again every
        # KEY_RECHECK_S, so a revoked or expired key's agents are let go within seconds.
        self._by_token: dict[str, set[GatewaySession]] = {}
        self._key_sweeper: asyncio.Task | None = None

    def _authenticate(self, token: str):
        principal = self.auth.authenticate(token)
        scopes.require(principal, "agent:connect", "connecting an agent")
        return principal

    def _refused_tokens(self, tokens: list[str]) -> dict[str, str]:
        """In the pool: the credentials among ``tokens`` that no longer authenticate."""
        bad = {}
        for token in tokens:
            try:
                self._authenticate(token)
            except BrokerError as exc:
                bad[token] = exc.message
        return bad

    async def _sweep_keys(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(KEY_RECHECK_S)
            if not self._by_token:
                continue
            try:
                bad = await loop.run_in_executor(self.executor, self._refused_tokens,
                                                 list(self._by_token))
            except Exception:  # noqa: BLE001 - the database may be away; try again later
                log.exception("could not check the connected agents' keys again")
                continue
            for token, why in bad.items():
                for session in list(self._by_token.get(token, ())):
                    log.warning("letting agent of provider %s go: %s", session.provider_id,
                                why)
                    session._cut(why, revoked=True)

    async def stop_sweeping(self) -> None:
        """On the loop, at shutdown: end the key re-check (the streams are gone)."""
        task, self._key_sweeper = self._key_sweeper, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def Connect(self, request_iterator, context):  # noqa: N802 - grpc naming
        if self.stats.streams >= self.max_streams:
            self.stats.refused += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this broker replica holds its limit of {self.max_streams} agent streams "
                "(max_agent_streams); retry with backoff, or connect to another replica")
        self.stats.streams += 1
        try:
            await self._serve(context)
        except _Refused as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self.stats.streams -= 1

    async def _call(self, fn, *args):
        """``fn(*args)`` in the pool; a BrokerError refuses the stream with its status."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        except BrokerError as exc:
            raise _Refused(_code(exc.grpc_status), exc.message) from None

    async def _serve(self, context) -> None:
        loop = asyncio.get_running_loop()
        metadata = dict(context.invocation_metadata())
        token = metadata.get("authorization", "").removeprefix("Bearer ").strip()
        principal = await self._call(self._authenticate, token)

        hello = (await self._next(context, "hello")).hello
        if len(hello.public_key) != 64:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           "hello.public_key must be a 64-hex-digit Ed25519 public key")
        nonce = secrets.token_hex(32)
        await context.write(pb.BrokerMessage(challenge=pb.Challenge(
            nonce=nonce, broker_public_key=self.signer.public_key_hex)))
        answer = await self._next(context, "challenge_response")
        try:
            verify(hello.public_key, "challenge",
                   challenge_document(nonce, hello.public_key, self.signer.public_key_hex),
                   answer.challenge_response.signature)
        except SignatureError as exc:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                           f"challenge failed: {exc}; the agent must sign with its own key")
        caps = (await self._next(context, "capabilities")).capabilities

        admitted = loop.run_in_executor(self.executor, self._admit, principal, hello, caps,
                                        loop, context.peer())
        try:
            session, greeting = await asyncio.shield(admitted)
        except asyncio.CancelledError:  # the agent left meanwhile: leave once admitted
            admitted.add_done_callback(lambda f: f.cancelled() or f.exception() or
                                       self.executor.submit(self._leave, f.result()[0],
                                                            hello.name))
            raise
        except BrokerError as exc:
            raise _Refused(_code(exc.grpc_status), exc.message) from None
        except _Refused:
            raise
        writer = reader = None
        self._by_token.setdefault(token, set()).add(session)
        if self._key_sweeper is None or self._key_sweeper.done():
            self._key_sweeper = asyncio.ensure_future(self._sweep_keys())
        try:
            for msg in greeting:
                await context.write(msg)
            writer = session._writer = asyncio.ensure_future(session.write_all(context))
            reader = asyncio.ensure_future(self._read(context, session))
            await asyncio.wait({writer})  # ends: closed, cut off, or the agent is gone
        finally:
            for task in (reader, writer):
                if task is not None:
                    task.cancel()
                    task.add_done_callback(_retrieved)
            self.executor.submit(self._leave, session, hello.name)
            streams = self._by_token.get(token)
            if streams is not None:
                streams.discard(session)
                if not streams:
                    del self._by_token[token]
        if session.revoked:
            await asyncio.wait_for(context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                                 session.revoked), ABORT_TIMEOUT_S)
        if session.cut_off:
            self.stats.cut_off += 1
            self.stats.cut_offs.append((session.provider_id, session.cut_off))
            log.warning("cut off agent %s (provider %s): %s", hello.name, session.provider_id,
                        session.cut_off)
            # The status waits behind what the agent does not read; past a bound the call
            # just ends (gRPC resets the stream) and its buffers go with it.
            await asyncio.wait_for(context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                 session.cut_off), ABORT_TIMEOUT_S)

    @staticmethod
    async def _next(context, want: str) -> pb.AgentMessage:
        try:
            msg = await asyncio.wait_for(context.read(), HANDSHAKE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"no {want} within {HANDSHAKE_TIMEOUT_S:g} s; agents send hello, "
                           "the challenge's answer and capabilities as they connect") from None
        if msg is grpc.aio.EOF:
            raise _Refused(grpc.StatusCode.CANCELLED, f"stream closed before {want}")
        if msg.WhichOneof("body") != want:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"expected {want}, got {msg.WhichOneof('body')}")
        return msg

    def _admit(self, principal, hello, caps, loop, peer: str = "") -> tuple[GatewaySession, list]:
        """In the pool: the provider's record and its session, held by the dispatcher (the
        market hears of it there, with what it offers the market); returns the session and
        the messages that greet the agent."""
        plugins = [{"name": p.name, "version": p.version, "weights_digest": p.weights_digest,
                    "warm": p.warm,
                    # the reproducibility class it declares (verification judges its runs
                    # by this, never by a receipt's word)
                    "hardware_class": p.hardware_class[:120], "dtype": p.dtype[:40]}
                   for p in caps.plugins]
        hardware = {"device": caps.hardware.device, "gpu_name": caps.hardware.gpu_name,
                    "vram_gb": caps.hardware.vram_gb, "cpu_count": caps.hardware.cpu_count,
                    "memory_gb": caps.hardware.memory_gb}
        # Stored with what its weights give inputs (image sizes): other replicas' submits
        # fill them in as this one does (broker.providers.defaults).
        stored = [{**p, "input_defaults": c.input_defaults}
                  for p, c in zip(plugins, caps.plugins)]
        provider = self.providers.connect(principal, hello.public_key, hello.name,
                                          sandboxed=caps.sandboxed, hardware=hardware,
                                          plugins=stored)
        if self.links is not None:  # where it connects from, and on which machine
            self.links.agent_seen(provider.account_id, peer=peer,
                                  fingerprint=caps.hardware.fingerprint[:128])
        if caps.slots < 1 or caps.slots > 64:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"capabilities.slots is {caps.slots}; must be between 1 and 64")
        if self.warm is not None:
            self.warm.update(provider.id, plugins, _adapters(caps.adapters))
        session = GatewaySession(
            provider_id=provider.id, public_key=hello.public_key,
            account_id=provider.account_id,
            plugins={f"{p['name']}@{p['version']}": p["weights_digest"] for p in plugins},
            classes={f"{p['name']}@{p['version']}": {"hardware_class": p["hardware_class"],
                                                      "dtype": p["dtype"]} for p in plugins},
            slots=caps.slots, paused=provider.status != "active", loop=loop,
            outbox_max=self.outbox_max, stats=self.stats, name=hello.name[:200],
            assignment_batches=caps.assignment_batches,
            # The memory a model runs in: the GPU's on a GPU, the host's on a CPU-only
            # machine (what the manifest's min_vram_gb is checked against).
            vram_gb=(caps.hardware.vram_gb if caps.hardware.device == "cuda"
                     else caps.hardware.memory_gb or caps.hardware.vram_gb),
            offer=Offer(benchmarks=tuple((b.plugin, b.units_per_s, b.cold_start_s or None)
                                         for b in caps.benchmarks),
                        asks=tuple((a.plugin, a.price_micro_per_unit) for a in caps.asks))
            if self.market is not None else None)
        session.resumed = {j.id: j for j in self.jobs.repo.leased_to(provider.id)}
        resumed = list(session.resumed)
        session.active.update(resumed)
        if not caps.sandboxed:
            log.warning("provider %s (%s) runs plugins WITHOUT a sandbox", provider.id,
                        hello.name)
        log.info("agent %s connected: provider %s, plugins %s, %d slot(s)%s", hello.name,
                 provider.id, sorted(session.plugins), caps.slots,
                 f", resuming {len(resumed)} job(s)" if resumed else "")
        greeting = [pb.BrokerMessage(welcome=pb.Welcome(
            provider_id=provider.id, heartbeat_interval_s=self.heartbeat_interval_s,
            lease_timeout_s=self.lease_timeout_s, resume_job_ids=resumed,
            direct_uploads=bool(getattr(self.jobs.blobs, "presigns", False)),
            receipt_batches=True))]
        # What its weights give inputs declared default_from = "weights" (image sizes);
        # _leave forgets it.
        if self.jobs.input_defaults is not None:
            self.jobs.input_defaults.update(provider.id, [
                {"name": p.name, "version": p.version, "weights_digest": p.weights_digest,
                 "input_defaults": p.input_defaults} for p in caps.plugins], session=session)
        # Whatever the dispatcher sends from now on queues behind the greeting: the outbox
        # is written only once the greeting is.
        self.dispatcher.register(session)  # the market and the replicas see it held here
        greeting += self._offer_replies(session)
        return session, greeting

    def _leave(self, session: GatewaySession, name: str) -> None:
        self.dispatcher.unregister(session)  # the replicas no longer see it held here
        if self.telemetry is not None:
            self.telemetry.forget(session.provider_id)
        if self.warm is not None:
            self.warm.forget(session.provider_id)
        if self.jobs.input_defaults is not None:
            self.jobs.input_defaults.forget(session.provider_id, session=session)
        log.info("agent %s (provider %s) disconnected", name, session.provider_id)

    async def _read(self, context, session: GatewaySession) -> None:
        """The agent's messages, handled one at a time and in order: the loop reads them
        into an inbox that one pool job at a time drains, so that messages arriving
        together cost one hop into the pool, not one each. A full inbox (INBOX_MAX) stops
        the reading until it drains: gRPC's flow control then holds the agent back."""
        loop = asyncio.get_running_loop()
        stats = self.stats
        inbox: deque = deque()
        lock = threading.Lock()
        state = {"draining": False}
        drained = None  # the latest pool job draining the inbox
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                stats.messages += 1
                if msg.WhichOneof("body") == "heartbeat":
                    stats.heartbeats += 1
                    if not msg.heartbeat.running_job_ids and not (
                            self.telemetry is not None and msg.heartbeat.HasField("telemetry")):
                        continue  # it renews no lease: nothing to write, no thread needed
                with lock:  # with when it arrived: a receipt ends the run the market times
                    inbox.append((msg, self.jobs.clock()))
                    start = not state["draining"]
                    state["draining"] = True
                    full = len(inbox) >= INBOX_MAX
                if start:
                    drained = loop.run_in_executor(self.executor, self._drain, session,
                                                   inbox, lock, state)
                if full:
                    await asyncio.wait({drained})
            if drained is not None:  # what was read is handled before the stream ends
                await asyncio.wait({drained})
        except grpc.RpcError:
            pass
        finally:
            session.close()

    def _drain(self, session: GatewaySession, inbox: deque, lock: threading.Lock,
               state: dict) -> None:
        """In the pool: handle the inbox's messages in order until it is empty. Single
        receipts that wait there one after another (an agent that sends no ReceiptBatch,
        or several sent while the last was settling) are settled together, as a batch,
        and acked one by one."""
        while True:
            with lock:
                if not inbox:
                    state["draining"] = False
                    return
                msg, arrived = inbox.popleft()
                run = None
                if msg.WhichOneof("body") == "receipt" and inbox and (
                        inbox[0][0].WhichOneof("body") == "receipt"):
                    run = [(msg.receipt, arrived)]
                    while (inbox and len(run) < RECEIPTS_MAX
                           and inbox[0][0].WhichOneof("body") == "receipt"):
                        more, at = inbox.popleft()
                        run.append((more.receipt, at))
            if run is None:
                self._handle_safely(msg, session, arrived)
                continue
            try:
                self._receipts(session, run, False)
            except Exception:  # noqa: BLE001 - one bad batch must not drop the agent
                log.exception("error handling %d receipts from %s", len(run),
                              session.provider_id)

    def _handle_safely(self, msg: pb.AgentMessage, session: GatewaySession,
                       arrived: float | None = None) -> None:
        try:
            self._handle(msg, session, arrived)
        except BrokerError as exc:
            job_id = getattr(getattr(msg, msg.WhichOneof("body") or "", None), "job_id", "")
            log.warning("refused %s from %s: %s", msg.WhichOneof("body"),
                        session.provider_id, exc)
            session.send(pb.BrokerMessage(refusal=pb.Refusal(
                job_id=job_id, code=exc.code, message=exc.message)))
        except Exception:  # noqa: BLE001 - one bad message must not drop the agent
            log.exception("error handling %s from %s", msg.WhichOneof("body"),
                          session.provider_id)

    # ---- the market ----------------------------------------------------------------------
    def _offer_replies(self, session: GatewaySession) -> list[pb.BrokerMessage]:
        """The market's answers to what the agent offered with its connection: a Refusal
        per impossible benchmark, an AskStatus per posted ask."""
        out: list[pb.BrokerMessage] = []
        for reply in session.offer_replies:
            if reply.kind == "benchmark":
                if reply.error is not None:
                    log.warning("refused a benchmark from %s: %s", session.provider_id,
                                reply.error)
                    out.append(pb.BrokerMessage(refusal=pb.Refusal(
                        code=reply.error.code, message=reply.error.message)))
            elif reply.error is None:
                out.append(pb.BrokerMessage(ask_status=pb.AskStatus(
                    plugin=reply.plugin, accepted=True,
                    standing_price_micro_per_unit=reply.price)))
            else:
                log.warning("refused an ask from %s: %s", session.provider_id, reply.error)
                out.append(pb.BrokerMessage(ask_status=pb.AskStatus(
                    plugin=reply.plugin, accepted=False, code=reply.error.code,
                    message=reply.error.message, standing_price_micro_per_unit=reply.price)))
        session.offer_replies = []
        return out

    def _benchmark(self, session: GatewaySession, b) -> list[pb.BrokerMessage]:
        try:
            self.market.report_benchmark(session.provider_id, b.plugin, b.units_per_s,
                                         cold_start_s=b.cold_start_s or None)
            return []
        except BrokerError as exc:
            log.warning("refused a benchmark from %s: %s", session.provider_id, exc)
            return [pb.BrokerMessage(refusal=pb.Refusal(code=exc.code, message=exc.message))]

    def _post_ask(self, session: GatewaySession, ask) -> pb.BrokerMessage:
        try:
            price = self.market.post_ask(session.provider_id, ask.plugin,
                                         ask.price_micro_per_unit)
            return pb.BrokerMessage(ask_status=pb.AskStatus(
                plugin=ask.plugin, accepted=True, standing_price_micro_per_unit=price))
        except BrokerError as exc:
            log.warning("refused an ask from %s: %s", session.provider_id, exc)
            standing = next((a["price_micro_per_unit"] for a in
                             self.market.asks({session.provider_id}) if a["plugin"] == ask.plugin
                             and not a["at_reserve"]), 0)
            return pb.BrokerMessage(ask_status=pb.AskStatus(
                plugin=ask.plugin, accepted=False, code=exc.code, message=exc.message,
                standing_price_micro_per_unit=standing))

    def _canary(self, msg: pb.AgentMessage, kind: str, session: GatewaySession,
                arrived: float | None = None) -> bool:
        """Messages about a canary job go to the canary service, not the job service."""
        if self.canaries is None or kind not in ("accepted", "progress", "output", "receipt",
                                                 "failed", "give_back", "checkpoint"):
            return False
        if kind == "receipt":
            return self._canary_receipt(msg.receipt, session, arrived)
        job_id = getattr(msg, kind).job_id
        if not self.canaries.owns(job_id):
            return False
        if kind == "give_back" and msg.give_back.for_owner:
            # The owner needed the GPU (if the agent said so first): the canary says nothing
            # of this provider's honesty; else it is a failure (CanaryService.withdrawn).
            self.canaries.withdrawn(session, job_id)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=job_id, what=kind)))
            self.dispatcher.kick()
        elif kind in ("failed", "give_back"):
            self.canaries.failed(session, job_id)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=job_id, what=kind)))
            self.dispatcher.kick()
        return True

    def _canary_receipt(self, r: pb.Receipt, session: GatewaySession,
                        arrived: float | None) -> bool:
        """A canary's receipt goes to the canary service (acked here); False: not one."""
        if self.canaries is None:
            return False
        # Opened (decoded, signature checked) once, by the service whose job it is; not
        # even decoded here unless the agent has a canary out (nearly never).
        if not (self.canaries.out_to(session.provider_id)
                and self.canaries.owns(receipt_job_id(r.receipt) or "")):
            return False
        job_id = self.canaries.receipt(session, r.receipt, r.signature, received_at=arrived)
        if job_id is None:
            return False
        session.send(pb.BrokerMessage(ack=pb.Ack(job_id=job_id, what="receipt")))
        self.dispatcher.kick()
        return True

    def _receipts(self, session: GatewaySession, receipts: list[tuple[pb.Receipt, float | None]],
                  batched: bool) -> None:
        """Several receipts settled in one transaction (JobService.receipts), each judged
        alone: a refused one gets its Refusal, the others their acks — one AckBatch when
        they came as a ReceiptBatch (``batched``), else one Ack each, as an agent that
        sends single receipts expects. Canaries' receipts go to the canary service."""
        items = []
        for r, arrived in receipts:
            try:
                if self._canary_receipt(r, session, arrived):
                    continue
            except BrokerError as exc:
                self._refuse(session, "receipt", receipt_job_id(r.receipt) or "", exc)
                continue
            items.append((r, arrived))
        results = []
        for at in range(0, len(items), RECEIPTS_MAX):  # one transaction per RECEIPTS_MAX
            results += self.jobs.receipts(
                session.provider_id, session.public_key,
                [(r.receipt, r.signature, [(o.data, o.sha256) for o in r.outputs], arrived)
                 for r, arrived in items[at:at + RECEIPTS_MAX]])
        self.stats.settled_together(len(items), -(-len(items) // RECEIPTS_MAX))
        acks = []
        for (r, _), result in zip(items, results):
            if isinstance(result, BrokerError):
                self._refuse(session, "receipt", receipt_job_id(r.receipt) or "", result)
            elif result is not None:
                acks.append(pb.Ack(job_id=result.id, what="receipt"))
        if batched and acks:
            session.send(pb.BrokerMessage(acks=pb.AckBatch(acks=acks)))
        else:
            for ack in acks:
                session.send(pb.BrokerMessage(ack=ack))

    def _refuse(self, session: GatewaySession, kind: str, job_id: str,
                exc: BrokerError) -> None:
        log.warning("refused %s from %s: %s", kind, session.provider_id, exc)
        session.send(pb.BrokerMessage(refusal=pb.Refusal(
            job_id=job_id, code=exc.code, message=exc.message)))

    def _grant(self, req, session: GatewaySession) -> None:
        """Presigned PUT URLs for the blobs an agent is about to upload (or why not)."""
        blobs = [(b.sha256, b.size) for b in req.blobs]
        try:
            if (self.canaries is not None and self.canaries.out_to(session.provider_id)
                    and self.canaries.owns(req.job_id)):
                puts = self.jobs.presign_uploads(blobs)  # it must look like any job
            else:
                puts = self.jobs.grant_uploads(session.provider_id, req.job_id, req.attempt,
                                               blobs)
        except BrokerError as exc:
            session.send(pb.BrokerMessage(upload_grant=pb.UploadGrant(
                job_id=req.job_id, request_id=req.request_id, error=exc.message,
                code=exc.code)))
            return
        session.send(pb.BrokerMessage(upload_grant=pb.UploadGrant(
            job_id=req.job_id, request_id=req.request_id, uploads=[
                pb.UploadUrl(sha256=b.sha256, url=p.url, headers=p.headers,
                             expires_at=p.expires_at) for b, p in zip(req.blobs, puts)])))

    def _handle(self, msg: pb.AgentMessage, session: GatewaySession,
                arrived: float | None = None) -> None:
        """One message of the agent's; ``arrived``: when the stream read it (the broker's
        clock), so a receipt's run is timed to its arrival, not to when a pool thread got
        to it."""
        kind = msg.WhichOneof("body")
        pid = session.provider_id
        if self._canary(msg, kind, session, arrived):
            return
        if kind == "post_asks" and self.market is not None:
            for ask in msg.post_asks.asks:
                session.send(self._post_ask(session, ask))
            self.dispatcher.kick()
        elif kind == "benchmark_report" and self.market is not None:
            for b in msg.benchmark_report.benchmarks:
                for reply in self._benchmark(session, b):
                    session.send(reply)
        elif kind == "heartbeat":
            hb = msg.heartbeat
            if hb.running_job_ids:
                self.jobs.heartbeat(pid, list(hb.running_job_ids))
            if self.telemetry is not None and hb.HasField("telemetry"):
                self.telemetry.record(pid, session.name, hb.telemetry,
                                      plugins={k.split("@", 1)[0] for k in session.plugins})
        elif kind == "accepted":
            self.jobs.accepted(pid, msg.accepted.job_id, msg.accepted.attempt)
        elif kind == "progress":
            p = msg.progress
            if p.preview:
                self.jobs.preview(pid, p.job_id, p.attempt, p.step, p.total, p.preview,
                                  p.preview_media_type)
            else:
                self.jobs.progress(pid, p.job_id, p.attempt, p.step, p.total, p.message,
                                   p.text)
        elif kind == "output":
            o = msg.output
            self.jobs.store_output(pid, o.job_id, o.attempt, o.data, o.sha256)
        elif kind == "receipt":
            r = msg.receipt
            self.stats.settled_together(1, 1)
            job = self.jobs.receipt(pid, session.public_key, r.receipt, r.signature,
                                    uploads=[(o.data, o.sha256) for o in r.outputs],
                                    received_at=arrived)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=job.id, what="receipt")))
        elif kind == "receipts":
            self._receipts(session, [(r, arrived) for r in msg.receipts.receipts], True)
        elif kind == "failed":
            f = msg.failed
            self.jobs.failed(pid, f.job_id, f.attempt, f.code, f.message, f.retryable)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=f.job_id, what="failed")))
        elif kind == "give_back":
            g = msg.give_back
            self.jobs.give_back(pid, g.job_id, g.attempt,
                                f"for the machine's owner: {g.reason}" if g.for_owner else g.reason)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=g.job_id, what="give_back")))
        elif kind == "upload_request":
            self._grant(msg.upload_request, session)
        elif kind == "checkpoint" and self.jobs.checkpoints is not None:
            c = msg.checkpoint
            self.jobs.checkpoints.upload(pid, c.job_id, c.attempt, c.step, c.total, c.data,
                                         c.sha256, stored=c.stored)
        elif kind == "fetch_checkpoint" and self.jobs.checkpoints is not None:
            f = msg.fetch_checkpoint
            data, url, error = b"", "", ""
            try:
                if getattr(self.jobs.blobs, "presigns", False):  # the agent GETs it from S3
                    url = self.jobs.checkpoints.fetch_url(pid, f.job_id, f.attempt, f.sha256)
                else:
                    data = self.jobs.checkpoints.fetch(pid, f.job_id, f.attempt, f.sha256)
            except (BrokerError, KeyError, OSError) as exc:
                error = getattr(exc, "message", None) or str(exc)
            session.send(pb.BrokerMessage(checkpoint_data=pb.CheckpointData(
                job_id=f.job_id, attempt=f.attempt, sha256=f.sha256, data=data, error=error,
                url=url)))
        elif kind == "inventory":
            if self.warm is not None:
                inv = msg.inventory
                self.warm.update(pid, [{"name": p.name, "version": p.version,
                                        "warm": p.warm} for p in inv.plugins],
                                 _adapters(inv.adapters))
                if self.market is not None:
                    self.market.refresh(pid)  # its cold-start term may have changed
        elif kind == "availability":
            a = msg.availability
            was = session.unavailable
            session.unavailable = "" if a.available else (a.state or "paused")
            session.unavailable_reports += bool(session.unavailable and not was)
            self.providers.set_availability(pid, available=a.available, state=a.state,
                                            reason=a.reason)
            self.dispatcher.changed(session)  # free slots: none while unavailable
            if bool(was) != bool(session.unavailable):
                log.info("provider %s %s%s", pid, "is available again" if a.available
                         else f"paused itself ({a.state})", f": {a.reason}" if a.reason else "")
        elif kind == "drain":
            session.draining = True
            self.dispatcher.changed(session)  # no new jobs: the market hears of it
            log.info("provider %s is draining: %s", pid, msg.drain.reason)
        else:
            log.warning("unexpected %s from %s after the handshake", kind, pid)
