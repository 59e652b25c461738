"""/livez and /readyz for process supervisors and load balancers (no authentication)."""
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
    svc = services()
    try:
        with svc.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        raise NotReady(f"database unreachable: {exc}") from None
    return {"status": "ok", "providers_online": len(svc.dispatcher.sessions()),
            "broker_public_key": svc.signer.public_key_hex}
