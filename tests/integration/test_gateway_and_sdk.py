"""The gRPC gateway on localhost:0 and the SDK against the live broker."""
import queue
import threading

import grpc
import pytest

from sdk import AuthenticationError, Client, ConfigurationError, InvalidInputError, NotFoundError
from sdk.protocol import agent_pb2 as pb
from sdk.protocol import agent_pb2_grpc as pb_grpc
from sdk.protocol.canonical import canonical_bytes
from sdk.protocol.envelope import challenge_document
from sdk.protocol.signing import KeyPair


class RawAgent:
    """A hand-driven agent stream, to send what a real agent never would."""

    def __init__(self, target, api_key):
        self.channel = grpc.insecure_channel(target)
        self.q = queue.Queue()
        stub = pb_grpc.AgentGatewayStub(self.channel)
        self.call = stub.Connect(iter(self.q.get, None),
                                 metadata=[("authorization", f"Bearer {api_key}")])

    def send(self, **kw):
        self.q.put(pb.AgentMessage(**kw))

    def recv(self):
        return next(self.call)

    def close(self):
        self.q.put(None)
        self.channel.close()


def _handshake(raw, key: KeyPair, sign_with: KeyPair | None = None):
    raw.send(hello=pb.Hello(public_key=key.public_key_hex, name="raw"))
    ch = raw.recv().challenge
    doc = challenge_document(ch.nonce, key.public_key_hex, ch.broker_public_key)
    raw.send(challenge_response=pb.ChallengeResponse(signature=(sign_with or key).sign("challenge", doc)))
    raw.send(capabilities=pb.Capabilities(
        plugins=[pb.PluginCapability(name="echo", version="1.0.0")], slots=1, sandboxed=True))
    return raw.recv()


def test_agent_that_cannot_prove_its_key_is_refused(live_broker):
    raw = RawAgent(live_broker.grpc, live_broker.key("provider"))
    with pytest.raises(grpc.RpcError) as exc:
        _handshake(raw, KeyPair.generate(), sign_with=KeyPair.generate())
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    raw.close()


@pytest.mark.parametrize("role", [None, "client"])
def test_agent_needs_a_provider_key(live_broker, role):
    raw = RawAgent(live_broker.grpc, live_broker.key(role) if role else "sc_bad")
    with pytest.raises(grpc.RpcError) as exc:
        _handshake(raw, KeyPair.generate())
    assert exc.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    raw.close()


def test_forged_receipt_gets_a_refusal_and_the_stream_survives(live_broker):
    key = KeyPair.generate()
    raw = RawAgent(live_broker.grpc, live_broker.key("provider"))
    welcome = _handshake(raw, key).welcome
    client = Client(live_broker.url, live_broker.key("client"))
    job = client.jobs.create("echo", text="x")
    assignment = raw.recv().assignment
    env = __import__("json").loads(assignment.envelope)
    assert env["job_id"] == job.id and env["provider"] == key.public_key_hex
    forged = {"v": 1, "job_id": job.id, "attempt": 0, "envelope_sha256": "0" * 64,
              "provider": key.public_key_hex, "outputs": [], "work_units": "1.000000",
              "timings_ms": {}}
    raw.send(receipt=pb.Receipt(receipt=canonical_bytes(forged),
                                signature=KeyPair.generate().sign("receipt", forged)))
    refusal = raw.recv().refusal
    assert refusal.code == "bad_signature"
    raw.send(receipt=pb.Receipt(receipt=canonical_bytes(forged), signature=key.sign("receipt", forged)))
    assert raw.recv().refusal.code == "envelope_mismatch"
    raw.send(heartbeat=pb.Heartbeat(running_job_ids=[job.id]))
    assert job.refresh().state in ("matched", "running") and welcome.provider_id
    raw.close()
    client.close()


def test_sdk_generate_through_a_real_agent(live_broker, start_agent):
    start_agent("a1")
    with Client(live_broker.url, live_broker.key("client")) as client:
        result = client.generate("echo", text="hello")
        assert result.json[0]["text"] == "hello"
        job = client.jobs.create("echo", text="slow", sleep_ms=300, steps=3)
        kinds = [e.kind for e in job.events()]
        assert kinds[0] == "queued" and kinds[-1] == "done" and kinds.count("progress") == 3
        assert job.wait(10).job.state == "settled"


def test_sdk_errors_are_typed(live_broker, monkeypatch):
    monkeypatch.delenv("SPARECYCLES_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="SPARECYCLES_API_KEY"):
        Client(live_broker.url)
    with pytest.raises(AuthenticationError):
        Client(live_broker.url, "sc_client_00_bad").plugins()
    with Client(live_broker.url, live_broker.key("client")) as client:
        with pytest.raises(InvalidInputError) as exc:   # caught by the SDK before sending
            client.jobs.create("echo", sleep_ms=-1)
        assert exc.value.field == "inputs.sleep_ms" and "between 0 and 60000" in str(exc.value)
        with pytest.raises(InvalidInputError) as exc:   # and by the broker, same message
            client.jobs.create("echo", validate=False, sleep_ms=-1)
        assert exc.value.field == "inputs.sleep_ms" and "between 0 and 60000" in str(exc.value)
        with pytest.raises(NotFoundError):
            client.jobs.create("no-such-plugin")
        assert live_broker.services.jobs.repo.counts_by_state() == {}


def test_wait_timeout_cancels_on_the_server(live_broker, start_agent):
    from sdk import JobTimeoutError

    start_agent("a1")
    with Client(live_broker.url, live_broker.key("client")) as client:
        job = client.jobs.create("echo", sleep_ms=5000, steps=50)
        with pytest.raises(JobTimeoutError) as exc:
            job.wait(timeout=0.5)
        assert exc.value.job.state == "cancelled"


def test_a_batch_wait_timeout_cancels_every_sibling_left(live_broker, start_agent):
    from sdk import JobTimeoutError

    start_agent("a1")
    with Client(live_broker.url, live_broker.key("client")) as client:
        batch = client.jobs.create_batch("echo", terms={"n": 2}, sleep_ms=5000, steps=50)
        with pytest.raises(JobTimeoutError, match="2 of 2 jobs did not finish"):
            batch.wait(timeout=0.5)
        assert [j.state for j in batch.refresh().jobs] == ["cancelled", "cancelled"]


def test_a_dead_agent_loses_its_job_to_another(tmp_path):
    """Lease expiry: the job goes back to the queue and finishes elsewhere."""
    from tests.integration.conftest import LiveBroker

    broker = LiveBroker(tmp_path, lease_timeout_s=1.0)
    try:
        key = KeyPair.generate()
        raw = RawAgent(broker.grpc, broker.key("provider"))
        _handshake(raw, key)
        with Client(broker.url, broker.key("client")) as client:
            job = client.jobs.create("echo", text="survive")
            raw.recv()              # assigned to the raw agent, which then goes silent
            from provider_agent.agent import Agent
            from provider_agent.config import AgentConfig
            from plugins import builtin_plugin_dir

            agent = Agent(AgentConfig(broker=broker.grpc, api_key=broker.key("provider"),
                                      plugins=["echo"], device="cpu"), KeyPair.generate(),
                          plugin_dirs={"echo": builtin_plugin_dir("echo")}, sandboxed=False)
            t = threading.Thread(target=agent.run, daemon=True)
            t.start()
            result = job.wait(timeout=30)
            assert result.json[0]["text"] == "survive"
            assert result.job.data["attempt"] == 1
            assert result.job.data["provider_id"] != ""
            agent.stop()
            t.join(10)
        raw.close()
    finally:
        broker.stop()
