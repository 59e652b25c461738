"""CanaryService: what a canary was sent with lives on the market's Canary, so a canary
that expires or is answered leaves nothing behind."""
import random
from types import SimpleNamespace

import pytest

from sdk.protocol.canonical import canonical_bytes, loads
from sdk.protocol.envelope import make_receipt
from sdk.protocol.sealing import open_inputs
from sdk.protocol.signing import KeyPair

from broker.catalog.registry import PluginCatalog
from broker.jobs.presence import AgentSession
from broker.market import MarketService, MarketSettings
from broker.market.canary import CanaryService
from broker.settings import BUILTIN_PLUGINS

from .agents import connect


def _world(interval_s: float = 0):
    now = [1_000.0]
    market = MarketService(lambda plugin: 1_000, MarketSettings(canary_timeout_s=60.0,
                                                                canary_interval_s=interval_s),
                           rng=random.Random(1), clock=lambda: now[0])
    answers, unanswered = [], []
    canaries = CanaryService(market, PluginCatalog.from_folders([BUILTIN_PLUGINS]),
                             KeyPair.generate(),
                             answers=SimpleNamespace(
                                 canary_answer=lambda *args: answers.append(args),
                                 canary_unanswered=lambda *args: unanswered.append(args)))
    agent = KeyPair.generate()
    sent = []

    class Agent(AgentSession):
        def send_assignment(self, envelope_bytes, signature):
            sent.append(envelope_bytes)

    session = connect(market, "p", "op", {"echo": "1.0.0"}, benchmarks={"echo": 5.0},
                      kind=Agent, public_key=agent.public_key_hex)
    return SimpleNamespace(now=now, market=market, canaries=canaries, answers=answers,
                           unanswered=unanswered,
                           agent=agent, sent=sent, session=session)


def _receipt(w, data: bytes) -> tuple[bytes, str]:
    env = loads(data)
    rec = make_receipt(envelope=env, envelope_bytes=data, provider_key=w.agent.public_key_hex,
                       outputs=[], work_units=1.0, timings_ms={"run": 100})
    return canonical_bytes(rec), w.agent.sign("receipt", rec)


def test_a_canary_carries_its_version_and_inputs_to_the_answer_check():
    w = _world()
    assert w.canaries.send_due(w.session) == 1
    job_id = loads(w.sent[0])["job_id"]
    canary = w.market.canary(job_id)
    assert canary.version == "1.0.0" and canary.inputs["text"] == "benchmark"
    assert w.canaries.receipt(w.session, *_receipt(w, w.sent[0])) == job_id
    [(pid, plugin, version, inputs, rec, source, repro)] = w.answers
    assert (pid, plugin, version, inputs) == ("p", "echo", "1.0.0", canary.inputs)
    assert source == ""  # no client job yet: the benchmark payload
    # the class it is judged in: what the session declared when the canary went out
    assert repro == {"hardware_class": "", "dtype": "", "weights_digest": ""} == canary.repro
    assert w.market.canary(job_id) is None and job_id not in w.session.active
    assert w.market.theta("p", "echo")[1]  # measured


def test_an_expired_canary_leaves_nothing_and_its_late_receipt_is_not_checked():
    w = _world()
    w.canaries.send_due(w.session)
    job_id = loads(w.sent[0])["job_id"]
    w.now[0] += 61.0
    w.canaries.send_due(w.session)  # the dispatcher's next call expires it
    assert w.market.canary(job_id) is None and job_id not in w.session.active
    assert w.canaries.receipt(w.session, *_receipt(w, w.sent[0])) is None
    assert w.answers == []


def test_a_canary_not_answered_is_reported_unanswered_and_an_answered_one_is_not():
    """Issue #20: a canary that timed out cost nothing, so not answering dodged the known
    answer. Now its expiry, and a failure the agent reports, go to verification
    (``CanaryAnswers.canary_unanswered``), which counts them (``VerificationService.canary_unanswered``)."""
    w = _world(interval_s=30.0)
    w.canaries.send_due(w.session)
    expired = loads(w.sent[-1])["job_id"]
    w.now[0] += 61.0
    w.canaries.send_due(w.session)  # expires it, and sends the next
    [(pid, plugin, version, repro, why, away)] = w.unanswered
    assert (pid, plugin, version) == ("p", "echo", "1.0.0") and "no receipt within 60" in why
    assert not away
    assert repro == {"hardware_class": "", "dtype": "", "weights_digest": ""}
    failed = loads(w.sent[-1])["job_id"]
    assert failed != expired
    w.canaries.failed(w.session, failed)
    assert len(w.unanswered) == 2 and w.unanswered[1][4] == "failed or given back"
    w.now[0] += 31.0
    w.canaries.send_due(w.session)
    answered = loads(w.sent[-1])["job_id"]
    assert w.canaries.receipt(w.session, *_receipt(w, w.sent[-1])) == answered
    assert len(w.unanswered) == 2 and len(w.answers) == 1


