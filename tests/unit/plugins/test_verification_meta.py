"""What the built-in plugins report for verification by spot redundancy (DESIGN §6):
diffusion outputs carry the hash of their final latents, llama outputs the per-token
scores a checker re-scores by teacher forcing. All of it must be canonical-JSON safe."""
from __future__ import annotations

import hashlib
import json
import math

import pytest

from sdk.protocol.canonical import canonical_bytes, loads

pytest.importorskip("diffusers", reason="plugin tests need the [agent] extra")
import numpy as np  # noqa: E402
import torch  # noqa: E402

from plugins.api import BadInput, latent_digest  # noqa: E402

FAST = {"prompt": "a lighthouse at dusk", "steps": 3, "width": 64, "height": 64}


def test_latent_digest_is_sha256_over_dtype_shape_and_float32_bytes():
    t = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4).transpose(1, 2)  # not contiguous
    arr = np.ascontiguousarray(t.float().numpy())
    h = hashlib.sha256(b"<f4(2, 4, 3)")
    h.update(arr.tobytes())
    assert latent_digest(t) == h.hexdigest()
    assert latent_digest(t.float().contiguous()) == h.hexdigest()  # dtype and layout: same
    assert latent_digest(t[:1]) != h.hexdigest()


@pytest.fixture
def sd15_run(sd15, make_ctx):
    plugin, manifest = sd15

    def run_job(ctx=None, **inputs):
        return plugin.run(manifest.validate_inputs({**FAST, **inputs}), ctx or make_ctx())

    return run_job


def test_sd15_latent_hash_same_seed_same_hash_other_seed_other(sd15_run):
    import io

    from PIL import Image

    a, b = sd15_run(seed=7, n=2)
    single, = sd15_run(seed=7)
    again, = sd15_run(seed=7)
    other, = sd15_run(seed=9)
    for out in (a, b, single, again, other):
        assert out.meta["dtype"] == "float32"
        assert len(out.meta["latent_sha256"]) == 64
        int(out.meta["latent_sha256"], 16)
    # The same job twice: the same latents, bit for bit, and the same bytes.
    assert again.meta["latent_sha256"] == single.meta["latent_sha256"]
    assert again.data == single.data                 # outputs unchanged by the capture
    # Image 0 of a two-image job is the one-image job's image up to the rounding (a batch
    # of two may take other kernels: the latents need not agree bit for bit).
    pixels = [np.asarray(Image.open(io.BytesIO(o.data)), dtype=np.int16) for o in (a, single)]
    assert np.abs(pixels[0] - pixels[1]).max() <= 3
    assert len({a.meta["latent_sha256"], b.meta["latent_sha256"],
                other.meta["latent_sha256"]}) == 3
    loads(canonical_bytes(a.meta))


def test_sd15_latent_hash_is_of_the_latents_the_vae_decodes(sd15, make_ctx, monkeypatch):
    import plugins.diffusion as diffusion

    plugin, manifest = sd15
    hashed, decoded = [], []

    def recording_digest(tensor):
        hashed.append(tensor.detach().clone())
        return latent_digest(tensor)

    decode = plugin.pipe.vae.decode

    def spy(latents, *args, **kwargs):
        decoded.append(latents.detach().clone())
        return decode(latents, *args, **kwargs)

    monkeypatch.setattr(diffusion, "latent_digest", recording_digest)
    monkeypatch.setattr(plugin.pipe.vae, "decode", spy)
    outs = plugin.run(manifest.validate_inputs({**FAST, "seed": 3, "n": 2}), make_ctx())
    assert len(hashed) == 2 and len(decoded) == 1
    scale = plugin.pipe.vae.config.scaling_factor
    for i, out in enumerate(outs):
        assert torch.equal(hashed[i] / scale, decoded[0][i])   # the decoded latents, exactly
        assert out.meta["latent_sha256"] == latent_digest(hashed[i])


def test_sd15_resumed_job_has_the_same_latent_hash(sd15, ckpt_ctx):
    plugin, manifest = sd15
    inputs = manifest.validate_inputs({**FAST, "steps": 4, "seed": 5, "scheduler": "euler_a"})
    [plain] = plugin.run(inputs, ckpt_ctx())
    writer = ckpt_ctx(every=2)
    plugin.run(inputs, writer)
    [resumed] = plugin.run(inputs, ckpt_ctx(resume=writer.checkpoints[2]))
    assert resumed.meta["latent_sha256"] == plain.meta["latent_sha256"]


