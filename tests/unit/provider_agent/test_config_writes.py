"""agent.toml is replaced whole, never truncated in place: the agents of one machine's fleet
pin the broker's key into it at the same moment (each reads, sets the key, writes), and a
read that met a half-written file loaded as the defaults and wrote them back, losing the
machine's devices (seen as a flaky tests/integration/test_agent_devices.py)."""
import stat
import threading

from provider_agent.config import (AgentConfig, config_path, load_config, pin_broker_key,
                                   save_config)


def test_concurrent_key_pins_and_reads_never_see_a_partial_file(tmp_path):
    cfg = AgentConfig(broker="127.0.0.1:1", api_key="sk", name="rig",
                      devices=[f"cuda:{i}" for i in range(8)], asks={"echo": 7})
    save_config(cfg, tmp_path)
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            seen.append(load_config(tmp_path).devices)

    def pin(key):
        for _ in range(200):
            pin_broker_key(key, tmp_path)
            save_config(load_config(tmp_path), tmp_path)  # the read-modify-write of a pin

    readers = [threading.Thread(target=read) for _ in range(2)]
    pinners = [threading.Thread(target=pin, args=("ab" * 32,)) for _ in range(2)]
    for t in readers + pinners:
        t.start()
    for t in pinners:
        t.join(60)
    stop.set()
    for t in readers:
        t.join(10)
    saved = load_config(tmp_path)
    assert saved.devices == cfg.devices and saved.name == "rig" and saved.asks == {"echo": 7}
    assert saved.broker_public_key == "ab" * 32
    assert seen and all(d == cfg.devices for d in seen)
    path = config_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # still the owner's alone
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
