"""Fixtures for the verification tests: one torch thread (the cores are shared), tiny
weights built once per session, and the llama plugin loaded as a plugin host loads it."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-weights")


class RecordingContext:
    """The RunContext a plugin host gives ``run()``, doing nothing."""

    job_id = "job-verification-test"
    scratch_dir = Path("/tmp")

    def progress(self, step, total, message=""):
        pass

    def stream(self, text, token_ids=None):
        pass

    def cancelled(self):
        return False

    def check_cancelled(self):
        pass


def load_llama_plugin(weights: Path):
    return load_plugin("llama", weights)


def load_plugin(name: str, weights: Path):
    """Built-in plugin ``name`` set up on ``weights`` on the CPU, as a plugin host loads it."""
    from plugins import builtin_plugin_dir
    from sdk.protocol.manifest import load_manifest

    folder = builtin_plugin_dir(name)
    manifest = load_manifest(folder)
    module_name, class_name = manifest.entrypoint.split(":")
    spec = importlib.util.spec_from_file_location(
        f"_sparecycles_verification_{name}", folder / f"{module_name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = getattr(module, class_name)()
    plugin.manifest = manifest
    plugin.setup(weights, "cpu")
    return plugin


@pytest.fixture(scope="module")
def honest(llama_weights):
    """The llama plugin on the tiny model: the honest provider's and checker's."""
    plugin = load_llama_plugin(llama_weights)
    yield plugin
    plugin.teardown()


@pytest.fixture(scope="module")
def other(other_llama_weights):
    """The llama plugin on another tiny model (built from seed 1): a cheater's."""
    plugin = load_llama_plugin(other_llama_weights)
    yield plugin
    plugin.teardown()


@pytest.fixture(scope="session")
def llama_weights(tiny_dir) -> Path:
    from plugins.tiny import build_tiny_llama

    return build_tiny_llama(tiny_dir / "llama", seed=0)


@pytest.fixture(scope="session")
def other_llama_weights(tiny_dir) -> Path:
    from plugins.tiny import build_tiny_llama

    return build_tiny_llama(tiny_dir / "llama-seed1", seed=1)


@pytest.fixture(scope="session")
def eager_llama_weights(tiny_dir, llama_weights) -> Path:
    """The tiny llama with its end-of-text logit scaled up, so that it often wants to
    stop: the model for the suppressed-end-of-sequence tests."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tiny_dir / "llama-eager"
    if out.exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(llama_weights, dtype=torch.float32)
    config = json.loads((llama_weights / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    with torch.no_grad():
        for i in eos:
            model.lm_head.weight[i] *= 30.0
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if (llama_weights / name).exists():
            shutil.copy(llama_weights / name, out / name)
    return out


def _bench():
    """The ``bench`` folder's modules (the verification benches' models are the tests')."""
    import sys

    root = Path(__file__).resolve().parents[4]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


@pytest.fixture(scope="session")
def sharp_llama_weights(tiny_dir, llama_weights) -> Path:
    """The tiny llama with its output layer scaled up (``bench/text_checks.py``): its
    next-token distributions are as peaked as a trained model's (the likeliest token
    holds ~70 % of the mass at temperature 0.7, where the tiny one's holds ~0.3 %), so
    that greedy and sampled text look much alike: the hard case for the sampling test."""
    _bench()
    from bench.text_checks import sharpen_llama

    return sharpen_llama(llama_weights, tiny_dir / "llama-sharp")


@pytest.fixture(scope="session")
def sd15_renderer(tiny_dir):
    """The calibration bench's renderer on the tiny sd15, its seed-1 sibling and LoRA."""
    import sys

    root = Path(__file__).resolve().parents[4]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench.calibrate import Renderer, build_weights

    return Renderer(*build_weights(tiny_dir / "calibrate", None))


@pytest.fixture(scope="session")
def sd15_weights(tiny_dir) -> Path:
    from plugins.tiny import build_tiny_sd15

    return build_tiny_sd15(tiny_dir / "sd15", seed=0)


@pytest.fixture(scope="module")
def sd15(sd15_weights):
    """The sd15 plugin on the tiny model: every provider's in these tests."""
    plugin = load_plugin("sd15", sd15_weights)
    yield plugin
    plugin.teardown()
