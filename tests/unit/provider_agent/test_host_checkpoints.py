"""Checkpoints over the agent ↔ plugin host pipe: the host relays each checkpoint the plugin
writes, and a run given a checkpoint resumes from it (echo plugin, real host process)."""
import json

from plugins import builtin_plugin_dir
from provider_agent.host.manager import PluginHost

ECHO = builtin_plugin_dir("echo")


def test_checkpoints_are_relayed_and_a_run_resumes_from_one():
    host = PluginHost(ECHO, None, device="cpu")
    host.start()
    try:
        inputs = {"text": "hi", "sleep_ms": 100, "steps": 10}
        got: list[tuple[int, bytes]] = []
        first = host.run("j1", inputs, wall_clock_s=30, checkpoint_every=4,
                         on_checkpoint=lambda step, data: got.append((step, data)))
        assert [s for s, _ in got] == [4, 8]
        assert json.loads(got[-1][1]) == {"echo_step": 8}
        steps: list[int] = []
        second = host.run("j1", inputs, wall_clock_s=30, resume_from=got[0][1],
                          on_progress=lambda step, total, msg: steps.append(step))
        assert steps[0] == 4 and steps[1:] == [5, 6, 7, 8, 9, 10]
        assert second.outputs[0].data == first.outputs[0].data
    finally:
        host.stop()
