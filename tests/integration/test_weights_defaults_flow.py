"""The image size a job gets when it names none: what the connected providers' weights give
(reported with the agent's capabilities), filled in by the broker before it prices the job,
so the README's first example runs at 64×64 on the demo's tiny weights and at 512×512 on
real SD 1.5 weights (issue #30). Hand-driven agent streams: no model is loaded here."""
import json
import time

from sdk import Client
from sdk.protocol import agent_pb2 as pb
from plugins import builtin_plugin_dir
from sdk.protocol.envelope import challenge_document
from sdk.protocol.manifest import load_manifest
from sdk.protocol.signing import KeyPair

from tests.integration.test_gateway_and_sdk import RawAgent

TINY = "a" * 64
SD15_VERSION = load_manifest(builtin_plugin_dir("sd15")).version
README = {"prompt": "a lighthouse at dusk", "seed": 7, "steps": 30}


def _connect(broker, defaults: dict | None, digest: str = TINY) -> RawAgent:
    raw, key = RawAgent(broker.grpc, broker.key("provider")), KeyPair.generate()
    raw.send(hello=pb.Hello(public_key=key.public_key_hex, name="raw"))
    ch = raw.recv().challenge
    raw.send(challenge_response=pb.ChallengeResponse(signature=key.sign(
        "challenge", challenge_document(ch.nonce, key.public_key_hex, ch.broker_public_key))))
    raw.send(capabilities=pb.Capabilities(plugins=[pb.PluginCapability(
        name="sd15", version=SD15_VERSION, weights_digest=digest,
        input_defaults=json.dumps(defaults) if defaults else "")], slots=1, sandboxed=True))
    assert raw.recv().welcome.provider_id
    return raw


def _defaults_now(client: Client) -> dict:
    return client.request("GET", "/v1/plugins/sd15").json()["input_defaults"]


def _until(predicate, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_job_without_a_size_gets_the_size_the_providers_weights_give(live_broker):
    raw = _connect(live_broker, {"width": 64, "height": 64})
    with Client(live_broker.url, live_broker.key("client")) as client:
        _until(lambda: _defaults_now(client) == {"width": 64, "height": 64},
               "the agent's report to reach the broker")
        job = client.jobs.create("sd15", **README)
        assert (job.data["inputs"]["width"], job.data["inputs"]["height"]) == (64, 64)
        units = 30 * 64 * 64 / 1048576
        assert job.data["work_units"] == units
        assert client.quote("sd15", **README)["work_units"] == units  # priced as it runs
        # what the client names is kept
        wide = client.jobs.create("sd15", width=128, **README)
        assert (wide.data["inputs"]["width"], wide.data["inputs"]["height"]) == (128, 64)
        # the schema still says what real SD 1.5 weights give
        schema = client.plugins("sd15")[0]["input_schema"]["properties"]["width"]
        assert schema["default"] == 512 and schema["x-default-from"] == "weights"
        raw.close()
        _until(lambda: _defaults_now(client) == {}, "the agent to be forgotten")
        assert client.quote("sd15", **README)["work_units"] == 30 * 512 * 512 / 1048576


def test_providers_whose_weights_disagree_leave_the_manifest_size(live_broker):
    tiny = _connect(live_broker, {"width": 64, "height": 64})
    real = _connect(live_broker, {"width": 512, "height": 512}, digest="b" * 64)
    with Client(live_broker.url, live_broker.key("client")) as client:
        _until(lambda: live_broker.services.jobs.defaults_for(
            live_broker.services.catalog.get("sd15"), TINY) == {"width": 64, "height": 64},
            "both reports")
        _until(lambda: len(live_broker.services.dispatcher.sessions()) == 2, "both agents")
        assert _defaults_now(client) == {}
        job = client.jobs.create("sd15", **README)
        assert job.data["inputs"]["width"] == 512
        # a job pinned to the tiny weights gets their size
        pinned = client.request("POST", "/v1/jobs", json_body={
            "plugin": "sd15", "inputs": README, "weights_digest": TINY}).json()
        assert pinned["inputs"]["width"] == 64
    tiny.close()
    real.close()


def test_weights_that_would_make_a_job_dearer_leave_the_manifest_size(live_broker):
    """A provider's report may shrink a job its client named no size for, never grow it:
    weights claiming 1024×1024 would quadruple an sd15 job's price."""
    raw = _connect(live_broker, {"width": 1024, "height": 1024})
    with Client(live_broker.url, live_broker.key("client")) as client:
        reports = live_broker.services.jobs.input_defaults
        _until(lambda: reports.for_job(live_broker.services.catalog.get("sd15"))
               == {"width": 1024, "height": 1024}, "the agent's report to reach the broker")
        assert _defaults_now(client) == {}
        job = client.jobs.create("sd15", **README)
        assert (job.data["inputs"]["width"], job.data["inputs"]["height"]) == (512, 512)
        assert job.data["work_units"] == 30 * 512 * 512 / 1048576
        # one named side with the report's larger other side: the manifest's stands too
        tall = client.jobs.create("sd15", width=256, **README)
        assert (tall.data["inputs"]["width"], tall.data["inputs"]["height"]) == (256, 512)
        raw.close()
