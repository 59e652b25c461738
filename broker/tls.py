"""The broker's TLS: the certificate it serves REST and gRPC with, checked at start, and
``sparecycles broker dev-cert``, which makes a local CA and a server certificate signed by
it for a first run (docs/architecture.md, *Security: TLS*).

A dev CA lives in ``<data dir>/tls``: ``ca.pem`` (give it to agents and clients as
``SPARECYCLES_CA_BUNDLE`` or ``ca_file``), ``ca.key`` (0600; it signs only this broker's
certificates), ``server.pem`` and ``server.key`` (0600). Rerunning dev-cert keeps the CA
and issues a new server certificate, so what trusts the CA keeps trusting the broker.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from sdk.tls import is_loopback

log = logging.getLogger("broker.tls")

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_DAYS = 3650
SERVER_DAYS = 397  # the longest browsers accept


class TLSError(ValueError):
    pass


@dataclass(frozen=True)
class ServerCert:
    cert_file: Path
    key_file: Path
    names: tuple[str, ...]
    not_after: dt.datetime

    @property
    def expired(self) -> bool:
        return self.not_after <= dt.datetime.now(dt.timezone.utc)


def _write(path: Path, data: bytes, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Sparecycles dev"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts) -> list:
    from cryptography import x509

    out = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h.strip("[]"))))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def make_ca(out_dir: Path, *, days: int = CA_DAYS):
    """A new CA key and self-signed certificate in ``out_dir`` (ca.key, ca.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    name = _name("Sparecycles dev CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write(out_dir / "ca.key", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()), private=True)
    _write(out_dir / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return key, cert


def load_ca(out_dir: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key((out_dir / "ca.key").read_bytes(), None)
    cert = x509.load_pem_x509_certificate((out_dir / "ca.pem").read_bytes())
    return key, cert


def issue_server_cert(out_dir: Path, hosts=DEFAULT_HOSTS, *, ca=None, days: int = SERVER_DAYS,
                      not_before: dt.datetime | None = None,
                      not_after: dt.datetime | None = None, stem: str = "server") -> ServerCert:
    """A server certificate for ``hosts`` (names and IP addresses) signed by ``ca`` (a
    (key, cert) pair; default the CA in ``out_dir``, made when missing), written to
    ``<stem>.pem`` and ``<stem>.key``. ``not_before``/``not_after`` override the validity
    (tests make expired certificates with them)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    hosts = tuple(h.strip() for h in hosts if h.strip())
    if not hosts:
        raise TLSError("a server certificate needs at least one host name or address")
    if ca is None:
        ca = load_ca(out_dir) if (out_dir / "ca.key").exists() else make_ca(out_dir)
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    start = not_before or now - dt.timedelta(minutes=5)
    end = not_after or now + dt.timedelta(days=days)
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_file, key_file = out_dir / f"{stem}.pem", out_dir / f"{stem}.key"
    _write(key_file, key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), private=True)
    _write(cert_file, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return ServerCert(cert_file, key_file, hosts, end)


def check_server_cert(cert_file: Path, key_file: Path) -> ServerCert:
    """The certificate the broker will serve, read and checked before it listens: both
    files readable, the key matching the certificate. An expired certificate is logged as
    an error (clients will refuse it, saying so) but served, so that a renewal in progress
    does not stop the broker."""
    from cryptography import x509

    for what, path in (("certificate", cert_file), ("key", key_file)):
        if not Path(path).is_file():
            raise TLSError(f"the TLS {what} {path} does not exist; give the broker's "
                           "certificate and key (SPARECYCLES_TLS_CERT, SPARECYCLES_TLS_KEY or "
                           "--tls-cert/--tls-key), or make a dev pair with `sparecycles broker "
                           "dev-cert`")
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert_file), str(key_file))
    except ssl.SSLError as exc:
        raise TLSError(f"cannot use {cert_file} with {key_file}: {exc.reason or exc} (is the "
                       "key the certificate's, both in PEM form?)") from None
    cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(str(n.value) for n in san)
    except x509.ExtensionNotFound:
        names = ()
    info = ServerCert(Path(cert_file), Path(key_file), names, cert.not_valid_after_utc)
    if info.expired:
        log.error("the TLS certificate %s EXPIRED on %s: clients and agents will refuse it; "
                  "renew it (a dev one: `sparecycles broker dev-cert`)", cert_file,
                  info.not_after.isoformat())
    elif info.not_after - dt.datetime.now(dt.timezone.utc) < dt.timedelta(days=14):
        log.warning("the TLS certificate %s expires on %s: renew it soon", cert_file,
                    info.not_after.isoformat())
    return info


def check_plaintext(addrs: dict[str, str], insecure: bool) -> None:
    """Without a certificate the broker listens in plaintext only on loopback; elsewhere
    only with ``insecure``, which is logged as a warning."""
    public = {what: a for what, a in addrs.items() if not is_loopback(a.rpartition(":")[0])}
    if not public:
        log.info("no TLS certificate: serving plaintext on loopback only (%s)",
                 ", ".join(f"{w} {a}" for w, a in addrs.items()))
        return
    listed = ", ".join(f"{w} on {a}" for w, a in public.items())
    if not insecure:
        raise TLSError(f"refusing to serve {listed} in plaintext: API keys and prompts would "
                       "cross the network in clear. Give a certificate (--tls-cert/--tls-key, "
                       "or `sparecycles broker dev-cert` for a dev one), listen on loopback, "
                       "or pass --insecure (SPARECYCLES_INSECURE=1) to accept plaintext")
    log.warning("--insecure: serving %s in PLAINTEXT; API keys, prompts and outputs cross "
                "the network in clear", listed)
