"""LoRA adapters on the built-in plugins (tiny seeded weights, CPU): the ``adapters`` input,
scales, composition, per-job swaps on the warm base model, refusals, the LRU cache."""
from __future__ import annotations

import argparse
import shutil

import pytest

from plugins.adapters import AdapterRequest, parse_adapters
from plugins.api import BadInput

pytest.importorskip("peft", reason="adapter tests need the [agent] extra")

from plugins.tiny import (build_tiny_lora_llama, build_tiny_lora_sd15,  # noqa: E402
                          build_tiny_lora_sdxl, read_marker, weights_digest)

SD_FAST = {"prompt": "a red cube", "steps": 3, "width": 64, "height": 64, "seed": 1}
LLAMA_FAST = {"prompt": "Once upon a time", "max_new_tokens": 6, "temperature": 0.0,
              "ignore_eos": True, "seed": 0}


# -- the input -------------------------------------------------------------------------
def test_parse_adapters_accepts_pairs_bare_names_and_json():
    assert parse_adapters("") == []
    assert parse_adapters("ink") == [AdapterRequest("ink", 1.0)]
    assert parse_adapters(" ink:0.8 , film-2:-0.5") == [AdapterRequest("film-2", -0.5),
                                                        AdapterRequest("ink", 0.8)]
    assert parse_adapters('{"ink": 0.8, "film": 1}') == [AdapterRequest("film", 1.0),
                                                         AdapterRequest("ink", 0.8)]


def test_adapters_come_in_name_order_whatever_order_they_are_given():
    want = [AdapterRequest("film", 0.5), AdapterRequest("ink", 0.8)]
    assert parse_adapters("ink:0.8,film:0.5") == want
    assert parse_adapters("film:0.5, ink:0.8") == want
    assert parse_adapters('{"ink": 0.8, "film": 0.5}') == want


@pytest.mark.parametrize("text, says", [
    ("ink:lots", "give a number"),
    ("ink:9", "between -4 and 4"),
    ("ink:nan", "between -4 and 4"),
    ("../etc:1", "is not an adapter name"),
    ("ink,ink:0.5", "given twice"),
    ("a,b,c,d,e", "at most 4"),
    ('{"ink": ', "not valid JSON"),
    ('{"ink": true}', "give a number"),
])
def test_parse_adapters_refuses_bad_text_with_a_clear_message(text, says):
    with pytest.raises(BadInput, match=says):
        parse_adapters(text)


# -- fixtures: adapters beside the session's tiny weights ------------------------------
@pytest.fixture(scope="session")
def adapters_root(tiny_dir):
    root = tiny_dir / "adapters"
    for seed, name in ((1, "ink"), (2, "film")):
        build_tiny_lora_sd15(root / "sd15" / name, seed=seed)
        build_tiny_lora_sdxl(root / "sdxl" / name, seed=seed)
        build_tiny_lora_llama(root / "llama" / name, seed=seed)
    for seed in range(3, 6):
        build_tiny_lora_llama(root / "llama" / f"extra{seed}", seed=seed)
    build_tiny_lora_sdxl(root / "sd15" / "xl-style", seed=1)  # declares base sdxl
    undeclared = root / "sd15" / "xl-undeclared"  # the same without adapter.json
    shutil.copytree(root / "sd15" / "xl-style", undeclared)
    (undeclared / "adapter.json").unlink()
    build_tiny_lora_sd15(root / "llama" / "sd-style", seed=1)
    return root


@pytest.fixture
def sd_run(sd15, adapters_root, make_ctx):
    plugin, manifest = sd15
    return lambda adapters="", **kw: plugin.run(
        manifest.validate_inputs({**SD_FAST, **kw, "adapters": adapters}), make_ctx())[0]


@pytest.fixture
def llama_run(llama, adapters_root, make_ctx):
    plugin, manifest = llama
    return lambda adapters="", **kw: plugin.run(
        manifest.validate_inputs({**LLAMA_FAST, **kw, "adapters": adapters}), make_ctx())[0]


# -- behaviour -------------------------------------------------------------------------
def test_sd15_scale_zero_is_the_base_image_and_scale_one_differs(sd_run):
    base = sd_run()
    assert sd_run("ink:0").data == base.data
    with_ink = sd_run("ink:1")
    assert with_ink.data != base.data
    assert with_ink.meta["adapters"] == {"ink": 1.0}
    assert sd_run().data == base.data, "a job without adapters must get the base model back"


def test_sd15_two_adapters_compose(sd_run):
    ink, film, both = sd_run("ink"), sd_run("film"), sd_run("ink:1,film:1")
    assert len({ink.data, film.data, both.data}) == 3
    assert sd_run('{"film": 1, "ink": 1}').data == both.data  # order does not matter