def test_sdxl_reports_latent_hash_and_dtype(sdxl, make_ctx):
    plugin, manifest = sdxl
    inputs = manifest.validate_inputs({"prompt": "a red cube", "steps": 2, "width": 64,
                                       "height": 64, "seed": 1})
    [a] = plugin.run(inputs, make_ctx())
    [b] = plugin.run(inputs, make_ctx())
    assert a.meta["dtype"] == "float32"
    assert a.meta["latent_sha256"] == b.meta["latent_sha256"]


# -- llama --------------------------------------------------------------------------------
@pytest.fixture
def llama_run(llama, make_ctx):
    plugin, manifest = llama

    def run_job(ctx=None, **inputs):
        return plugin.run(manifest.validate_inputs(inputs), ctx or make_ctx())

    return run_job


def _check_scores(meta):
    scores = meta["scores"]
    assert len(scores) == len(meta["token_ids"]) == len(meta["logprobs"])
    for token, lp, s in zip(meta["token_ids"], meta["logprobs"], scores):
        # "near", and where the token sits in the distribution sampled from: sampled only
        draw = {"near", "lp_t", "mass_tied", "top_mass", "nucleus_mass", "tilts"}
        assert set(s) - draw == {"top", "eos_lp", "eos_p", "mass_above"}
        assert set(s) & draw in (set(), draw)
        if "tilts" in s:
            assert [g for g, _ in s["tilts"]] == [0.6, 1.5, 3.0]
            assert 0.0 < s["mass_tied"] <= s["top_mass"] + 1e-6 or s["mass_above"] > 0
            assert 0.0 < s["top_mass"] <= s["nucleus_mass"] <= 1.0 + 1e-6
            assert s["lp_t"] <= 0.0 and math.isfinite(s["lp_t"])
        top = s["top"]
        for tid, tlp, tp in s.get("near", []):
            assert isinstance(tid, int) and tlp <= top[0][1] + 1e-6 and 0.0 <= tp <= 1.0
        assert len(top) == 5
        lps = [t[1] for t in top]
        assert lps == sorted(lps, reverse=True)
        assert all(len(t) == 3 and isinstance(t[0], int) for t in top)
        assert all(0.0 <= t[2] <= 1.0 for t in top)
        assert lp <= top[0][1] + 1e-6
        for tid, tlp, _ in top:
            if tid == token:
                assert tlp == pytest.approx(lp, abs=1e-6)
        for value in (s["eos_lp"], s["eos_p"], s["mass_above"], *lps):
            assert value == round(value, 6) and math.isfinite(value)
        assert 0.0 <= s["eos_p"] <= 1.0 and 0.0 <= s["mass_above"] <= 1.0
    loads(canonical_bytes(meta))


def test_llama_greedy_meta(llama, llama_run):
    plugin, _ = llama
    out, = llama_run(prompt="Once upon a time", max_new_tokens=12, temperature=0.0, seed=1,
                     ignore_eos=True)
    m = out.meta
    assert m["eos_ids"] == sorted(plugin.eos_ids) and m["eos_ids"]
    assert (m["temperature"], m["top_p"], m["max_new_tokens"]) == (0.0, 0.95, 12)
    assert m["finish_reason"] == "length" and m["stopped_by_string"] is False
    assert m["ignore_eos"] is True
    assert m["dtype"] == "float32"
    _check_scores(m)
    for token, s in zip(m["token_ids"], m["scores"]):
        assert s["eos_p"] == 0.0 and s["mass_above"] == 0.0
        assert [t[2] for t in s["top"] if t[0] == token] in ([1.0], [])
        # greedy with eos banned: the token is the likeliest non-eos one
        best = next(t for t in s["top"] if t[0] not in m["eos_ids"])
        assert best[0] == token
        # logsumexp over all eos ids: at least each one's own logprob
        assert all(s["eos_lp"] >= t[1] - 1e-6 for t in s["top"] if t[0] in m["eos_ids"])


