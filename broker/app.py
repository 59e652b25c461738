"""create_app: the Flask application over a Services object."""
from __future__ import annotations

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from broker.errors import BrokerError
from sdk import logs
from .api.common import REQUEST_ID, check_url_text, internal_problem, request_id
from .api.waiting import HANDOVER

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
    def bind_request_id():
        # Every log line written while this request is handled names it (sdk.logs).
        g.log_token = logs.bind(request_id=request_id())

    @app.teardown_request
    def unbind_request_id(_exc):
        token = g.pop("log_token", None)
        if token is not None:
            logs.unbind(token)

    @app.before_request
    def authenticate():
        check_url_text()  # every route, the console's too: no column stores a NUL
        if request.path in PUBLIC or not request.path.startswith("/v1"):
            return None
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        g.principal = services.auth.authenticate(token)
        return None

    @app.after_request
    def tag_request(response):
        response.headers[REQUEST_ID] = request_id()
        handover = request.environ.get(HANDOVER)
        if handover is not None:  # the metrics' route label: the rule, never the raw path
            handover.route = request.url_rule.rule if request.url_rule else "(unmatched)"
        return response

    def problem(body: dict, status: int):
        return problem_response(app, {**body, "request_id": request_id()}, status)

    @app.errorhandler(BrokerError)
    def broker_error(exc: BrokerError):
        return problem(exc.problem(), exc.http_status)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed",
                413: "payload_too_large"}.get(exc.code, "http_error")
        resp = problem({"type": f"https://sparecycles.dev/errors/{code}", "title": exc.name,
                        "status": exc.code, "code": code, "detail": exc.description}, exc.code)
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:  # RFC 9110 §15.5.6
            resp.headers["Allow"] = ", ".join(sorted(exc.valid_methods))
        return resp

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        return problem(internal_problem(exc), 500)

    return app
