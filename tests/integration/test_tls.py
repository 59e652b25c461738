"""TLS on both hops (REST for clients, gRPC for agents): a good certificate is accepted, and
a wrong CA, an expired certificate, a wrong host name and a plaintext peer are each refused
with an error that says which."""
from __future__ import annotations

import datetime as dt

import grpc
import pytest

from broker.server import BrokerServer
from broker.settings import Settings
from broker.tls import issue_server_cert, make_ca
from provider_agent import transport
from sdk import Client
from sdk.errors import APIConnectionError, ConfigurationError
from sdk.protocol import agent_pb2 as pb
from sdk.protocol import agent_pb2_grpc as pb_grpc
from tests.integration.conftest import LiveBroker

NOW = dt.datetime.now(dt.timezone.utc)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca")
    make_ca(root / "other")
    return {
        "ca": root / "ca" / "ca.pem",
        "other_ca": root / "other" / "ca.pem",
        "good": issue_server_cert(root / "ca", ca=ca),
        "expired": issue_server_cert(root / "ca", ca=ca, stem="expired",
                                     not_before=NOW - dt.timedelta(days=30),
                                     not_after=NOW - dt.timedelta(days=1)),
        "wrong_host": issue_server_cert(root / "ca", ["broker.example"], ca=ca,
                                        stem="wrong-host"),
    }


def _broker(tmp_path, cert):
    return LiveBroker(tmp_path, tls_cert=cert.cert_file, tls_key=cert.key_file)


@pytest.fixture
def tls_broker(tmp_path, pki):
    b = _broker(tmp_path, pki["good"])
    yield b
    b.stop()


def _connect(broker_addr: str, t: transport.Transport, key: str = "sc_bad") -> grpc.RpcError | None:
    """The agent's own channel (provider_agent.transport), one Connect; the error, if any."""
    channel = transport.open_channel(broker_addr, t, [])
    try:
        call = pb_grpc.AgentGatewayStub(channel).Connect(
            iter([pb.AgentMessage(hello=pb.Hello(public_key="00"))]),
            metadata=[("authorization", f"Bearer {key}")], timeout=5)
        next(call)
    except grpc.RpcError as exc:
        return exc
    finally:
        channel.close()
    return None


def test_good_certificate_on_both_hops(tls_broker, pki, start_agent_tls):
    with Client(tls_broker.url, tls_broker.key("client"), ca_file=str(pki["ca"])) as client:
        assert tls_broker.url.startswith("https://")
        assert client.account()["role"] == "client"
        assert client.request("GET", "/readyz").json()["transport"] == "tls"
        agent = start_agent_tls(ca_file=str(pki["ca"]))
        assert agent.transport.tls and agent.transport.ca_file == str(pki["ca"])
        result = client.generate("echo", text="over tls", timeout=60)
        assert result.json[0]["text"] == "over tls"
        assert result.job.data["provider_id"] == agent.provider_id


@pytest.fixture
def start_agent_tls(tls_broker):
    from plugins import builtin_plugin_dir
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from sdk.protocol.signing import KeyPair
    import threading
    import time

    agents = []

    def start(ca_file):
        cfg = AgentConfig(broker=tls_broker.grpc, api_key=tls_broker.key("provider"),
                          plugins=["echo"], device="cpu", ca_file=ca_file)
        agent = Agent(cfg, KeyPair.generate(), plugin_dirs={"echo": builtin_plugin_dir("echo")},
                      sandboxed=False)
        t = threading.Thread(target=agent.run, daemon=True)
        t.start()
        agents.append((agent, t))
        deadline = time.monotonic() + 30
        while not agent.provider_id and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.provider_id, f"agent did not connect: {agent.last_error}"
        return agent

    yield start
    for agent, t in agents:
        agent.stop()
        t.join(10)


@pytest.mark.parametrize("case, ca, words", [
    ("good", "other_ca", "not signed by a CA"),
    ("expired", "ca", "has expired"),
    ("wrong_host", "ca", "not for '127.0.0.1'"),
])
def test_refused_certificates_say_which(tmp_path, pki, case, ca, words):
    b = _broker(tmp_path, pki[case])
    try:
        # REST: the SDK refuses at once (no retries) and names the failed check.
        with pytest.raises(APIConnectionError) as refused:
            Client(b.url, b.key("client"), ca_file=str(pki[ca]), max_retries=3).account()
        sdk_words = {"other_ca": "not signed by a CA", "expired": "expired",
                     "wrong_host": "not for this host name"}[ca if case == "good" else case]
        assert sdk_words in str(refused.value)
        # gRPC: the agent's channel fails, and the agent's explanation names the check.
        t = transport.choose(b.grpc, str(pki[ca]))
        assert t.tls  # a TLS broker on loopback is reached over TLS
        exc = _connect(b.grpc, t, b.key("provider"))
        assert exc is not None and exc.code() == grpc.StatusCode.UNAVAILABLE
        assert words in transport.explain(t, exc)
    finally:
        b.stop()


def test_plaintext_clients_of_a_tls_broker_are_refused(tls_broker):
    # An SDK client speaking http:// to the TLS port: refused, with the hint to use https.
    with pytest.raises(APIConnectionError) as refused:
        Client(tls_broker.url.replace("https://", "http://"), "sc_client_x_y",
               max_retries=0).account()
    assert "use https://" in str(refused.value)
    # An agent forced to plaintext (insecure): the broker hangs up; the agent says why.
    t = transport.choose(tls_broker.grpc, insecure=True)
    assert not t.tls
    exc = _connect(tls_broker.grpc, t)
    assert exc is not None and exc.code() == grpc.StatusCode.UNAVAILABLE
    assert "serves TLS and this agent connected in plaintext" in transport.explain(t, exc)


def test_plaintext_allowed_on_loopback_only(tmp_path, live_broker):
    # A plaintext broker on loopback: the agent finds it speaks no TLS and connects anyway.
    t = transport.choose(live_broker.grpc)
    assert not t.tls
    assert _connect(live_broker.grpc, t).code() == grpc.StatusCode.UNAUTHENTICATED
    # Plaintext off loopback: the SDK and the broker refuse unless told --insecure.
    with pytest.raises(ConfigurationError, match="not loopback"):
        Client("http://broker.example:8080", "sc_client_x_y")
    Client("http://broker.example:8080", "sc_client_x_y", insecure=True).close()
    with pytest.raises(SystemExit, match="refusing to serve REST on 0.0.0.0:0 in plaintext"):
        BrokerServer(Settings(data_dir=tmp_path / "b", http="0.0.0.0:0", grpc="127.0.0.1:0"))


def test_bad_ca_bundle_and_mismatched_key_are_named(tmp_path, pki):
    with pytest.raises(ConfigurationError, match="cannot read the CA bundle"):
        Client("https://127.0.0.1:1", "sc_client_x_y", ca_file=str(tmp_path / "nope.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigurationError, match="holds no PEM certificate"):
        Client("https://127.0.0.1:1", "sc_client_x_y", ca_file=str(tmp_path / "junk.pem"))
    with pytest.raises(SystemExit, match="cannot use"):
        BrokerServer(Settings(data_dir=tmp_path / "b", http="127.0.0.1:0", grpc="127.0.0.1:0",
                              tls_cert=pki["good"].cert_file, tls_key=pki["expired"].key_file))
