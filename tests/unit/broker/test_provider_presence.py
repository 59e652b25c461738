"""broker.jobs.presence.ProviderPresence: the agents whose streams this replica holds, kept
once (issue #21) — a reconnect keeps the jobs its agent holds, a replaced session's stream
closing changes nothing, and which replica holds a stream is recorded as it comes and goes."""
from types import SimpleNamespace

from broker.jobs.presence import AgentSession, ProviderPresence


class RecordingStreams:
    """The replica registry as the presence sees it: holds and releases, in order."""

    def __init__(self, others=None):
        self.calls: list[tuple[str, str]] = []
        self.others = dict(others or {})

    def hold(self, provider_id):
        self.calls.append(("hold", provider_id))

    def release(self, provider_id):
        self.calls.append(("release", provider_id))

    def held_elsewhere(self):
        return dict(self.others)


def _session(pid="p1", plugins=None, slots=2):
    return AgentSession(provider_id=pid, public_key="k" * 64, account_id="op-" + pid,
                        plugins=plugins or {"echo@1.0.0": ""}, slots=slots)


def test_a_reconnect_replaces_the_session_and_keeps_the_jobs_it_holds():
    streams = RecordingStreams()
    presence = ProviderPresence(streams=streams)
    first = _session()
    assert presence.add(first) is True
    first.active.add("job-1")
    second = _session(plugins={"other@2.0.0": ""})
    assert presence.add(second) is False  # the provider was held here already
    assert presence.get("p1") is second and second.active == {"job-1"}
    assert presence.serving("other", "2.0.0") and not presence.serving("echo", "1.0.0")
    assert presence.remove(first) is False  # the replaced stream closing changes nothing
    assert presence.get("p1") is second and presence.count() == 1
    assert streams.calls == [("hold", "p1"), ("hold", "p1")]
    assert presence.remove(second) is True
    assert presence.get("p1") is None and presence.ids() == [] and presence.count() == 0
    assert not presence.serving("other", "2.0.0")
    assert streams.calls[-1] == ("release", "p1")


def test_it_indexes_who_serves_a_build_and_their_free_slots():
    presence = ProviderPresence()
    a, b = _session("a", slots=1), _session("b", plugins={"other@1.0.0": ""})
    presence.add(a)
    presence.add(b)
    job = SimpleNamespace(plugin="echo", plugin_version="1.0.0")  # what the index reads
    assert presence.serving_sessions(job) == {"a": a}
    assert presence.any_free()
    a.active.add("j")
    b.paused = True
    assert not presence.any_free()  # a is full, b paused
    assert presence.get(None) is None and presence.get("") is None


def test_the_streams_other_replicas_hold_are_read_through_it():
    assert ProviderPresence().held_elsewhere() == {}  # one process: nobody else
    presence = ProviderPresence(streams=RecordingStreams(others={"p9": "replica-b"}))
    assert presence.held_elsewhere() == {"p9": "replica-b"}
