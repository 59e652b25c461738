"""The console's blueprint: every page and form of /admin. Views call services only."""
from __future__ import annotations

import json
import time
from datetime import datetime
from urllib.parse import urlparse

import jwt
from flask import (Blueprint, Response, abort, current_app, g, make_response, redirect,
                   render_template, request, url_for)

from broker.api.common import output_response
from broker.errors import BrokerError, NotFound, Unauthenticated
from broker.ledger.model import AccountId, AccountKind
from broker.jobs.model import JobState
from broker.pricing.policy import POLICY_FIELDS
from .charts import chart, status_bar
from .service import PRICE_FIELDS
from .session import COOKIE, LOGIN_CSRF_COOKIE, SIGN_IN_NOTICES, AdminSessions

bp = Blueprint("admin", __name__, url_prefix="/admin", template_folder="templates",
               static_folder="static")
FLASH_COOKIE = "sc_admin_flash"
OPEN = ("admin.login", "admin.static")


def svc():
    return current_app.extensions["sparecycles"]


def sessions() -> AdminSessions:
    return svc().admin_sessions


def _secure() -> bool:
    """Cookies are ``Secure`` whenever the console is reached over TLS (or says it is)."""
    return request.is_secure or svc().settings.public_url.startswith("https://")


# ---- flash messages in a signed cookie (the app has no Flask session) -------------------
def flash_to(resp, message: str, kind: str = "ok"):
    token = jwt.encode({"m": message, "k": kind, "exp": int(time.time()) + 60},
                       sessions().secret, algorithm="HS256")
    resp.set_cookie(FLASH_COOKIE, token, httponly=True, samesite="Strict", secure=_secure(),
                    path="/admin")
    return resp


def _take_flash():
    token = request.cookies.get(FLASH_COOKIE)
    if not token:
        return None
    try:
        data = jwt.decode(token, sessions().secret, algorithms=["HS256"])
        return {"message": data["m"], "kind": data["k"]}
    except jwt.InvalidTokenError:
        return None


def back(endpoint: str, message: str, kind: str = "ok", **values):
    return flash_to(redirect(url_for(endpoint, **values)), message, kind)


# ---- access ---------------------------------------------------------------------------
@bp.before_request
def require_admin():
    g.flash = _take_flash()
    if request.endpoint in OPEN:
        return None
    try:
        g.admin = sessions().check(request.cookies.get(COOKIE))
    except Unauthenticated as exc:
        if request.method == "GET":
            target = url_for("admin.login", next=request.full_path.rstrip("?"),
                             why=getattr(exc, "why", "required"))
            resp = redirect(target)
        else:
            resp = make_response(render_template("admin/error.html", title="Signed out",
                                                 message=exc.message, status=401), 401)
        resp.delete_cookie(COOKIE, path="/admin")
        return resp
    if request.method == "POST":
        sessions().check_csrf(g.admin, request.form.get("csrf_token"))
    return None


@bp.after_request
def headers(resp: Response):
    resp.headers.setdefault("Cache-Control", "no-store")
    resp.headers["X-Frame-Options"] = "DENY"
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "same-origin"
    policy = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
              "frame-ancestors 'none'; form-action 'self'")
    if resp.headers.get("Content-Security-Policy") == "sandbox":
        policy += "; sandbox"  # a provider's output (api.common.output_response): keep it
    resp.headers["Content-Security-Policy"] = policy
    if g.get("flash") is not None:
        resp.delete_cookie(FLASH_COOKIE, path="/admin")
    return resp


@bp.errorhandler(BrokerError)
def broker_error(exc: BrokerError):
    return render_template("admin/error.html", title=exc.title, message=exc.message,
                           status=exc.http_status), exc.http_status


@bp.app_template_filter("credits")
def credits_filter(micro) -> str:
    if micro is None:
        return "—"
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(int(micro)), 1_000_000)
    text = f"{whole:,}" + (f".{frac:06d}".rstrip("0") if frac else "")
    return sign + text


@bp.app_template_filter("when")
def when_filter(t) -> str:
    if not t:
        return "—"
    return datetime.fromtimestamp(float(t)).strftime("%Y-%m-%d %H:%M:%S")


@bp.app_template_filter("secs")
def secs_filter(v) -> str:
    if v is None:
        return "—"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s"


@bp.app_template_filter("figure")
def figure_filter(v, fmt: str = "%.0f", scale: float = 1.0, unit: str = "") -> str:
    """A measured figure (an agent's telemetry) formatted, or "—" when it is unknown."""
    if v is None:
        return "—"
    return (fmt % (v * scale)) + unit


