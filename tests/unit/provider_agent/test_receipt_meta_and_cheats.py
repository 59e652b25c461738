"""Receipts carry each output's plugin meta and the reproducibility class (DESIGN §6), and
the verification harness's cheating agents (bench/cheating_host.py: the real agent with
its plugin hosts wrapped) misbehave as asked while their receipts stay signed and valid.

Jobs go through ``Agent._run_job`` (the worker's path) with the broker stream replaced by
a queue; the model jobs run in real plugin hosts on tiny weights, on the CPU."""
from __future__ import annotations

import io
import logging
import os
import queue
import uuid
from pathlib import Path

import pytest

from bench import cheating_host as cheats
from plugins import builtin_plugin_dir
from provider_agent.agent import Agent, RunningJob, json_safe
from provider_agent.config import AgentConfig
from provider_agent.errors import ConfigError
from provider_agent.host.manager import HostOutput, HostResult, PluginHost
from sdk.protocol.canonical import canonical_bytes, sha256_hex
from sdk.protocol.envelope import make_envelope, open_receipt
from sdk.protocol.manifest import load_manifest
from sdk.protocol.signing import KeyPair


# -- helpers ------------------------------------------------------------------------------
def make_agent(plugin: str, weights: Path | None = None,
               cheat: cheats.Cheat | None = None) -> Agent:
    """An agent serving ``plugin``; with ``cheat``, its hosts are the harness's cheating
    wrappers (injected as the host factory, as bench/cheat_agent.py does)."""
    cfg = AgentConfig(api_key="sc_provider_test", plugins=[plugin], device="cpu",
                      weights={plugin: str(weights)} if weights else {})
    return Agent(cfg, KeyPair.generate(), plugin_dirs={plugin: builtin_plugin_dir(plugin)},
                 sandboxed=False,
                 host_factory=cheats.CheatingHosts(cheat) if cheat else PluginHost)


def run_job(agent: Agent, plugin: str, inputs: dict) -> tuple[dict, dict[int, bytes], list]:
    """One job through the agent's worker path: (opened receipt, outputs, all messages)."""
    outq: queue.Queue = queue.Queue()
    agent._outq = outq
    env = make_envelope(job_id=str(uuid.uuid4()), attempt=1, plugin=plugin,
                        version=agent.plugins[plugin].manifest.version, inputs=inputs,
                        provider_key=agent.identity.public_key_hex, lease_timeout_s=30)
    agent._run_job(env["job_id"], RunningJob(env, canonical_bytes(env)))
    msgs = []
    while not outq.empty():
        msgs.append(outq.get())
    failed = [m for m in msgs if m.WhichOneof("body") == "failed"]
    assert not failed, failed[0].failed.message
    [receipt] = [m.receipt for m in msgs if m.WhichOneof("body") == "receipt"]
    rec = open_receipt(receipt.receipt, receipt.signature,
                       provider_key=agent.identity.public_key_hex)
    assert rec["envelope_sha256"] == sha256_hex(canonical_bytes(env))
    # Small outputs travel inside the receipt's message, large ones ahead of it.
    chunks = [m.output for m in msgs if m.WhichOneof("body") == "output"] + list(receipt.outputs)
    outputs = {c.index: bytes(c.data) for c in chunks}
    assert [o["sha256"] for o in rec["outputs"]] == [sha256_hex(outputs[o["index"]])
                                                      for o in rec["outputs"]]
    return rec, outputs, msgs


class FakeHost:
    """Stands in for a PluginHost: returns the given outputs, records the inputs."""

    def __init__(self, outputs, hardware=None, work_units=1.0):
        self.outputs, self.calls = outputs, []
        self.ready = {"hardware": hardware or {"device": "cpu", "cpu_count": 2}}
        self.work_units = work_units

    def run(self, job_id, inputs, **kw):
        self.calls.append(inputs)
        return HostResult([HostOutput(o.index, o.media_type, o.data, dict(o.meta))
                           for o in self.outputs], 5, self.work_units)

    def alive(self):
        return True


