"""The Helm chart (infra/helm/sparecycles) renders with its default values through Helm's
own engine: helm-python-sdk binds Helm's Go SDK (the same template engine and lint as the
`helm` binary, v4), so nothing here re-implements Go templates. Every rendered manifest is
YAML of the kinds the chart promises, wired to the Secrets that must exist already."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "infra" / "helm" / "sparecycles"


def _helm():
    try:
        import helm_python
    except ImportError as exc:  # the dev extra installs it (pyproject.toml)
        pytest.skip(f"helm-python-sdk (Helm's Go SDK) is not installed: {exc}; "
                    "pip install -e '.[dev]'")
    return helm_python


def render(values: dict | None = None) -> list[dict]:
    """Every manifest of the chart rendered as `helm template sc` would, parsed."""
    helm = _helm()
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name="sc", namespace="sparecycles", is_install=True)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def notes() -> str:
    helm = _helm()
    with helm.Chart.load(CHART) as chart:
        return chart.render(None, name="sc", namespace="sparecycles")["sparecycles/templates/NOTES.txt"]


def _one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} rendered"
    return found[0]


def test_the_chart_lints_clean():
    report = _helm().lint(CHART, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # warnings or errors


def test_defaults_render_every_part_of_the_network():
    docs = render()
    assert sorted(d["kind"] for d in docs) == ["DaemonSet", "Deployment", "Ingress", "Ingress",
                                                "Job", "Service"]
    deploy = _one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] != 0
    (broker,) = pod["containers"]
    assert broker["args"] == ["serve"]
    assert broker["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert broker["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert broker["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert broker["resources"]["requests"]["cpu"] and broker["resources"]["requests"]["memory"]
    assert broker["envFrom"] == [{"secretRef": {"name": "sparecycles-broker"}}]
    assert broker["securityContext"]["allowPrivilegeEscalation"] is False
    tls = {v["name"]: v for v in pod["volumes"]}["tls"]
    assert tls["secret"]["secretName"] == "sparecycles-broker-tls"
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert _one(docs, "Service")["spec"]["selector"] == selector


def test_migrate_runs_as_a_hook_before_install_and_upgrade():
    job = _one(render(), "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["migrate"]
    assert container["envFrom"] == [{"secretRef": {"name": "sparecycles-broker"}}]


def test_ingress_serves_tls_for_rest_and_grpc():
    ingresses = [d for d in render() if d["kind"] == "Ingress"]
    ports = set()
    for ingress in ingresses:
        (tls,) = ingress["spec"]["tls"]
        assert tls["secretName"] == "sparecycles-ingress-tls"
        assert tls["hosts"] == [ingress["spec"]["rules"][0]["host"]]
        ports.add(ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"]["name"])
    assert ports == {"https", "grpc"}
    backends = {i["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"]
                for i in ingresses}
    assert backends == {"HTTPS", "GRPCS"}


def test_the_agent_is_a_daemonset_on_gpu_nodes():
    ds = _one(render(), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (agent,) = pod["containers"]
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert agent["args"][:2] == ["--broker", "sc-sparecycles-broker:50051"]
    assert agent["envFrom"] == [{"secretRef": {"name": "sparecycles-agent"}}]
    assert agent["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] >= 600  # SIGTERM drains running jobs
    # bubblewrap's fresh /proc: Unmasked, which Kubernetes 1.31+ allows only with a user
    # namespace (hostUsers: false); with the host's users the field is left out, not refused.
    assert pod["hostUsers"] is False and agent["securityContext"]["procMount"] == "Unmasked"
    pod = _one(render({"agent": {"hostUsers": True}}), "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostUsers"] is True
    assert "procMount" not in pod["containers"][0]["securityContext"]


def test_service_monitor_scrapes_every_replica_over_tls():
    docs = render({"serviceMonitor": {"enabled": True}})
    monitor = _one(docs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "https"
    service = _one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_optional_parts_switch_off():
    docs = render({"agent": {"enabled": False}, "ingress": {"enabled": False},
                   "migrate": {"enabled": False}})
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Service"]
