"""/v1/plugins: what the broker runs, with each plugin's input JSON Schema."""
from flask import Blueprint

from .common import services

bp = Blueprint("plugins", __name__)


@bp.get("/v1/plugins")
def list_plugins():
    """Every plugin jobs can run (built-in and published), latest version of each.
    ``q`` matches name and description, ``publisher`` the manifest's publisher or the
    registry's publisher account/key, ``output`` the output kind (images, text)."""
    from flask import request

    svc = services()
    q = (request.args.get("q") or "").strip().lower()
    publisher, output = request.args.get("publisher"), request.args.get("output")
    registry = getattr(svc, "registry", None)
    out = []
    for m in svc.catalog.all():
        item = m.to_public()
        rec = None
        if registry is not None and m.name not in registry.builtin:
            rec = next((r for r in registry.repo.versions("plugin", m.name)
                        if r.version == m.version), None)
        item["source"] = "registry" if rec is not None else "builtin"
        if rec is not None:
            item.update(publisher_account=rec.publisher_account,
                        publisher_key=rec.document.get("publisher_key"), digest=rec.digest)
        if q and q not in m.name.lower() and q not in m.description.lower():
            continue
        if output and m.output != output:
            continue
        if publisher and publisher not in (m.publisher, item.get("publisher_account"),
                                           item.get("publisher_key")):
            continue
        out.append(item)
    return {"object": "list", "data": out}


@bp.get("/v1/plugins/<name>")
def get_plugin(name):
    return services().catalog.get(name).to_public()
