"""The llama plugin on a tiny seeded model (2 layers, width 64, byte-level BPE), on the CPU.

The model is random, so its text is gibberish with odd bytes in it: good for testing that
streaming never loses or reorders a character."""
from __future__ import annotations

import json

import pytest

from plugins.api import BadInput, Cancelled
from sdk.protocol.schema import InputError

pytest.importorskip("transformers", reason="plugin tests need the [agent] extra")


@pytest.fixture
def run(llama, make_ctx):
    plugin, manifest = llama

    def run_job(ctx=None, **inputs):
        return plugin.run(manifest.validate_inputs(inputs), ctx or make_ctx())

    return run_job


def test_tiny_llama_loads_with_the_auto_classes(llama_weights):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_weights)
    model = AutoModelForCausalLM.from_pretrained(llama_weights)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.decode(tok("Zürich 東京").input_ids, skip_special_tokens=True) == "Zürich 東京"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_pieces_add_up_to_the_final_text(run, make_ctx, seed):
    ctx = make_ctx()
    out, = run(ctx, prompt="Once upon a time", max_new_tokens=60, temperature=1.0, seed=seed,
               ignore_eos=True)
    assert out.media_type == "text/plain"
    assert "".join(text for text, _ in ctx.streamed) == out.data.decode("utf-8")
    streamed_ids = [i for _, ids in ctx.streamed for i in ids]
    assert streamed_ids == out.meta["token_ids"][:len(streamed_ids)]
    assert out.meta["generated_tokens"] == 60 == len(out.meta["logprobs"])
    assert all(lp <= 0 for lp in out.meta["logprobs"])
    assert out.meta["work_units"] == out.meta["prompt_tokens"] + 60
    assert ctx.progress_calls[-1] == (60, 60)


def test_same_seed_same_tokens_other_seed_other_tokens(run):
    inputs = dict(prompt="Hello", max_new_tokens=20, temperature=1.0, ignore_eos=True)
    a, = run(seed=7, **inputs)
    b, = run(seed=7, **inputs)
    c, = run(seed=8, **inputs)
    assert a.meta["token_ids"] == b.meta["token_ids"] != c.meta["token_ids"]
    assert a.data == b.data


def test_greedy_ignores_the_seed(run):
    a, = run(prompt="Hello", max_new_tokens=10, temperature=0.0, ignore_eos=True, seed=1)
    b, = run(prompt="Hello", max_new_tokens=10, temperature=0.0, ignore_eos=True, seed=2)
    assert a.meta["token_ids"] == b.meta["token_ids"]


def test_chat_messages_go_through_the_template(llama, run):
    plugin, _ = llama
    messages = json.dumps([{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hello, world!"}])
    out, = run(messages=messages, max_new_tokens=5, seed=0, ignore_eos=True)
    expected = plugin.tokenizer.apply_chat_template(
        json.loads(messages), tokenize=False, add_generation_prompt=True)
    expected_ids = plugin.tokenizer(expected, add_special_tokens=False).input_ids
    assert out.meta["prompt_tokens"] == len(expected_ids)


def test_stop_string_ends_the_text_before_it(run, make_ctx):
    free, = run(prompt="Once upon a time", max_new_tokens=80, temperature=1.0, seed=0,
                ignore_eos=True)
    text = free.data.decode()
    # a two-character string the model produces with this seed (whole characters only)
    stop = next(text[i:i + 2] for i in range(10, len(text) - 1)
                if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2])
    ctx = make_ctx()
    out, = run(ctx, prompt="Once upon a time", max_new_tokens=80, temperature=1.0, seed=0,
               ignore_eos=True, stop=stop)
    assert out.data.decode() == text[:text.index(stop)]
    assert "".join(t for t, _ in ctx.streamed) == out.data.decode()
    assert out.meta["finish_reason"] == "stop"


def test_cancellation_stops_generation(run, make_ctx):
    ctx = make_ctx(cancel_at_step=3)
    with pytest.raises(Cancelled):
        run(ctx, prompt="Hello", max_new_tokens=50, ignore_eos=True, seed=0)
    assert ctx.progress_calls[-1] == (3, 50)


@pytest.mark.parametrize("inputs", [
    {"max_new_tokens": 5}, {"prompt": "hi", "messages": '[{"role": "user", "content": "hi"}]'}])
def test_prompt_or_messages_is_the_manifests_rule_on_every_side(run, inputs):
    # refused by the manifest's rule before the plugin runs (the broker, at submit)
    with pytest.raises(InputError, match="exactly one of prompt") as err:
        run(**inputs)
    assert err.value.field == "prompt"


@pytest.mark.parametrize("inputs,message", [
    ({"messages": "not json"}, "not valid JSON"),
    ({"messages": '[{"role": "robot", "content": "hi"}]'}, "messages\\[0\\]"),
    ({"prompt": "word " * 300, "max_new_tokens": 400}, "context of 512 tokens"),
])
def test_bad_requests_are_refused_with_a_reason(run, inputs, message):
    with pytest.raises(BadInput, match=message):
        run(**inputs)


def test_schema_limits(llama):
    _, manifest = llama
    with pytest.raises(InputError, match="temperature"):
        manifest.validate_inputs({"prompt": "x", "temperature": 3})
    inputs = manifest.validate_inputs({"prompt": "x", "max_new_tokens": 100})
    assert manifest.work_units_for(inputs) == 100