def test_a_canary_looks_like_a_recent_client_job_of_another_operator():
    """Issue #20: canaries carried the benchmark inputs and no weights_digest, so an agent
    could tell 1 of 1. Now a canary reuses the inputs of a recent client job another
    operator ran, and its envelope has the fields a job's has."""
    from broker.jobs.checkpoints import CheckpointPolicy, CheckpointService, InMemoryCheckpointRepository

    w = _world()
    # what an envelope says of checkpoints only: no job rows, blobs or wake-ups are read
    w.canaries.extra = CheckpointService(InMemoryCheckpointRepository(),
                                         CheckpointPolicy(min_steps=8),
                                         jobs=None, blobs=None, hub=None)
    w.session.plugins = {"echo@1.0.0": "ab" * 32}
    w.session.account_id = "op"
    w.canaries.remember("echo", "1.0.0", "op", {"text": "my own job", "steps": 1})
    w.canaries.remember("echo", "1.0.0", "other-op", {"text": "a client's words",
                                                      "sleep_ms": 20, "steps": 12})
    assert w.canaries.send_due(w.session) == 1
    env = loads(w.sent[0])
    # sealed to the agent, as every job's inputs are
    inputs = open_inputs(env["sealed_inputs"], w.agent)
    assert inputs["text"] == "a client's words"  # never the agent's own job again
    assert env["weights_digest"] == "ab" * 32
    assert env["checkpoint_every"] >= 1                 # 12 steps: a job would checkpoint
    assert w.market.canary(env["job_id"]).inputs == inputs



def test_a_canary_records_the_class_its_machine_declared_when_it_went_out():
    """Issue #20: the class a canary is judged in is the one its session declared when the
    broker sent it (in its envelope, as a job's is at assignment), not what the machine
    declares by the time its answer comes."""
    w = _world()
    w.session.plugins = {"echo@1.0.0": "ab" * 32}
    w.session.classes = {"echo@1.0.0": {"hardware_class": "cuda:sm90", "dtype": "float16"}}
    w.canaries.send_due(w.session)
    env = loads(w.sent[0])
    assert env["repro_class"] == {"hardware_class": "cuda:sm90", "dtype": "float16"}
    w.session.classes = {"echo@1.0.0": {"hardware_class": "cpu", "dtype": "float32"}}
    w.canaries.receipt(w.session, *_receipt(w, w.sent[0]))
    [answer] = w.answers
    assert answer[-1] == {"hardware_class": "cuda:sm90", "dtype": "float16",
                          "weights_digest": "ab" * 32}


@pytest.mark.parametrize("unavailable,reports,counted", [
    ("", 1, 1),               # never said so while it was out: a failure
    ("owner_active", 1, 0),   # said so, and still does
    ("", 2, 0),               # the owner came and went while the agent waited to checkpoint
])
def test_a_canary_is_given_back_for_the_owner_only_by_an_agent_that_said_it_takes_no_work(
        unavailable, reports, counted):
    """Issue #20: a give-back "for the owner" was taken at any time, so a provider could
    refuse every canary (and the known answer it is judged by) for free. It counts for
    nothing as a miss only from an agent that said it takes no work while the canary was
    out; even then verification counts it, apart (``away``), with its own allowance."""
    w = _world()
    w.session.unavailable, w.session.unavailable_reports = "", 1
    w.canaries.send_due(w.session)
    job_id = loads(w.sent[-1])["job_id"]
    w.session.unavailable, w.session.unavailable_reports = unavailable, reports
    assert w.canaries.withdrawn(w.session, job_id) is (counted == 0)
    assert w.market.tracker.record_of("p", "echo").failures == counted
    assert w.market.canary(job_id) is None and job_id not in w.session.active
    [(*_, why, away)] = w.unanswered  # verification counts it, as a miss or apart
    assert away is (counted == 0), why