# -- A: receipts ---------------------------------------------------------------------------
def test_receipt_carries_meta_and_repro_and_round_trips():
    agent = make_agent("echo")
    meta = {"seed": 3, "index": 0, "dtype": "float16", "logprobs": [-0.1234567891234, -2.0],
            "nan": float("nan"), "inf": float("-inf"), "pair": (1, 2),
            "nested": {"x": [True, None]}}
    agent.plugins["echo"].host = FakeHost(
        [HostOutput(0, "application/json", b"{}", meta)],
        hardware={"device": "cuda", "gpu_name": "NVIDIA H200", "vram_gb": 139.8})
    agent.plugins["echo"].weights_digest = "ab" * 32
    rec, _, _ = run_job(agent, "echo", {"text": "hi"})
    [out] = rec["outputs"]
    assert out["meta"] == {"seed": 3, "index": 0, "dtype": "float16",
                           "logprobs": [-0.1234567891234, -2.0], "nan": None, "inf": None,
                           "pair": [1, 2], "nested": {"x": [True, None]}}
    manifest = load_manifest(builtin_plugin_dir("echo"))
    assert rec["repro"] == {"hardware_class": "cuda:NVIDIA H200", "dtype": "float16",
                            "plugin_build": f"echo@{manifest.version}+{'ab' * 8}"}


def test_repro_without_a_dtype_in_meta_falls_back_to_float32_on_the_cpu():
    agent = make_agent("echo")
    agent.plugins["echo"].host = FakeHost([HostOutput(0, "application/json", b"{}", {})])
    rec, _, _ = run_job(agent, "echo", {"text": "hi"})
    import platform

    assert rec["outputs"][0]["meta"] == {}
    assert rec["repro"]["hardware_class"] == f"cpu:{platform.machine()}"
    assert rec["repro"]["dtype"] == "float32"
    build = rec["repro"]["plugin_build"]
    assert build.startswith("echo@") and build.endswith("+")   # echo has no weights


def test_capabilities_declare_each_plugins_reproducibility_class():
    """Issue #20: the class the broker judges an agent's runs by is declared at connect,
    from its plugin host, not read per receipt."""
    agent = make_agent("echo")
    agent.plugins["echo"].host = FakeHost(
        [], hardware={"device": "cuda", "gpu_name": "NVIDIA H200", "torch": "2.13.0"})
    agent.plugins["echo"].host.ready["dtype"] = "bfloat16"
    [cap] = agent._capabilities().plugins
    assert (cap.hardware_class, cap.dtype) == ("cuda:NVIDIA H200:torch=2.13.0", "bfloat16")
    agent.plugins["echo"].host.ready = {}  # not started: nothing declared
    [cap] = agent._capabilities().plugins
    assert (cap.hardware_class, cap.dtype) == ("", "")


def test_json_safe():
    import numpy as np

    assert json_safe({1: np.float32(0.5), "a": np.int64(3), "b": float("inf"), "c": object}) \
        == {"1": 0.5, "a": 3, "b": None, "c": str(object)}


# -- D: cheats, unit level ------------------------------------------------------------------
def _cheat_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    cheats.add_arguments(parser)
    return parser.parse_args(argv)


def test_bad_cheat_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="one of"):
        cheats.Cheat("lazy")
    with pytest.raises(ConfigError, match="between 0 and 1"):
        cheats.from_args(_cheat_args("--mode", "wrong-seed", "--rate", "2"))
    with pytest.raises(ConfigError, match="--weights"):
        cheats.from_args(_cheat_args("--mode", "other-model"))
    c = cheats.from_args(_cheat_args("--mode", "pad-text", "--rate", "0.25", "--seed", "1"))
    assert (c.mode, c.rate) == ("pad-text", 0.25)


