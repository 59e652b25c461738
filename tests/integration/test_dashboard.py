"""The Grafana dashboard and the Prometheus configuration in infra/ (issue #25): every
panel's query names only metrics a live broker or agent really exports (read from their
/metrics), and the scrape configuration names both."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from provider_agent.gpu_usage import NvmlUsageSource
from provider_agent.telemetry import Telemetry
from sdk import Client
from tests.unit.provider_agent.test_telemetry import GPU, FakeNvml

INFRA = Path(__file__).resolve().parents[2] / "infra"
DASHBOARD = INFRA / "grafana" / "sparecycles-dashboard.json"
_METRIC = re.compile(r"\b(sparecycles_[a-z0-9_]+)")
_SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def exported(text: str) -> set[str]:
    """The sample names an exposition text can have (from its # TYPE lines: a family with
    no sample yet counts too)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        if kind == "counter":
            names.add(name if name.endswith("_total") else name + "_total")
        else:
            names.update(name + s for s in _SUFFIXES.get(kind, ("",)))
    return names


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            out += [(sub["title"], t["expr"]) for t in sub.get("targets", [])]
    return out


@pytest.fixture
def scraped(live_broker, start_agent):
    agent = start_agent("dash", metrics_addr="127.0.0.1:0",
                        telemetry=Telemetry(NvmlUsageSource(FakeNvml([GPU])), interval_s=0))
    with Client(live_broker.url, live_broker.key("client")) as client:
        client.generate("echo", text="for the dashboard")
    broker = httpx.get(f"{live_broker.url}/metrics", timeout=10).text
    local = httpx.get(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10).text
    return exported(broker) | exported(local)


def test_every_panel_query_names_an_exported_metric(scraped):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dashboard)
    assert len(queries) >= 20
    missing = [(title, name) for title, expr in queries for name in _METRIC.findall(expr)
               if name not in scraped]
    assert not missing, f"panels query metrics nobody exports: {missing}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for wanted in ("settled", "latency", "queue", "providers online", "gpu", "earnings",
                   "disputes"):
        assert wanted in titles, f"no panel about {wanted}"


def test_every_exported_family_is_named_and_described(live_broker):
    text = httpx.get(f"{live_broker.url}/metrics", timeout=10).text
    typed = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
    helped = set(re.findall(r"^# HELP (\S+) \S", text, re.MULTILINE))
    assert typed and set(typed) <= helped
    assert all(re.fullmatch(r"sparecycles_[a-z0-9_]+", name) for name in typed)
    # Units in the names of the latency histograms (Prometheus's conventions).
    histograms = re.findall(r"^# TYPE (\S+) histogram$", text, re.MULTILINE)
    assert histograms and all(name.endswith("_seconds") for name in histograms)


def test_the_scrape_configuration_names_broker_and_agents():
    import yaml  # noqa: PLC0415 - PyYAML comes with the dev tools

    cfg = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"sparecycles-broker", "sparecycles-agents"}
    assert all(j["metrics_path"] == "/metrics" and j["static_configs"][0]["targets"]
               for j in jobs.values())
