"""The systemd units run as their own users, never root, with no way to gain privilege;
the users they name are the ones infra/systemd/sparecycles.sysusers.conf creates."""
import configparser
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "infra" / "systemd"


def _service(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNITS / name)
    return parser["Service"]


@pytest.mark.parametrize("unit", ["sparecycles-agent.service", "sparecycles-broker.service"])
def test_units_run_as_their_own_user(unit):
    service = _service(unit)
    users = {line.split()[1] for line in (UNITS / "sparecycles.sysusers.conf").read_text()
             .splitlines() if line.startswith("u ")}
    assert service.get("User") in users and service.get("User") != "root"
    assert service.get("NoNewPrivileges") == "yes"


def test_the_agent_unit_delegates_its_cgroup_and_reaches_gpus():
    service = _service("sparecycles-agent.service")
    assert service.get("Delegate") == "yes"
    assert "render" in service.get("SupplementaryGroups", "").split()