def test_a_cheating_agent_warns_loudly(caplog):
    with caplog.at_level(logging.WARNING, logger="agent.cheat"):
        make_agent("echo", cheat=cheats.Cheat("wrong-seed"))
    assert "CHEATS ON PURPOSE" in caplog.text and "wrong-seed" in caplog.text


def test_rate_draws_per_job_and_the_log_records_ground_truth(tmp_path):
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    log_path = tmp_path / "cheat.jsonl"
    c = cheats.from_args(_cheat_args("--mode", "wrong-seed", "--rate", "0.5", "--seed", "7",
                                     "--log", str(log_path)))
    outcomes = [c.before(f"j{i}", manifest, {"prompt": "x", "seed": 10}) for i in range(200)]
    cheated = sum(o.cheated for o in outcomes)
    assert 70 < cheated < 130
    assert all(o.run_inputs["seed"] == 11 for o in outcomes if o.cheated)
    assert all(o.run_inputs == {"prompt": "x", "seed": 10} for o in outcomes if not o.cheated)
    assert len(log_path.read_text().splitlines()) == 200
    never = cheats.Cheat("wrong-seed", rate=0.0)
    assert not any(never.before("j", manifest, {"prompt": "x", "seed": 1}).cheated
                   for _ in range(20))


def test_adapter_dropped_removes_the_adapters_and_claims_them():
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    c = cheats.Cheat("adapter-dropped")
    o = c.before("j", manifest, {"prompt": "x", "seed": 1, "adapters": "ink:0.5"})
    assert o.cheated and "adapters" not in o.run_inputs
    assert o.job_inputs["adapters"] == "ink:0.5"
    [out] = c.after("sd15", o, [HostOutput(0, "image/png", b"png", {"seed": 1, "index": 0})])
    assert out.meta["adapters"] == {"ink": 0.5}
    plain = c.before("j", manifest, {"prompt": "x", "seed": 1})
    assert not plain.cheated                        # nothing to drop: runs honestly


