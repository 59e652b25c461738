"""Several GPUs (issue #26): one agent per device, each with its own plugin host,
benchmark, asks and provider; each sandbox sees only its own GPU's device node, checked
from inside the sandbox. The devices are fake nodes in a temporary /dev; a third device
whose node is missing is taken out while the other two serve."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from plugins import BUILTIN_DIR
from provider_agent.config import AgentConfig, save_config
from provider_agent.fleet import build_fleet
from provider_agent.sandbox import Sandbox
from sdk import Client

from tests.integration.conftest import LiveBroker

_ok, _reason = Sandbox.available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"sandbox unavailable: {_reason}")
FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "plugins"


@pytest.fixture
def fake_dev(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
        os.chmod(dev / name, 0o666)  # as NVIDIA's nodes are
    return dev


def test_two_devices_two_hosts_separate_asks_own_nodes(tmp_path, fake_dev):
    broker = LiveBroker(tmp_path, plugin_dirs=[BUILTIN_DIR, FIXTURES])
    home = tmp_path / "home"
    provider_key = broker.key("provider")
    cfg = AgentConfig(broker=broker.grpc, api_key=provider_key, name="rig",
                      plugins=["devices"], devices=["cuda:0", "cuda:1", "cuda:2"],
                      asks={"devices": 7}, device_slots={"cuda:1": 2},
                      device_asks={"cuda:1": {"devices": 9}})
    save_config(cfg, home)
    fleet = build_fleet(cfg, home=home, plugin_dirs={"devices": FIXTURES / "devices"},
                        sandboxed=True, dev_root=fake_dev)
    try:
        fleet.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                all(a.provider_id for a in fleet.agents[:2]) and fleet.slots[2].ended):
            time.sleep(0.05)
        one, two, three = fleet.slots
        # The device without a node is out; the two others serve, as two providers.
        assert three.error and "nvidia2" in three.error
        assert one.agent.provider_id and two.agent.provider_id
        assert one.agent.provider_id != two.agent.provider_id
        assert one.agent.name == "rig/cuda:0" and two.agent.name == "rig/cuda:1"
        # Each has its own benchmark and standing ask in the broker's book.
        asks = httpx.get(f"{broker.url}/v1/asks",
                         headers={"Authorization": f"Bearer {provider_key}"}).json()["data"]
        mine = {a["provider_id"]: a for a in asks if a["plugin"] == "devices"}
        assert set(mine) >= {one.agent.provider_id, two.agent.provider_id}
        assert mine[one.agent.provider_id]["price_micro_per_unit"] == 7
        assert mine[two.agent.provider_id]["price_micro_per_unit"] == 9  # its own ask
        assert all(mine[p]["claimed_units_per_s"]
                   for p in (one.agent.provider_id, two.agent.provider_id))
        sessions = broker.services.dispatcher
        assert sessions.session(one.agent.provider_id).slots == 1
        assert sessions.session(two.agent.provider_id).slots == 2
        # agent.toml keeps the machine's settings; only the broker's key was pinned.
        from provider_agent.config import load_config

        saved = load_config(home)
        assert saved.broker_public_key and saved.devices == cfg.devices
        assert saved.device == "auto" and saved.name == "rig"
        # From inside each sandbox: its own GPU node and the shared ones, never the other's.
        for slot, own, other in ((one, "nvidia0", "nvidia1"), (two, "nvidia1", "nvidia0")):
            host = slot.agent.plugins["devices"].host
            out = json.loads(host.run("probe", {"note": "x"}, wall_clock_s=10).outputs[0].data)
            assert out["device"] == slot.device
            assert out["nodes"].get(own) is True and "nvidiactl" in out["nodes"]
            assert other not in out["nodes"] and "nvidia2" not in out["nodes"]
        # Jobs run on both; the status file names every device's state.
        client = Client(broker.url, broker.key("client"))
        jobs = [client.jobs.create("devices", note=str(i)) for i in range(6)]
        for job in jobs:
            job.wait(timeout=30)
        fleet.write_status()
        status = json.loads((home / "status.json").read_text())
        states = {d["device"]: d["state"] for d in status["devices"]}
        assert states["cuda:2"] == "failed"
        assert states["cuda:0"] in ("ready", "working") and states["cuda:1"] in ("ready", "working")
        assert sum(d.get("jobs_today", 0) for d in status["devices"]) >= 6
    finally:
        fleet.stop()
        assert fleet.wait(timeout_s=20) == 0  # two devices stopped normally
        broker.stop()


def test_a_device_whose_host_keeps_dying_is_taken_out(tmp_path):
    """Three jobs in a row lose the plugin host: the device is taken out (its agent stops
    and says why in status.json) instead of failing every job sent to it."""
    from provider_agent.agent import DEVICE_FAILURES_MAX

    broker = LiveBroker(tmp_path, plugin_dirs=[BUILTIN_DIR, FIXTURES], max_attempts=1)
    home = tmp_path / "home"
    cfg = AgentConfig(broker=broker.grpc, api_key=broker.key("provider"), name="flaky",
                      plugins=["devices"], device="cpu")
    save_config(cfg, home)
    fleet = build_fleet(cfg, home=home, plugin_dirs={"devices": FIXTURES / "devices"},
                        sandboxed=False)
    try:
        fleet.start()
        [agent] = fleet.agents
        deadline = time.monotonic() + 30
        while not agent.provider_id and time.monotonic() < deadline:
            time.sleep(0.05)
        client = Client(broker.url, broker.key("client"))
        assert client.generate("devices", note="fine", timeout=30).json[0]["note"] == "fine"
        for i in range(DEVICE_FAILURES_MAX):
            _wait_quietly(client.jobs.create("devices", note=str(i), crash=True))
        assert fleet.wait(timeout_s=20) == 2  # its only device failed
        assert "lost their plugin host" in agent.failed_reason
        status = json.loads((home / "status.json").read_text())
        assert status["devices"][0]["state"] == "failed"
    finally:
        fleet.stop()
        broker.stop()


def _wait_quietly(job):
    try:
        job.wait(timeout=30)
    except Exception:  # noqa: BLE001 - the job fails, as it should
        pass
