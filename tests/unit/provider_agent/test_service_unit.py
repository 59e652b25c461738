"""`sparecycles agent install-service`: the systemd units it writes (issue #26)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from provider_agent.config import AgentConfig, save_config
from provider_agent.errors import ConfigError
from provider_agent.service import UNIT_NAME, UnitSpec, install, plan, render_unit

PROJECT = Path(__file__).resolve().parents[3]


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "agent-home"
    save_config(AgentConfig(api_key="k"), h)
    return h


def verify(path: Path) -> None:
    """systemd's own check of the unit, where this machine has it."""
    if shutil.which("systemd-analyze") is None:
        return
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                         text=True)
    bad = [line for line in out.stderr.splitlines()
           if UNIT_NAME in line and "Special user nobody" not in line]
    assert not bad, out.stderr


def test_user_unit_drains_logs_to_the_journal_and_runs_as_the_user(home, tmp_path):
    spec = plan(mode=None, run_as=None, home=home, exec_path="/usr/bin/true", euid=1000,
                extra_args=("--idle-only", "--schedule", "22:00-07:00"))
    assert spec.mode == "user"
    path, done = install(spec, directory=tmp_path / "units", start=False)
    text = path.read_text()
    assert "User=" not in text and "WantedBy=default.target" in text
    assert 'ExecStart=/usr/bin/true agent run --idle-only --schedule 22:00-07:00' in text
    assert f"SPARECYCLES_AGENT_HOME={home.resolve()}" in text
    for line in ("KillSignal=SIGTERM", "KillMode=mixed", "TimeoutStopSec=900",
                 "StandardOutput=journal", "Delegate=yes", "Restart=on-failure"):
        assert line in text.splitlines()
    assert done == [f"wrote {path}"]
    verify(path)
    assert install(spec, directory=tmp_path / "units", start=False)[1] == [f"{path} unchanged"]


@pytest.mark.skipif(os.geteuid() != 0, reason="system units are installed by root")
def test_system_unit_runs_as_a_non_root_account(home, tmp_path):
    with pytest.raises(ConfigError, match="does not run as root"):
        plan(mode="system", run_as="root", home=home, exec_path="/usr/bin/true")
    with pytest.raises(ConfigError, match="there is no user 'no-such-user-26'.*useradd"):
        plan(mode="system", run_as="no-such-user-26", home=home, exec_path="/usr/bin/true")
    with pytest.raises(ConfigError, match="chown -R nobody"):
        plan(mode="system", run_as="nobody", home=home, exec_path="/usr/bin/true")
    with pytest.raises(ConfigError, match="would run the agent as root"):
        plan(mode="user", run_as=None, home=home, exec_path="/usr/bin/true")
    for p in (home, *home.iterdir()):
        os.chown(p, 65534, -1)
    spec = plan(mode="system", run_as="nobody", home=home, exec_path="/usr/bin/true")
    path, _ = install(spec, directory=tmp_path / "system", start=False)
    text = path.read_text()
    assert "User=nobody" in text and "WantedBy=multi-user.target" in text
    verify(path)


def test_without_init_it_says_what_to_run(tmp_path):
    with pytest.raises(ConfigError, match="agent init"):
        plan(mode="user", run_as=None, home=tmp_path, exec_path="x", euid=1000)


def test_reinstalling_a_running_unit_restarts_it_so_the_old_agent_drains(home, tmp_path):
    """An upgrade: install-service again while the unit runs -> restart (SIGTERM: drain)."""
    calls = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                    '[ "$2" = "is-active" ] && exit 0\nexit 0\n')
    fake.chmod(0o755)
    spec = plan(mode="user", run_as=None, home=home, exec_path="/usr/bin/true", euid=1000)
    _, done = install(spec, directory=tmp_path / "units", systemctl=str(fake))
    assert calls.read_text().splitlines() == [
        "--user daemon-reload", f"--user enable {UNIT_NAME}",
        f"--user is-active --quiet {UNIT_NAME}", f"--user restart {UNIT_NAME}"]
    assert "drained" in done[-1]


def test_infra_unit_is_the_system_unit_install_service_writes():
    expected = render_unit(UnitSpec(mode="system",
                                    exec_path="/opt/sparecycles/.venv/bin/sparecycles",
                                    home="/etc/sparecycles/agent",
                                    user="sparecycles-agent", group="sparecycles-agent"))
    assert (PROJECT / "infra" / "systemd" / "sparecycles-agent.service").read_text() == expected
