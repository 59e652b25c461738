"""The auction with real broker and agent processes: four agents with different asks and
speeds (echo throttled to emulate a slow GPU); jobs go where DESIGN §4 says; a split n=4
request runs on four agents."""
import shutil
import time

import pytest

from sdk import Client

pytestmark = [pytest.mark.e2e, pytest.mark.localnet(lease_timeout_s=10)]
SANDBOX = shutil.which("bwrap") is not None
# name: (ask in micro-credits per work unit, throttle in ms per work unit)
AGENTS = {"fast-cheap": (200, 0), "slow-cheap": (200, 150), "fast-dear": (800, 0),
          "slow-dear": (900, 150)}


def test_four_agents_asks_speeds_and_a_split(localnet):
    localnet.start_broker()
    client_key = localnet.create_key("client")
    for name, (ask, throttle) in AGENTS.items():
        run_args = ["--ask", f"echo={ask}"]
        if throttle:
            run_args += ["--throttle", f"echo={throttle}"]
        # One provider account per agent: each is its own operator.
        localnet.start_agent(name, localnet.create_key("provider", name), plugins="echo",
                             sandbox=SANDBOX, run_args=run_args)
    localnet.wait_for_providers(4)
    providers = {}
    for agent in localnet.agents:
        text = agent.log_path.read_text()
        providers[agent.name] = text.split(" as provider ")[1].split()[0]
    by_id = {v: k for k, v in providers.items()}
    # Wait until the broker has measured all four (their canaries came back): an agent not
    # yet measured is not eligible, and the split below must find four.
    with Client(localnet.url, localnet.create_key("admin")) as admin:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            asks = admin.request("GET", "/v1/asks").json()["data"]
            if sum(1 for a in asks if a["measured_units_per_s"]) >= len(AGENTS):
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"the broker measured {asks and sum(1 for a in asks if a['measured_units_per_s'])} "
                        f"of {len(AGENTS)} agents within 90 s (their canaries did not come back)")
    with Client(localnet.url, client_key) as client:
        # Wait until the fast, cheap agent wins a standard job (its measured θ counts).
        deadline = time.monotonic() + 60
        while True:
            result = client.generate("echo", text="warm", priority="standard")
            winner = by_id[result.job.data["provider_id"]]
            if winner == "fast-cheap" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert winner == "fast-cheap"
        price = result.job.data["price_micro_per_unit"]
        assert 200 <= price <= 1_000_000
        # A split n=4 clears four slots on four different operators.
        batch = client.jobs.create_batch("echo", terms={"n": 4}, text="split")
        result = batch.wait(timeout=60)
        assert len(result.outputs) == 4
        ran_on = {by_id[j.data["provider_id"]] for j in batch.refresh().jobs}
        assert ran_on == set(AGENTS), ran_on