@bp.app_template_filter("pretty")
def pretty_filter(v) -> str:
    return json.dumps(v, indent=2, sort_keys=True, default=str)


@bp.app_context_processor
def common():
    try:
        mode = svc().payments.funding_mode
    except Exception:  # noqa: BLE001
        mode = "?"
    return {"admin": g.get("admin"), "flash": g.get("flash"), "funding_mode": mode,
            "csrf": g.admin.csrf if g.get("admin") else ""}


# ---- login / logout -----------------------------------------------------------------
def _safe_next(value: str | None) -> str:
    if value and value.startswith("/admin") and not urlparse(value).netloc:
        return value
    return url_for("admin.overview")


@bp.route("/login", methods=["GET", "POST"])
def login():
    # Only a known code's own message: never text the link carries (SIGN_IN_NOTICES).
    error = SIGN_IN_NOTICES.get(request.args.get("why", "")) if request.method == "GET" else None
    if request.method == "POST":
        cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
        if not cookie or cookie != request.form.get("csrf_token"):
            error = "the sign-in form expired; try again"
        else:
            try:
                token, session = sessions().login(request.form.get("api_key", ""))
            except BrokerError as exc:
                error = exc.message
            else:
                svc().audit.safe_record(f"admin:{session.account_id}", "admin.login",
                                        f"account:{session.account_id}", {"key": session.key_id})
                resp = redirect(_safe_next(request.form.get("next")))
                resp.set_cookie(COOKIE, token, max_age=sessions().ttl_s, httponly=True,
                                samesite="Strict", secure=_secure(), path="/admin")
                resp.delete_cookie(LOGIN_CSRF_COOKIE, path="/admin")
                return resp
    import secrets
    login_csrf = secrets.token_urlsafe(24)
    resp = make_response(render_template("admin/login.html", error=error, login_csrf=login_csrf,
                                         next=request.values.get("next", "")),
                         401 if request.method == "POST" else 200)
    resp.set_cookie(LOGIN_CSRF_COOKIE, login_csrf, max_age=1800, httponly=True, samesite="Strict",
                    secure=_secure(), path="/admin")
    return resp


@bp.post("/logout")
def logout():
    sessions().logout(g.admin)
    svc().audit.safe_record(f"admin:{g.admin.account_id}", "admin.logout",
                            f"account:{g.admin.account_id}", {})
    resp = redirect(url_for("admin.login", why="signed_out"))
    resp.delete_cookie(COOKIE, path="/admin")
    return resp


# ---- overview ---------------------------------------------------------------------------
@bp.get("/")
def overview():
    o = svc().admin.overview()
    b = o["series"]["buckets"]
    charts = {
        "jobs": chart([(x["t"], x["finished"]) for x in b], kind="bar", label="jobs finished per minute"),
        "queue": chart([(x["t"], x["queue"]) for x in b], label="queue depth", color="#f5a524"),
        "wait": chart([(x["t"], x["median_wait_s"]) for x in b], label="median wait", color="#17c964"),
        "run": chart([(x["t"], x["median_run_s"]) for x in b], label="median run", color="#7828c8"),
        "credits": chart([(x["t"], x["spent_micro"] / 1e6) for x in b], kind="bar",
                         label="credits spent per minute", color="#0e9f9a"),
    }
    v = svc().admin.verification_overview(svc().verification)
    vbar = status_bar(v.get("by_status") or {}) if v.get("enabled") else ""
    storage = svc().retention.last if svc().retention is not None else None
    return render_template("admin/overview.html", o=o, charts=charts, v=v, vbar=vbar,
                           storage=storage, store=svc().jobs.blobs, page="overview")


# ---- pricing ------------------------------------------------------------------------------
FIELD_LABELS = {
    "reserve_micro_per_unit": ("Reserve / work unit", "credits"),
    "fee_bps": ("Platform fee", "%"),
    "min_charge_micro": ("Minimum charge", "credits"),
    "vesting_window_s": ("Vesting window", "hours"),
    "cache_price_micro": ("Cache hit price", "credits"),
    "min_stake_micro": ("Minimum stake", "credits"),
    "always_verify_above_micro": ("Always verify above", "credits"),
}


def _to_form(name: str, value: int) -> str:
    unit = FIELD_LABELS[name][1]
    if unit == "credits":
        return credits_filter(value).replace(",", "")
    if unit == "%":
        return f"{value / 100:g}"
    return f"{value / 3600:g}"


