"""/livez and /readyz for process supervisors and load balancers (no authentication).

The broker's asyncio front (broker.web) answers both on its event loop, with the same
bodies, so they never wait behind job traffic; these views serve other WSGI servers."""
from flask import Blueprint
from sqlalchemy import text

from broker.errors import NotReady
from .common import services

bp = Blueprint("health", __name__)


@bp.get("/livez")
def livez():
    return {"status": "ok"}


@bp.get("/readyz")
def readyz():
    check_database(services())
    return readiness(services())


def check_database(svc) -> None:
    """A statement on the database, or NotReady saying why not."""
    try:
        with svc.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        raise NotReady(f"database unreachable: {exc}") from None


def readiness(svc) -> dict:
    """/readyz's answer once the database answered."""
    from sdk.tls import is_loopback

    settings = svc.settings
    loopback = all(is_loopback(a.rpartition(":")[0]) for a in (settings.http, settings.grpc))
    return {"status": "ok", "providers_online": svc.dispatcher.session_count(),
            "broker_public_key": svc.signer.public_key_hex,
            # how clients and agents reach this replica: "tls", "plaintext (loopback)" or
            # "plaintext (insecure)", the last also logged as a warning at start
            "transport": "tls" if settings.tls else
                         "plaintext (loopback)" if loopback else "plaintext (insecure)"}
