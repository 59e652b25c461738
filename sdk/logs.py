"""Logging shared by the broker, the agent and the plugin host (issue #25): text or JSON
lines (``--log-format json``), each carrying the request and job it is about.

:func:`bind` puts fields (``request_id``, ``job_id``) in the current context (a
``contextvars`` variable: per thread, and per asyncio task), and every record logged in
that context carries them: as ``"request_id": …`` keys in JSON, as ``[job … request …]``
after the logger's name in text. A thread starts with an empty context.

Request ids as providers see them: :func:`request_digest` gives the form a job's envelope
carries (``rq_`` and 24 hex digits of the id's SHA-256), never the client's own text: a
provider learns nothing a client put in its id, and a verification check (which carries
its primary's) or a canary (a random one, :func:`new_request_digest`) looks the same as
any job.
"""
from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import secrets
import sys
import time
from contextlib import contextmanager

_FIELDS: contextvars.ContextVar[dict] = contextvars.ContextVar("sparecycles_log_fields",
                                                              default={})
FORMATS = ("text", "json")
_current_format = "text"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(trace)s: %(message)s"


def bind(**fields) -> contextvars.Token:
    """Add ``fields`` (None values are left out) to the current context's; returns the
    token :func:`unbind` takes."""
    merged = {**_FIELDS.get(), **{k: v for k, v in fields.items() if v}}
    return _FIELDS.set(merged)


def unbind(token: contextvars.Token) -> None:
    _FIELDS.reset(token)


@contextmanager
def bound(**fields):
    token = bind(**fields)
    try:
        yield
    finally:
        unbind(token)


def fields() -> dict:
    """The current context's fields."""
    return dict(_FIELDS.get())


def request_digest(request_id: str) -> str:
    """The form of a request id that job envelopes and agents' logs carry."""
    return "rq_" + hashlib.sha256(request_id.encode("utf-8")).hexdigest()[:24]


def new_request_digest() -> str:
    """A digest of the same shape for work no request made (canaries)."""
    return "rq_" + secrets.token_hex(12)


class ContextFilter(logging.Filter):
    """Puts the context's fields on each record (``record.trace`` for the text format)."""

    def filter(self, record: logging.LogRecord) -> bool:
        got = _FIELDS.get()
        record.context = got
        if got:
            record.trace = " [" + " ".join(f"{_SHORT.get(k, k)} {v}" for k, v in got.items()) + "]"
        else:
            record.trace = ""
        return True


_SHORT = {"request_id": "request", "job_id": "job"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, the
    context's fields, and the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        out.update(getattr(record, "context", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(log_format: str = "text", level: int = logging.INFO, stream=None) -> None:
    """Set up the root logger for a process: ``log_format`` "text" or "json"."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    global _current_format
    _current_format = log_format


def current_format() -> str:
    """The format :func:`configure` set last ("text" before any): what an agent passes
    on to its plugin hosts."""
    return _current_format