def test_llama_sampled_meta_mass_above_and_sampled_probabilities(llama_run):
    out, = llama_run(prompt="Hello", max_new_tokens=16, temperature=1.0, top_p=1.0, seed=3,
                     ignore_eos=True)
    m = out.meta
    _check_scores(m)
    for token, lp, s in zip(m["token_ids"], m["logprobs"], m["scores"]):
        assert s["eos_p"] == 0.0                    # ignore_eos: banned from the sampler
        rank = [t[0] for t in s["top"]].index(token) if token in [t[0] for t in s["top"]] \
            else None
        if rank is not None and not any(t[0] in m["eos_ids"] for t in s["top"][:rank]):
            # at T=1 without top_p, the mass above is the raw mass of the likelier tokens
            above = sum(math.exp(t[1]) for t in s["top"][:rank])
            eos_total = sum(math.exp(t[1]) for t in s["top"] if t[0] in m["eos_ids"])
            assert s["mass_above"] == pytest.approx(above / (1 - eos_total), abs=1e-4)
        for tid, tlp, p in s["top"]:
            if tid not in m["eos_ids"]:
                assert p >= math.exp(tlp) - 1e-6    # renormalised without eos: a bit more


def test_llama_top_p_zeroes_the_tail_and_eos_mass_counts(llama_run):
    """Without ignore_eos the eos ids are not banned: their mass in the distribution sampled
    from (what top_p kept of it) is reported as eos_p, beside the other tokens' mass."""
    job = {"prompt": "Hello", "max_new_tokens": 10, "temperature": 0.7, "top_p": 0.05,
           "seed": 2}
    out, = llama_run(**job)
    m = out.meta
    _check_scores(m)
    assert m["top_p"] == 0.05 and m["temperature"] == 0.7
    eos = set(m["eos_ids"])
    for token, s in zip(m["token_ids"], m["scores"]):
        kept = [t for t in s["top"] if t[2] > 0]
        assert kept and sum(t[2] for t in kept) <= 1.0 + 1e-5
        # everything kept by top_p is at least as likely as everything dropped
        dropped = [t for t in s["top"] if t[2] == 0]
        if dropped:
            assert min(t[1] for t in kept) >= max(t[1] for t in dropped)
        # the eos mass is a share of the sampled distribution, apart from the others'
        assert s["eos_p"] + sum(t[2] for t in s["top"] if t[0] not in eos) <= 1.0 + 1e-5
    # where top_p's head takes an eos id in, its mass counts (this seeded job has such steps)
    assert any(s["eos_p"] > 0 for s in m["scores"])
    # ... unless ignore_eos bans the eos ids from the sampler
    banned, = llama_run(**job, ignore_eos=True)
    assert all(s["eos_p"] == 0.0 for s in banned.meta["scores"])
    # at T=1 without top_p the sampled distribution is the model's own: all its eos mass
    full, = llama_run(**{**job, "temperature": 1.0, "top_p": 1.0})
    for s in full.meta["scores"]:
        assert s["eos_p"] == pytest.approx(math.exp(s["eos_lp"]), rel=1e-3)


def test_llama_stop_string_is_reported(llama_run):
    free, = llama_run(prompt="Once upon a time", max_new_tokens=40, temperature=1.0, seed=0,
                      ignore_eos=True)
    text = free.data.decode()
    stop = next(text[i:i + 2] for i in range(5, len(text) - 1)
                if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2])
    out, = llama_run(prompt="Once upon a time", max_new_tokens=40, temperature=1.0, seed=0,
                     ignore_eos=True, stop=stop)
    assert out.meta["stopped_by_string"] is True and out.meta["finish_reason"] == "stop"
    assert free.meta["stopped_by_string"] is False
    _check_scores(out.meta)