def _from_form(name: str, text: str) -> int:
    from decimal import Decimal, InvalidOperation
    unit = FIELD_LABELS[name][1]
    try:
        d = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        d = None
    if d is None or not d.is_finite():
        _invalid(name, text)
    v = d * {"credits": 1_000_000, "%": 100, "hours": 3600}[unit]
    if v != int(v):
        _invalid(name, text)
    return int(v)


def _invalid(name, text):
    from broker.errors import InvalidInput
    label, unit = FIELD_LABELS[name]
    raise InvalidInput(f"{label} is {text!r}; enter a number of {unit}"
                       + (" (at most 6 decimals)" if unit == "credits" else ""), field=name)


@bp.get("/pricing")
def pricing():
    rows = svc().admin.price_rows()
    history = svc().audit.search(subject="plugin:*", limit=15)
    return render_template("admin/pricing.html", rows=rows, fields=FIELD_LABELS, to_form=_to_form,
                           history=history, page="pricing")


@bp.post("/pricing/<plugin>")
def pricing_update(plugin):
    try:
        values = {name: _from_form(name, request.form[name])
                  for name in (*PRICE_FIELDS, *POLICY_FIELDS) if request.form.get(name, "") != ""}
        changed = svc().admin.change_price(plugin, values, by=g.admin.account_id)
    except BrokerError as exc:
        return back("admin.pricing", f"{plugin}: nothing saved — {exc.message}", "error")
    if not changed:
        return back("admin.pricing", f"{plugin}: nothing changed")
    labels = ", ".join(FIELD_LABELS[c][0].lower() for c in changed)
    return back("admin.pricing", f"{plugin}: saved {labels}; the next job uses it")


# ---- providers ----------------------------------------------------------------------------
@bp.get("/providers")
def providers():
    s = svc()
    all_p = s.providers.all()
    online = {x.provider_id: x for x in s.dispatcher.sessions()}
    names = s.admin.queries.account_names(sorted({p.account_id for p in all_p}))
    return render_template("admin/providers.html", providers=all_p, online=online, names=names,
                           standing=s.admin.queries.standing_summary(),
                           verification_on=s.verification is not None, page="providers")


@bp.get("/providers/<provider_id>")
def provider(provider_id):
    s = svc()
    d = s.admin.provider_detail(provider_id, market=s.market, verification=s.verification)
    p = d["provider"]
    # The agent's latest telemetry: as this replica holds it, else as last kept in its row.
    held = s.telemetry.latest(provider_id) if s.telemetry is not None else None
    telemetry, telemetry_at = held if held is not None else (p.telemetry, p.telemetry_at)
    return render_template("admin/provider.html", d=d, p=p, telemetry=telemetry,
                           telemetry_at=telemetry_at, marks=_job_marks(d["jobs"]),
                           page="providers")


@bp.post("/providers/<provider_id>/action")
def provider_action(provider_id):
    action = request.form.get("action", "")
    try:
        svc().admin.provider_action(provider_id, action, request.form.get("reason", ""),
                                    by=g.admin.account_id)
    except BrokerError as exc:
        return back("admin.provider", f"nothing changed — {exc.message}", "error",
                    provider_id=provider_id)
    verb = {"pause": "paused", "ban": "banned", "unban": "unbanned", "resume": "resumed"}[action]
    return back("admin.provider", f"provider {verb}", provider_id=provider_id)


# ---- keys ---------------------------------------------------------------------------------
@bp.get("/keys")
def keys():
    from broker.api.keys import key_to_json

    s = svc()
    account = request.args.get("account") or None
    rows = [key_to_json(k) for k in s.auth.list_keys(account)]
    names = s.admin.queries.account_names(sorted({r["account_id"] for r in rows}))
    return render_template("admin/keys.html", keys=rows, names=names, account=account,
                           page="keys")


