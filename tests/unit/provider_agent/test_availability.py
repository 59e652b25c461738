"""The owner's terms (provider_agent.availability) on a fake clock and a fake GPU: idle
detection, schedules, each limit."""
from datetime import datetime, timezone

import pytest

from provider_agent.availability import (AVAILABLE, IDLE_WAITING, LIMIT_REACHED, OWNER_ACTIVE,
                                         SCHEDULE_CLOSED, FakeClock, Gate, Rules, Schedule,
                                         UsageMeter)
from provider_agent.config import AgentConfig
from provider_agent.errors import ConfigError
from provider_agent.gpu_usage import FakeGpuUsageSource, FakePresence, GpuProcess

OWN = {4242}


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def gate(clock=None, source=None, presence=None, meter=None, **rules) -> Gate:
    rules.setdefault("idle_only", True)
    return Gate(Rules(**rules), device="cuda:0", gpu_index=0,
                clock=clock or FakeClock(zone=timezone.utc), source=source or FakeGpuUsageSource(),
                meter=meter or UsageMeter(), presence=presence)


def test_an_owner_process_pauses_and_idle_time_resumes():
    clock, gpu = FakeClock(zone=timezone.utc), FakeGpuUsageSource()
    g = gate(clock, gpu, idle_resume_s=60)
    assert g.look(own_pids=OWN, working=False).state == AVAILABLE
    # The agent's own plugin host on the GPU is not the owner.
    gpu.set(0, processes=[GpuProcess(4242, "python", 900)], utilisation_pct=95)
    assert g.look(own_pids=OWN, working=True).state == AVAILABLE
    gpu.set(0, processes=[GpuProcess(4242, "python", 900), GpuProcess(777, "blender", 2000)])
    st = g.look(own_pids=OWN, working=True)
    assert st.state == OWNER_ACTIVE and "blender (777)" in st.reason
    gpu.set(0, processes=[], utilisation_pct=0)
    clock.advance(30)
    assert g.look(own_pids=OWN, working=False).state == IDLE_WAITING
    clock.advance(29)
    assert g.look(own_pids=OWN, working=False).state == IDLE_WAITING
    # Busy again inside the wait: the wait starts over.
    gpu.set(0, processes=[GpuProcess(778, "game")])
    assert g.look(own_pids=OWN, working=False).state == OWNER_ACTIVE
    gpu.set(0, processes=[])
    clock.advance(59)
    assert g.look(own_pids=OWN, working=False).state == IDLE_WAITING
    clock.advance(2)
    assert g.look(own_pids=OWN, working=False).state == AVAILABLE


def test_utilisation_without_a_job_of_ours_counts_as_the_owner():
    gpu = FakeGpuUsageSource()
    g = gate(source=gpu, idle_util_pct=15)
    gpu.set(0, utilisation_pct=40)  # e.g. a process in another container NVML cannot name
    assert g.look(own_pids=OWN, working=False).state == OWNER_ACTIVE
    g2 = gate(source=gpu, idle_util_pct=15)
    assert g2.look(own_pids=OWN, working=True).state == AVAILABLE  # that load is ours


def test_owner_at_the_keyboard_keeps_it_paused_until_away():
    presence = FakePresence(idle_s=5)
    clock = FakeClock(zone=timezone.utc)
    g = gate(clock, presence=presence, owner_away_s=300, idle_resume_s=0)
    st = g.look(own_pids=OWN, working=False)
    assert st.state == OWNER_ACTIVE and "owner was active" in st.reason
    presence.value = 301
    assert g.look(own_pids=OWN, working=False).state == AVAILABLE


@pytest.mark.parametrize("window,when,open_", [
    ("22:00-07:00", "2026-12-02 23:30", True),
    ("22:00-07:00", "2026-12-02 06:59", True),
    ("22:00-07:00", "2026-12-02 07:00", False),
    ("22:00-07:00", "2026-12-02 12:00", False),
    ("weekdays 09:00-17:00", "2026-12-05 10:00", False),   # a Saturday
    ("weekdays 09:00-17:00", "2026-12-04 10:00", True),    # a Friday
    ("fri 22:00-02:00", "2026-12-05 01:00", True),         # Friday night, past midnight
    ("fri 22:00-02:00", "2026-12-04 01:00", False),        # Thursday night
    ("sat-sun 00:00-24:00", "2026-12-06 23:59", True),
    ("mon,wed 08:00-09:00", "2026-12-02 08:30", True),     # a Wednesday
])
def test_schedule_windows(window, when, open_):
    assert Schedule.parse([window]).open_at(datetime.fromisoformat(when)) is open_


def test_schedule_opens_and_closes_on_the_clock():
    clock = FakeClock(now=at("2026-12-02 21:59"), zone=timezone.utc)
    g = gate(clock, idle_only=False, schedule=Schedule.parse(["22:00-07:00"]))
    assert g.look(own_pids=OWN, working=False).state == SCHEDULE_CLOSED
    clock.advance(60)
    assert g.look(own_pids=OWN, working=False).state == AVAILABLE
    clock.advance(9 * 3600)
    assert g.look(own_pids=OWN, working=False).state == SCHEDULE_CLOSED


