"""create_app: the Flask application over a Services object."""
from __future__ import annotations

import logging

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException

from broker.errors import BrokerError

log = logging.getLogger(__name__)
PUBLIC = ("/livez", "/readyz", "/openapi.json", "/v1/stripe/webhook")


def problem_response(app: Flask, body: dict, status: int):
    """An RFC 7807 answer (problem JSON), as every error of the API is rendered."""
    resp = app.response_class(app.json.dumps(body), status=status,
                              mimetype="application/problem+json")
    if status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="sparecycles"'
    return resp


def create_app(services) -> Flask:
    app = Flask("broker")
    app.extensions["sparecycles"] = services
    app.config["MAX_CONTENT_LENGTH"] = 32 * 1024 * 1024

    from .api import account, credits, health, jobs, market, openapi, plugins, stake
    from .api import registry as registry_api

    for bp in (health.bp, jobs.bp, plugins.bp, openapi.bp, account.bp, credits.bp, market.bp,
               stake.bp):
        app.register_blueprint(bp)
    app.register_blueprint(registry_api.bp)  # the marketplace: publishers, packages, adapters
    from .admin.views import bp as admin_bp

    app.register_blueprint(admin_bp)  # /admin: cookie sessions of its own, not API keys

    @app.before_request
    def authenticate():
        if request.path in PUBLIC or not request.path.startswith("/v1"):
            return None
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        g.principal = services.auth.authenticate(token)
        return None

    def problem(body: dict, status: int):
        return problem_response(app, body, status)

    @app.errorhandler(BrokerError)
    def broker_error(exc: BrokerError):
        return problem(exc.problem(), exc.http_status)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed",
                413: "payload_too_large"}.get(exc.code, "http_error")
        return problem({"type": f"https://sparecycles.dev/errors/{code}", "title": exc.name,
                        "status": exc.code, "code": code, "detail": exc.description}, exc.code)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return problem({"type": "https://sparecycles.dev/errors/internal", "title": "Internal error",
                        "status": 500, "code": "internal",
                        "detail": "the broker hit an unexpected error; it is logged"}, 500)

    return app
