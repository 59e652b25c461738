"""Connections cost sockets, not threads (issue #22), on a real in-process broker: hundreds
of long polls and agent streams beyond the thread pools' sizes, /livez while they are held
and the pool is full, the limits' refusals, and an agent that stops reading its stream.
"""
from __future__ import annotations

import asyncio
import json
import queue
import re
import socket
import time

import grpc
import httpx
import pytest

from broker.server import raise_open_files_limit
from sdk.protocol import agent_pb2 as pb
from sdk.protocol import agent_pb2_grpc as pb_grpc
from sdk.protocol.envelope import challenge_document
from sdk.protocol.signing import KeyPair
from tests.integration.conftest import LiveBroker

HTTP_THREADS = 16
MAX_STREAMS = 300
MAX_WAITING = 300
OUTBOX_MAX = 32


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    raise_open_files_limit()  # a few hundred sockets on each side, in this one process
    b = LiveBroker(tmp_path_factory.mktemp("connections"), http_threads=HTTP_THREADS,
                   max_agent_streams=MAX_STREAMS, max_waiting_clients=MAX_WAITING,
                   agent_outbox_max=OUTBOX_MAX)
    yield b
    b.stop()


def metric(broker, name: str) -> float:
    text = httpx.get(f"{broker.url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics:\n{text}"
    return float(found.group(1))


def until(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def online(broker) -> int:
    return httpx.get(f"{broker.url}/readyz", timeout=10).json()["providers_online"]


def no_streams(broker) -> None:
    until(lambda: online(broker) == 0, "agents to disconnect")


class SyncAgent:
    """A hand-driven agent stream (grpc's sync client); ``options``: channel options."""

    def __init__(self, broker, options=()):
        self.key = KeyPair.generate()
        self.channel = grpc.insecure_channel(broker.grpc, options=list(options))
        self.q: queue.Queue = queue.Queue()
        self.call = pb_grpc.AgentGatewayStub(self.channel).Connect(
            iter(self.q.get, None),
            metadata=[("authorization", f"Bearer {broker.key('provider')}")])

    def send(self, **kw):
        self.q.put(pb.AgentMessage(**kw))

    def handshake(self, slots: int = 1) -> pb.Welcome:
        self.send(hello=pb.Hello(public_key=self.key.public_key_hex, name="raw"))
        ch = next(self.call).challenge
        doc = challenge_document(ch.nonce, self.key.public_key_hex, ch.broker_public_key)
        self.send(challenge_response=pb.ChallengeResponse(signature=self.key.sign("challenge",
                                                                                  doc)))
        self.send(capabilities=pb.Capabilities(
            plugins=[pb.PluginCapability(name="echo", version="1.0.0")], slots=slots,
            sandboxed=True))
        return next(self.call).welcome

    def close(self):
        self.q.put(None)
        self.channel.close()


def _held_request(broker, raw: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", broker.server.http_port), timeout=60)
    s.sendall(raw)
    return s


def _answer(s: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of a ``Connection: close`` answer."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_held_long_polls_and_a_full_pool_leave_livez_answering(broker):
    """300 long polls (far more than the pool's 16 threads) wait without a thread each;
    with every pool thread also taken by a slow upload, /livez still answers; the next
    waiter is refused with 503 replica_full and Retry-After, a Prefer: wait submit is
    answered at once; and ending the job answers all 300."""
    client = broker.key("client")
    agent = SyncAgent(broker)
    agent.handshake()
    job = httpx.post(f"{broker.url}/v1/jobs", json={"plugin": "echo", "inputs": {}},
                     headers={"Authorization": f"Bearer {client}"}, timeout=30).json()
    assert next(agent.call).WhichOneof("body") == "assignment"  # held by the silent agent

    poll = (f"GET /v1/jobs/{job['id']}?wait=60 HTTP/1.1\r\nHost: broker\r\nAuthorization: "
            f"Bearer {client}\r\nConnection: close\r\n\r\n").encode()
    polls = [_held_request(broker, poll) for _ in range(MAX_WAITING)]
    until(lambda: metric(broker, "sparecycles_http_waiting_clients") == MAX_WAITING,
          "300 long polls to be held")
    # Slow uploads: each pool thread blocks reading a body that never finishes arriving.
    big = 2 << 20
    uploads = [_held_request(broker, (
        f"POST /v1/jobs HTTP/1.1\r\nHost: broker\r\nAuthorization: Bearer {client}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {big}\r\n\r\n").encode()
        + b" " * (big // 2 + 4096)) for _ in range(HTTP_THREADS)]
    until(lambda: metric(broker, "sparecycles_http_pool_load") >= HTTP_THREADS,
          "the pool to be full")

    with httpx.Client(base_url=broker.url, timeout=10) as http:
        answers = [http.get("/livez") for _ in range(20)]
        assert [a.status_code for a in answers] == [200] * 20
        assert answers[0].json() == {"status": "ok"}
        assert http.get("/readyz").json()["providers_online"] == 1

        full = http.get(f"/v1/jobs/{job['id']}?wait=5",
                        headers={"Authorization": f"Bearer {client}"})
        assert full.status_code == 503 and full.headers["Retry-After"] == "1"
        assert full.headers["Content-Type"] == "application/problem+json"
        assert full.json()["code"] == "replica_full"
        assert "max_waiting_clients" in full.json()["detail"]

    for s in uploads:
        s.close()
    until(lambda: metric(broker, "sparecycles_http_pool_load") == 0, "the uploads to end")
    with httpx.Client(base_url=broker.url, timeout=10,
                      headers={"Authorization": f"Bearer {client}"}) as http:
        quick = http.post("/v1/jobs", json={"plugin": "echo", "inputs": {}},
                          headers={"Prefer": "wait=30"})
        assert quick.status_code == 202 and quick.json()["state"] == "queued"
        assert "Preference-Applied" not in quick.headers  # the wait was not applied
        http.delete(f"/v1/jobs/{quick.json()['id']}")
        assert http.delete(f"/v1/jobs/{job['id']}").json()["state"] == "cancelled"
    answered = [_answer(s) for s in polls]
    assert {(status, body["id"], body["state"]) for status, body in answered} == {
        (200, job["id"], "cancelled")}
    assert metric(broker, "sparecycles_http_waiting_clients") == 0
    agent.close()
    no_streams(broker)


def test_an_agent_that_stops_reading_is_cut_off(broker):
    """Replies pile up for an agent that sends but never reads: past the outbox bound
    the broker drops them and ends the stream with RESOURCE_EXHAUSTED; its outbox never
    held more than the bound."""
    no_streams(broker)
    # No bandwidth probing: the flow-control window stays small, so the broker's writes
    # stall as soon as the agent stops reading.
    agent = SyncAgent(broker, options=[("grpc.http2.bdp_probe", 0)])
    welcome = agent.handshake()
    assert online(broker) == 1
    ask = pb.PostAsks(asks=[pb.StandingAsk(plugin="not-served", price_micro_per_unit=1)] * 50)
    for _ in range(400):  # 20,000 refusals to answer (an AskStatus each), ~2 MB
        agent.send(post_asks=ask)
    until(lambda: online(broker) == 0, "the agent to be cut off")
    assert metric(broker, "sparecycles_agent_streams_cut_off_total") >= 1
    stats = broker.server.gateway_stats
    assert stats.outbox_peak <= OUTBOX_MAX
    provider, why = stats.cut_offs[-1]
    assert provider == welcome.provider_id and "stopped reading" in why
    assert broker.services.dispatcher.session(welcome.provider_id) is None
    with pytest.raises(grpc.RpcError) as ended:
        for _ in agent.call:  # what was written before the cut-off, then the end
            pass
    assert ended.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.CANCELLED)
    agent.close()
    no_streams(broker)


class Refused(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


async def _agent(target: str, api_key: str, done: asyncio.Event):
    """One agent stream on grpc.aio through the handshake; it then holds the stream
    until ``done``. Yields the welcome; raises Refused with the stream's status when the
    broker ends it."""
    key = KeyPair.generate()
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.AgentGatewayStub(channel).Connect(
            metadata=[("authorization", f"Bearer {api_key}")])
        try:
            await call.write(pb.AgentMessage(hello=pb.Hello(public_key=key.public_key_hex,
                                                            name="many")))
            ch = (await asyncio.wait_for(call.read(), 30)).challenge
            doc = challenge_document(ch.nonce, key.public_key_hex, ch.broker_public_key)
            await call.write(pb.AgentMessage(challenge_response=pb.ChallengeResponse(
                signature=key.sign("challenge", doc))))
            await call.write(pb.AgentMessage(capabilities=pb.Capabilities(
                plugins=[pb.PluginCapability(name="echo", version="0.0.0-test")], slots=1,
                sandboxed=True)))
            welcome = (await asyncio.wait_for(call.read(), 30)).welcome
        except grpc.aio.AioRpcError:  # the status the broker ended the stream with
            raise Refused(await call.code(), await call.details()) from None
        yield welcome
        await done.wait()
        await call.done_writing()


def _refused(broker) -> grpc.RpcError:
    agent = SyncAgent(broker)
    try:
        agent.handshake()
    except grpc.RpcError as exc:
        return exc
    finally:
        agent.close()
    raise AssertionError("the agent past max_agent_streams was let in")


def test_more_agents_than_any_thread_pool_connect_and_the_limit_refuses_the_next(broker):
    """300 agent streams (the old gRPC pool had 256 threads) complete the handshake and
    stay connected; the 301st is refused with RESOURCE_EXHAUSTED saying why."""
    no_streams(broker)
    key = broker.key("provider")

    async def main():
        done = asyncio.Event()
        gens = [_agent(broker.grpc, key, done) for _ in range(MAX_STREAMS)]
        limit = asyncio.Semaphore(50)

        async def first(gen):
            async with limit:
                return await gen.__anext__()
        welcomes = await asyncio.gather(*(first(g) for g in gens))
        holding = [asyncio.ensure_future(g.__anext__()) for g in gens]
        connected = await asyncio.to_thread(online, broker)
        refused = await asyncio.to_thread(_refused, broker)  # as a real agent (sync) sees it
        done.set()
        for task in holding:
            with pytest.raises(StopAsyncIteration):
                await task
        return welcomes, connected, refused

    welcomes, connected, refused = asyncio.run(main())
    assert len({w.provider_id for w in welcomes}) == MAX_STREAMS and all(
        w.provider_id for w in welcomes)
    assert connected == MAX_STREAMS
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"limit of {MAX_STREAMS} agent streams" in refused.details()
    no_streams(broker)
