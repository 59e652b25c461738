"""/v1/plugins: what the broker runs, with each plugin's input JSON Schema."""
from flask import Blueprint

from .common import services

bp = Blueprint("plugins", __name__)


@bp.get("/v1/plugins")
def list_plugins():
    return {"object": "list", "data": [m.to_public() for m in services().catalog.all()]}


@bp.get("/v1/plugins/<name>")
def get_plugin(name):
    return services().catalog.get(name).to_public()
