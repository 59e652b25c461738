"""The images' HEALTHCHECK: GET the broker's /readyz (or the path given) on this container's
own REST address, $SPARECYCLES_HTTP (0.0.0.0:8080 in the image), over TLS when
$SPARECYCLES_TLS_CERT is set. Exit 0 when it answers 200, 1 otherwise (printing why).

The certificate is not verified: this asks the process in this same container over loopback
whether it serves, not whether a client would trust it (that is the proxy's and clients' own
check, against the real host name)."""
import os
import ssl
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/readyz"
    port = os.environ.get("SPARECYCLES_HTTP", "127.0.0.1:8080").rpartition(":")[2]
    tls = bool(os.environ.get("SPARECYCLES_TLS_CERT"))
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}{path}"
    context = ssl._create_unverified_context() if tls else None  # noqa: S323 (see above)
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as response:
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: {exc.code} {exc.read()[:300]!r}", file=sys.stderr)
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