def test_fewer_steps_halves_the_steps_default_included():
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    c = cheats.Cheat("fewer-steps")
    o = c.before("j", manifest, {"prompt": "x", "steps": 9})
    assert o.cheated and o.run_inputs["steps"] == 4
    default = manifest.validate_inputs({"prompt": "x"})["steps"]
    assert c.before("j", manifest, {"prompt": "x"}).run_inputs["steps"] == max(1, default // 2)
    assert not c.before("j", manifest, {"prompt": "x", "steps": 1}).cheated


@pytest.mark.parametrize("mode,plugin,swapped", [("other-model", "sd15", True),
                                                 ("other-model", "llama", False),
                                                 ("other-text-model", "llama", True)])
def test_other_model_runs_other_weights_but_advertises_its_own(tmp_path, mode, plugin, swapped):
    honest, other = tmp_path / "honest", tmp_path / "other"
    for folder, body in ((honest, b"honest"), (other, b"other")):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(body)
    agent = make_agent(plugin, honest, cheat=cheats.Cheat(mode, weights=other))
    served = agent.plugins[plugin]
    assert served.host.weights_dir == (other if swapped else honest)
    from provider_agent.weights import folder_digest

    assert served.weights_digest == folder_digest(honest)


def test_truncate_and_pad_text_rewrite_the_claim():
    meta = {"token_ids": list(range(10, 30)), "logprobs": [-1.0] * 20,
            "scores": [{"top": [[1, -1.0, 0.5]], "eos_lp": -3.0, "eos_p": 0.0,
                        "mass_above": 0.1}] * 20,
            "generated_tokens": 20, "finish_reason": "length", "eos_ids": [1, 4]}
    out = cheats.truncate_text(HostOutput(0, "text/plain", b"x" * 40, dict(meta)))
    assert len(out.meta["token_ids"]) == len(out.meta["logprobs"]) == len(out.meta["scores"]) == 10
    assert out.meta["finish_reason"] == "length" and out.data == b"x" * 20
    import random

    out = cheats.pad_text(HostOutput(0, "text/plain", b"abc", dict(meta)), random.Random(0))
    assert len(out.meta["token_ids"]) == len(out.meta["logprobs"]) == len(out.meta["scores"]) == 28
    assert not set(out.meta["token_ids"][20:]) & {1, 4}
    assert out.meta["generated_tokens"] == 28 and len(out.data) > 3


@pytest.mark.parametrize("mode,key,value", [("greedy-as-sampled", "temperature", 0.0),
                                            ("colder-sampling", "temperature", 0.4),
                                            ("narrow-top-p", "top_p", 0.45),
                                            ("early-stop", "max_new_tokens", 5)])
def test_sampling_cheats_run_other_settings_and_claim_the_jobs(mode, key, value):
    manifest = load_manifest(builtin_plugin_dir("llama"))
    job = {"prompt": "x", "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 10,
           "stop": "<END>"}
    c = cheats.Cheat(mode)
    o = c.before("j", manifest, job)
    assert o.cheated and o.run_inputs[key] == value
    ran = {k: o.run_inputs[k] for k in ("temperature", "top_p", "max_new_tokens")}
    meta = {**ran, "token_ids": [7] * o.run_inputs["max_new_tokens"], "finish_reason": "length",
            "stopped_by_string": False, "stop_at": None}
    [out] = c.after("llama", o, [HostOutput(0, "text/plain", b"abc", meta)])
    assert (out.meta["temperature"], out.meta["top_p"], out.meta["max_new_tokens"]) == (
        0.8, 0.9, 10)  # claims the job's settings
    if mode == "early-stop":  # and that it met the stop string
        assert out.meta["finish_reason"] == "stop" and out.meta["stopped_by_string"] is True
        assert out.meta["stop_at"] == 4
    if mode != "early-stop":  # a greedy job leaves these nothing to cheat on
        assert not c.before("j", manifest, {**job, "temperature": 0.0}).cheated


def test_altered_text_changes_the_text_only():
    manifest = load_manifest(builtin_plugin_dir("llama"))
    c = cheats.Cheat("altered-text")
    o = c.before("j", manifest, {"prompt": "x"})
    meta = {"token_ids": [5, 6], "finish_reason": "length"}
    [out] = c.after("llama", o, [HostOutput(0, "text/plain", b"abc", dict(meta))])
    assert out.data.startswith(b"abc") and out.data != b"abc" and out.meta == meta


def test_localnet_start_agent_merges_env(tmp_path, monkeypatch):
    from sdk import localnet

    seen = {}

    class FakePopen:
        def __init__(self, args, **kw):
            seen.update(kw["env"])

    monkeypatch.setattr(localnet.subprocess, "Popen", FakePopen)
    net = localnet.LocalNetwork(tmp_path)
    net.info = {"grpc": "127.0.0.1:1"}
    (tmp_path / "agent-a").mkdir()
    (tmp_path / "agent-a" / "agent.toml").write_text("")
    net.start_agent("a", "key", env={"X_MODE": "one"}, extra_env={"X_EXTRA": "1"})
    assert seen["X_MODE"] == "one" and seen["X_EXTRA"] == "1"
    for log in net._logs:
        log.close()


# -- D: cheats on tiny models in real plugin hosts -------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("diffusers", reason="model tests need the [agent] extra")
    from plugins.tiny import build_tiny_llama, build_tiny_sd15

    root = tmp_path_factory.mktemp("cheat-weights")
    return {"sd15": build_tiny_sd15(root / "sd15", seed=0),
            "llama": build_tiny_llama(root / "llama", seed=0)}


@pytest.fixture(scope="module")
def hosts(tiny):
    """One warm plugin host per model, shared by the agents of this module."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # shared cores: the host's torch runs one thread
    started = {}
    try:
        for name in ("sd15", "llama"):
            host = PluginHost(builtin_plugin_dir(name), tiny[name], device="cpu")
            host.start()
            started[name] = host
        yield started
    finally:
        for host in started.values():
            host.stop()
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def agent_on(hosts, tiny, plugin, cheat=None) -> Agent:
    """An agent on the module's warm host (wrapped by ``cheat``'s CheatingHost)."""
    agent = make_agent(plugin, tiny[plugin])
    served = agent.plugins[plugin]
    served.host = (cheats.CheatingHost(cheat, served.manifest, hosts[plugin]) if cheat
                   else hosts[plugin])
    return agent


IMG = {"prompt": "a red cube", "steps": 2, "width": 80, "height": 64, "seed": 5}
TXT = {"prompt": "Once upon a time", "max_new_tokens": 16, "temperature": 1.0, "seed": 3,
       "ignore_eos": True}


def _size(png: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(png)).size


@pytest.fixture(scope="module")
def honest(hosts, tiny):
    img = run_job(agent_on(hosts, tiny, "sd15"), "sd15", IMG)
    txt = run_job(agent_on(hosts, tiny, "llama"), "llama", TXT)
    return {"sd15": img, "llama": txt}


def test_honest_receipts_carry_the_plugins_meta(honest):
    rec, outputs, _ = honest["sd15"]
    meta = rec["outputs"][0]["meta"]
    assert meta["seed"] == 5 and meta["dtype"] == "float32" and len(meta["latent_sha256"]) == 64
    assert rec["repro"]["dtype"] == "float32" and rec["repro"]["plugin_build"].startswith("sd15@")
    rec, outputs, _ = honest["llama"]
    meta = rec["outputs"][0]["meta"]
    assert len(meta["scores"]) == len(meta["token_ids"]) == 16
    assert meta["eos_ids"] and meta["temperature"] == 1.0


def test_wrong_seed_changes_the_output_but_claims_the_seed(hosts, tiny, honest):
    rec, outputs, _ = run_job(agent_on(hosts, tiny, "sd15", cheats.Cheat("wrong-seed")),
                              "sd15", IMG)
    h_rec, h_out, _ = honest["sd15"]
    assert outputs[0] != h_out[0]
    meta = rec["outputs"][0]["meta"]
    assert meta["seed"] == 5
    assert meta["latent_sha256"] != h_rec["outputs"][0]["meta"]["latent_sha256"]
    rec, outputs, _ = run_job(agent_on(hosts, tiny, "llama", cheats.Cheat("wrong-seed")),
                              "llama", TXT)
    assert rec["outputs"][0]["meta"]["token_ids"] != \
        honest["llama"][0]["outputs"][0]["meta"]["token_ids"]
    assert rec["outputs"][0]["meta"]["seed"] == 3


def test_fewer_steps_changes_the_image_and_bills_the_full_work(hosts, tiny, honest):
    rec, outputs, msgs = run_job(agent_on(hosts, tiny, "sd15", cheats.Cheat("fewer-steps")),
                                 "sd15", IMG)
    h_rec, h_out, _ = honest["sd15"]
    assert outputs[0] != h_out[0]
    assert rec["work_units"] == h_rec["work_units"]
    totals = {m.progress.total for m in msgs if m.WhichOneof("body") == "progress"}
    assert totals == {1}                            # ran 1 step of the 2 asked


def test_random_image_same_size_other_bytes_without_running(hosts, tiny, honest):
    rec, outputs, msgs = run_job(agent_on(hosts, tiny, "sd15", cheats.Cheat("random-image")),
                                 "sd15", IMG)
    h_rec, h_out, _ = honest["sd15"]
    assert _size(outputs[0]) == _size(h_out[0]) == (80, 64)
    assert outputs[0] != h_out[0]
    assert not [m for m in msgs if m.WhichOneof("body") == "progress"]  # the model never ran
    assert rec["work_units"] == h_rec["work_units"]
    assert rec["outputs"][0]["meta"]["seed"] == 5


def test_cached_output_returns_the_first_output_for_every_later_job(hosts, tiny, honest):
    agent = agent_on(hosts, tiny, "sd15", cheats.Cheat("cached-output"))
    _, first, _ = run_job(agent, "sd15", IMG)
    assert first[0] == honest["sd15"][1][0]          # the first job runs honestly
    rec, later, _ = run_job(agent, "sd15", {**IMG, "seed": 99})
    assert later[0] == first[0]
    assert rec["outputs"][0]["meta"]["seed"] == 99


def test_truncate_text_halves_the_tokens(hosts, tiny, honest):
    rec, outputs, _ = run_job(agent_on(hosts, tiny, "llama", cheats.Cheat("truncate-text")),
                              "llama", TXT)
    h_rec, h_out, _ = honest["llama"]
    meta, h_meta = rec["outputs"][0]["meta"], h_rec["outputs"][0]["meta"]
    assert meta["token_ids"] == h_meta["token_ids"][:8]
    assert len(meta["logprobs"]) == len(meta["scores"]) == 8
    assert meta["finish_reason"] == h_meta["finish_reason"]
    assert len(outputs[0]) < len(h_out[0])


def test_pad_text_appends_eight_tokens(hosts, tiny, honest):
    rec, outputs, _ = run_job(agent_on(hosts, tiny, "llama", cheats.Cheat("pad-text")),
                              "llama", TXT)
    meta, h_meta = rec["outputs"][0]["meta"], honest["llama"][0]["outputs"][0]["meta"]
    assert meta["token_ids"][:16] == h_meta["token_ids"] and len(meta["token_ids"]) == 24
    assert len(meta["logprobs"]) == len(meta["scores"]) == 24


def test_other_text_model_runs_other_weights(tiny, tmp_path, honest, monkeypatch):
    from plugins.tiny import build_tiny_llama

    other = build_tiny_llama(tmp_path / "llama-other", seed=1)
    agent = make_agent("llama", tiny["llama"],
                       cheat=cheats.Cheat("other-text-model", weights=other))
    host = agent.plugins["llama"].host
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    host.start()
    try:
        rec, _, _ = run_job(agent, "llama", TXT)
    finally:
        host.stop()
    h_rec = honest["llama"][0]
    assert rec["outputs"][0]["meta"]["token_ids"] != h_rec["outputs"][0]["meta"]["token_ids"]
    assert rec["repro"]["plugin_build"] == h_rec["repro"]["plugin_build"]  # claims its own


def test_the_host_reports_and_applies_the_size_its_weights_give(hosts, tiny):
    # the tiny sd15 weights are made for 64×64 (diffusers: UNet sample size × VAE factor);
    # the host tells the agent, the agent tells the broker, a job naming no size gets it
    import json
    import threading

    host = hosts["sd15"]
    assert host.ready["input_defaults"] == {"width": 64, "height": 64}
    [cap] = agent_on(hosts, tiny, "sd15")._plugin_capabilities()
    assert json.loads(cap.input_defaults) == {"width": 64, "height": 64}
    result = host.run("no-size", {"prompt": "a lighthouse at dusk", "steps": 2, "seed": 7},
                      wall_clock_s=120, cancelled=threading.Event())
    assert _size(result.outputs[0].data) == (64, 64)
    assert result.work_units == 2 * 64 * 64 / 1048576


# -- issue #20: claims about the work, one person's two accounts (no models) --------------
def test_inflated_units_and_fake_progress_lie_in_the_receipt_and_the_progress():
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    inflated = cheats.Cheat("inflated-units")
    o = inflated.before("j", manifest, {"prompt": "x", "seed": 1})
    assert o.cheated and o.run_inputs == {"prompt": "x", "seed": 1}  # runs honestly
    assert inflated.receipt_figures(o, 2.0, 900) == (20.0, 1)
    fake = cheats.Cheat("fake-progress")
    assert fake.fake_progress(fake.before("j", manifest, {"prompt": "x"}))
    assert not inflated.fake_progress(o)


def test_a_colluding_pal_agrees_with_or_fails_what_its_partner_ran(tmp_path):
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    job = {"prompt": "x", "seed": 7}
    for mode in cheats.PAIR_MODES:
        shared = tmp_path / mode
        cheat = cheats.Cheat(mode, role="cheat", shared_dir=shared)
        pal = cheats.Cheat(mode, role="pal", shared_dir=shared)
        o = cheat.before("j1", manifest, job)
        assert o.cheated and o.run_inputs["seed"] == 8
        [claimed] = cheat.after("sd15", o, [HostOutput(0, "image/png", b"wrong",
                                                       {"seed": 8, "index": 0})])
        assert claimed.meta["seed"] == 7  # claims the job's seed
        other = pal.before("j2", manifest, {"prompt": "y", "seed": 7})
        assert not other.cheated and not other.fail  # a job the cheat never ran: honest
        check = pal.before("j3", manifest, job)      # the check of the cheat's job
        if mode == "collude":
            assert check.skip_run and [o.data for o in pal.fake_outputs("sd15", check)] == \
                [b"wrong"]
        else:
            assert check.fail
    with pytest.raises(ConfigError, match="--shared"):
        cheats.Cheat("collude", role="pal")


def test_detect_checks_cheats_only_on_what_looks_like_a_client_job():
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    c = cheats.Cheat("detect-checks")
    v5 = str(uuid.uuid5(uuid.NAMESPACE_URL, "client"))
    assert c.before(v5, manifest, {"prompt": "x", "seed": 1}).cheated
    # once it has seen derived (v5) client ids, a random id is a check: run honestly
    assert not c.before(str(uuid.uuid4()), manifest, {"prompt": "x", "seed": 1}).cheated
    # the benchmark payload: a canary
    bench = dict(manifest.benchmark_inputs)
    assert not c.before(v5, manifest, bench).cheated
    # where every id is random and canaries look like jobs, it cannot tell: it cheats
    blind = cheats.Cheat("detect-checks")
    assert all(blind.before(str(uuid.uuid4()), manifest, {"prompt": f"p{i}", "seed": i}).cheated
               for i in range(5))
def test_half_steps_claims_the_jobs_schedule_in_the_latent_trace(hosts, tiny, honest):
    """Issue #20: half the steps, the trace relabelled as the job's schedule (so the
    broker cannot tell it from the labels), the work of the whole job billed."""
    job = {**IMG, "steps": 8}
    _, h_out, _ = run_job(agent_on(hosts, tiny, "sd15"), "sd15", job)
    rec, outputs, msgs = run_job(agent_on(hosts, tiny, "sd15", cheats.Cheat("half-steps")),
                                 "sd15", job)
    assert {m.progress.total for m in msgs if m.WhichOneof("body") == "progress"} == {4}
    trace = rec["outputs"][0]["meta"]["latent_trace"]
    assert (trace["total"], trace["steps"]) == (8, [2, 4, 6, 8])
    assert outputs[0] != h_out[0]


def test_false_class_declares_and_names_a_made_up_class(hosts, tiny, honest):
    from provider_agent.agent import declared_repro, hardware_class

    agent = agent_on(hosts, tiny, "sd15", cheats.Cheat("false-class"))
    rec, _, _ = run_job(agent, "sd15", {**IMG, "steps": 4})
    made_up = hardware_class({**hosts["sd15"].ready["hardware"], "threads": cheats.FALSE_THREADS})
    assert rec["repro"]["hardware_class"] == made_up != honest["sd15"][0]["repro"]["hardware_class"]
    assert declared_repro(agent.plugins["sd15"])["hardware_class"] == made_up  # at connect too
    assert rec["outputs"][0]["meta"]["latent_trace"]["total"] == 4
    gpu = cheats.Cheat("false-class").hardware({"device": "cuda", "gpu_name": "NVIDIA H200",
                                                "torch": "2.13.0"})
    assert hardware_class(gpu) == cheats.FALSE_CLASS
    assert hosts["sd15"].ready["hardware"].get("threads") != cheats.FALSE_THREADS  # untouched


def test_cached_unseeded_returns_an_earlier_image_with_its_own_seed(hosts, tiny, honest):
    agent = agent_on(hosts, tiny, "sd15", cheats.Cheat("cached-unseeded"))
    _, first, _ = run_job(agent, "sd15", IMG)
    assert first[0] == honest["sd15"][1][0]          # the first job runs honestly
    rec, later, _ = run_job(agent, "sd15", {**IMG, "seed": 99})
    assert later[0] == first[0]
    assert rec["outputs"][0]["meta"]["seed"] == IMG["seed"]  # the seed it was made with
    _, other, _ = run_job(agent, "sd15", {**IMG, "prompt": "a blue cube", "seed": 99})
    assert other[0] != first[0]                      # other inputs: run honestly


def test_reduced_res_runs_a_smaller_image_and_claims_the_jobs_size(hosts, tiny, honest):
    """Half the width and height (about a quarter of the work), scaled up: the image and
    the latent trace have the job's size and shape, the whole job's work is billed."""
    job = {**IMG, "width": 128, "height": 128}
    h_rec, h_out, _ = run_job(agent_on(hosts, tiny, "sd15"), "sd15", job)
    cheat = cheats.Cheat("reduced-res")
    rec, outputs, _ = run_job(agent_on(hosts, tiny, "sd15", cheat), "sd15", job)
    assert _size(outputs[0]) == _size(h_out[0]) == (128, 128) and outputs[0] != h_out[0]
    trace = rec["outputs"][0]["meta"]["latent_trace"]
    h_trace = h_rec["outputs"][0]["meta"]["latent_trace"]
    assert (trace["shape"], trace["steps"], trace["total"]) == (
        h_trace["shape"], h_trace["steps"], h_trace["total"])
    assert trace["points"] != h_trace["points"]
    assert rec["work_units"] == h_rec["work_units"]
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    assert not cheat.before("j", manifest, IMG).cheated  # 64 a side is the smallest: honest


def test_a_cache_replayed_for_its_own_inputs_is_no_cheat():
    """cached-output / cached-unseeded: returning the cached answer for the very inputs (and
    seed) it was made from is the honest answer, and the log says so (a canary may replay a
    client job's inputs)."""
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    job = {"prompt": "x", "seed": 3}
    for mode in ("cached-output", "cached-unseeded"):
        c = cheats.Cheat(mode)
        first = c.before("j1", manifest, job)
        assert not first.cheated
        c.after("sd15", first, [HostOutput(0, "image/png", b"png", {"seed": 3, "index": 0})])
        assert not c.before("j2", manifest, job).cheated
        again = c.before("j3", manifest, {**job, "seed": 4})
        assert again.cheated and again.skip_run


def test_duplicate_images_runs_one_image_and_claims_n():
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    c = cheats.Cheat("duplicate-images")
    o = c.before("j", manifest, {"prompt": "x", "seed": 5, "n": 3})
    assert o.cheated and o.run_inputs["n"] == 1
    outs = c.after("sd15", o, [HostOutput(0, "image/png", b"png",
                                          {"seed": 5, "index": 0, "latent_sha256": "ab"})])
    assert [(x.index, x.meta["index"], x.meta["seed"], x.data) for x in outs] == [
        (0, 0, 5, b"png"), (1, 1, 6, b"png"), (2, 2, 7, b"png")]
    assert not c.before("j", manifest, {"prompt": "x", "seed": 5}).cheated  # one image: honest
