"""bench/cheaters.py runs every behaviour of the cheat registry (bench/cheating_host.py),
so a mode appended there is measured without touching the bench."""
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
    assert set(bench.BEHAVIOURS) == set(cheats.MODES) - set(bench.SKIPPED)
    assert list(bench.BEHAVIOURS) == [m for m in cheats.MODES if m not in bench.SKIPPED]
    # a mode appended without bench inputs runs on the plugin its name suggests
    assert bench.bench_inputs("half-steps") == ("sd15", {})
    assert bench.bench_inputs("some-text-cheat") == ("llama", {})
    for mode in cheats.TRUST_MODES:
        assert mode in bench.RUNNERS
