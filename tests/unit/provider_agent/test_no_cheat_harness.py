"""The production agent carries no cheating harness (issue #23): no module of it, no
environment switch, no code path. The harness (bench/cheating_host.py) wraps the real
plugin host from outside, injected as the agent's host factory; the agent's default is the
real ``PluginHost``."""
from __future__ import annotations

import inspect
import io
import tokenize
from pathlib import Path

import provider_agent
from provider_agent.agent import Agent
from provider_agent.cli import cmd_run
from provider_agent.fleet import build_fleet
from provider_agent.host.manager import PluginHost

PACKAGE = Path(provider_agent.__file__).resolve().parent


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_cheat_module_in_the_agent_package():
    assert not [p for p in PACKAGE.rglob("*") if "cheat" in p.name.lower()]


def test_no_cheat_name_env_switch_or_harness_import_in_its_code():
    found = []
    for path in _sources():
        toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for i, tok in enumerate(toks):
            where = f"{path.relative_to(PACKAGE)}:{tok.start[0]}"
            if tok.type == tokenize.NAME and "cheat" in tok.string.lower():
                found.append(f"{where}: name {tok.string}")
            if tok.type == tokenize.STRING and "SPARECYCLES_CHEAT" in tok.string:
                found.append(f"{where}: the SPARECYCLES_CHEAT switch")
            if (tok.type == tokenize.NAME and tok.string in ("import", "from")
                    and i + 1 < len(toks) and toks[i + 1].string == "bench"):
                found.append(f"{where}: imports bench")
    assert not found, found


def test_hosts_are_built_by_an_injected_factory_whose_default_is_the_real_host():
    for fn in (Agent.__init__, build_fleet, cmd_run):
        params = inspect.signature(fn).parameters
        assert not [n for n in params if "cheat" in n], fn
        assert "host_factory" in params, fn
    assert inspect.signature(Agent.__init__).parameters["host_factory"].default is PluginHost
    assert inspect.signature(build_fleet).parameters["host_factory"].default is PluginHost
