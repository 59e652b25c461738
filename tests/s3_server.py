"""A real S3 API in its own process for the tests and bench/blobs.py: moto's server mode
(``moto[server]``), with the two checks real S3 makes that moto 5.2 leaves out put in front of
it, so that tests of them mean something:

- a presigned URL past ``X-Amz-Date + X-Amz-Expires`` is refused (403 AccessDenied,
  "Request has expired"), and one whose signed headers (``X-Amz-SignedHeaders``) are not all
  sent is refused (403 SignatureDoesNotMatch);
- a PUT whose ``x-amz-checksum-sha256`` is not the SHA-256 of its body is refused
  (400 BadDigest) and stores nothing.

(Signatures themselves are not checked: moto does not, and neither does this front.)

Run: ``python tests/s3_server.py [--host 127.0.0.1] [--port 0]``; it prints
``listening on http://HOST:PORT`` once it accepts connections.
"""
from __future__ import annotations

import argparse
import base64
import calendar
import hashlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs


def _error(start_response, status: str, code: str, message: str):
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()
    start_response(status, [("Content-Type", "application/xml"),
                            ("Content-Length", str(len(body)))])
    return [body]


class StrictFront:
    """WSGI middleware: refuse what S3 would refuse and moto lets through (see above)."""

    def __init__(self, app, clock=time.time):
        self.app = app
        self.clock = clock

    def __call__(self, environ, start_response):
        query = parse_qs(environ.get("QUERY_STRING", ""))
        if "X-Amz-Expires" in query and "X-Amz-Date" in query:
            signed_at = calendar.timegm(time.strptime(query["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ"))
            if self.clock() > signed_at + int(query["X-Amz-Expires"][0]):
                return _error(start_response, "403 Forbidden", "AccessDenied",
                              "Request has expired")
            for name in query.get("X-Amz-SignedHeaders", [""])[0].split(";"):
                key = "HTTP_" + name.upper().replace("-", "_")
                if name and name != "host" and key not in environ and not (
                        name == "content-length" and environ.get("CONTENT_LENGTH")):
                    return _error(start_response, "403 Forbidden", "SignatureDoesNotMatch",
                                  f"the signed header {name} was not sent")
        want = environ.get("HTTP_X_AMZ_CHECKSUM_SHA256")
        if (environ.get("REQUEST_METHOD") == "PUT" and want
                and "aws-chunked" not in environ.get("HTTP_CONTENT_ENCODING", "")):
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length) if length else b""
            if base64.b64encode(hashlib.sha256(body).digest()).decode() != want:
                return _error(start_response, "400 Bad Request", "BadDigest",
                              "The SHA256 you specified did not match the calculated checksum.")
            environ["wsgi.input"] = io.BytesIO(body)
        return self.app(environ, start_response)


def serve(host: str, port: int) -> None:
    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)
    from werkzeug.serving import make_server

    app = StrictFront(DomainDispatcherApplication(create_backend_app))
    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"listening on http://{host}:{server.server_port}", flush=True)
    server.serve_forever()


class S3Server:
    """The server above as a child process on a free loopback port (``with`` or stop())."""

    def __init__(self, host: str = "127.0.0.1", log_path: Path | None = None):
        env = {**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"}
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                      "--host", host, "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=self._log, env=env)
        line = self.proc.stdout.readline().decode().strip()
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"the S3 test server did not start (said {line!r})")
        self.endpoint = line.removeprefix("listening on ")
        host_, port = self.endpoint.split("//", 1)[1].rsplit(":", 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host_, int(port)), 1).close()
                break
            except OSError:
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    serve(args.host, args.port)