def test_llama_resumed_job_keeps_the_scores(llama, ckpt_ctx):
    plugin, manifest = llama
    inputs = manifest.validate_inputs({"prompt": "hello there", "max_new_tokens": 12,
                                       "seed": 4, "temperature": 0.8, "ignore_eos": True})
    [plain] = plugin.run(inputs, ckpt_ctx())
    writer = ckpt_ctx(every=5)
    plugin.run(inputs, writer)
    [resumed] = plugin.run(inputs, ckpt_ctx(resume=writer.checkpoints[5]))
    assert resumed.meta["token_ids"] == plain.meta["token_ids"]
    # the first 5 come from the checkpoint; after it the prompt is re-encoded in one pass
    # rather than token by token, which may move the last digit
    assert resumed.meta["scores"][:5] == plain.meta["scores"][:5]
    for a, b in zip(resumed.meta["scores"][5:], plain.meta["scores"][5:]):
        assert [t[0] for t in a["top"]] == [t[0] for t in b["top"]]
        assert a["mass_above"] == pytest.approx(b["mass_above"], abs=1e-4)
        assert [t[1] for t in a["top"]] == pytest.approx([t[1] for t in b["top"]], abs=1e-4)


@pytest.mark.parametrize("temperature,top_p,ban", [(0.8, 0.6, False), (1.0, 1.0, False),
                                                   (0.5, 0.9, True), (1.3, 0.3, False)])
