"""Every `sparecycles` command, flag and environment variable that the images, the compose
files, the Helm chart, the systemd units and infra/README.md use exists: each invocation is
parsed by the CLI's own parser (the one `sparecycles … --help` prints), and every
SPARECYCLES_* variable named anywhere in infra/ is one the settings module reads or a
command's --help names."""
from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from tests.infra_paths import infra_files

from sdk.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"

ENTRYPOINT_SH = INFRA / "docker" / "agent-entrypoint.sh"


@lru_cache(maxsize=1)
def parser() -> argparse.ArgumentParser:
    return build_parser()


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _all_parsers(p=None, path=()) -> dict[tuple, argparse.ArgumentParser]:
    p = p or parser()
    found = {path: p}
    for name, sub in _subparsers(p).items():
        found.update(_all_parsers(sub, path + (name,)))
    return found


def check_invocation(argv: list[str], where: str) -> None:
    """`sparecycles ARGV` is a command the CLI accepts: parse it as `main` would."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            pytest.fail(f"{where}: `sparecycles {shlex.join(argv)}` is refused by the CLI: "
                        f"{err.getvalue().strip().splitlines()[-1]}")


def check_mention(argv: list[str], where: str) -> None:
    """A command named in prose (`sparecycles broker dev-cert --host`): its words and flags
    exist, though it need not carry every required argument."""
    p, path = parser(), []
    words = list(argv)
    while words and words[0] in _subparsers(p):
        path.append(words[0])
        p = _subparsers(p)[words.pop(0)]
    assert path, f"{where}: `sparecycles {' '.join(argv)}` names no command"
    if _subparsers(p) and words and not words[0].startswith("-"):
        pytest.fail(f"{where}: `sparecycles {' '.join(path)}` has no command {words[0]!r} "
                    f"(it has {', '.join(_subparsers(p))})")
    flags = {o for a in p._actions for o in a.option_strings}
    for word in words:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag != "--":
            assert flag in flags, (f"{where}: `sparecycles {' '.join(path)}` has no {flag} "
                                   f"(it has {', '.join(sorted(flags))})")


def _agent_entrypoint(args: list[str]) -> list[list[str]]:
    """What agent-entrypoint.sh runs for these container arguments."""
    init, _, run = [], None, []
    target = init
    for a in args:
        if a == "--" and target is init:
            target = run
            continue
        target.append(a)
    return [["agent", "init", "--force", *init], ["agent", "run", *run]]


def _broker_image(args: list[str]) -> list[list[str]]:
    return [["broker", *args]]


def _compose_invocations() -> list[tuple[str, list[str]]]:
    found = []
    services = yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]
    for name, spec in services.items():
        image = spec.get("image", "")
        if "sparecycles-broker" not in image:
            continue
        if "entrypoint" in spec:  # a shell line: every sparecycles command in it
            shell = " ".join(spec["entrypoint"][2:] + spec["command"])
            found += [(f"compose.yaml {name}", argv) for argv in _shell_commands(shell)]
        else:
            found += [(f"compose.yaml {name}", a) for a in _broker_image(spec["command"])]
    (agent,) = yaml.safe_load((INFRA / "compose.agent.yaml").read_text())["services"].values()
    found += [("compose.agent.yaml agent", a) for a in _agent_entrypoint(agent["command"])]
    return found


def _shell_commands(shell: str) -> list[list[str]]:
    try:
        words = shlex.split(shell, comments=True)
    except ValueError:  # prose around a command (an apostrophe): words as written
        words = shell.split()
    commands, current = [], None
    for word in words:
        if word in ("||", "&&", ";", "|"):
            current = None
        elif current is not None:
            current.append(word)
        elif word == "sparecycles" or word.endswith("/bin/sparecycles"):
            current = []
            commands.append(current)
    # `sparecycles` as a word of its own (a user's name) is no command
    groups = _subparsers(parser())
    return [c for c in commands if c and c[0] in groups]


def _dockerfile_invocations() -> list[tuple[str, list[str]]]:
    found = []
    for dockerfile in sorted((INFRA / "docker").glob("*.Dockerfile")):
        text = re.sub(r"\\\n", " ", dockerfile.read_text())
        steps = {}
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                op, _, arg = line.strip().partition(" ")
                steps[op.upper()] = arg.strip()
                if op.upper() == "RUN":
                    found += [(dockerfile.name, a) for a in _shell_commands(arg)]
        entry = json.loads(steps["ENTRYPOINT"])
        cmd = json.loads(steps.get("CMD", "[]"))
        if entry[0] == "sparecycles":
            found.append((dockerfile.name, entry[1:] + cmd))
        else:
            assert entry == ["/opt/sparecycles/agent-entrypoint.sh"], entry
    return found


def _chart_invocations() -> list[tuple[str, list[str]]]:
    from tests.unit.test_infra_helm import render

    found = []
    for doc in render({"serviceMonitor": {"enabled": True}}):
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []):
            where = f"chart {doc['kind']} {container['name']}"
            if "sparecycles-broker" in container["image"]:
                found += [(where, a) for a in _broker_image(container["args"])]
            elif "sparecycles-agent" in container["image"]:
                found += [(where, a) for a in _agent_entrypoint(container["args"])]
    return found


def _unit_invocations() -> list[tuple[str, list[str]]]:
    found = []
    for unit in sorted((INFRA / "systemd").glob("*.service")):
        for line in unit.read_text().splitlines():
            key, _, value = line.partition("=")
            if key in ("ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload"):
                found += [(unit.name, a) for a in _shell_commands(value)]
    return found


def _check_all(every) -> set[tuple[str, ...]]:
    for where, argv in every:
        if "--help" in argv:
            check_mention(argv, where)
        else:
            check_invocation(argv, where)
    return {tuple(argv[:2]) for _, argv in every}


RUN = {("broker", "serve"), ("broker", "migrate"), ("agent", "init"), ("agent", "run")}


def test_every_command_the_images_compose_and_units_run_is_accepted_by_the_cli():
    ran = _check_all(_dockerfile_invocations() + _compose_invocations() + _unit_invocations())
    assert RUN | {("broker", "dev-cert")} <= ran


def test_every_command_the_chart_runs_is_accepted_by_the_cli():
    assert RUN <= _check_all(_chart_invocations())


def test_the_agent_entrypoint_runs_init_then_run():
    text = ENTRYPOINT_SH.read_text()
    assert 'sparecycles agent init --force "${init[@]}"' in text
    assert 'exec sparecycles agent run "$@"' in text


def _mentions() -> list[tuple[str, list[str]]]:
    found = []
    for path in infra_files():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        snippets = re.findall(r"`(sparecycles [^`]+)`", text)
        if path.suffix == ".md":  # command lines of code blocks
            for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
                snippets += [l for l in re.sub(r"\\\n\s*", " ", block).splitlines()]
        elif path.suffix in (".txt", ".example", ".Dockerfile", ".service", ".sh", ".yaml"):
            snippets += re.findall(r"(?:^|\s)(sparecycles (?:broker|agent) [^\n`#]*)", text)
        for snippet in snippets:
            found += [(where, argv) for argv in _shell_commands(
                re.sub(r"[<>]", "", snippet).replace("…", "x"))]
    return found


def test_every_command_named_in_infra_exists():
    mentions = _mentions()
    assert len(mentions) > 10
    for where, argv in mentions:
        check_mention(argv, where)


def known_variables() -> set[str]:
    from broker.settings import Settings

    known = set(re.findall(r"\b((?:SPARECYCLES|AWS)_[A-Z0-9_]+)",
                           inspect.getsource(Settings.from_env)))
    for p in _all_parsers().values():
        known |= set(re.findall(r"\$(SPARECYCLES_[A-Z0-9_]+)", p.format_help()))
    return known


def test_every_variable_infra_sets_is_read_by_the_broker_or_the_cli():
    known = known_variables()
    assert {"SPARECYCLES_DB_URL", "SPARECYCLES_API_KEY", "SPARECYCLES_AGENT_HOME",
            "AWS_ACCESS_KEY_ID"} <= known
    for path in infra_files():
        used = set(re.findall(r"\b(SPARECYCLES_[A-Z0-9_]+)\b", path.read_text()))
        unknown = sorted(used - known)
        assert not unknown, f"{path.relative_to(ROOT)} names {unknown}, which nothing reads"


def test_a_misspelt_flag_or_variable_would_be_caught():
    with pytest.raises(pytest.fail.Exception, match="--grcp"):
        check_invocation(["broker", "serve", "--grcp", "0.0.0.0:1"], "here")
    with pytest.raises(AssertionError, match="--ca-fil"):
        check_mention(["agent", "init", "--ca-fil", "x"], "here")
    assert "SPARECYCLES_DB_URI" not in known_variables()


def test_the_parser_checked_is_the_installed_command(monkeypatch):
    """The parser these checks use is the one `sparecycles … --help` prints."""
    import subprocess
    import sys

    monkeypatch.setenv("COLUMNS", "100")
    exe = Path(sys.executable).with_name("sparecycles")
    if not exe.exists():
        pytest.skip(f"no sparecycles script beside {sys.executable} (pip install -e .)")
    for path in (("broker", "serve"), ("agent", "init")):
        printed = subprocess.run([str(exe), *path, "--help"], capture_output=True, text=True,
                                 timeout=120, env={**os.environ, "COLUMNS": "100"}).stdout
        assert printed == _all_parsers()[path].format_help()
