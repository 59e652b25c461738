"""plugins.tiny and `sparecycles plugins build-tiny`: real layouts, deterministic, idempotent."""
from __future__ import annotations

import argparse
import json

import pytest

from plugins.tiny import (MARKER, build_tiny, build_tiny_llama, build_tiny_sd15, read_marker,
                          weights_digest)

pytest.importorskip("diffusers", reason="plugin tests need the [agent] extra")


def test_sd15_folder_has_the_published_layout(sd15_weights):
    index = json.loads((sd15_weights / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["safety_checker"] == [None, None] and index["requires_safety_checker"] is False
    for path in ("unet/diffusion_pytorch_model.safetensors",
                 "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "tokenizer/vocab.json", "tokenizer/merges.txt",
                 "scheduler/scheduler_config.json"):
        assert (sd15_weights / path).is_file(), path
    assert not list(sd15_weights.rglob("*.bin")), "weights must be safetensors only"
    size_mb = sum(p.stat().st_size for p in sd15_weights.rglob("*") if p.is_file()) / 1e6
    assert size_mb < 12
    assert read_marker(sd15_weights)["kind"] == "sd15"


def test_same_seed_same_digest_other_seed_other_digest(sd15_weights, tmp_path):
    again = build_tiny_sd15(tmp_path / "again", seed=0)
    other = build_tiny_sd15(tmp_path / "other", seed=1)
    assert weights_digest(again) == weights_digest(sd15_weights)
    assert weights_digest(other) != weights_digest(sd15_weights)


def test_building_again_is_a_no_op_and_a_new_seed_replaces_the_folder(tmp_path):
    folder = build_tiny_llama(tmp_path / "llama", seed=0)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_llama(folder, seed=0) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    build_tiny_llama(folder, seed=7)
    assert read_marker(folder)["seed"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]  # no temp folders left


def test_refuses_to_overwrite_a_folder_that_is_not_a_tiny_build(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=MARKER):
        build_tiny("llama", tmp_path / "mine")
    assert (tmp_path / "mine" / "precious.txt").read_text() == "keep me"


def test_unknown_kind_names_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match="sd15.*sdxl.*llama"):
        build_tiny("sd3", tmp_path / "x")


def test_tiny_clip_tokenizer_fits_ordinary_prompts(sd15_weights):
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(sd15_weights / "tokenizer")
    assert tok.model_max_length == 77 and tok.pad_token is not None
    ids = tok("a photo of a lighthouse at dusk, oil painting").input_ids
    assert len(ids) == 12  # one token per word and comma, plus start and end
    assert tok.decode(tok("Zürich 東京").input_ids, skip_special_tokens=True) == "zürich 東京"


def test_cli_build_tiny(tmp_path, capsys):
    from plugins.cli import register

    parser = argparse.ArgumentParser(prog="sparecycles")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plugins", "build-tiny", "llama", "--out", str(tmp_path / "w"),
                              "--seed", "3"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "llama" in out and str(tmp_path / "w") in out
    assert read_marker(tmp_path / "w")["seed"] == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["plugins", "build-tiny", "sd3", "--out", str(tmp_path / "x")])
