"""A real broker (uvicorn + grpc.aio on one event loop, dispatcher) in this process, on
loopback ports."""
from __future__ import annotations

import threading
import time

import pytest

from broker.server import BrokerServer
from broker.settings import Settings


def seen_provider(services, plugins=("echo",), name: str = "seen-a-moment-ago"):
    """A provider whose agent connected a moment ago advertising ``plugins`` (as the
    gateway records one) and is not connected now: a provider the broker knows, so jobs
    for those plugins are admitted (see broker/providers/presence.py) and stay queued."""
    from sdk.protocol.signing import KeyPair

    _, who = services.auth.create_account_with_key("provider")
    refs = [services.catalog.get(p) for p in plugins]
    return services.providers.connect(
        who, KeyPair.generate().public_key_hex, name, sandboxed=True, hardware={},
        plugins=[{"name": m.name, "version": m.version, "weights_digest": "", "warm": True}
                 for m in refs])


class LiveBroker:
    def __init__(self, tmp_path, db_url=None, lease_timeout_s=5.0, plugin_dirs=None,
                 max_attempts=None, **settings):
        extra = {"plugin_dirs": list(plugin_dirs)} if plugin_dirs is not None else {}
        # Verification re-runs sampled jobs on other agents; tests about other things turn
        # it off so that every job runs once (the verification tests turn it on).
        extra.setdefault("verification", False)
        extra.setdefault("check_delay_max_s", 0.0)
        extra.setdefault("http_threads", 16)
        extra.update(settings)  # any other Settings field (e.g. Stripe against a stub)
        if max_attempts is not None:
            extra["max_attempts"] = max_attempts
        self.settings = Settings(data_dir=tmp_path / "broker", db_url=db_url or "",
                                 http="127.0.0.1:0", grpc="127.0.0.1:0",
                                 lease_timeout_s=lease_timeout_s, **extra)
        self.server = BrokerServer(self.settings)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = (f"{'https' if self.settings.tls else 'http'}://127.0.0.1:"
                    f"{self.server.http_port}")
        self.grpc = f"127.0.0.1:{self.server.grpc_port}"
        self.services = self.server.services
        time.sleep(0.05)

    def key(self, role: str, credits: int = 1000) -> str:
        """A new account's key; clients are granted ``credits`` (dev funding mode)."""
        key, who = self.services.auth.create_account_with_key(role)
        if role == "client" and credits and self.services.payments.funding_mode == "dev":
            self.services.payments.grant(who.account_id, credits * 1_000_000, by="test")
        return key

    def stop(self):
        self.server.stop()
        self.thread.join(10)


@pytest.fixture
def live_broker(tmp_path):
    b = LiveBroker(tmp_path)
    yield b
    b.stop()


def _rewriting_hosts(cheat):
    """A host factory (``provider_agent.host.manager.HostFactory``) whose hosts pass every
    output through ``cheat(bytes) -> bytes``."""
    from provider_agent.host.manager import PluginHost

    class RewritingHost(PluginHost):
        def run(self, *args, **kwargs):
            result = super().run(*args, **kwargs)
            for out in result.outputs:
                out.data = cheat(out.data)
            return result

    return RewritingHost


def agent_starter(broker: LiveBroker):
    """(start, stop_all): ``start(name, slots=1, key=None, cheat=None, plugins=None,
    weights_dir=None, connect_timeout_s=30, telemetry=None)`` runs an in-process agent
    (plain subprocess hosts) on ``broker`` serving ``plugins`` ({name: folder}, default echo)
    with the weights under ``weights_dir`` (``<weights_dir>/<plugin>``, for the model
    plugins); ``cheat(bytes) -> bytes`` rewrites every output it returns (a cheating
    provider, for verification tests). ``gate``: the owner's terms
    (provider_agent.availability.Gate, e.g. with a fake clock and GPU source), watched every
    ``poll_s``; other keywords are AgentConfig fields."""
    from plugins import builtin_plugin_dir
    from provider_agent.agent import Agent
    from provider_agent.config import AgentConfig
    from provider_agent.host.manager import PluginHost
    from sdk.protocol.signing import KeyPair

    agents = []

    def start(name="agent", slots=1, key=None, cheat=None, plugins=None, weights_dir=None,
              connect_timeout_s=30.0, gate=None, poll_s=0.05, telemetry=None, **cfg_fields):
        plugins = plugins or {"echo": builtin_plugin_dir("echo")}
        cfg = AgentConfig(broker=broker.grpc, api_key=key or broker.key("provider"),
                          name=name, slots=slots, plugins=list(plugins), device="cpu",
                          **({"weights_dir": str(weights_dir)} if weights_dir else {}),
                          **cfg_fields)
        # A cheat is in its hosts from the start: its very first run (the broker's canary)
        # is already cheated.
        agent = Agent(cfg, KeyPair.generate(), plugin_dirs=dict(plugins), sandboxed=False,
                      gate=gate, availability_poll_s=poll_s, telemetry=telemetry,
                      host_factory=_rewriting_hosts(cheat) if cheat is not None else PluginHost)
        t = threading.Thread(target=agent.run, daemon=True)
        t.start()
        agents.append((agent, t))
        deadline = time.monotonic() + connect_timeout_s  # model plugins benchmark first
        while not agent.provider_id and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent.provider_id, "agent did not connect"
        return agent

    def stop_all():
        for agent, t in agents:
            agent.stop()
            t.join(10)
    return start, stop_all


@pytest.fixture
def start_agent(live_broker):
    """Start an in-process agent serving echo (plain subprocess host) on the live broker."""
    start, stop_all = agent_starter(live_broker)
    yield start
    stop_all()