@pytest.mark.parametrize("bad", ["22-07", "25:00-07:00", "10:00-10:00", "someday 01:00-02:00",
                                 "mon-funday 01:00-02:00", 7])
def test_bad_schedules_say_what_is_allowed(bad):
    with pytest.raises(ConfigError, match="schedule entry"):
        Schedule.parse([bad])


def test_gpu_hours_per_day_limit_and_next_day(tmp_path):
    clock = FakeClock(now=at("2026-12-02 20:00"), zone=timezone.utc)
    meter = UsageMeter(tmp_path / "gpu-hours.json")
    g = gate(clock, meter=meter, idle_only=False, max_gpu_hours_per_day=1)
    g.look(own_pids=OWN, working=True)
    for _ in range(59):
        clock.advance(60)
        assert g.look(own_pids=OWN, working=True).state == AVAILABLE
    clock.advance(61)
    st = g.look(own_pids=OWN, working=True)
    assert st.state == LIMIT_REACHED and "GPU hours" in st.reason
    meter.save()
    # A restart keeps today's hours.
    again = gate(clock, meter=UsageMeter(tmp_path / "gpu-hours.json"), idle_only=False,
                 max_gpu_hours_per_day=1)
    assert again.look(own_pids=OWN, working=False).state == LIMIT_REACHED
    clock.advance(4 * 3600)  # past midnight: a new day's budget
    assert again.look(own_pids=OWN, working=False).state == AVAILABLE


def test_temperature_power_and_vram_ceilings():
    gpu = FakeGpuUsageSource()
    g = gate(source=gpu, idle_only=False, max_temperature_c=80, max_power_w=250, max_vram_gb=4)
    assert g.look(own_pids=OWN, working=True).state == AVAILABLE
    gpu.set(0, temperature_c=83)
    st = g.look(own_pids=OWN, working=True)
    assert st.state == LIMIT_REACHED and "83°C" in st.reason
    gpu.set(0, temperature_c=77)  # below the ceiling, not yet below it by 5°C
    assert g.look(own_pids=OWN, working=True).state == LIMIT_REACHED
    gpu.set(0, temperature_c=70, power_w=300)
    assert "300 W" in g.look(own_pids=OWN, working=True).reason
    gpu.set(0, power_w=240)  # under 250 W, not under 225 W
    assert g.look(own_pids=OWN, working=True).state == LIMIT_REACHED
    gpu.set(0, power_w=100, processes=[GpuProcess(4242, "python", 5 * 1024)])
    assert "VRAM" in g.look(own_pids=OWN, working=True).reason
    gpu.set(0, processes=[GpuProcess(4242, "python", 3 * 1024)])
    assert g.look(own_pids=OWN, working=True).state == AVAILABLE


def test_config_terms_are_checked_and_min_price_lifts_asks():
    cfg = AgentConfig(api_key="k", plugins=["echo", "sd15"], asks={"echo": 5},
                      min_price_micro_per_unit=10)
    assert cfg.effective_asks(["echo", "sd15"]) == {"echo": 10, "sd15": 10}
    assert AgentConfig(api_key="k", asks={"echo": 5}).effective_asks(["echo"]) == {"echo": 5}
    for field, value, words in (("on_owner", "panic", "finish, give_back, checkpoint"),
                                ("max_temperature_c", -1, "from 0 to 120"),
                                ("schedule", ["nightly"], "time window"),
                                ("min_price_micro_per_unit", 1.5, "whole number")):
        with pytest.raises(ConfigError, match=words):
            AgentConfig(api_key="k", **{field: value}).check()


def test_owner_away_alone_ignores_gpu_processes():
    """owner_away_s without idle_only: only the keyboard counts, not the GPU's users."""
    gpu, presence = FakeGpuUsageSource(), FakePresence(idle_s=10)
    gpu.set(0, processes=[GpuProcess(777, "blender")])
    g = gate(source=gpu, presence=presence, idle_only=False, owner_away_s=60, idle_resume_s=0)
    assert g.look(own_pids=OWN, working=False).state == OWNER_ACTIVE
    presence.value = 61
    assert g.look(own_pids=OWN, working=False).state == AVAILABLE


def test_display_servers_are_not_the_owner_using_the_gpu():
    gpu = FakeGpuUsageSource()
    gpu.set(0, processes=[GpuProcess(900, "Xorg", 300), GpuProcess(901, "gnome-shell", 150)])
    g = gate(source=gpu)
    assert g.look(own_pids=OWN, working=False).state == AVAILABLE
    strict = gate(source=gpu, idle_ignore_processes=())
    assert strict.look(own_pids=OWN, working=False).state == OWNER_ACTIVE
    cfg = AgentConfig(api_key="k", idle_only=True, idle_ignore_processes=["Xorg"])
    assert cfg.rules().idle_ignore_processes == ("Xorg",)
    assert "Xorg" in AgentConfig(api_key="k").rules().idle_ignore_processes
    with pytest.raises(ConfigError, match="process names"):
        AgentConfig(api_key="k", idle_ignore_processes="Xorg").check()
