"""Tiny, randomly initialised model weights in the real on-disk layouts, built locally.

Tests and the demo cannot download models, so they run the built-in plugins on weights
built here: the same library classes as the real models (diffusers / transformers),
saved with ``save_pretrained`` as safetensors, so a plugin loads a tiny folder exactly as
it loads a real one. The outputs are noise, but they are *deterministic* noise: a builder
called with the same seed and the same library versions writes byte-identical files
(``weights_digest`` proves it), and the pipelines are small enough to run in about a
second on a CPU (see DESIGN §10).

::

    build_tiny("sd15", "/tmp/w/sd15", seed=0)   # or build_tiny_sd15 / _sdxl / _llama
    weights_digest("/tmp/w/sd15")               # sha256 over the whole folder

Every builder writes into a temporary sibling folder and renames it into place, so a
reader never sees a half-written folder; calling it again with the same arguments is a
no-op. The folder carries a ``sparecycles-tiny.json`` marker (kind, seed, versions).
Nothing here is ever committed: build the weights where you need them.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

from sdk.protocol.digest import folder_digest

MARKER = "sparecycles-tiny.json"
KINDS = ("sd15", "sdxl", "llama", "lora-sd15", "lora-sdxl", "lora-llama")
LORA_RANK = 4

# Words that become single tokens of the tiny CLIP vocabulary, so that ordinary prompts
# fit in 77 tokens as they do with the real tokenizer. Any other text still tokenizes
# (byte by byte), it only takes more tokens.
_PROMPT_WORDS = """
a an the of and in on at with by for to from under over near behind beside
photo painting drawing portrait landscape illustration render sketch picture image art
lighthouse dusk dawn sunset sunrise night day sky cloud clouds sea ocean beach wave waves
mountain mountains forest tree trees river lake city street house castle bridge garden
cat dog bird horse fish fox owl dragon robot person man woman child astronaut knight
red orange yellow green blue purple pink black white gray grey golden silver dark bright
old new small large big tiny giant beautiful detailed realistic cinematic dramatic soft
light lighting shadow fog rain snow storm fire water stone wood glass metal
style oil watercolor digital studio highly quality masterpiece sharp focus 4k 8k hdr
blurry ugly low bad deformed noisy
""".split()

_LLAMA_CORPUS = """\
The quick brown fox jumps over the lazy dog. Sparecycles runs AI inference on idle GPUs.
A provider earns credits when its machine would otherwise sit idle. Clients submit jobs,
the broker auctions them, and a plugin runs the model in a sandbox. Hello, world! How are
you today? I am fine, thank you. What is the capital of France? Paris is the capital of
France. Once upon a time there was a lighthouse by the sea, and every night its light
turned slowly over the waves. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000.
def add(a, b):\n    return a + b\n
User: Write a haiku about autumn.
Assistant: Leaves fall, red and gold; the river carries them home; the year exhales slow.
Émilie a visité Zürich et Kraków; naïve café — ça coûte 5 €. 東京 と 大阪.
"""

# Llama-3 style chat template (the tiny tokenizer has the same special tokens).
_LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
_LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]


# -- public API ------------------------------------------------------------------------
def build_tiny(kind: str, out_dir: Path | str, seed: int = 0) -> Path:
    """Build tiny weights of ``kind`` (one of ``KINDS``) into ``out_dir``."""
    try:
        builder = _BUILDERS[kind]
    except KeyError:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {list(KINDS)}") from None
    return builder(out_dir, seed=seed)


def build_tiny_sd15(out_dir: Path | str, seed: int = 0) -> Path:
    """A StableDiffusionPipeline folder: UNet (32, 64), 5-layer CLIP width 32, 2-block VAE."""
    return _build("sd15", Path(out_dir), seed, _write_sd15)


def build_tiny_sdxl(out_dir: Path | str, seed: int = 0) -> Path:
    """A StableDiffusionXLPipeline folder: two text encoders, ``text_time`` UNet."""
    return _build("sdxl", Path(out_dir), seed, _write_sdxl)


def build_tiny_llama(out_dir: Path | str, seed: int = 0) -> Path:
    """A LlamaForCausalLM folder (2 layers, width 64) with a byte-level BPE tokenizer."""
    return _build("llama", Path(out_dir), seed, _write_llama)


def build_tiny_lora_sd15(out_dir: Path | str, seed: int = 0) -> Path:
    """A diffusers LoRA for the tiny sd15 (``pytorch_lora_weights.safetensors``: UNet
    attention, rank 4), as ``save_lora_weights`` writes it."""
    return _build("lora-sd15", Path(out_dir), seed, _write_lora_sd15)


def build_tiny_lora_sdxl(out_dir: Path | str, seed: int = 0) -> Path:
    """A diffusers LoRA for the tiny sdxl (UNet attention, rank 4)."""
    return _build("lora-sdxl", Path(out_dir), seed, _write_lora_sdxl)


def build_tiny_lora_llama(out_dir: Path | str, seed: int = 0) -> Path:
    """A peft LoRA for the tiny llama (``adapter_model.safetensors`` and
    ``adapter_config.json``: q_proj and v_proj, rank 4), as ``save_pretrained`` writes it."""
    return _build("lora-llama", Path(out_dir), seed, _write_lora_llama)


def weights_digest(folder: Path | str) -> str:
    """The digest an agent advertises for this folder (sdk.protocol.digest)."""
    return folder_digest(folder)


def read_marker(folder: Path | str) -> dict | None:
    """The ``sparecycles-tiny.json`` marker of a tiny build, or None if there is none."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# -- building with an atomic rename ----------------------------------------------------
