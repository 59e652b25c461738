"""AgentGatewayServicer: one bidirectional stream per agent.

The handshake proves the agent holds its Ed25519 key (a fresh challenge signed with the
purpose "challenge"); the provider API key in the call metadata says which provider account
it belongs to. After that a reader thread feeds the agent's messages to the job service and
the handler's generator drains the session's outbox back to the agent. A refused message
(a forged receipt, progress for a job it no longer holds) gets a Refusal; the stream stays.
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading

import grpc

from sdk.protocol import agent_pb2 as pb
from sdk.protocol import agent_pb2_grpc as pb_grpc
from sdk.protocol.envelope import challenge_document, receipt_job_id
from sdk.protocol.signing import KeyPair, SignatureError, verify

from broker.auth.service import ApiKeyService
from broker.errors import BrokerError
from broker.jobs.dispatch import AgentSession, Dispatcher
from broker.jobs.service import JobService
from broker.providers.service import ProviderService

log = logging.getLogger(__name__)
_CLOSE = object()


class GatewaySession(AgentSession):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outbox: queue.Queue = queue.Queue()

    def send(self, msg: pb.BrokerMessage) -> None:
        self.outbox.put(msg)

    def send_assignment(self, envelope_bytes: bytes, signature: str) -> None:
        self.send(pb.BrokerMessage(assignment=pb.Assignment(envelope=envelope_bytes,
                                                            signature=signature)))

    def send_cancel(self, job_id: str, attempt: int, reason: str) -> None:
        self.send(pb.BrokerMessage(cancel=pb.Cancel(job_id=job_id, attempt=attempt, reason=reason)))

    def close(self) -> None:
        self.outbox.put(_CLOSE)


def _adapters(adapters) -> list[dict]:
    """InstalledAdapter messages as the WarmIndex takes them."""
    return [{"plugin": a.plugin, "name": a.name, "version": a.version, "digest": a.digest}
            for a in adapters]


def _code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


class AgentGatewayServicer(pb_grpc.AgentGatewayServicer):
    def __init__(self, *, jobs: JobService, providers: ProviderService, auth: ApiKeyService,
                 dispatcher: Dispatcher, signer: KeyPair, heartbeat_interval_s: float,
                 lease_timeout_s: float, market=None, canaries=None, warm=None):
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

    def Connect(self, request_iterator, context):  # noqa: N802 - grpc naming
        metadata = dict(context.invocation_metadata())
        token = metadata.get("authorization", "").removeprefix("Bearer ").strip()
        try:
            principal = self.auth.authenticate(token)
        except BrokerError as exc:
            context.abort(_code(exc.grpc_status), exc.message)

        hello = self._next(request_iterator, context, "hello")
        agent_key = hello.hello.public_key
        if len(agent_key) != 64:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "hello.public_key must be a 64-hex-digit Ed25519 public key")
        nonce = secrets.token_hex(32)
        yield pb.BrokerMessage(challenge=pb.Challenge(nonce=nonce,
                                                      broker_public_key=self.signer.public_key_hex))
        answer = self._next(request_iterator, context, "challenge_response")
        try:
            verify(agent_key, "challenge",
                   challenge_document(nonce, agent_key, self.signer.public_key_hex),
                   answer.challenge_response.signature)
        except SignatureError as exc:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"challenge failed: {exc}; the agent must sign with its own key")
        caps = self._next(request_iterator, context, "capabilities").capabilities
        plugins = [{"name": p.name, "version": p.version, "weights_digest": p.weights_digest,
                    "warm": p.warm} for p in caps.plugins]
        hardware = {"device": caps.hardware.device, "gpu_name": caps.hardware.gpu_name,
                    "vram_gb": caps.hardware.vram_gb, "cpu_count": caps.hardware.cpu_count,
                    "memory_gb": caps.hardware.memory_gb}
        try:
            provider = self.providers.connect(principal, agent_key, hello.hello.name,
                                              sandboxed=caps.sandboxed, hardware=hardware,
                                              plugins=plugins)
        except BrokerError as exc:
            context.abort(_code(exc.grpc_status), exc.message)
        if caps.slots < 1 or caps.slots > 64:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"capabilities.slots is {caps.slots}; must be between 1 and 64")

        if self.warm is not None:
            self.warm.update(provider.id, plugins, _adapters(caps.adapters))
        session = GatewaySession(
            provider_id=provider.id, public_key=agent_key, account_id=provider.account_id,
            plugins={f"{p['name']}@{p['version']}": p["weights_digest"] for p in plugins},
            slots=caps.slots, paused=provider.status != "active")
        session.resumed = {j.id: j for j in self.jobs.repo.leased_to(provider.id)}
        resumed = list(session.resumed)
        session.active.update(resumed)
        if not caps.sandboxed:
            log.warning("provider %s (%s) runs plugins WITHOUT a sandbox", provider.id,
                        hello.hello.name)
        log.info("agent %s connected: provider %s, plugins %s, %d slot(s)%s", hello.hello.name,
                 provider.id, sorted(session.plugins), caps.slots,
                 f", resuming {len(resumed)} job(s)" if resumed else "")
        yield pb.BrokerMessage(welcome=pb.Welcome(
            provider_id=provider.id, heartbeat_interval_s=self.heartbeat_interval_s,
            lease_timeout_s=self.lease_timeout_s, resume_job_ids=resumed))
        if self.market is not None:
            for msg in self._join_market(session, caps):
                yield msg

        reader = threading.Thread(target=self._read, args=(request_iterator, session),
                                  name=f"agent-{provider.id[:8]}", daemon=True)
        # What its weights give inputs declared default_from = "weights" (image sizes),
        # from here to the finally below: no yield in between, so it is always forgotten.
        if self.jobs.input_defaults is not None:
            self.jobs.input_defaults.update(provider.id, [
                {"name": p.name, "version": p.version, "weights_digest": p.weights_digest,
                 "input_defaults": p.input_defaults} for p in caps.plugins], session=session)
        self.dispatcher.register(session)
        reader.start()
        context.add_callback(session.close)
        try:
            while True:
                msg = session.outbox.get()
                if msg is _CLOSE:
                    return
                yield msg
        finally:
            self.dispatcher.unregister(session)
            if self.warm is not None:
                self.warm.forget(provider.id)
            if self.jobs.input_defaults is not None:
                self.jobs.input_defaults.forget(provider.id, session=session)
            log.info("agent %s (provider %s) disconnected", hello.hello.name, provider.id)

    @staticmethod
    def _next(it, context, want: str) -> pb.AgentMessage:
        try:
            msg = next(it)
        except StopIteration:
            context.abort(grpc.StatusCode.CANCELLED, f"stream closed before {want}")
        if msg.WhichOneof("body") != want:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"expected {want}, got {msg.WhichOneof('body')}")
        return msg

    def _read(self, it, session: GatewaySession) -> None:
        try:
            for msg in it:
                try:
                    self._handle(msg, session)
                except BrokerError as exc:
                    job_id = getattr(getattr(msg, msg.WhichOneof("body") or "", None),
                                     "job_id", "")
                    log.warning("refused %s from %s: %s", msg.WhichOneof("body"),
                                session.provider_id, exc)
                    session.send(pb.BrokerMessage(refusal=pb.Refusal(
                        job_id=job_id, code=exc.code, message=exc.message)))
                except Exception:  # noqa: BLE001 - one bad message must not drop the agent
                    log.exception("error handling %s from %s", msg.WhichOneof("body"),
                                  session.provider_id)
        except grpc.RpcError:
            pass
        finally:
            session.close()

    # ---- the market ----------------------------------------------------------------------
    def _join_market(self, session: GatewaySession, caps) -> list[pb.BrokerMessage]:
        """Enter the provider in the order book with its benchmarks and asks; one AskStatus
        per posted ask and a Refusal per impossible benchmark."""
        out: list[pb.BrokerMessage] = []
        plugins = {key.split("@", 1)[0]: key.split("@", 1)[1] for key in session.plugins}
        digests = {key.split("@", 1)[0]: digest for key, digest in session.plugins.items()}
        # The memory a model runs in: the GPU's on a GPU, the host's on a CPU-only machine
        # (what the manifest's min_vram_gb is checked against).
        memory = (caps.hardware.vram_gb if caps.hardware.device == "cuda"
                  else caps.hardware.memory_gb or caps.hardware.vram_gb)
        self.market.connect(session.provider_id, session.account_id, plugins,
                            vram_gb=memory, free=session.free,
                            slots=session.slots, digests=digests)
        for b in caps.benchmarks:
            out += self._benchmark(session, b)
        for ask in caps.asks:
            out.append(self._post_ask(session, ask))
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

    def _canary(self, msg: pb.AgentMessage, kind: str, session: GatewaySession) -> bool:
        """Messages about a canary job go to the canary service, not the job service."""
        if self.canaries is None or kind not in ("accepted", "progress", "output", "receipt",
                                                 "failed", "give_back"):
            return False
        if kind == "receipt":
            # Opened (decoded, signature checked) once, by the service whose job it is; not
            # even decoded here unless the agent has a canary out (nearly never).
            if not (self.canaries.out_to(session.provider_id)
                    and self.canaries.owns(receipt_job_id(msg.receipt.receipt) or "")):
                return False
            job_id = self.canaries.receipt(session, msg.receipt.receipt, msg.receipt.signature)
            if job_id is None:
                return False
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=job_id, what="receipt")))
            self.dispatcher.kick()
            return True
        job_id = getattr(msg, kind).job_id
        if not self.canaries.owns(job_id):
            return False
        if kind in ("failed", "give_back"):
            self.canaries.failed(session, job_id)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=job_id, what=kind)))
            self.dispatcher.kick()
        return True

    def _handle(self, msg: pb.AgentMessage, session: GatewaySession) -> None:
        kind = msg.WhichOneof("body")
        pid = session.provider_id
        if self._canary(msg, kind, session):
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
            self.jobs.heartbeat(pid, list(msg.heartbeat.running_job_ids))
        elif kind == "accepted":
            self.jobs.accepted(pid, msg.accepted.job_id, msg.accepted.attempt)
        elif kind == "progress":
            p = msg.progress
            self.jobs.progress(pid, p.job_id, p.attempt, p.step, p.total, p.message, p.text)
        elif kind == "output":
            o = msg.output
            self.jobs.store_output(pid, o.job_id, o.attempt, o.data, o.sha256)
        elif kind == "receipt":
            r = msg.receipt
            job = self.jobs.receipt(pid, session.public_key, r.receipt, r.signature,
                                    uploads=[(o.data, o.sha256) for o in r.outputs])
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=job.id, what="receipt")))
        elif kind == "failed":
            f = msg.failed
            self.jobs.failed(pid, f.job_id, f.attempt, f.code, f.message, f.retryable)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=f.job_id, what="failed")))
        elif kind == "give_back":
            g = msg.give_back
            self.jobs.give_back(pid, g.job_id, g.attempt, g.reason)
            session.send(pb.BrokerMessage(ack=pb.Ack(job_id=g.job_id, what="give_back")))
        elif kind == "checkpoint" and self.jobs.checkpoints is not None:
            c = msg.checkpoint
            self.jobs.checkpoints.upload(pid, c.job_id, c.attempt, c.step, c.total, c.data,
                                         c.sha256)
        elif kind == "fetch_checkpoint" and self.jobs.checkpoints is not None:
            f = msg.fetch_checkpoint
            try:
                data, error = self.jobs.checkpoints.fetch(pid, f.job_id, f.attempt, f.sha256), ""
            except (BrokerError, KeyError, OSError) as exc:
                data, error = b"", getattr(exc, "message", None) or str(exc)
            session.send(pb.BrokerMessage(checkpoint_data=pb.CheckpointData(
                job_id=f.job_id, attempt=f.attempt, sha256=f.sha256, data=data, error=error)))
        elif kind == "inventory":
            if self.warm is not None:
                inv = msg.inventory
                self.warm.update(pid, [{"name": p.name, "version": p.version,
                                        "warm": p.warm} for p in inv.plugins],
                                 _adapters(inv.adapters))
                if self.market is not None:
                    self.market.refresh(pid)  # its cold-start term may have changed
        elif kind == "drain":
            session.draining = True
            log.info("provider %s is draining: %s", pid, msg.drain.reason)
        else:
            log.warning("unexpected %s from %s after the handshake", kind, pid)
