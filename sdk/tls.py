"""TLS as the SDK and the provider agent see it: which CA to trust, when plaintext is
allowed, and why a handshake failed (docs/architecture.md, *Security: TLS*).

Trust: a CA bundle given explicitly (``Client(ca_file=...)``, ``ca_file`` in agent.toml),
else ``$SPARECYCLES_CA_BUNDLE``, else the system's trust store.

Plaintext: only to a loopback address (127.0.0.0/8, ::1, ``localhost``), or with an
explicit ``insecure`` that is logged as a warning on every connection. Anything else is
TLS with the broker's certificate verified, host name included.

The stdlib's ``ssl`` names the reason a certificate is refused ("certificate has
expired", "Hostname mismatch", "unable to get local issuer certificate"); gRPC's own
messages do not always. :func:`diagnose` repeats a failed handshake with ``ssl`` so that
the agent's error says which it was.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import ssl

CA_BUNDLE_ENV = "SPARECYCLES_CA_BUNDLE"
INSECURE_ENV = "SPARECYCLES_INSECURE"
PROBE_TIMEOUT_S = 5.0


class TLSConfigError(ValueError):
    """A CA bundle that cannot be read, or plaintext where it is not allowed."""


def ca_bundle(explicit: str | os.PathLike | None = None, env=None) -> str | None:
    """The CA bundle to trust (a path), or None for the system's trust store; a path that
    is given but unreadable is an error naming it and the setting it came from."""
    env = os.environ if env is None else env
    path, source = (explicit, "ca_file") if explicit else (env.get(CA_BUNDLE_ENV), CA_BUNDLE_ENV)
    if not path:
        return None
    path = os.path.expanduser(str(path))
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise TLSConfigError(f"cannot read the CA bundle {path} ({source}): {exc.strerror}; "
                             "give a PEM file holding the broker's CA certificate (for a "
                             "dev broker: <data dir>/tls/ca.pem, made by `sparecycles broker "
                             "dev-cert`)") from None
    if b"-----BEGIN CERTIFICATE-----" not in head:
        raise TLSConfigError(f"the CA bundle {path} ({source}) holds no PEM certificate; "
                             "give the broker's CA certificate in PEM form")
    return path


def env_insecure(env=None) -> bool:
    env = os.environ if env is None else env
    return env.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this
    machine's loopback: plaintext to it never leaves the machine."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise TLSConfigError(f"address {addr!r} must look like HOST:PORT")
    return host.strip("[]"), int(port)


def client_context(ca_file: str | None) -> ssl.SSLContext:
    """A verifying client context: ``ca_file`` or the system's trust, host names checked."""
    ctx = ssl.create_default_context(cafile=ca_file)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def speaks_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at ``host:port`` completes a TLS handshake (certificate not
    checked: this only tells a TLS listener from a plaintext one). Raises OSError when
    nothing answers there."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=host):
                return True
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError, socket.timeout):
            return False
        except OSError as exc:  # EOF in the handshake: a plaintext peer hung up
            if isinstance(exc, ConnectionRefusedError):
                raise
            return False


def diagnose(host: str, port: int, ca_file: str | None,
             timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Why a verified TLS connection to ``host:port`` fails, in words that say what to do;
    "" when it succeeds (the failure was elsewhere)."""
    trust = f"the CA bundle {ca_file}" if ca_file else "the system's trust store"
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc.strerror or exc})"
    with raw:
        try:
            with client_context(ca_file).wrap_socket(raw, server_hostname=host):
                return ""
        except ssl.SSLCertVerificationError as exc:
            reason = exc.verify_message or exc.reason or str(exc)
            if exc.verify_code == 10 or "expired" in reason:
                return (f"the broker's certificate has expired ({reason}); the broker's "
                        "operator must renew it")
            if exc.verify_code == 9 or "not yet valid" in reason:
                return (f"the broker's certificate is not valid yet ({reason}); check this "
                        "machine's clock")
            if exc.verify_code == 62 or "Hostname mismatch" in reason or "IP address mismatch" in reason:
                return (f"the broker's certificate is not for {host!r} ({reason}); connect "
                        "by a name the certificate lists, or reissue it with that name")
            if exc.verify_code in (18, 19, 20, 21) or "issuer" in reason or "self" in reason:
                return (f"the broker's certificate is not signed by a CA in {trust} "
                        f"({reason}); give the broker's CA with {CA_BUNDLE_ENV} or ca_file")
            return f"the broker's certificate was refused: {reason}"
        except ssl.SSLError as exc:
            return (f"the TLS handshake with {host}:{port} failed ({exc.reason or exc}); is "
                    "the broker serving plaintext? Give it a certificate (`sparecycles "
                    "broker dev-cert`), or, on loopback only, connect without TLS")
        except (ConnectionResetError, BrokenPipeError, socket.timeout, OSError) as exc:
            return (f"{host}:{port} closed the TLS handshake ({exc}); is the broker serving "
                    "plaintext?")


def check_url(url: str, insecure: bool = False, *, what: str = "the broker URL") -> None:
    """An ``http://`` URL is allowed only to a loopback host or with ``insecure`` (then
    logged as a warning); ``https://`` always. Raises TLSConfigError saying what to do."""
    import logging
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http":
        return
    host = parts.hostname or ""
    if is_loopback(host):
        return
    if not insecure:
        raise TLSConfigError(
            f"{what} {url} is plaintext http:// to {host}, which is not loopback: the API key "
            "and prompts would cross the network in clear. Use https:// (trusting the "
            f"broker's CA with {CA_BUNDLE_ENV} if it is a dev one), or pass insecure=True / "
            f"{INSECURE_ENV}=1 to accept plaintext")
    logging.getLogger("sparecycles").warning(
        "insecure: talking to %s in PLAINTEXT (%s); the API key and prompts cross the "
        "network in clear", url, what)