def test_sdxl_scale_zero_is_the_base_image_and_scale_one_differs(sdxl, adapters_root,
                                                                  make_ctx):
    plugin, manifest = sdxl

    def run(adapters):
        inputs = manifest.validate_inputs({**SD_FAST, "adapters": adapters})
        return plugin.run(inputs, make_ctx())[0].data

    base = run("")
    assert run("ink:0") == base
    assert len({base, run("ink:1"), run("ink:1,film:0.5")}) == 3


def test_llama_scale_zero_is_the_base_text_and_adapters_compose(llama_run):
    def logprobs(out):
        return out.meta["logprobs"]

    base = llama_run()
    zero = llama_run("ink:0")
    assert (zero.data, logprobs(zero)) == (base.data, logprobs(base))
    ink, film, both = llama_run("ink"), llama_run("film"), llama_run("ink:1,film:1")
    assert logprobs(ink) != logprobs(base)
    assert len({tuple(logprobs(o)) for o in (ink, film, both)}) == 3
    assert logprobs(llama_run()) == logprobs(base)


def test_swapping_adapters_per_job_keeps_the_warm_base_model(sd15, sd_run, sd15_weights):
    plugin, _ = sd15
    unet, text_encoder = plugin.pipe.unet, plugin.pipe.text_encoder
    sd_run("ink")
    sd_run("film")
    loads = plugin.adapters.loads
    first = sd_run("ink").data
    assert plugin.adapters.loads == loads, "a cached adapter must not be read again"
    assert plugin.pipe.unet is unet and plugin.pipe.text_encoder is text_encoder

    assert sd_run("ink").data == first



@pytest.mark.parametrize("name, says", [
    ("xl-style", "'xl-style' is an adapter for sdxl, not for sd15"),
    ("xl-undeclared", "does not fit this sd15 model"),
])
def test_an_adapter_for_another_base_model_is_refused(sd_run, name, says):
    base = sd_run().data
    with pytest.raises(BadInput, match=says):
        sd_run(f"{name}:1")
    assert sd_run().data == base, "a refused adapter must leave the model as it was"
    assert sd_run("ink:0").data == base


def test_llama_refuses_a_diffusers_adapter(llama_run):
    with pytest.raises(BadInput, match="is an adapter for sd15, not for llama"):
        llama_run("sd-style")


def test_unknown_adapter_lists_the_available_ones(sd_run):
    with pytest.raises(BadInput, match=r"no sd15 adapter 'nope'; available: film, ink"):
        sd_run("nope:0.5")


def test_lru_cache_evicts_the_least_recently_used_adapter(llama, llama_run):
    plugin, _ = llama
    cache = plugin.adapters
    for name in list(cache.loaded):  # start empty and small
        cache.loaded.pop(name)
        plugin._unload_adapter(name)
    cache.capacity = 4
    first = llama_run("ink").meta["logprobs"]
    for name in ("film", "extra3", "extra4"):
        llama_run(name)
    llama_run("ink")  # ink is now the most recent; film the least
    loads = cache.loads
    llama_run("extra5")
    assert list(cache.loaded) == ["extra3", "extra4", "ink", "extra5"]
    assert cache.loads == loads + 1
    llama_run("film")  # evicted: read again from disk, and works as before
    assert cache.loads == loads + 2 and "extra3" not in cache.loaded
    assert llama_run("ink").meta["logprobs"] == first
    cache.capacity = 8


# -- tiny LoRA builders ----------------------------------------------------------------
def test_tiny_loras_are_in_the_real_layouts_and_deterministic(tmp_path):
    a = build_tiny_lora_llama(tmp_path / "a", seed=7)
    b = build_tiny_lora_llama(tmp_path / "b", seed=7)
    c = build_tiny_lora_llama(tmp_path / "c", seed=8)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in a.iterdir()}
    assert weights_digest(a) == weights_digest(b) != weights_digest(c)
    sd = build_tiny_lora_sd15(tmp_path / "sd", seed=7)
    assert (sd / "pytorch_lora_weights.safetensors").exists()
    assert read_marker(sd)["kind"] == "lora-sd15"


def test_cli_builds_a_tiny_lora(tmp_path, capsys):
    from plugins.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plugins", "build-tiny", "lora-llama", "--out",
                              str(tmp_path / "lora"), "--seed", "3"])
    assert args.func(args) == 0
    assert "built tiny lora-llama (seed 3)" in capsys.readouterr().out
    assert (tmp_path / "lora" / "adapter_config.json").exists()