@bp.post("/keys/<key_id>/action")
def key_action(key_id):
    action = request.form.get("action", "")
    auth = svc().auth
    try:
        if action == "revoke":
            auth.revoke(key_id)
            svc().audit.record(f"admin:{g.admin.account_id}", "key.revoke", f"key:{key_id}", {})
            return back("admin.keys", f"key {key_id} revoked: every replica refuses it within "
                                      "seconds")
        if action == "rotate":
            grace = request.form.get("grace_s", "0").strip() or "0"
            try:
                grace_s = float(grace)
            except ValueError:
                return back("admin.keys", f"nothing changed — grace {grace!r} is not a number "
                                          "of seconds", "error")
            new_key, old = auth.rotate(key_id, grace_s=grace_s)
            svc().audit.record(f"admin:{g.admin.account_id}", "key.rotate", f"key:{key_id}",
                               {"new_key_id": new_key.split("_")[2], "grace_s": grace_s})
            # The one time the plaintext is shown: on the page, never in a cookie.
            return render_template("admin/key_created.html", key=new_key, old=old,
                                   page="keys")
    except BrokerError as exc:
        return back("admin.keys", f"nothing changed — {exc.message}", "error")
    return back("admin.keys", f"nothing changed — unknown action {action!r} (revoke or "
                              "rotate)", "error")


# ---- jobs ---------------------------------------------------------------------------------
def _job_marks(rows) -> dict:
    """What the jobs tables show beside each row: its verification status, and for a
    check job the client job it checks and its role."""
    q = svc().admin.queries
    return {"status": q.verification_statuses([r.id for r in rows if not r.check_of]),
            "checks": q.check_roles([r.id for r in rows if r.check_of])}


def _time_arg(name):
    v = request.args.get(name, "").strip()
    if not v:
        return None
    try:
        return datetime.fromisoformat(v).timestamp()
    except ValueError:
        from broker.errors import InvalidInput
        raise InvalidInput(f"{name} is {v!r}; use a date and time like 2026-01-31T14:00") from None


@bp.get("/jobs")
def jobs():
    a = request.args
    rows = svc().admin.queries.search_jobs(job_id=a.get("id") or None, client=a.get("client") or None,
                                           provider=a.get("provider") or None,
                                           plugin=a.get("plugin") or None, state=a.get("state") or None,
                                           since=_time_arg("since"), until=_time_arg("until"), limit=200)
    return render_template("admin/jobs.html", rows=rows, q=a, states=[s.value for s in JobState],
                           plugins=svc().catalog.names(), marks=_job_marks(rows), page="jobs")


@bp.get("/jobs/<job_id>")
def job(job_id):
    s = svc()
    row = s.admin.queries.search_jobs(job_id=job_id, limit=1)
    if not row or row[0].id != job_id:
        from broker.errors import NotFound
        raise NotFound(f"no job {job_id!r}")
    j = row[0]
    # An admin reads a client's prompt and outputs only under audit: each view is recorded.
    _audit_read(job_id, "job.viewed")
    outputs = s.jobs.repo.outputs(job_id)
    texts = {}
    for o in outputs:
        if not o.media_type.startswith("image/"):
            try:
                texts[o.index] = s.jobs.blobs.get(o.sha256)[:4000].decode("utf-8", "replace")
            except Exception as exc:  # noqa: BLE001
                texts[o.index] = f"(output unavailable: {exc})"
    trail = s.audit.search(subject=f"job:{job_id}", limit=50)
    if j.hold_id:
        trail = sorted(trail + s.audit.search(subject=f"hold:{j.hold_id}", limit=50),
                       key=lambda e: -e.seq)
    disputes = [d for d in s.disputes.list(None) if d.job_id == job_id or
                any(x.get("job_id") == job_id for x in d.sides)]
    if j.check_of:
        trail = sorted(trail + s.audit.search(subject=f"job:{j.check_of}", action="verification",
                                              limit=50), key=lambda e: -e.seq)
    return render_template("admin/job.html", j=j, outputs=outputs, texts=texts,
                           events=s.jobs.repo.events_after(job_id, 0), trail=trail,
                           disputes=disputes, ver=s.admin.job_verification(job_id, s.verification),
                           page="jobs")


def _audit_read(job_id: str, action: str, **data) -> None:
    svc().audit.record(f"admin:{g.admin.account_id}", action, f"job:{job_id}", data)


@bp.get("/jobs/<job_id>/outputs/<int:index>")
def job_output(job_id, index):
    s = svc()
    for o in s.jobs.repo.outputs(job_id):
        if o.index == index:
            _audit_read(job_id, "job.output_viewed", index=index)
            return output_response(s.jobs.blobs.get(o.sha256), o.media_type,
                                   headers={"Cache-Control": "private, max-age=3600"})
    abort(404)


