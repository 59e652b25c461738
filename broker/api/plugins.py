"""/v1/plugins: what the broker runs, with each plugin's input JSON Schema."""
from flask import Blueprint, request

from broker.registry.service import matches_query
from .common import services

bp = Blueprint("plugins", __name__)


@bp.get("/v1/plugins")
def list_plugins():
    """Every plugin jobs can run (built-in and published), latest version of each.
    ``q`` matches name and description, ``publisher`` the manifest's publisher or the
    registry's publisher account/key, ``output`` the output kind (images, text)."""
    svc = services()
    q = (request.args.get("q") or "").strip().lower()
    publisher, output = request.args.get("publisher"), request.args.get("output")
    registry = svc.registry
    published = {(r.name, r.version): r for r in registry.repo.all("plugin")}  # one read
    out = []
    for m in svc.catalog.all():
        if not matches_query(q, m.name, m.description):
            continue
        if output and m.output != output:
            continue
        rec = None if m.name in registry.builtin else published.get((m.name, m.version))
        if publisher and publisher != m.publisher and not (rec is not None
                                                          and rec.published_by(publisher)):
            continue
        item = _public(svc, m)
        item["source"] = "registry" if rec is not None else "builtin"
        if rec is not None:
            item.update(publisher_account=rec.publisher_account,
                        publisher_key=rec.document.get("publisher_key"), digest=rec.digest)
        out.append(item)
    return {"object": "list", "data": out}


@bp.get("/v1/plugins/<name>")
def get_plugin(name):
    svc = services()
    return _public(svc, svc.catalog.get(name))


def _public(svc, manifest) -> dict:
    """The manifest as clients see it, with ``input_defaults``: what a job that leaves out
    an input declared ``default_from = "weights"`` gets now, from the weights of the
    providers that could run it (the image size of the model they serve), where that
    differs from the schema's default."""
    item = manifest.to_public()
    item["input_defaults"] = svc.jobs.defaults_for(manifest)
    return item
