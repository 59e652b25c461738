"""`sparecycles agent status` and `sparecycles agent payout`: earnings and state at a glance.

Two sources, joined by provider id: the running agent's own ``<home>/status.json`` (each
device's state as the agent sees it: working, idle-waiting, paused by schedule, limit
reached, failed; written every few seconds by provider_agent.fleet) and the broker's
``GET /v1/providers`` (connection as the broker sees it, jobs today, credits pending,
vesting, available and paid, verification standing). Either may be missing — the agent
stopped, the broker unreachable — and the view says which, showing the other.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from .config import AgentConfig, config_dir
from .errors import ConfigError

MICRO = 1_000_000
# status.json older than this means the agent that wrote it is gone or stuck.
STALE_S = 15.0
STATE_STYLE = {"working": "bold green", "ready": "green", "available": "green",
               "idle_waiting": "yellow", "owner_active": "yellow",
               "schedule_closed": "cyan", "limit_reached": "magenta", "draining": "yellow",
               "failed": "bold red"}
STATE_WORDS = {"working": "working", "ready": "ready (waiting for jobs)",
               "idle_waiting": "idle-waiting", "owner_active": "paused: owner using the GPU",
               "schedule_closed": "paused by schedule", "limit_reached": "limit reached",
               "draining": "draining", "failed": "taken out"}


def api_url(cfg: AgentConfig, given: str | None) -> str:
    url = given or os.environ.get("SPARECYCLES_URL") or cfg.registry_url
    if not url:
        raise ConfigError("the broker's REST address is unknown: pass --url http://HOST:8080, "
                          "set SPARECYCLES_URL, or set registry_url in agent.toml")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url {url!r} must start with http:// or https://")
    return url.rstrip("/")


def local_state(home: Path | None, now: float | None = None) -> dict:
    """What the agent on this machine last wrote; ``running`` false when there is none,
    its process is gone, or it is older than STALE_S."""
    path = (Path(home) if home is not None else config_dir()) / "status.json"
    now = time.time() if now is None else now
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"running": False, "why": f"no agent has run here ({path} is missing)",
                "devices": []}
    except (OSError, ValueError) as exc:
        return {"running": False, "why": f"{path} is unreadable: {exc}", "devices": []}
    age = now - float(data.get("written_at") or 0)
    alive = _alive(int(data.get("pid") or 0))
    running = alive and age < STALE_S
    why = "" if running else (f"the agent (pid {data.get('pid')}) is not running" if not alive
                              else f"the agent has not written its state for {age:.0f}s")
    return {"running": running, "why": why, "pid": data.get("pid"), "age_s": round(age, 1),
            "devices": list(data.get("devices") or [])}


def broker_state(url: str, api_key: str, *, timeout_s: float = 5.0) -> dict:
    try:
        r = httpx.get(f"{url}/v1/providers", headers={"Authorization": f"Bearer {api_key}"},
                      timeout=timeout_s)
    except httpx.HTTPError as exc:
        return {"reachable": False, "error": f"cannot reach the broker at {url}: {exc}"}
    if r.status_code != 200:
        return {"reachable": True, "error": _problem(r)}
    return {"reachable": True, "error": "", **r.json()}


def gather(cfg: AgentConfig, home: Path | None, url: str) -> dict:
    """The whole status document (what --json prints)."""
    local = local_state(home)
    remote = broker_state(url, cfg.api_key)
    machines = {m["id"]: m for m in remote.get("machines", [])}
    devices = []
    seen = set()
    for d in local["devices"]:
        m = machines.get(d.get("provider_id") or "")
        seen.add(d.get("provider_id"))
        devices.append(_device_row(d if local["running"] else {**d, "state": "stopped",
                                                                 "connected": False}, m))
    for pid, m in machines.items():  # machines of the account this host does not run now
        if pid not in seen:
            devices.append(_device_row(None, m))
    return {"object": "agent_status", "broker": {"url": url,
                                                 "reachable": remote.get("reachable", False),
                                                 "error": remote.get("error", "")},
            "agent": {"running": local["running"], "why": local["why"],
                      "pid": local.get("pid")},
            "credits": remote.get("credits"), "jobs_today": remote.get("jobs_today"),
            "devices": devices}


def _device_row(local: dict | None, machine: dict | None) -> dict:
    row = {"device": (local or {}).get("device", ""),
           "name": (local or {}).get("name") or (machine or {}).get("name", ""),
           "provider_id": (local or {}).get("provider_id") or (machine or {}).get("id", ""),
           "state": (local or {}).get("state") or _broker_state_word(machine),
           "reason": (local or {}).get("reason", "") or
           ((machine or {}).get("availability") or {}).get("reason", ""),
           "connected": bool((local or {}).get("connected")) or bool((machine or {}).get("online")),
           "running_jobs": (local or {}).get("running_jobs", (machine or {}).get("running_jobs", 0)),
           "jobs_today_here": (local or {}).get("jobs_today"),
           "gpu_hours_today": (local or {}).get("gpu_hours_today"),
           "local": local is not None}
    if machine is not None:
        row.update(jobs_today=machine["jobs_today"], pending_micro=machine["pending_micro"],
                   verification=machine["verification"], broker_status=machine["status"],
                   availability=machine.get("availability"), online=machine["online"])
    return row


def _broker_state_word(machine: dict | None) -> str:
    if machine is None:
        return "unknown"
    if not machine.get("online"):
        return "offline"
    a = machine.get("availability") or {}
    if a and not a.get("available", True):
        return a.get("state") or "paused"
    return "working" if machine.get("running_jobs") else "ready"


def render(doc: dict):
    """A rich renderable of ``doc`` (gather's)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    head = Text()
    b = doc["broker"]
    head.append("broker ", style="bold")
    head.append(b["url"])
    head.append("  ")
    if b["reachable"] and not b["error"]:
        head.append("connected", style="green")
    else:
        head.append(b["error"] or "unreachable", style="red")
    head.append("\nagent  ", style="bold")
    a = doc["agent"]
    head.append(f"running (pid {a['pid']})" if a["running"] else f"not running: {a['why']}",
                style="green" if a["running"] else "yellow")

    table = Table(title="devices", expand=True)
    for col in ("device", "machine", "connection", "state", "jobs today", "running",
                "pending", "verification"):
        table.add_column(col)
    for d in doc["devices"]:
        state = d["state"]
        words = STATE_WORDS.get(state, state)
        cell = Text(words, style=STATE_STYLE.get(state, ""))
        if d.get("reason"):
            cell.append(f"\n{d['reason']}", style="dim")
        jobs = d.get("jobs_today") or {}
        today = (f"{jobs.get('settled', 0)} settled, {jobs.get('failed', 0)} failed"
                 + (f", {jobs['given_back']} given back" if jobs.get("given_back") else "")
                 if jobs else str(d.get("jobs_today_here") or 0))
        v = d.get("verification") or {}
        table.add_row(d["device"] or "-", d["name"], "online" if d["connected"] else "offline",
                      cell, today, str(d.get("running_jobs", 0)),
                      credits(d.get("pending_micro")),
                      f"{v.get('standing', '-')} ({v.get('checks', 0)} checks, "
                      f"{v.get('lost', 0)} lost)" if v else "-")
    c = doc.get("credits") or {}
    money = Table.grid(padding=(0, 3))
    for _ in range(4):
        money.add_column()
    money.add_row(*(Text(k, style="bold") for k in ("pending", "vesting", "available", "paid")))
    money.add_row(*(credits(c.get(k)) for k in ("pending_micro", "vesting_micro",
                                                 "available_micro", "paid_out_micro")))
    return Group(Panel(head, title="sparecycles agent"), table,
                 Panel(money, title="credits"))


def credits(micro) -> str:
    """Micro-credits as credits: two decimals, more when a share of a cent would vanish
    (small jobs earn fractions of a credit)."""
    if micro is None:
        return "-"
    text = f"{micro / MICRO:,.6f}".rstrip("0")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


def payout(url: str, api_key: str, *, credits_amount: str | None, everything: bool,
           idempotency_key: str) -> dict:
    """Ask the broker to pay out ``credits_amount`` (or all available credits)."""
    headers = {"Authorization": f"Bearer {api_key}", "Idempotency-Key": idempotency_key}
    try:
        if everything:
            r = httpx.get(f"{url}/v1/account", headers=headers, timeout=10)
            if r.status_code != 200:
                raise ConfigError(_problem(r))
            amount = int(r.json().get("available_micro", 0))
            amount -= amount % MICRO  # whole credits: always whole cents at any credit price
            if amount <= 0:
                raise ConfigError("no available credits to pay out yet (credits vest after "
                                  "their window; see `sparecycles agent status`)")
            body = {"amount_micro": amount}
        else:
            body = {"credits": credits_amount}
        r = httpx.post(f"{url}/v1/payouts", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach the broker at {url}: {exc}") from None
    if r.status_code != 201:
        raise ConfigError(_problem(r))
    return r.json()


def _problem(r: httpx.Response) -> str:
    try:
        p = r.json()
        return f"{p.get('detail') or p.get('title')} ({p.get('code', r.status_code)})"
    except ValueError:
        return f"HTTP {r.status_code}: {r.text[:200]}"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
