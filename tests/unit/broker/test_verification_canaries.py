"""Canaries with known answers (DESIGN §6): an answer two operators agree on becomes known
for its inputs and reproducibility class (the class each machine declared at connect,
never a receipt's); a later canary that disagrees counts as a failed check (CV reset,
quota cut), one that agrees as a valid check."""
from broker.services import build_services
from broker.settings import Settings


def _receipt(sha: str, hw: str = "cpu:x86_64:threads=1") -> dict:
    return {"outputs": [{"index": 0, "sha256": sha, "meta": {}}],
            "repro": {"hardware_class": hw, "dtype": "float32", "plugin_build": "sd15@1.0.0+ab"}}


def _provider(services, name, hw: str = "cpu:x86_64:threads=1"):
    from sdk.protocol.signing import KeyPair

    _, who = services.auth.create_account_with_key("provider")
    plugins = [{"name": "sd15", "version": "1.0.0", "weights_digest": "ab" * 32,
                "hardware_class": hw, "dtype": "float32"}]
    return services.providers.connect(who, KeyPair.generate().public_key_hex, name,
                                      sandboxed=True, hardware={}, plugins=plugins).id


def test_known_answers_judge_later_canaries(tmp_path):
    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0))
    v = services.verification
    a, b, c, d = (_provider(services, n) for n in "abcd")
    inputs = {"prompt": "a lighthouse at dusk", "seed": 2}
    assert v.canary_answer(a, "sd15", "1.0.0", inputs, _receipt("1" * 64)) == "learning"
    assert v.canary_answer(b, "sd15", "1.0.0", inputs, _receipt("1" * 64)) == "learning"
    # two operators agree: known. A third agrees (valid), a fourth does not (invalid).
    assert v.canary_answer(c, "sd15", "1.0.0", inputs, _receipt("1" * 64)) == "valid"
    assert v.canary_answer(d, "sd15", "1.0.0", inputs, _receipt("2" * 64)) == "invalid"
    hw = "cpu:x86_64:threads=1"
    assert v.repo.standing(c, "sd15", hw).consecutive_valid == 1
    bad = v.repo.standing(d, "sd15", hw)
    assert (bad.consecutive_valid, bad.failures, bad.quota_factor) == (0, 1, 0.5)
    # A receipt that names another class changes nothing (issue #20): d declared this one.
    assert v.canary_answer(d, "sd15", "1.0.0", inputs,
                           _receipt("2" * 64, hw="cpu:x86_64:threads=2")) == "invalid"
    # Another declared class, or other inputs, learn their own answer: nothing judged yet.
    e = _provider(services, "e", hw="cpu:x86_64:threads=2")
    assert v.canary_answer(e, "sd15", "1.0.0", inputs, _receipt("2" * 64)) == "learning"
    assert v.canary_answer(d, "sd15", "1.0.0", {**inputs, "seed": 3},
                           _receipt("2" * 64)) == "learning"
    actions = [e.action for e in services.audit.search(subject=f"provider:{d}")]
    assert "verification.canary" in actions
    services.engine.dispose()


def test_a_canary_on_a_client_jobs_inputs_counts_that_job_as_its_operators_answer(tmp_path):
    """Canaries reuse recent client jobs' inputs (issue #20): the job that gave them is
    one operator's answer, so one canary of another operator makes the answer known and
    the next canary is judged by it (before, two canaries on the same inputs were needed,
    which inputs drawn from client jobs rarely gave)."""
    import time

    from broker.jobs.model import Job, JobState

    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0))
    v = services.verification
    a, b, c = (_provider(services, n) for n in "abc")
    inputs = {"prompt": "a client's lighthouse", "seed": 11}
    now = time.time()
    _, client = services.auth.create_account_with_key("client")
    services.jobs.repo.create(Job(id="client-job", account_id=client.account_id, plugin="sd15",
                                  plugin_version="1.0.0", inputs=inputs,
                                  state=JobState.SETTLED, provider_id=a,
                                  receipt=_receipt("1" * 64), created_at=now,
                                  updated_at=now), ("queued", {}))
    assert v.canary_answer(b, "sd15", "1.0.0", inputs, _receipt("1" * 64),
                           source="client-job") == "learning"  # a's job and b: known now
    assert v.canary_answer(c, "sd15", "1.0.0", inputs, _receipt("3" * 64),
                           source="client-job") == "invalid"
    # A source that is not a settled job teaches nothing.
    other = {"prompt": "nobody's", "seed": 1}
    assert v.canary_answer(b, "sd15", "1.0.0", other, _receipt("1" * 64),
                           source="no-such-job") == "learning"
    assert v.canary_answer(c, "sd15", "1.0.0", other, _receipt("3" * 64),
                           source="no-such-job") == "learning"  # still nothing known


def test_an_answer_is_known_only_once_two_operators_not_linked_to_each_other_gave_it(tmp_path):
    """Issue #20: an answer two operators returned became known, so one person's two
    accounts agreeing on a wrong answer made it the one every honest canary was judged by
    (failed: CV reset, quota cut). Two accounts the broker sees linked count as one."""
    services = build_services(Settings(data_dir=tmp_path, maintenance_interval_s=0))
    v = services.verification
    cheat, pal, h1, h2 = (_provider(services, n) for n in ("cheat", "pal", "h1", "h2"))
    owner = services.providers.owner_of
    services.links.declare([owner(cheat), owner(pal)], "one person's two accounts")
    inputs = {"prompt": "a lighthouse at dusk", "seed": 3}
    wrong, right = _receipt("6" * 64), _receipt("1" * 64)
    assert v.canary_answer(cheat, "sd15", "1.0.0", inputs, wrong) == "learning"
    assert v.canary_answer(pal, "sd15", "1.0.0", inputs, wrong) == "learning"  # one word
    assert v.canary_answer(h1, "sd15", "1.0.0", inputs, right) == "learning"  # not judged
    hw = "cpu:x86_64:threads=1"
    assert v.repo.standing(h1, "sd15", hw).failures == 0
    assert v.canary_answer(h2, "sd15", "1.0.0", inputs, right) == "learning"  # h1 and h2
    assert v.canary_answer(cheat, "sd15", "1.0.0", inputs, wrong) == "invalid"
    assert v.canary_answer(h1, "sd15", "1.0.0", inputs, right) == "valid"
    services.engine.dispose()
