"""The systemd units run as their own users, never root, with no way to gain privilege;
the users they name are the ones infra/systemd/sparecycles.sysusers.conf creates; the broker's
is hardened further, and both pass `systemd-analyze verify`."""
import configparser
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "infra" / "systemd"
# The systemd the units were verified with (Debian 12's): every directive they use is known
# to it, so there an unknown one is a misspelling.
VERIFIED_WITH = 252


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


def _verify(analyze: str, root: Path, names: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`systemd-analyze verify` of our units, and the lines of its output that are about
    them (the rest are about this machine's own units, or systemd's environment)."""
    out = subprocess.run([analyze, "verify", f"--root={root}", *names], capture_output=True,
                         text=True, timeout=60)
    lines = (out.stdout + out.stderr).splitlines()
    ours = [line for line in lines if any(name in line for name in names)]
    others = [line for line in lines if line not in ours]
    if others:
        warnings.warn("systemd-analyze verify, not about our units: " + " | ".join(others))
    if out.returncode and not ours:
        pytest.skip(f"systemd-analyze verify failed on something other than our units "
                    f"({out.returncode}): {' | '.join(others)[-800:]}")
    return out, ours


def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (make system-deps installs systemd)")
    root, names = _verify_root(tmp_path)
    out, ours = _verify(analyze, root, names)
    version = subprocess.run([analyze, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    version = int(re.match(r"systemd (\d+)", version).group(1))
    unknown = [line for line in ours if re.search(r"Unknown (key|lvalue)", line)]
    if version < VERIFIED_WITH and ours and unknown == ours:
        # An older systemd lacking a directive the units use: that, not a misspelling.
        pytest.skip(f"systemd {version} is older than {VERIFIED_WITH}, which the units are "
                    f"verified with, and does not know: {' | '.join(unknown)}")
    # Unknown or misspelt directives are warnings (exit 0): any line about our units fails.
    assert out.returncode == 0 and not ours, "\n".join(ours) or out.stderr


def test_verify_catches_a_misspelt_directive(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (make system-deps installs systemd)")
    root, names = _verify_root(tmp_path)
    unit = root / "etc/systemd/system" / names[0]
    unit.write_text(unit.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    _, ours = _verify(analyze, root, names[:1])
    assert any("NoNewPrivilege" in line for line in ours), ours
