"""GPU check: full-size SD 1.5 / SDXL architectures with random fp16 weights, images per
minute through the Sparecycles network vs. the bare diffusers pipeline on the same GPU.

    python bench/gpu_check.py [--models sd15,sdxl] [--images 8] [--steps 25]
    python bench/gpu_check.py --tiny          # the same code path on the CPU, tiny weights

For each model it
  1. builds a diffusers folder with the real full-size architecture (SD 1.5: 860M-parameter
     UNet, 12-layer CLIP ViT-L text encoder, the SD VAE; SDXL: the 2.6B UNet with
     text_time conditioning and both text encoders) and random weights in fp16 — nothing
     is downloaded; the tokenizer is the small one `plugins build-tiny` trains (prompts
     stay in its vocabulary, the models' embedding tables keep their real size);
  2. times the bare pipeline (from_pretrained, fp16, one image at a time, native size);
  3. frees the GPU, starts a broker and one agent (`--device cuda`) serving the same
     folder, and times the same number of images submitted with client.generate();
  4. prints images/min for both and the ratio, and writes results.json (to $OUT when set).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {"sd15": 512, "sdxl": 1024}


def _sd_scheduler():
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear", steps_offset=1,
                                  timestep_spacing="leading")


def _vae(sample_size: int, scaling: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
                         block_out_channels=(128, 256, 512, 512),
                         down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, sample_size=sample_size,
                         scaling_factor=scaling)


def _clip(tok, hidden: int, layers: int, heads: int, inter: int, projection: int | None,
          act: str):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         max_position_embeddings=77, hidden_act=act,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id,
                         **({"projection_dim": projection} if projection else {}))
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)


def build_full(kind: str, out: Path, device: str) -> Path:
    """A full-size random-weight diffusers folder for ``kind`` (fp16 on cuda)."""
    import torch
    from diffusers import (StableDiffusionPipeline, StableDiffusionXLPipeline,
                           UNet2DConditionModel)
    from plugins.tiny import _clip_tokenizer

    if (out / "model_index.json").exists():
        return out
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    tok = _clip_tokenizer()
    torch.manual_seed(0)
    with torch.device(device):
        if kind == "sd15":
            unet = UNet2DConditionModel(
                sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                block_out_channels=(320, 640, 1280, 1280),
                down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                cross_attention_dim=768, attention_head_dim=8)
            text = _clip(tok, 768, 12, 12, 3072, None, "quick_gelu")
            pipe = StableDiffusionPipeline(vae=_vae(512, 0.18215), text_encoder=text,
                                           tokenizer=tok, unet=unet, scheduler=_sd_scheduler(),
                                           safety_checker=None, feature_extractor=None,
                                           requires_safety_checker=False)
        else:
            unet = UNet2DConditionModel(
                sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                block_out_channels=(320, 640, 1280),
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
                cross_attention_dim=2048, use_linear_projection=True,
                addition_embed_type="text_time", addition_time_embed_dim=256,
                projection_class_embeddings_input_dim=2816)
            text = _clip(tok, 768, 12, 12, 3072, None, "quick_gelu")
            text2 = _clip(tok, 1280, 32, 20, 5120, 1280, "gelu")
            pipe = StableDiffusionXLPipeline(vae=_vae(1024, 0.13025), text_encoder=text,
                                             text_encoder_2=text2, tokenizer=tok, tokenizer_2=tok,
                                             unet=unet, scheduler=_sd_scheduler())
    pipe.to(dtype=dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)
    params = sum(p.numel() for p in pipe.unet.parameters()) / 1e6
    print(f"  built {kind}: UNet {params:.0f}M parameters, {dtype}, in "
          f"{time.perf_counter() - t0:.0f}s -> {out}", flush=True)
    del pipe
    gc.collect()
    return out


def bare_images_per_min(kind: str, folder: Path, device: str, images: int, steps: int,
                        size: int) -> float:
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionPipeline if kind == "sd15" else StableDiffusionXLPipeline
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    pipe = cls.from_pretrained(folder, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)

    def one(seed):
        g = torch.Generator("cpu").manual_seed(seed)
        pipe("a lighthouse", num_inference_steps=steps, width=size, height=size, generator=g)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    one(0)  # warm-up
    t0 = time.perf_counter()
    for i in range(images):
        one(i + 1)
    rate = images / (time.perf_counter() - t0) * 60
    pipe = None  # free the GPU before the network run
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rate


def network_images_per_min(kind: str, weights_root: Path, device: str, images: int,
                           steps: int, size: int, sandbox: bool) -> tuple[float, float]:
    from sdk import Client
    from sdk.localnet import LocalNetwork

    work = Path(tempfile.mkdtemp(prefix="sc-gpu-"))
    net = LocalNetwork(work, lease_timeout_s=120, env={"SPARECYCLES_VERIFICATION": "off"})
    try:
        net.start_broker()
        pkey, ckey = net.create_key("provider"), net.create_key("client")
        t0 = time.perf_counter()
        net.start_agent("gpu", pkey, plugins=kind, weights_dir=weights_root, sandbox=sandbox,
                        device=device, extra_env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)})
        net.wait_for_providers(1, timeout_s=900)
        start_s = time.perf_counter() - t0
        with Client(net.url, ckey) as client:
            client.generate(kind, prompt="a lighthouse", seed=0, steps=steps, width=size,
                            height=size, timeout=900)  # warm-up
            t0 = time.perf_counter()
            for i in range(images):
                client.generate(kind, prompt="a lighthouse", seed=i + 1, steps=steps,
                                width=size, height=size, timeout=900).output_bytes(0)
            rate = images / (time.perf_counter() - t0) * 60
        return rate, start_s
    finally:
        net.stop()
        print(f"  logs: {work}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="sd15,sdxl")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "sc-gpu-check")
    ap.add_argument("--tiny", action="store_true", help="tiny weights on the CPU (smoke test)")
    ap.add_argument("--no-sandbox", action="store_true")
    args = ap.parse_args()

    import torch

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --tiny for the CPU smoke test")
        return 2
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (tiny weights)"
    sandbox = not args.no_sandbox and shutil.which("bwrap") is not None
    print(f"device: {gpu}; torch {torch.__version__}; sandbox {'on' if sandbox else 'off'}")
    weights_root = args.workdir / ("tiny" if args.tiny else "full")
    results = []
    for kind in args.models.split(","):
        size = 64 if args.tiny else SIZES[kind]
        print(f"{kind}: {size}x{size}, {args.steps} steps, {args.images} images", flush=True)
        if args.tiny:
            from plugins.tiny import build_tiny

            build_tiny(kind, weights_root / kind)
        else:
            build_full(kind, weights_root / kind, device)
        bare = bare_images_per_min(kind, weights_root / kind, device, args.images, args.steps,
                                   size)
        print(f"  bare diffusers: {bare:.1f} images/min", flush=True)
        net, start_s = network_images_per_min(kind, weights_root, device, args.images,
                                              args.steps, size, sandbox)
        print(f"  through the network: {net:.1f} images/min (agent + model start {start_s:.0f}s)",
              flush=True)
        results.append({"model": kind, "size": size, "steps": args.steps, "images": args.images,
                        "bare_images_per_min": round(bare, 2),
                        "network_images_per_min": round(net, 2),
                        "ratio": round(net / bare, 3), "agent_start_s": round(start_s, 1)})
    print(f"\n{'model':6} {'size':>5} {'bare/min':>9} {'network/min':>12} {'ratio':>6}")
    for r in results:
        print(f"{r['model']:6} {r['size']:>5} {r['bare_images_per_min']:>9.1f} "
              f"{r['network_images_per_min']:>12.1f} {r['ratio']:>6.2f}")
    out = Path(os.environ.get("OUT", args.workdir))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": gpu, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
