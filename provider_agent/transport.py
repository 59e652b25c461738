"""The agent's channel to the broker: TLS with the broker's certificate verified, plaintext
only to loopback or with ``insecure`` (docs/architecture.md, *Security: TLS*).

Trust comes from ``ca_file`` in agent.toml, else ``$SPARECYCLES_CA_BUNDLE``, else the
system's trust store. To a loopback broker the agent first asks whether it speaks TLS at
all (one handshake, certificate unchecked) and, if not, connects in plaintext: nothing on
loopback leaves the machine. Anywhere else plaintext needs ``insecure``, and each
connection says so in the log as a warning.
"""
from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from sdk.tls import (TLSConfigError, ca_bundle, diagnose, is_loopback, speaks_tls,
                     split_host_port)
from .errors import ConfigError

log = logging.getLogger("agent")


@dataclass(frozen=True)
class Transport:
    tls: bool
    ca_file: str | None  # None: the system's trust store
    host: str
    port: int

    def describe(self) -> str:
        if not self.tls:
            return "PLAINTEXT"
        return f"TLS, trusting {self.ca_file or 'the system trust store'}"


def _system_roots() -> bytes | None:
    """The system's CA bundle (grpc otherwise trusts the roots it ships)."""
    paths = ssl.get_default_verify_paths()
    for path in (paths.cafile, paths.openssl_cafile):
        if path and Path(path).is_file():
            return Path(path).read_bytes()
    return None


def choose(broker: str, ca_file: str = "", insecure: bool = False) -> Transport:
    try:
        host, port = split_host_port(broker)
        ca = ca_bundle(ca_file or None)
    except TLSConfigError as exc:
        raise ConfigError(str(exc)) from None
    if insecure:
        where = "loopback" if is_loopback(host) else "the NETWORK"
        log.warning("insecure is set: connecting to %s in PLAINTEXT over %s; the API key, "
                    "prompts and outputs cross it in clear", broker, where)
        return Transport(False, None, host, port)
    if is_loopback(host):
        try:
            if not speaks_tls(host, port):
                log.info("the broker on loopback (%s) serves plaintext: connecting without "
                         "TLS (it never leaves this machine)", broker)
                return Transport(False, None, host, port)
        except OSError:
            pass  # nothing there yet: try TLS, the reconnect loop asks again
    return Transport(True, ca, host, port)


def open_channel(broker: str, transport: Transport, options) -> grpc.Channel:
    if not transport.tls:
        return grpc.insecure_channel(broker, options=options)
    roots = Path(transport.ca_file).read_bytes() if transport.ca_file else _system_roots()
    return grpc.secure_channel(broker, grpc.ssl_channel_credentials(root_certificates=roots),
                               options=options)


def explain(transport: Transport, exc: grpc.RpcError) -> str:
    """What an UNAVAILABLE from the broker means for this transport: a refused
    certificate (which check), TLS against plaintext or the other way round; "" when the
    handshake was not the problem."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    try:
        tls_there = speaks_tls(transport.host, transport.port)
    except OSError:
        return ""
    if not transport.tls:
        if tls_there:
            return (f"the broker at {transport.host}:{transport.port} serves TLS and this "
                    "agent connected in plaintext (insecure): remove `insecure` from "
                    "agent.toml (and --insecure) and trust the broker's CA with ca_file")
        return ""
    if not tls_there:
        return (f"the broker at {transport.host}:{transport.port} does not speak TLS: give "
                "it a certificate (`sparecycles broker dev-cert`), or, if it is meant to be "
                "plaintext, set insecure = true in agent.toml (logged as a warning)")
    return diagnose(transport.host, transport.port, transport.ca_file)
