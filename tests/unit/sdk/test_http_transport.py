"""The SDK's urllib3 transport against a scripted local HTTP server: the Response wrapper,
error mapping, retries, the Prefer: wait submit and server-sent events over a real stream."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from sdk import (APIConnectionError, Client, ConfigurationError, InvalidInputError,
                 NotFoundError, ServerError)
from sdk._http import Response, iter_lines, with_query
from sdk.client import _parse_sse


class Script(BaseHTTPRequestHandler):
    """Answers from ``server.routes[(method, path)]``: a callable(handler) -> (status,
    headers, body) or None when it wrote the answer itself."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _handle(self):
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(length) if length else b""
        self.query = parse_qs(url.query)
        self.server.seen.append((self.command, url.path, self.query, dict(self.headers),
                                 self.body))
        route = self.server.routes[(self.command, url.path)]
        answer = route(self)
        if answer is None:
            return
        status, headers, body = answer
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **headers}
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _handle

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client closing a stream early is expected here; anything else (a route the
        # test did not script, a script that ran out) fails the test at teardown.
        exc = sys.exc_info()[1]
        if not isinstance(exc, ConnectionError):
            self.errors.append(exc)


@pytest.fixture
def server():
    srv = Server(("127.0.0.1", 0), Script)
    srv.routes, srv.seen, srv.errors = {}, [], []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()
    assert not srv.errors, f"the scripted server failed: {srv.errors!r}"


@pytest.fixture
def client(server, monkeypatch):
    monkeypatch.setattr(Client, "_backoff", staticmethod(lambda attempt: None))
    with Client(server.url, "sc_test_key", timeout=5) as c:
        yield c


# ---- the Response wrapper ----------------------------------------------------------------
def test_response_headers_are_case_insensitive_and_body_decodes():
    r = Response(200, {"Content-Type": "text/plain; charset=latin-1", "X-Request-Id": "r1"},
                 "café".encode("latin-1"))
    assert r.headers.get("x-request-id") == r.headers["X-REQUEST-ID"] == "r1"
    assert r.headers.get("missing") is None
    assert r.text == "café" and r.status_code == 200
    with pytest.raises(ValueError):
        r.json()
    assert Response(201, {}, b'{"a": [1]}').json() == {"a": [1]}


def test_params_are_url_encoded():
    assert with_query("/v1/x", None) == "/v1/x"
    assert with_query("/v1/x", {"q": "a b&c", "n": 3, "ok": True}) == "/v1/x?q=a+b%26c&n=3&ok=true"
    assert with_query("/v1/x?a=1", {"b": "2"}) == "/v1/x?a=1&b=2"


def test_request_sends_json_params_and_headers(server, client):
    server.routes[("POST", "/v1/things")] = lambda h: (201, {"X-Thing": "yes"},
                                                       {"echo": json.loads(h.body)})
    resp = client.request("POST", "/v1/things", json_body={"name": "é"}, params={"limit": 5},
                          idempotency_key="key-1")
    assert resp.status_code == 201 and resp.json() == {"echo": {"name": "é"}}
    assert resp.headers.get("x-thing") == "yes"
    method, path, query, headers, _ = server.seen[-1]
    assert query == {"limit": ["5"]}
    assert headers["Authorization"] == "Bearer sc_test_key"
    assert headers["User-Agent"] == "sparecycles-python/0.1"
    assert headers["Content-Type"] == "application/json"
    assert headers["Accept"] == "application/json"
    assert headers["Idempotency-Key"] == "key-1"


def test_content_uploads_bytes(server, client):
    server.routes[("PUT", "/v1/blobs/abc")] = lambda h: (200, {}, {"size": len(h.body)})
    data = bytes(range(256)) * 4000
    assert client.request("PUT", "/v1/blobs/abc", content=data).json() == {"size": len(data)}
    assert server.seen[-1][3]["Content-Type"] == "application/octet-stream"
    assert server.seen[-1][4] == data


# ---- errors and retries ------------------------------------------------------------------
def test_problem_answers_map_to_sdk_errors(server, client):
    server.routes[("GET", "/v1/jobs/nope")] = lambda h: (
        404, {"X-Request-Id": "req-9"}, {"code": "not_found", "detail": "no such job"})
    server.routes[("POST", "/v1/jobs")] = lambda h: (
        422, {}, {"code": "invalid_input", "detail": "steps too big", "field": "inputs.steps"})
    server.routes[("GET", "/v1/broken")] = lambda h: (500, {}, b"<html>oops</html>")
    with pytest.raises(NotFoundError) as e:
        client.request("GET", "/v1/jobs/nope")
    assert e.value.request_id == "req-9" and e.value.detail == "no such job"
    with pytest.raises(InvalidInputError) as e:
        client.request("POST", "/v1/jobs", json_body={})
    assert e.value.field == "inputs.steps"
    with pytest.raises(ServerError) as e:
        client.request("GET", "/v1/broken")
    assert "oops" in e.value.detail


def test_retries_busy_answers_with_the_same_idempotency_key(server, client):
    answers = iter([(503, {}, {"code": "busy"}), (429, {}, {"code": "slow_down"}),
                    (202, {}, {"id": "j1"})])
    server.routes[("POST", "/v1/jobs")] = lambda h: next(answers)
    assert client.request("POST", "/v1/jobs", json_body={}, idempotency_key="k").json() == \
        {"id": "j1"}
    assert [s[3]["Idempotency-Key"] for s in server.seen] == ["k", "k", "k"]


def test_gives_up_after_max_retries(server, client):
    server.routes[("GET", "/v1/x")] = lambda h: (502, {}, {"code": "bad_gateway"})
    with pytest.raises(ServerError):
        client.request("GET", "/v1/x")
    assert len(server.seen) == client.max_retries + 1


def test_unreachable_broker_says_so(monkeypatch):
    monkeypatch.setattr(Client, "_backoff", staticmethod(lambda attempt: None))
    with Client("http://127.0.0.1:9", "sc_k", max_retries=1) as c:
        with pytest.raises(APIConnectionError, match="cannot reach the broker at "
                                                     r"http://127.0.0.1:9: .*broker serve"):
            c.request("GET", "/v1/account")


@pytest.mark.parametrize("url", ["localhost:8080", "ftp://broker", "http://[bad"])
def test_a_bad_broker_url_is_a_configuration_error(url):
    with pytest.raises(ConfigurationError, match="bad broker URL"):
        Client(url, "sc_k")


def test_base_url_path_prefix_is_kept(server):
    server.routes[("GET", "/api/v1/account")] = lambda h: (200, {}, {"id": "a"})
    with Client(server.url + "/api/", "sc_k") as c:
        assert c.account() == {"id": "a"}


# ---- submit and wait ---------------------------------------------------------------------
def _schema_route(server):
    server.routes[("GET", "/v1/plugins/echo")] = lambda h: (
        200, {}, {"input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}})


def test_generate_submits_with_prefer_wait_and_needs_no_second_request(server, client):
    _schema_route(server)
    server.routes[("POST", "/v1/jobs")] = lambda h: (
        200, {"Preference-Applied": "wait=30"},
        {"id": "j1", "state": "settled", "outputs": []})
    result = client.generate("echo", text="hi")
    assert result.job.state == "settled"
    posts = [s for s in server.seen if s[0] == "POST"]
    assert len(posts) == 1 and posts[0][3]["Prefer"] == "wait=30"
    assert json.loads(posts[0][4]) == {"plugin": "echo", "inputs": {"text": "hi"}}
    assert not [s for s in server.seen if s[1] == "/v1/jobs/j1"]
    client.generate("echo", text="again", timeout=4.5)
    assert server.seen[-1][3]["Prefer"] == "wait=4"
    assert [s[1] for s in server.seen].count("/v1/plugins/echo") == 1  # schema cached


def test_generate_falls_back_to_polling_when_the_wait_is_ignored(server, client):
    _schema_route(server)
    server.routes[("POST", "/v1/jobs")] = lambda h: (202, {}, {"id": "j2", "state": "queued"})
    server.routes[("GET", "/v1/jobs/j2")] = lambda h: (
        200, {}, {"id": "j2", "state": "settled", "outputs": []})
    assert client.generate("echo", text="hi", timeout=10).job.state == "settled"
    assert server.seen[-1][2]["wait"]  # Job.wait long-polls


def test_create_without_wait_sends_no_preference(server, client):
    server.routes[("POST", "/v1/jobs")] = lambda h: (202, {}, {"id": "j3", "state": "queued"})
    job = client.jobs.create("echo", validate=False, text="x")
    assert job.state == "queued" and "Prefer" not in server.seen[-1][3]
    client.jobs.create("echo", validate=False, wait=500, text="x")
    assert server.seen[-1][3]["Prefer"] == "wait=60"


# ---- server-sent events ------------------------------------------------------------------
def _sse(ev_id: int, kind: str, data: dict) -> bytes:
    return f"id: {ev_id}\nevent: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def test_parse_sse_lines():
    lines = ["id: 1", "event: token", 'data: {"text":', 'data: "a"}', "", ": keep-alive", "",
             "id: 2", "event: done", "data: {}", ""]
    evs = list(_parse_sse(lines))
    assert [(e.id, e.kind, e.data) for e in evs] == [(1, "token", {"text": "a"}), (2, "done", {})]


def test_iter_lines_joins_chunks_and_strips_crlf():
    class Fake:
        chunked = True

        def supports_chunked_reads(self):
            return True

        def read_chunked(self, decode_content=True):
            yield from (b"id: 1\r\nda", b"ta: {}", b"\r\n\r\n", b"tail")

    assert list(iter_lines(Fake())) == ["id: 1", "data: {}", "", "tail"]


def test_events_stream_and_reconnect_where_they_left_off(server, client):
    def events(h):
        after = int(h.query["after"][0])
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        if after == 0:  # two events, then the connection drops mid-stream
            h.chunk(_sse(1, "queued", {"a": 1}) + _sse(2, "token", {"text": "he"}))
            h.wfile.write(b"40\r\nid: 3\nev")
            h.wfile.flush()
            h.close_connection = True
            return None
        h.chunk(b": keep-alive\n\n")
        h.chunk(_sse(3, "token", {"text": "llo"}))
        h.chunk(_sse(4, "done", {}))
        h.chunk(b"")
        return None

    server.routes[("GET", "/v1/jobs/j1/events")] = events
    from sdk.client import Job

    job = Job(client, {"id": "j1", "state": "running"})
    got = [(e.id, e.kind, e.data) for e in job.events()]
    assert got == [(1, "queued", {"a": 1}), (2, "token", {"text": "he"}),
                   (3, "token", {"text": "llo"}), (4, "done", {})]
    streams = [s for s in server.seen if s[1] == "/v1/jobs/j1/events"]
    assert [s[2]["after"] for s in streams] == [["0"], ["2"]]
    assert streams[0][3]["Accept"] == "text/event-stream"
    # the pool still serves ordinary requests afterwards
    server.routes[("GET", "/v1/account")] = lambda h: (200, {}, {"id": "me"})
    assert client.account() == {"id": "me"}


def test_events_of_an_unknown_job_raise(server, client):
    server.routes[("GET", "/v1/jobs/zz/events")] = lambda h: (
        404, {}, {"code": "not_found", "detail": "no such job"})
    from sdk.client import Job

    with pytest.raises(NotFoundError):
        list(Job(client, {"id": "zz", "state": "queued"}).events())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_error_event_raises_the_brokers_problem(server, kind):
    """The broker failed after the stream had begun: its ``error`` event (an RFC 7807 body,
    as broker/api/jobs.py writes it) raises that error in both clients, after the events
    before it; it is never handed on as one more event."""
    problem = {"type": "https://sparecycles.dev/errors/internal", "title": "Internal error",
               "status": 500, "code": "internal", "request_id": "req-43",
               "detail": "an internal error (request req-43)"}

    def events(h):
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        h.chunk(b": events of job j1\n\n" + _sse(1, "queued", {}))
        h.chunk(f"event: error\ndata: {json.dumps(problem)}\n\n".encode())
        h.chunk(b"")
        return None

    server.routes[("GET", "/v1/jobs/j1/events")] = events
    from sdk import AsyncClient
    from sdk.client import Job

    got = []
    with pytest.raises(ServerError) as caught:
        if kind == "sync":
            with Client(server.url, "sc_k", timeout=5) as c:
                for e in Job(c, {"id": "j1", "state": "running"}).events():
                    got.append(e.kind)
        else:
            async def follow():
                async with AsyncClient(server.url, "sc_k", timeout=5) as c:
                    async for e in Job(c, {"id": "j1", "state": "running"}).events():
                        got.append(e.kind)
            asyncio.run(follow())
    assert got == ["queued"]
    err = caught.value
    assert err.code == "internal" and err.request_id == "req-43" and err.status == 500
    assert "event stream of job j1" in str(err) and "req-43" in str(err)
    assert len(server.seen) == 1  # not reopened: the broker said what went wrong


def test_events_back_off_then_give_up_on_a_broker_that_drops_every_stream(server, monkeypatch):
    waits = []
    monkeypatch.setattr(Client, "_backoff", staticmethod(waits.append))

    def drop(h):  # accepts the request, then hangs up without an answer
        h.close_connection = True
        return None

    server.routes[("GET", "/v1/jobs/j1/events")] = drop
    from sdk.client import Job

    with Client(server.url, "sc_k", timeout=5, max_retries=2) as c:
        with pytest.raises(APIConnectionError, match="lost the event stream of job j1"):
            list(Job(c, {"id": "j1", "state": "running"}).events())
    assert len(server.seen) == 3 and waits == [0, 1]


def test_events_reset_the_failure_count_on_each_event(server, monkeypatch):
    waits = []
    monkeypatch.setattr(Client, "_backoff", staticmethod(waits.append))
    script = iter(["drop", "drop", "one", "drop", "done"])

    def events(h):
        step = next(script)
        h.close_connection = True
        if step == "drop":
            return None
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        if step == "one":  # an event, then the connection breaks mid-stream
            h.chunk(_sse(1, "token", {"text": "a"}))
            h.wfile.write(b"40\r\nid: 2\nev")
            h.wfile.flush()
            return None
        h.chunk(_sse(2, "done", {}))
        h.chunk(b"")
        return None

    server.routes[("GET", "/v1/jobs/j1/events")] = events
    from sdk.client import Job

    with Client(server.url, "sc_k", timeout=5, max_retries=2) as c:
        got = [(e.id, e.kind) for e in Job(c, {"id": "j1", "state": "running"}).events()]
    assert got == [(1, "token"), (2, "done")]
    assert [s[2]["after"] for s in server.seen] == [["0"], ["0"], ["0"], ["1"], ["1"]]
    assert waits == [0, 1, 0]  # no wait after the stream that delivered an event


# ---- the API key stays with the broker -------------------------------------------------
def test_absolute_urls_only_reach_the_brokers_own_origin(server, client):
    server.routes[("GET", "/v1/jobs/j1/outputs/0")] = lambda h: (200, {}, b"png")
    assert client.request("GET", "/v1/jobs/j1/outputs/0").content == b"png"
    assert client.request("GET", server.url + "/v1/jobs/j1/outputs/0").content == b"png"
    seen = len(server.seen)
    for url in ("http://example.com/v1/jobs/j1/outputs/0",
                server.url.replace("127.0.0.1", "localhost") + "/x",
                "https://127.0.0.1:%d/x" % server.server_address[1]):
        with pytest.raises(ValueError, match="refusing to send the API key"):
            client.request("GET", url)
    assert len(server.seen) == seen


# ---- uploads -----------------------------------------------------------------------------
def test_a_file_upload_is_streamed_with_its_length_and_rewound_for_a_retry(server, client,
                                                                          tmp_path):
    answers = iter([503, 201])
    server.routes[("PUT", "/v1/blobs/abc")] = lambda h: (next(answers), {},
                                                         {"size": len(h.body)})
    data = bytes(range(256)) * 1000
    (tmp_path / "f.bin").write_bytes(b"skip" + data)
    with open(tmp_path / "f.bin", "rb") as fh:
        fh.seek(4)  # sent from where the file stands
        assert client.request("PUT", "/v1/blobs/abc", content=fh).json() == {"size": len(data)}
    assert [s[4] for s in server.seen] == [data, data]
    assert all(s[3]["Content-Length"] == str(len(data)) and "Transfer-Encoding" not in s[3]
               for s in server.seen)


def test_publish_streams_each_file_from_disk(server, client, tmp_path, monkeypatch):
    from sdk.protocol.package import build_document
    from sdk.protocol.signing import KeyPair
    from tests.marketplace_helpers import adapter_folder

    keys = KeyPair.generate()
    folder = adapter_folder(tmp_path)
    files = build_document(folder, keys.public_key_hex)["files"]
    for f in files:
        server.routes[("PUT", f"/v1/blobs/{f['sha256']}")] = lambda h: (201, {}, {})
    server.routes[("POST", "/v1/adapters")] = lambda h: (201, {}, {"created": True})
    real = Path.read_bytes

    def read_bytes(self):  # the upload must not load a weights file whole
        assert self.suffix != ".safetensors", f"{self} read whole"
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert client.publish(folder, keys) == {"created": True}
    puts = {s[1]: s for s in server.seen if s[0] == "PUT"}
    assert len(puts) == len(files)
    for f in files:
        _, _, _, headers, body = puts[f"/v1/blobs/{f['sha256']}"]
        with open(folder / f["path"], "rb") as fh:
            assert body == fh.read() and headers["Content-Length"] == str(f["size"])


# ---- verification ------------------------------------------------------------------------
def test_wait_verified_backs_off_to_five_seconds(server, client, monkeypatch):
    polls = iter(["checking"] * 8 + ["verified"])
    server.routes[("GET", "/v1/jobs/j1")] = lambda h: (200, {}, {
        "id": "j1", "state": "settled", "outputs": [],
        "verification": {"status": next(polls)}})
    sleeps = []
    monkeypatch.setattr("sdk.client.time.sleep", sleeps.append)
    from sdk.client import Job, Result

    result = Result(client, Job(client, {"id": "j1", "state": "settled", "outputs": []}))
    assert result.wait_verified(timeout=600) == "verified"
    assert sleeps == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
