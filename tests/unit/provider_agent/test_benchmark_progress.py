"""A new agent benchmarks each plugin before it connects, which takes minutes on a CPU: it
says so, gives an estimate after the first step, and shows progress (a tqdm bar on a
terminal, log lines otherwise) (issue #30). A real echo plugin host, a plain subprocess."""
from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass

import pytest

from plugins import builtin_plugin_dir
from provider_agent.benchmark import BenchmarkProgress, benchmark_plugin
from provider_agent.host.manager import PluginHost
from sdk.protocol.manifest import Manifest, load_manifest


@dataclass
class Served:
    manifest: Manifest
    host: PluginHost


@pytest.fixture(scope="module")
def stepping_echo(tmp_path_factory):
    """The echo plugin with a benchmark of 5 progress steps (its own has none)."""
    src = builtin_plugin_dir("echo")
    folder = tmp_path_factory.mktemp("plugins") / "echo"
    folder.mkdir()
    (folder / "plugin.py").write_text((src / "plugin.py").read_text())
    (folder / "plugin.toml").write_text((src / "plugin.toml").read_text().replace(
        'inputs = { text = "benchmark", sleep_ms = 0 }',
        'inputs = { text = "benchmark", sleep_ms = 50, steps = 5 }'))
    host = PluginHost(folder, None, device="cpu")
    host.start()
    yield Served(load_manifest(folder), host)
    host.stop()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_benchmark_says_what_it_does_estimates_and_logs_progress(stepping_echo, caplog):
    caplog.set_level(logging.INFO, logger="agent.benchmark")
    progress = BenchmarkProgress(stepping_echo.manifest.ref, 4, stream=io.StringIO(),
                                 log_every_s=0.0)
    result = benchmark_plugin(stepping_echo, runs=3, progress=progress)
    assert result is not None and result.units_per_s > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "agent.benchmark"]
    assert lines[0].startswith("benchmarking echo@1.0.0 before connecting: 1 warm-up run and "
                               "3 timed runs of its benchmark (sleep_ms=50, steps=5;")
    assert re.fullmatch(r"benchmark echo@1\.0\.0: about [\d.]+ s in all \(estimated from run "
                        r"1 of 4, step 1 of 5, [\d.]+ s so far\)", lines[1]), lines[1]
    steps = [line for line in lines[2:-1] if "left" in line]
    assert steps and all(re.fullmatch(r"benchmark echo@1\.0\.0: run \d of 4(, step \d of 5| done); "
                                      r"[\d.]+ s so far, about [\d.]+ s left", line)
                         for line in steps), steps
    assert "run 4 of 4, step 4 of 5" in " ".join(steps)
    assert re.fullmatch(r"benchmark echo@1\.0\.0: [\d.e+]+ work units/s \(3 runs of 1\.05 "
                        r"units; [\d.]+ s in all\)", lines[-1]), lines[-1]


def test_benchmark_on_a_terminal_draws_a_tqdm_bar(stepping_echo):
    screen = Terminal()
    progress = BenchmarkProgress(stepping_echo.manifest.ref, 4, stream=screen)
    assert benchmark_plugin(stepping_echo, runs=3, progress=progress) is not None
    drawn = screen.getvalue()
    assert "benchmark echo@1.0.0 (run 4 of 4): 100%" in drawn
    assert " 25%|" in drawn or " 20%|" in drawn  # drawn as it went, not only at the end


def test_periodic_lines_are_spaced_by_the_interval():
    now = [0.0]
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("agent.benchmark")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        progress = BenchmarkProgress("sd15@1.0.0", 4, stream=io.StringIO(), log_every_s=10.0,
                                     clock=lambda: now[0])
        for run in range(4):
            progress.run_started(run)
            for step in range(1, 11):
                now[0] += 1.0  # one second a step: 40 s in all
                progress.step(step, 10)
            progress.run_done(run)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert lines[0] == ("benchmark sd15@1.0.0: about 40 s in all (estimated from run 1 of 4, "
                        "step 1 of 10, 1.0 s so far)")
    assert lines[1] == "benchmark sd15@1.0.0: run 2 of 4, step 1 of 10; 11 s so far, about 29 s left"
    assert len(lines) == 4  # the estimate, then one line every 10 s
