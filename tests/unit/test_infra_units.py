"""The systemd units run as their own users, never root, with no way to gain privilege;
the users they name are the ones infra/systemd/sparecycles.sysusers.conf creates; the broker's
is hardened further, and both pass `systemd-analyze verify`."""
import configparser
import shutil
import subprocess
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


def test_the_broker_unit_is_hardened():
    """The broker needs the network and its state directory, nothing else of the machine."""
    service = _service("sparecycles-broker.service")
    for key, value in {"ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                       "PrivateDevices": "yes", "CapabilityBoundingSet": "",
                       "RestrictNamespaces": "yes", "StateDirectory": "sparecycles",
                       "SystemCallArchitectures": "native", "LockPersonality": "yes"}.items():
        assert service.get(key) == value, key
    assert "Environment=SPARECYCLES_DATA_DIR=/var/lib/sparecycles" in (
        UNITS / "sparecycles-broker.service").read_text()


def _verify_root(tmp_path: Path) -> tuple[Path, list[str]]:
    """A root for `systemd-analyze verify --root`: this machine's own units (the targets ours
    name), ours, and an executable stand-in at every path an Exec line names (the test beside
    this one, tests/unit/test_infra_cli.py, checks what those commands are)."""
    system = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                   if (p / "multi-user.target").exists()), None)
    if system is None:
        pytest.skip("no systemd unit directory on this machine (make system-deps installs "
                    "systemd)")
    root = tmp_path / "root"
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    names = []
    for unit in sorted(UNITS.glob("*.service")):
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
        names.append(unit.name)
        for line in unit.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.startswith("Exec"):
                exe = root / value.lstrip("-@:+!").split()[0].lstrip("/")
                exe.parent.mkdir(parents=True, exist_ok=True)
                exe.write_text("#!/bin/sh\n")
                exe.chmod(0o755)
    return root, names


def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (make system-deps installs systemd)")
    root, names = _verify_root(tmp_path)
    out = subprocess.run([analyze, "verify", f"--root={root}", *names], capture_output=True,
                         text=True, timeout=60)
    # Unknown or misspelt directives are warnings (exit 0): any output fails the test.
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_verify_catches_a_misspelt_directive(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (make system-deps installs systemd)")
    root, names = _verify_root(tmp_path)
    unit = root / "etc/systemd/system" / names[0]
    unit.write_text(unit.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    out = subprocess.run([analyze, "verify", f"--root={root}", names[0]], capture_output=True,
                         text=True, timeout=60)
    assert "NoNewPrivilege" in out.stdout + out.stderr
