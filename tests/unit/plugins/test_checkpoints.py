"""Checkpoints of the built-in plugins on tiny seeded models: a job resumed from a
checkpoint gives exactly the bytes of an uninterrupted run (the same machine and dtype)."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers", reason="plugin tests need the [agent] extra")

from plugins import checkpoints  # noqa: E402
from plugins.checkpoints import BadCheckpoint  # noqa: E402


@pytest.mark.parametrize("scheduler", ["euler", "euler_a", "ddim", "dpmpp_2m"])
def test_sd15_resumed_from_a_checkpoint_is_byte_identical(sd15, ckpt_ctx, scheduler):
    plugin, manifest = sd15
    inputs = manifest.validate_inputs({"prompt": "a lighthouse at dusk", "steps": 6,
                                       "width": 64, "height": 64, "seed": 5,
                                       "scheduler": scheduler})
    [plain] = plugin.run(inputs, ckpt_ctx())
    writer = ckpt_ctx(every=2)
    [checkpointed] = plugin.run(inputs, writer)
    assert checkpointed.data == plain.data          # writing checkpoints changes nothing
    assert sorted(writer.checkpoints) == [2, 4]     # every 2 steps, none at the end
    for step in (2, 4):
        resumed_ctx = ckpt_ctx(resume=writer.checkpoints[step])
        [resumed] = plugin.run(inputs, resumed_ctx)
        assert resumed.data == plain.data, f"{scheduler} resumed at {step} differs"
        assert resumed_ctx.progress_calls[0] == (step, 6)
        # the latent trace too: the points before the checkpoint come with it
        assert resumed.meta["latent_trace"] == plain.meta["latent_trace"]


def test_dpmpp_2m_checkpoint_holds_the_solver_history(sd15, ckpt_ctx):
    plugin, manifest = sd15
    inputs = manifest.validate_inputs({"prompt": "x", "steps": 6, "width": 64, "height": 64,
                                       "seed": 1, "scheduler": "dpmpp_2m"})
    writer = ckpt_ctx(every=3)
    plugin.run(inputs, writer)
    doc = checkpoints.loads(writer.checkpoints[3], kind="diffusion", inputs=inputs)
    state = doc["scheduler_state"]
    assert state["_step_index"] == 3 and state["lower_order_nums"] >= 1
    assert any(t is not None for t in state["model_outputs"])
    assert doc["step"] == 3 and doc["total"] == 6 and len(doc["rng"]) == 1


def test_a_chain_of_resumes_is_still_byte_identical(sd15, ckpt_ctx):
    plugin, manifest = sd15
    inputs = manifest.validate_inputs({"prompt": "a red cube", "steps": 9, "width": 64,
                                       "height": 64, "seed": 2, "scheduler": "euler_a", "n": 2})
    plain = plugin.run(inputs, ckpt_ctx())
    first = ckpt_ctx(every=3)
    first.cancel_at_step = 4                        # dies after its step-3 checkpoint
    with pytest.raises(Exception):
        plugin.run(inputs, first)
    second = ckpt_ctx(every=3, resume=first.checkpoints[3])
    second.cancel_at_step = 7
    with pytest.raises(Exception):
        plugin.run(inputs, second)
    third = plugin.run(inputs, ckpt_ctx(resume=second.checkpoints[6]))
    assert [o.data for o in third] == [o.data for o in plain]


def test_a_checkpoint_of_another_job_is_refused(sd15, ckpt_ctx):
    plugin, manifest = sd15
    base = {"prompt": "x", "steps": 4, "width": 64, "height": 64, "seed": 1}
    writer = ckpt_ctx(every=2)
    plugin.run(manifest.validate_inputs(base), writer)
    with pytest.raises(BadCheckpoint, match="other inputs"):
        plugin.run(manifest.validate_inputs({**base, "seed": 2}),
                   ckpt_ctx(resume=writer.checkpoints[2]))
    with pytest.raises(BadCheckpoint):
        plugin.run(manifest.validate_inputs(base), ckpt_ctx(resume=b"not a checkpoint"))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_llama_resumes_from_its_token_ids(llama, ckpt_ctx, temperature):
    plugin, manifest = llama
    inputs = manifest.validate_inputs({"prompt": "hello there", "max_new_tokens": 20,
                                       "seed": 4, "temperature": temperature,
                                       "ignore_eos": True})
    [plain] = plugin.run(inputs, ckpt_ctx())
    writer = ckpt_ctx(every=8)
    plugin.run(inputs, writer)
    assert sorted(writer.checkpoints) == [8, 16]
    doc = checkpoints.loads(writer.checkpoints[8], kind="tokens", inputs=inputs)
    assert doc["token_ids"] == plain.meta["token_ids"][:8]
    resumed_ctx = ckpt_ctx(resume=writer.checkpoints[8])
    [resumed] = plugin.run(inputs, resumed_ctx)
    assert resumed.meta["token_ids"] == plain.meta["token_ids"]
    assert resumed.data == plain.data
    # Only the text after the checkpoint is streamed; the earlier text reached the client.
    streamed = "".join(text for text, _ in resumed_ctx.streamed)
    assert plain.data.decode().endswith(streamed) and len(streamed) < len(plain.data.decode())
