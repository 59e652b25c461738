"""bench/cheaters.py runs every behaviour of the cheat registry (bench/cheating_host.py),
and the behaviours it scripts itself (``SCRIPTED``),
so a mode appended there is measured without touching the bench; bench/cheat_agent.py
starts the real agent with the harness's cheating hosts injected."""
import importlib.util
from pathlib import Path

from bench import cheating_host as cheats

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cheaters.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cheaters", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_registered_cheat_mode_is_a_bench_behaviour():
    bench = _bench()
    assert set(bench.BEHAVIOURS) == set(cheats.MODES) - set(bench.SKIPPED) | set(bench.SCRIPTED)
    assert list(bench.BEHAVIOURS) == [m for m in cheats.MODES if m not in bench.SKIPPED] + \
        list(bench.SCRIPTED)
    # a scripted behaviour (issue #20: canary-dodger) has its own runner, and is no host mode
    assert all(b in bench.RUNNERS and b not in cheats.MODES for b in bench.SCRIPTED)
    # a mode appended without bench inputs runs on the plugin its name suggests
    assert bench.bench_inputs("half-steps") == ("sd15", {})
    assert bench.bench_inputs("some-text-cheat") == ("llama", {})
    for mode in cheats.TRUST_MODES:
        assert mode in bench.RUNNERS


def test_cheat_agent_runs_the_real_agent_with_cheating_hosts_injected(monkeypatch, tmp_path):
    from bench import cheat_agent

    seen = {}

    def fake_run(args, *, host_factory):
        seen.update(home=args.home, factory=host_factory)
        return 0

    monkeypatch.setattr(cheat_agent, "cmd_run", fake_run)
    assert cheat_agent.main(["--mode", "wrong-seed", "--seed", "1", "--", "agent", "run",
                             "--home", str(tmp_path)]) == 0
    assert isinstance(seen["factory"], cheats.CheatingHosts)
    assert seen["factory"].cheat.mode == "wrong-seed" and str(seen["home"]) == str(tmp_path)
    # anything but `agent run` after --, or a cheat that cannot be, is refused
    assert cheat_agent.main(["--mode", "wrong-seed", "--", "agent", "status"]) == 2
    assert cheat_agent.main(["--mode", "other-model", "--", "agent", "run"]) == 2
