"""A local HTTP stub of the few Stripe endpoints the broker uses, for the real ``stripe``
library pointed at it through ``SPARECYCLES_STRIPE_API_BASE``; plus :func:`signed_event`,
which signs a webhook exactly as Stripe does (``t=<ts>,v1=HMAC-SHA256(secret, "<ts>.<body>")``).

Endpoints: POST /v1/checkout/sessions, GET /v1/checkout/sessions/<id>, POST /v1/accounts,
POST /v1/account_links, POST /v1/transfers. Honours ``Idempotency-Key`` like Stripe (same key,
same response). ``fail_transfers`` makes transfers fail as Stripe does when its balance is short.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl

WEBHOOK_SECRET = "whsec_test_secret"
SECRET_KEY = "sk_test_stub"


def _nest(pairs: list[tuple[str, str]]) -> dict:
    """Stripe's form encoding (``a[b][0][c]=v``) back into nested dicts (lists as dicts)."""
    out: dict = {}
    for key, value in pairs:
        parts = key.replace("]", "").split("[")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


class StripeStub:
    def __init__(self):
        self.sessions: dict[str, dict] = {}
        self.accounts: dict[str, dict] = {}
        self.transfers: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.fail_transfers = False
        self._idem: dict[str, tuple[int, dict]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Request-Id", f"req_{next(stub._ids)}")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stub.requests.append(("GET", self.path))
                if self.headers.get("Authorization") != f"Bearer {SECRET_KEY}":
                    return self._reply(401, {"error": {"type": "invalid_request_error",
                                                       "message": "Invalid API Key provided"}})
                if self.path.startswith("/v1/checkout/sessions/"):
                    s = stub.sessions.get(self.path.rsplit("/", 1)[1].split("?")[0])
                    if s is None:
                        return self._reply(404, {"error": {"type": "invalid_request_error",
                                                           "message": "No such checkout.session"}})
                    return self._reply(200, s)
                self._reply(404, {"error": {"type": "invalid_request_error", "message": "unknown"}})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                form = _nest(parse_qsl(self.rfile.read(length).decode(), keep_blank_values=True))
                stub.requests.append(("POST", self.path))
                if self.headers.get("Authorization") != f"Bearer {SECRET_KEY}":
                    return self._reply(401, {"error": {"type": "invalid_request_error",
                                                       "message": "Invalid API Key provided"}})
                key = self.headers.get("Idempotency-Key")
                with stub._lock:
                    if key and key in stub._idem:
                        return self._reply(*stub._idem[key])
                    status, body = stub._handle(self.path, form)
                    if key:
                        stub._idem[key] = (status, body)
                self._reply(status, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _handle(self, path: str, form: dict) -> tuple[int, dict]:
        n = next(self._ids)
        if path == "/v1/checkout/sessions":
            item = form["line_items"]["0"]
            sid = f"cs_test_{n}"
            s = {"id": sid, "object": "checkout.session", "mode": form["mode"],
                 "url": f"https://checkout.stripe.test/c/pay/{sid}",
                 "payment_status": "unpaid", "status": "open",
                 "amount_total": int(item["price_data"]["unit_amount"]) * int(item["quantity"]),
                 "currency": item["price_data"]["currency"],
                 "client_reference_id": form.get("client_reference_id"),
                 "metadata": form.get("metadata", {})}
            self.sessions[sid] = s
            return 200, s
        if path == "/v1/accounts":
            acct = {"id": f"acct_test_{n}", "object": "account", "type": form.get("type"),
                    "metadata": form.get("metadata", {})}
            self.accounts[acct["id"]] = acct
            return 200, acct
        if path == "/v1/account_links":
            return 200, {"object": "account_link",
                         "url": f"https://connect.stripe.test/setup/{form['account']}"}
        if path == "/v1/transfers":
            if self.fail_transfers:
                return 400, {"error": {"type": "invalid_request_error", "code": "balance_insufficient",
                                       "message": "You have insufficient funds in your Stripe account."}}
            if form.get("destination") not in self.accounts:
                return 400, {"error": {"type": "invalid_request_error",
                                       "message": "No such destination"}}
            t = {"id": f"tr_test_{n}", "object": "transfer", "amount": int(form["amount"]),
                 "currency": form["currency"], "destination": form["destination"],
                 "metadata": form.get("metadata", {})}
            self.transfers[t["id"]] = t
            return 200, t
        return 404, {"error": {"type": "invalid_request_error", "message": f"no route {path}"}}

    # ---- what Stripe's side does --------------------------------------------------------
    def pay(self, session_id: str, status: str = "paid") -> dict:
        """The customer paid on Stripe's page (``status`` "unpaid" leaves it pending)."""
        self.sessions[session_id].update(payment_status=status, status="complete")
        return dict(self.sessions[session_id])

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def signed_event(event_type: str, obj: dict, *, secret: str = WEBHOOK_SECRET,
                 event_id: str | None = None, timestamp: int | None = None) -> tuple[bytes, str]:
    """A webhook body and its ``Stripe-Signature`` header, signed as Stripe signs them."""
    body = json.dumps({"id": event_id or f"evt_{time.time_ns()}", "object": "event",
                       "api_version": "2024-06-20", "created": int(time.time()),
                       "type": event_type, "data": {"object": obj}}).encode()
    ts = int(time.time()) if timestamp is None else timestamp
    sig = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return body, f"t={ts},v1={sig}"