def _versions() -> dict[str, str]:
    import diffusers
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__}


def _readable(folder: Path) -> None:
    """Give the folder and what is in it the modes of files made under this umask
    (mkdtemp makes a folder 0700, safetensors writes files 0600): a root agent's sandboxed
    plugin hosts run as an unprivileged user, which must be able to read the weights."""
    try:  # read without setting it (os.umask would change it for every thread)
        status = Path("/proc/self/status").read_text()
        umask = int(status.split("Umask:")[1].split()[0], 8)
    except (OSError, IndexError, ValueError):
        umask = 0o022
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _build(kind: str, out_dir: Path, seed: int, write: Callable[[Path, int], None]) -> Path:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    marker = {"kind": kind, "seed": seed, "versions": _versions()}
    if kind.startswith("lora-"):
        import peft

        marker["versions"]["peft"] = peft.__version__
    if out_dir.exists():
        existing = read_marker(out_dir)
        if existing == marker:
            _readable(out_dir)  # folders built before this was done were 0700
            return out_dir  # already built with these arguments and library versions
        if existing is None and any(out_dir.iterdir()):
            raise FileExistsError(
                f"{out_dir} exists and is not a tiny-weights folder (no {MARKER}); "
                f"refusing to overwrite it; choose an empty or new --out folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp, seed)
        _readable(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():  # an older tiny build (other seed or versions): swap it out
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(tmp, out_dir)
            except OSError:
                # another process finished the same build first: keep its folder
                if read_marker(out_dir) != marker:
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# -- tokenizers ------------------------------------------------------------------------
def _clip_tokenizer(pad_token: str = "<|endoftext|>"):
    """A CLIPTokenizer with a small vocabulary trained here, and model_max_length=77.

    The vocabulary is every byte-level character, alone and word-final (``</w>``), so any
    text tokenizes, plus BPE merges trained on ``_PROMPT_WORDS`` until each of those words
    is one token. (The ``tokenizers`` trainer breaks ties differently from run to run when
    words carry an end-of-word suffix, so this small trainer is our own: same words, same
    merges, same bytes.)
    """
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    alphabet = sorted(byte_char.values())
    words = [[byte_char[b] for b in w.encode()] for w in dict.fromkeys(_PROMPT_WORDS)]
    for w in words:
        w[-1] += "</w>"
    merges: list[tuple[str, str]] = []
    while True:
        counts = Counter(pair for w in words for pair in zip(w, w[1:]))
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))  # ties: lexical order
        merges.append(best)
        words = [_merge_pair(w, best) for w in words]
    vocab: dict[str, int] = {}
    for tok in ["<|startoftext|>", "<|endoftext|>", *alphabet, *(c + "</w>" for c in alphabet),
                *(a + b for a, b in merges), pad_token]:
        vocab.setdefault(tok, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=77)