def test_a_canary_never_reuses_the_inputs_of_a_linked_operators_job():
    """A partner account (linked, broker.links) could tell its own client job's inputs in a
    canary to the agent, as the agent's own could: they are not reused for it."""
    w = _world()
    canaries = CanaryService(w.market, w.canaries.catalog, w.canaries.signer,
                             linked_to=lambda a: frozenset({"pal"}) if a == "op" else frozenset())
    w.session.account_id = "op"
    canaries.remember("echo", "1.0.0", "pal", {"text": "the partner's job", "steps": 1})
    assert canaries.send_due(w.session) == 1
    inputs = open_inputs(loads(w.sent[0])["sealed_inputs"], w.agent)
    assert inputs["text"] == "benchmark"  # the payload: no job of an unlinked operator yet


def test_an_expired_canary_of_another_provider_gives_its_slot_back_too():
    w = _world()
    other_sent = []

    class Other(AgentSession):
        def send_assignment(self, envelope_bytes, signature):
            other_sent.append(envelope_bytes)

    other = connect(w.market, "q", "op2", {"echo": "1.0.0"}, benchmarks={"echo": 5.0},
                    kind=Other, public_key=KeyPair.generate().public_key_hex)
    assert w.canaries.send_due(other) == 1
    theirs = loads(other_sent[0])["job_id"]
    assert other.free == 0
    w.now[0] += 61.0
    w.canaries.send_due(w.session)  # another agent's call expires q's canary
    assert w.market.canary(theirs) is None
    assert theirs not in other.active and other.free == other.slots  # q's slot is free again
    assert [u[0] for u in w.unanswered] == ["q"]  # still counted against q


def test_a_canary_of_another_provider_is_neither_failed_nor_given_back_by_this_one():
    """Only the agent a canary went to answers for it: another's failure or give-back (a
    canary id it should not know) counts against nobody and frees nobody's slot."""
    w = _world()
    w.canaries.send_due(w.session)
    job_id = loads(w.sent[-1])["job_id"]
    other = connect(w.market, "q", "op2", {"echo": "1.0.0"}, kind=type(w.session))
    w.canaries.failed(other, job_id)
    assert not w.canaries.withdrawn(other, job_id)
    assert w.market.canary(job_id) is not None and job_id in w.session.active
    assert w.unanswered == []


def test_no_canary_goes_to_a_session_a_reconnect_replaced():
    """A canary sent on a replaced stream goes nowhere and would expire as a miss against
    an honest provider: the presence refuses the slot, so nothing is sent."""
    w = _world()
    old = w.session
    new = connect(w.market, "p", "op", {"echo": "1.0.0"}, kind=type(old),
                  public_key=old.public_key)
    assert w.canaries.send_due(old) == 0 and w.sent == []
    assert w.canaries.send_due(new) == 1


def test_a_canary_answered_on_the_replaced_stream_frees_the_new_sessions_slot():
    w = _world()
    old = w.session
    w.canaries.send_due(old)
    job_id = loads(w.sent[0])["job_id"]
    new = connect(w.market, "p", "op", {"echo": "1.0.0"}, kind=type(old),
                  public_key=old.public_key)
    assert job_id in new.active
    assert w.canaries.receipt(old, *_receipt(w, w.sent[0])) == job_id
    assert job_id not in new.active and new.free == 1


def test_a_canary_out_when_its_agent_left_this_replica_counts_as_away_not_missed():
    """An agent that moved to another replica answers its canary there, where it is not
    known: the sending replica counts it at its deadline as *away* (its own allowance in
    the window), not as a miss; an agent still held here that let it expire missed it."""
    w = _world()
    w.canaries.send_due(w.session)
    other = connect(w.market, "q", "op2", {"echo": "1.0.0"}, kind=type(w.session))
    w.market.presence.remove(w.session)  # the stream left (moved to another replica)
    w.now[0] += 61.0
    w.canaries.send_due(other)  # another agent's pass finds it expired
    [(pid, *_, why, away)] = w.unanswered
    assert pid == "p" and away and "left this replica" in why