@bp.get("/jobs/<job_id>/runs/<int:index>")
def job_run_output(job_id, index):
    """An output as the run's provider signed it in its receipt: for an overturned job
    that is the wrong output the client first got (its output rows now name the
    majority's)."""
    s = svc()
    job = s.jobs.repo.get(job_id)
    if job is None:
        abort(404)
    for o in s.admin.run_outputs(job):
        if o["index"] == index:
            _audit_read(job_id, "job.output_viewed", index=index, run=True)
            try:
                data = s.jobs.blobs.get(o["sha256"])
            except NotFound:  # gone from the blob store
                abort(404)
            return output_response(data, o["media_type"],
                                   headers={"Cache-Control": "private, max-age=3600"})
    abort(404)


# ---- disputes -----------------------------------------------------------------------------
@bp.get("/disputes")
def disputes():
    from .verification_view import comparison_rows, role_rank, thresholds_caption
    s = svc()
    state = request.args.get("state", "open")
    items = s.disputes.list(None if state == "all" else state)
    texts, figures, sides = {}, {}, {}
    for d in items:
        rows = comparison_rows(d.comparisons)
        figures[d.id] = (rows, thresholds_caption(rows))
        shown = []
        for side in sorted(d.sides, key=lambda x: role_rank(x.get("role", ""))):
            side = dict(side)  # what the run's provider signed, not what the job shows now
            key = (side.get("job_id"), side.get("output_index", 0))
            job = s.jobs.repo.get(key[0]) if key[0] else None
            for o in (s.admin.run_outputs(job) if job else []):
                if o["index"] == key[1]:
                    side.update(sha256=o["sha256"], media_type=o["media_type"])
                    if not o["media_type"].startswith("image/") and key not in texts:
                        texts[key] = s.admin.output_text(o["sha256"])
            shown.append(side)
        sides[d.id] = shown
    from .verification_view import image_calibration
    return render_template("admin/disputes.html", items=items, state=state, texts=texts,
                           figures=figures, sides=sides, page="disputes",
                           calibration=image_calibration())


@bp.post("/disputes/<dispute_id>/override")
def dispute_override(dispute_id):
    try:
        svc().disputes.override(dispute_id, request.form.get("winner", ""),
                                request.form.get("reason", ""), by=g.admin.account_id)
    except BrokerError as exc:
        return back("admin.disputes", f"nothing changed — {exc.message}", "error")
    return back("admin.disputes", "dispute resolved; the override is in the audit log")


# ---- ledger -------------------------------------------------------------------------------
@bp.get("/ledger")
def ledger():
    s = svc()
    a = request.args
    return render_template("admin/ledger.html", trial=s.ledger.verify(),
                           accounts=s.admin.queries.ledger_accounts(owner=a.get("owner") or None,
                                                                    kind=a.get("kind") or None),
                           kinds=[k.value for k in AccountKind], q=a,
                           stripe=s.admin.queries.stripe_events(),
                           payouts=s.admin.queries.payouts(),
                           transactions=s.admin.queries.transactions(25), page="ledger")


@bp.get("/ledger/account")
def ledger_account():
    raw = request.args.get("id", "")
    kind, _, owner = raw.partition(":")
    try:
        account = AccountId(AccountKind(kind), owner)
    except ValueError:
        from broker.errors import NotFound
        raise NotFound(f"no ledger account {raw!r}; ids look like client_available:<account>") from None
    s = svc()
    return render_template("admin/ledger_account.html", account=raw, balance=s.ledger.balance(account),
                           lines=s.ledger.history(account, limit=200), page="ledger")


# ---- audit --------------------------------------------------------------------------------
@bp.get("/audit")
def audit():
    s = svc()
    a = request.args
    report = s.audit.verify() if a.get("verify") else None
    before = a.get("before", type=int)
    entries = s.audit.search(subject=a.get("subject") or None, action=a.get("action") or None,
                             before_seq=before, limit=100)
    broken = None
    if report and not report.ok:
        broken = report.broken_seq
    return render_template("admin/audit.html", entries=entries, report=report, broken=broken, q=a,
                           page="audit")


@bp.errorhandler(404)
def not_found(exc):
    return render_template("admin/error.html", title="Not found",
                           message="There is no such page or record.", status=404), 404


@bp.errorhandler(Exception)
def unexpected(exc):
    import logging
    from werkzeug.exceptions import HTTPException
    if isinstance(exc, HTTPException):
        return render_template("admin/error.html", title=exc.name, message=exc.description,
                               status=exc.code), exc.code
    logging.getLogger(__name__).exception("console error on %s %s", request.method, request.path)
    return render_template("admin/error.html", title="Something went wrong",
                           message="The console hit an unexpected error; it is logged. Nothing "
                                   "was changed by this request.", status=500), 500