def _merge_pair(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _llama_tokenizer():
    """A byte-level BPE tokenizer trained here on a small corpus, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, min_frequency=1, special_tokens=_LLAMA_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_LLAMA_CORPUS], trainer=trainer)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>", pad_token="<|pad|>",
        model_max_length=512, chat_template=_LLAMA_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False)


# -- model components ------------------------------------------------------------------
def _sd_scheduler_config() -> dict:
    # The noise schedule of SD 1.5 / SDXL; the plugins swap the sampler per job from it.
    return dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading")


def _vae(seed: int):
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=32, sample_size=64)


def _clip_config(vocab_size: int, tokenizer, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    extra = {"projection_dim": projection_dim} if projection_dim else {}
    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=37, num_hidden_layers=5,
        num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
        layer_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)


def _save_pipeline(pipe, folder: Path) -> None:
    """save_pretrained, plus vocab.json / merges.txt beside each CLIP tokenizer.json, as
    in the published SD folders (older transformers read only those two files)."""
    with _quiet():
        pipe.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer", "tokenizer_2"):
        if getattr(pipe, name, None) is None:
            continue
        model = json.loads(getattr(pipe, name).backend_tokenizer.to_str())["model"]
        (folder / name / "vocab.json").write_text(
            json.dumps(model["vocab"], ensure_ascii=False, sort_keys=True) + "\n")
        lines = ["#version: 0.2", *(" ".join(m) for m in model["merges"])]
        (folder / name / "merges.txt").write_text("\n".join(lines) + "\n")


class _quiet:
    """Silence the save progress bars of transformers / diffusers while building."""

    def __enter__(self):
        from diffusers.utils import logging as dlog
        from transformers.utils import logging as tlog

        self._was = (tlog.is_progress_bar_enabled(), dlog.is_progress_bar_enabled())
        tlog.disable_progress_bar()
        dlog.disable_progress_bar()

    def __exit__(self, *exc):
        from diffusers.utils import logging as dlog
        from transformers.utils import logging as tlog

        if self._was[0]:
            tlog.enable_progress_bar()
        if self._was[1]:
            dlog.enable_progress_bar()


def _write_sd15(folder: Path, seed: int) -> None:
    _save_pipeline(_sd15_pipeline(seed), folder)


def _sd15_pipeline(seed: int):
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    tokenizer = _clip_tokenizer()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        norm_num_groups=32)
    vae = _vae(seed + 1)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(_clip_config(len(tokenizer), tokenizer))
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=EulerDiscreteScheduler(**_sd_scheduler_config()),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return pipe


def _write_sdxl(folder: Path, seed: int) -> None:
    _save_pipeline(_sdxl_pipeline(seed), folder)


def _sdxl_pipeline(seed: int):
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = _clip_tokenizer()
    tokenizer_2 = _clip_tokenizer(pad_token="!")  # as in SDXL: the second one pads with "!"
    projection_dim, time_dim = 32, 8
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=time_dim, transformer_layers_per_block=(1, 2),
        # pooled text embedding + 6 time ids (original size, crop, target size)
        projection_class_embeddings_input_dim=projection_dim + 6 * time_dim,
        cross_attention_dim=32 + 32,  # the two encoders' hidden states, concatenated
        norm_num_groups=32)
    vae = _vae(seed + 1)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(_clip_config(len(tokenizer), tokenizer))
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(
        _clip_config(len(tokenizer_2), tokenizer_2, projection_dim=projection_dim))
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
        tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet,
        scheduler=EulerDiscreteScheduler(**_sd_scheduler_config()),
        force_zeros_for_empty_prompt=True, add_watermarker=False)
    return pipe


def _write_llama(folder: Path, seed: int) -> None:
    model, tokenizer = _llama_model(seed)
    with _quiet():
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    # The published Llama 3 layout: the chat template inside tokenizer_config.json and the
    # generic fast tokenizer class, which transformers 4.x and 5.x both load.
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        tok_config["chat_template"] = jinja.read_text()
        jinja.unlink()
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(
        json.dumps(tok_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _llama_model(seed: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _llama_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer


# -- LoRA adapters ---------------------------------------------------------------------
# A LoRA is made for a base architecture, not for one set of base weights: the builders
# attach it to the tiny base built with seed 0 (only its shapes matter) and draw the LoRA
# matrices from ``seed``. Both factors are random (peft's usual init zeroes B, which would
# make a no-op adapter) and B is scaled down so the adapter changes the output without
# swamping it. ``adapter.json`` declares the base model, which the plugins check; the CLI
# adds the ``adapter.toml`` publishing reads (``write_adapter_toml``).
_LORA_B_SCALE = 0.1


def _randomize_lora(module, seed: int) -> None:
    import torch

    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if ".lora_A." in name:
                bound = 1.0 / param.shape[1] ** 0.5
                param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound)
            elif ".lora_B." in name:
                bound = _LORA_B_SCALE / param.shape[1] ** 0.5
                param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound)


def _lora_config(targets: list[str], **extra):
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=targets,
                      init_lora_weights=False, **extra)


def _write_lora_diffusers(folder: Path, seed: int, family: str, pipe) -> None:
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    # UNet attention only, the commonest kind of SD LoRA. (Text-encoder parts are left out:
    # diffusers 0.42 with transformers 5 and peft < 0.22 loads them as MISSING.)
    layers = {}
    parts = [("unet", ["to_q", "to_k", "to_v", "to_out.0"])]
    for i, (name, targets) in enumerate(parts):
        module = getattr(pipe, name)
        inject_adapter_in_model(_lora_config(targets), module)  # works on any nn.Module
        _randomize_lora(module, seed * 16 + i)
        layers[f"{name}_lora_layers"] = convert_state_dict_to_diffusers(
            get_peft_model_state_dict(module))
    with _quiet():
        type(pipe).save_lora_weights(folder, safe_serialization=True, **layers)
    _declare_adapter(folder, family, "diffusers-lora")


def _write_lora_sd15(folder: Path, seed: int) -> None:
    _write_lora_diffusers(folder, seed, "sd15", _sd15_pipeline(0))


def _write_lora_sdxl(folder: Path, seed: int) -> None:
    _write_lora_diffusers(folder, seed, "sdxl", _sdxl_pipeline(0))


def _write_lora_llama(folder: Path, seed: int) -> None:
    from peft import get_peft_model

    model, _ = _llama_model(0)
    model = get_peft_model(model, _lora_config(["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    _randomize_lora(model, seed)
    with _quiet():
        model.save_pretrained(folder, safe_serialization=True)
    _declare_adapter(folder, "llama", "peft-lora")


def _declare_adapter(folder: Path, family: str, fmt: str) -> None:
    (folder / "adapter.json").write_text(json.dumps(
        {"base_model": family, "format": fmt, "rank": LORA_RANK}, indent=2, sort_keys=True) + "\n")


def write_adapter_toml(folder: Path | None, name: str, version: str, base: str):
    """Write ``adapter.toml``, the package manifest `sparecycles publish` reads
    (``sdk.protocol.package``), into a tiny LoRA ``folder``; ``adapter.json`` stays beside
    it, the base declaration the plugins check. Checked first, as publishing will check
    it (raises ManifestError); ``folder`` None only checks. Returns the parsed manifest."""
    from sdk.protocol.package import ADAPTER_TOML, parse_adapter_manifest

    fields = {"name": name, "version": version, "base": base,
              "description": f"tiny random LoRA for {base} (tests and demos: its pictures "
                             f"are noise)"}
    manifest = parse_adapter_manifest(fields)
    if folder is not None:
        (Path(folder) / ADAPTER_TOML).write_text(
            "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    return manifest


_BUILDERS: dict[str, Callable[..., Path]] = {
    "sd15": build_tiny_sd15, "sdxl": build_tiny_sdxl, "llama": build_tiny_llama,
    "lora-sd15": build_tiny_lora_sd15, "lora-sdxl": build_tiny_lora_sdxl,
    "lora-llama": build_tiny_lora_llama}
