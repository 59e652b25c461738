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

    from broker.auth.scopes import ROUTE_SCOPES, check_route
    from broker.ratelimit import RateLimited

    from .api import (account, credits, health, jobs, keys, market, openai_compat, openapi,
                      plugins, providers, stake)
    from .api import registry as registry_api

    for bp in (health.bp, jobs.bp, plugins.bp, openapi.bp, account.bp, credits.bp, market.bp,
               stake.bp, keys.bp, openai_compat.bp, providers.bp):
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
        if (request.path in PUBLIC or not request.path.startswith("/v1")
                or request.endpoint in openai_compat.PUBLIC_ENDPOINTS):
            return None
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        g.principal = services.auth.authenticate(token)
        if request.url_rule is not None:  # (no route: the 404 says so)
            check_route(g.principal, request.endpoint, request.method, request.path)
            limiter = getattr(services, "rate_limiter", None)
            if limiter is not None:
                limiter.hit(g.principal.account_id, ROUTE_SCOPES.get(request.endpoint))
        return None

    @app.after_request
    def tag_request(response):
        response.headers[REQUEST_ID] = request_id()
        handover = request.environ.get(HANDOVER)
        if handover is not None:  # the metrics' route label: the rule, never the raw path
            handover.route = request.url_rule.rule if request.url_rule else "(unmatched)"
        return response

    def problem(body: dict, status: int):
        body = {**body, "request_id": request_id()}
        if openai_compat.is_openai_route():  # OpenAI's error shape, which its clients parse
            err, status, headers = openai_compat.openai_error_body(body, status)
            resp = app.response_class(app.json.dumps(err), status=status,
                                      mimetype="application/json")
            resp.headers.update(headers)
            return resp
        return problem_response(app, body, status)

    @app.errorhandler(BrokerError)
    def broker_error(exc: BrokerError):
        resp = problem(exc.problem(), exc.http_status)
        if isinstance(exc, RateLimited):
            resp.headers["Retry-After"] = str(exc.retry_after_s)
        return resp

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
