"""/livez and /readyz for process supervisors and load balancers (no authentication).

The broker's asyncio front (broker.web) answers both on its event loop, with the same
bodies, so they never wait behind job traffic; these views serve other WSGI servers.

Not ready (503, RFC 7807 ``not_ready``) names every reason in ``reasons``: ``database``
(no statement answers), ``migrations`` (the schema is not the one this broker needs),
``draining`` (the broker is stopping: new work goes to another replica)."""
from flask import Blueprint
from sqlalchemy import text

from broker.errors import NotReady
from broker.storage.migrate import schema_behind
from .common import services

bp = Blueprint("health", __name__)


@bp.get("/livez")
def livez():
    return {"status": "ok"}


@bp.get("/readyz")
def readyz():
    check_ready(services())
    return readiness(services())


def check_ready(svc, *, draining: bool = False) -> None:
    """Raise NotReady naming each reason this broker should get no traffic now."""
    reasons: list[dict] = []
    if draining:
        reasons.append({"check": "draining", "detail": "the broker is shutting down; "
                        "send new requests to another replica"})
    try:
        with svc.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        reasons.append({"check": "database", "detail": f"database unreachable: {exc}"})
    else:
        try:
            behind = schema_behind(svc.engine)
        except Exception as exc:  # noqa: BLE001
            behind = f"the schema's version could not be read: {exc}"
        if behind:
            reasons.append({"check": "migrations", "detail": f"{behind}; restart "
                            "`sparecycles broker serve` with this database (it migrates at "
                            "start)"})
    if reasons:
        raise NotReady("; ".join(r["detail"] for r in reasons), reasons=reasons)


def readiness(svc) -> dict:
    """/readyz's answer once every check passed."""
    from sdk.tls import is_loopback

    settings = svc.settings
    loopback = all(is_loopback(a.rpartition(":")[0]) for a in (settings.http, settings.grpc))
    return {"status": "ok", "providers_online": svc.dispatcher.session_count(),
            "broker_public_key": svc.signer.public_key_hex,
            "checks": {"database": "ok", "migrations": "ok", "draining": False},
            # how clients and agents reach this replica: "tls", "plaintext (loopback)" or
            # "plaintext (insecure)", the last also logged as a warning at start
            "transport": "tls" if settings.tls else
                         "plaintext (loopback)" if loopback else "plaintext (insecure)"}