def test_llama_scores_match_a_brute_force_computation(llama, temperature, top_p, ban):
    plugin, _ = llama
    ns = type(plugin).run.__globals__          # the plugin module's functions
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 2
    logits[10] = logits[11] = logits[12]       # ties, to exercise the stable order
    eos_ids = [3, 7]
    banned = eos_ids if ban else []
    for seed in range(20):
        gen = torch.Generator("cpu").manual_seed(seed)
        token, dist = ns["_sample_dist"](logits, temperature, top_p, gen, banned)
        logp = torch.log_softmax(logits, -1)
        s = ns["_score"](logp, token, dist, torch.tensor(eos_ids))
        masked = logits.clone()
        masked[banned] = float("-inf")
        probs = torch.softmax(masked / temperature, -1).tolist()
        order = sorted(range(64), key=lambda i: -probs[i])   # stable, like the sampler
        kept, mass = set(), 0.0
        for i in order:
            if mass >= top_p and top_p < 1.0:
                break
            kept.add(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        sampled = [probs[i] / total if i in kept else 0.0 for i in range(64)]
        assert sampled[token] > 0
        top = sorted(range(64), key=lambda i: -logp[i].item())[:5]
        assert [t[0] for t in s["top"]] == top or \
            sorted(t[1] for t in s["top"]) == sorted(round(logp[i].item(), 6) for i in top)
        for tid, tlp, p in s["top"]:
            assert tlp == pytest.approx(logp[tid].item(), abs=1e-6)
            assert p == pytest.approx(sampled[tid], abs=1e-5)
        assert s["eos_p"] == pytest.approx(sum(sampled[i] for i in eos_ids), abs=1e-5)
        assert s["eos_lp"] == pytest.approx(torch.logsumexp(logp[eos_ids], 0).item(), abs=1e-5)
        assert s["mass_above"] == pytest.approx(
            sum(p for p in probs if p > probs[token]), abs=1e-5)
        # where the token sits in what was sampled from (the verifier's sampling test)
        assert s["lp_t"] == pytest.approx(math.log(probs[token]), abs=1e-5)
        assert s["mass_tied"] == pytest.approx(
            sum(p for p in probs if p == probs[token]), abs=1e-5)
        assert s["top_mass"] == pytest.approx(sum(p for p in probs if p == max(probs)),
                                              abs=1e-5)
        assert s["nucleus_mass"] == pytest.approx(total, abs=1e-5)
        for g, log_sum in s["tilts"]:
            assert log_sum == pytest.approx(
                math.log(sum((probs[i] / total) ** g for i in kept)), abs=1e-4)


@pytest.mark.parametrize("temperature,top_p,ignore_eos", [(0.0, 1.0, False), (1.0, 0.9, True)])
def test_llama_scoring_reports_what_the_generating_run_reported(llama_run, temperature, top_p,
                                                                ignore_eos):
    """Scoring a run's own tokens (score_tokens) gives back that run's meta: one teacher-
    forced pass agrees with the step-by-step generation over the KV cache."""
    job = dict(prompt="Once upon a time", max_new_tokens=24, temperature=temperature,
               top_p=top_p, seed=5, ignore_eos=ignore_eos)
    ran, = llama_run(**job)
    scored, = llama_run(**job, score_tokens=json.dumps(ran.meta["token_ids"]))
    a, b = ran.meta, scored.meta
    assert b["scored"] is True and "scored" not in a
    assert b["token_ids"] == a["token_ids"]
    assert b["logprobs"] == pytest.approx(a["logprobs"], abs=1e-4)
    for key in ("temperature", "top_p", "max_new_tokens", "ignore_eos", "eos_ids",
                "prompt_tokens", "generated_tokens", "work_units", "finish_reason"):
        assert b[key] == a[key], key
    _check_scores(b)
    for x, y in zip(a["scores"], b["scores"]):
        assert [t[0] for t in x["top"]] == [t[0] for t in y["top"]]
        assert [t[1] for t in x["top"]] == pytest.approx([t[1] for t in y["top"]], abs=1e-4)
        assert y["mass_above"] == pytest.approx(x["mass_above"], abs=1e-4)
        assert y["eos_p"] == pytest.approx(x["eos_p"], abs=1e-4)
    assert scored.data.decode() == ran.data.decode()


def test_llama_scoring_matches_the_verifiers_rescoring(llama, llama_run):
    """The plugin's teacher-forced scores are the ones broker.verification.rescoring
    computes from the same model (a claim of other tokens than the model would pick)."""
    from broker.verification.rescoring import rescore_causal_lm

    plugin, _ = llama
    claim = [plugin.tokenizer.encode(w, add_special_tokens=False)[0] for w in
             ("the", " cat", " sat", " on", " a", " mat")]
    out, = llama_run(prompt="Once upon a time", max_new_tokens=8, temperature=0.7, top_p=0.95,
                     score_tokens=json.dumps(claim))
    prompt_ids = plugin.tokenizer("Once upon a time").input_ids
    expect = rescore_causal_lm(plugin.model, prompt_ids, claim, plugin.eos_ids,
                               temperature=0.7, top_p=0.95)
    assert out.meta["logprobs"] == pytest.approx([t.logprob for t in expect.tokens], abs=1e-4)
    assert [s["mass_above"] for s in out.meta["scores"]] == pytest.approx(
        [t.mass_above for t in expect.tokens], abs=1e-4)


@pytest.mark.parametrize("raw,message", [
    ("[1, 2", "JSON array of token ids"),
    ("[]", "JSON array of token ids"),
    ('["a"]', "JSON array of token ids"),
    ("[1, 99999999]", "JSON array of token ids"),
    ("[1, 2, 3, 4, 5]", "more than max_new_tokens"),
])
def test_llama_scoring_refuses_bad_token_lists(llama_run, raw, message):
    with pytest.raises(BadInput, match=message):
        llama_run(prompt="hi", max_new_tokens=4, score_tokens=raw)


def test_sd15_latent_trace_records_the_schedule_and_tells_half_the_steps(sd15_run):
    """Issue #20: each image's meta carries its latents at fixed fractions of its schedule
    (pooled, float16), so that a checker can tell a run of half the steps, whose final
    image looks alike, from its own."""
    import base64

    from plugins.api import trace_steps

    assert trace_steps(30) == [8, 15, 23, 30] and trace_steps(15) == [4, 8, 12, 15]
    assert trace_steps(1) == [1] and trace_steps(3) == [1, 2, 3]
    a, b = sd15_run(seed=7, n=2, steps=8)
    again, = sd15_run(seed=7, steps=8)
    half, = sd15_run(seed=7, steps=4)
    trace = a.meta["latent_trace"]
    assert trace["total"] == 8 and trace["steps"] == [2, 4, 6, 8]
    assert trace["shape"] == [4, 8, 8]  # the tiny model's 64x64 image: 8x8 latents
    for point in trace["points"]:
        assert len(base64.b64decode(point)) == 4 * 8 * 8 * 2  # float16
    assert b.meta["latent_trace"]["points"] != trace["points"]  # seed + 1
    again_trace, = sd15_run(seed=7, steps=8)
    assert again_trace.meta["latent_trace"] == again.meta["latent_trace"]  # reproducible
    final = [np.frombuffer(base64.b64decode(o.meta["latent_trace"]["points"][-1]),
                           np.float16).astype(np.float32) for o in (again, half)]
    assert np.linalg.norm(final[0] - final[1]) > 0.02 * np.linalg.norm(final[0])
    loads(canonical_bytes(a.meta))
