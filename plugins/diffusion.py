"""What the built-in Stable Diffusion plugins (sd15, sdxl) share: one base class on diffusers.

A subclass names its two pipeline classes (text-to-image and image-to-image); this class
loads the first once in ``setup()``, derives the second from the same components (no
second copy of the weights), and per job: swaps the sampler, checks that the prompts fit
the text encoders, runs with one seeded CPU generator per image (so image ``i`` of a job
with seed ``s`` is the image of a one-image job with seed ``s + i``, up to the rounding
that batching changes, whatever the device),
reports progress and honours cancellation every step, and encodes deterministic PNGs.

Each output's meta: ``seed``, ``index``, ``dtype`` (the dtype the pipeline ran in,
"float32" or "float16"), ``latent_sha256`` (``plugins.api.latent_digest`` of that image's
final denoised latents, before the VAE decode: what verification compares exactly between
two runs of the same reproducibility class), ``latent_trace`` (``plugins.api.latent_trace``:
that image's latents after a quarter, half, three quarters and all of its steps, pooled to
at most 8×8 and rounded to float16: what verification compares across classes, where a run
of fewer steps or at another size shows though its final image looks alike), and ``nsfw``
/ ``adapters`` when they apply.

This module is shared by built-in plugins only; a third-party plugin imports just
``plugins.api`` and its ML libraries.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import io
import logging
import secrets
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler,
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler)
from PIL import Image

from plugins import checkpoints
from plugins.adapters import AdapterCache, AdapterRequest, adapter_roots, parse_adapters
from plugins.api import (BadInput, Output, Plugin, PluginError, RunContext, latent_digest,
                         TRACE_SIDE, latent_trace, run_dtype, trace_point, trace_steps)

# Sampler name (the `scheduler` input) -> (class, settings over the model's saved config).
SCHEDULERS: dict[str, tuple[type, dict[str, Any]]] = {
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    # The SD noise schedule is trained without clipping and with alpha_prod at t<0 = alpha_0.
    "ddim": (DDIMScheduler, {"clip_sample": False, "set_alpha_to_one": False}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
}
MAX_INIT_IMAGE_PIXELS = 4096 * 4096
PNG_COMPRESS_LEVEL = 6  # fixed: the PNG bytes are part of what verification compares


def encode_png(image: Image.Image) -> bytes:
    """PNG bytes that depend only on the pixels (no timestamps or text chunks)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def decode_init_image(b64: str, width: int, height: int) -> Image.Image:
    """The ``init_image`` input (base64 PNG or JPEG) as an RGB image of width × height."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise BadInput("init_image must be a base64-encoded PNG or JPEG "
                       "(standard alphabet, no data: prefix, no line breaks)") from None
    try:
        image = Image.open(io.BytesIO(raw))
        if image.format not in ("PNG", "JPEG"):
            raise BadInput(f"init_image is a {image.format} image; send a PNG or JPEG")
        if image.width * image.height > MAX_INIT_IMAGE_PIXELS:
            raise BadInput(f"init_image is {image.width}x{image.height}; at most "
                           f"{MAX_INIT_IMAGE_PIXELS} pixels are accepted")
        image = image.convert("RGB")
    except BadInput:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for corrupt data
        raise BadInput(f"init_image could not be read as an image: {exc}") from None
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    return image


class _DropEmptyFp32Notice(logging.Filter):
    """diffusers warns "modules that should be kept in float32: []" whenever a pipeline
    casts its VAE (SDXL img2img does, every job) even when the list is empty; that says
    nothing, so it is dropped. Non-empty lists still get through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


def _install_log_filter() -> None:
    log = logging.getLogger("diffusers.models.modeling_utils")
    if not any(isinstance(f, _DropEmptyFp32Notice) for f in log.filters):
        log.addFilter(_DropEmptyFp32Notice())


@contextlib.contextmanager
def _quiet_diffusers():
    """Hide load-time chatter (progress bars, deprecation notes) from the host's log."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    level, bars = dlog.get_verbosity(), (dlog.is_progress_bar_enabled(),
                                         tlog.is_progress_bar_enabled())
    dlog.set_verbosity_error()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            yield
    finally:
        dlog.set_verbosity(level)
        if bars[0]:
            dlog.enable_progress_bar()
        if bars[1]:
            tlog.enable_progress_bar()


class DiffusersImagePlugin(Plugin):
    """Base of the diffusers image plugins; a subclass sets the two pipeline classes."""

    pipeline_class: ClassVar[type]
    img2img_class: ClassVar[type]
    family: ClassVar[str]  # the base model LoRA adapters must be made for (plugins.adapters)

    pipe: Any = None
    img2img: Any = None

    # -- lifecycle ---------------------------------------------------------------------
    def setup(self, weights_dir: Path | None, device: str) -> None:
        if weights_dir is None:
            raise PluginError(f"{type(self).__name__} needs a weights folder in the diffusers "
                              f"layout (model_index.json, unet/, vae/, ...)", retryable=False)
        _install_log_filter()
        self.device = torch.device(device)
        self.dtype = run_dtype(self.device.type)
        with _quiet_diffusers():
            # torch_dtype rather than dtype: the older diffusers we support know only it.
            pipe = self.pipeline_class.from_pretrained(weights_dir, torch_dtype=self.dtype)
            pipe.to(self.device)
            pipe.set_progress_bar_config(disable=True)
            # Same modules, a second front end: no reload. torch_dtype keeps from_pipe
            # from casting the shared modules to its float32 default.
            img2img = self.img2img_class.from_pipe(pipe, torch_dtype=self.dtype)
            img2img.set_progress_bar_config(disable=True)
        self.pipe, self.img2img = pipe, img2img
        self.scheduler_config = dict(pipe.scheduler.config)
        self.adapters = AdapterCache(adapter_roots(weights_dir, self.family), self.family,
                                     load=self._load_adapter, unload=self._unload_adapter)

    def input_defaults(self) -> dict[str, Any]:
        """The size diffusers itself gives an image when none is asked for: the UNet's
        sample size (latent pixels) times the VAE's scale factor. 512×512 for SD 1.5,
        1024×1024 for SDXL; 64×64 for the tiny test weights, whose random pictures would
        take half an hour at 512×512 on a CPU."""
        if self.pipe is None:
            raise PluginError("input_defaults() called before setup()")
        sample = self.pipe.unet.config.sample_size
        height, width = (sample, sample) if isinstance(sample, int) else tuple(sample)
        scale = self.pipe.vae_scale_factor
        return {"width": int(width) * scale, "height": int(height) * scale}

    def teardown(self) -> None:
        self.pipe = self.img2img = None
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- one job -----------------------------------------------------------------------
    def run(self, inputs: dict[str, Any], ctx: RunContext) -> list[Output]:
        if self.pipe is None:
            raise PluginError("run() called before setup()")
        ctx.check_cancelled()
        width, height, n = inputs["width"], inputs["height"], inputs["n"]
        seed = inputs.get("seed")
        if seed is None:  # the client left it to us: draw one and report it in meta
            seed = secrets.randbelow(2**32)
        for name in ("prompt", "negative_prompt"):
            self.check_prompt_length(name, inputs.get(name) or "")
        adapters = parse_adapters(inputs.get("adapters"))
        self.use_adapters(adapters)

        resume = _resume_state(ctx, inputs)
        if resume is not None:
            seed = int(resume["seed"])  # a drawn seed must stay the first attempt's
        init = inputs.get("init_image")
        pipe = self.img2img if init else self.pipe
        pipe.scheduler = self.make_scheduler(inputs["scheduler"])
        generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(n)]
        stepper = _Stepper(pipe, ctx, generators, inputs, seed, resume)
        kwargs: dict[str, Any] = dict(
            prompt=inputs["prompt"], negative_prompt=inputs.get("negative_prompt") or None,
            guidance_scale=inputs["guidance_scale"], num_inference_steps=inputs["steps"],
            num_images_per_prompt=n, output_type="pil",
            generator=generators,
            callback_on_step_end=stepper.on_step_end,
        )
        if init:
            strength = inputs["strength"]
            if int(inputs["steps"] * strength) < 1:
                raise BadInput(f"steps × strength is {inputs['steps']} × {strength}, which "
                               f"leaves no denoising step; raise steps or strength")
            kwargs.update(image=decode_init_image(init, width, height), strength=strength)
            # img2img takes its size from the image (already width × height)
        else:
            kwargs.update(width=width, height=height)

        with stepper.replaying():
            result = pipe(**kwargs)
        digests = stepper.final_digests()
        traces = stepper.traces()
        nsfw = getattr(result, "nsfw_content_detected", None)
        dtype = str(self.dtype).removeprefix("torch.")
        outputs = []
        for i, image in enumerate(result.images):
            meta: dict[str, Any] = {"seed": seed + i, "index": i, "dtype": dtype}
            if i < len(digests):
                meta["latent_sha256"] = digests[i]
            if i < len(traces):
                meta["latent_trace"] = traces[i]
            if nsfw is not None:
                meta["nsfw"] = bool(nsfw[i])
            if adapters:
                meta["adapters"] = {a.name: a.scale for a in adapters}
            outputs.append(Output(data=encode_png(image), media_type="image/png", meta=meta))
        return outputs

    # -- LoRA adapters (diffusers' peft backend) ---------------------------------------
    def use_adapters(self, adapters: list[AdapterRequest]) -> None:
        """Make exactly ``adapters`` active at their scales on the warm pipeline (the
        img2img front end shares its modules). Loads only adapters not already cached."""
        if not adapters:
            if self.adapters.loaded:
                self.pipe.disable_lora()
            return
        self.adapters.prepare(adapters)
        self.pipe.enable_lora()
        # (in name order, as parse_adapters gives them: the order of the sum is fixed)
        self.pipe.set_adapters([a.name for a in adapters], [a.scale for a in adapters])

    def _load_adapter(self, name: str, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        weight_name = ("pytorch_lora_weights.safetensors"
                       if (folder / "pytorch_lora_weights.safetensors").exists()
                       else files[0].name if len(files) == 1 else None)
        if weight_name is None:
            raise BadInput(f"adapters: {name!r} has no pytorch_lora_weights.safetensors "
                           f"(and not exactly one other .safetensors file) in its folder")
        with _quiet_diffusers():
            self.pipe.load_lora_weights(folder, weight_name=weight_name, adapter_name=name)
        if not any(name in names for names in self.pipe.get_list_adapters().values()):
            raise BadInput(f"adapters: no layer of this {self.family} model matches {name!r}; "
                           f"is it an adapter for another base model?")

    def _unload_adapter(self, name: str) -> None:
        self.pipe.delete_adapters([name])

    # -- hooks and helpers -------------------------------------------------------------
    def make_scheduler(self, name: str):
        """A fresh sampler ``name`` on the model's noise schedule (cheap; no weights)."""
        try:
            cls, overrides = SCHEDULERS[name]
        except KeyError:
            raise BadInput(f"scheduler {name!r} is not available; "
                           f"choose one of {sorted(SCHEDULERS)}") from None
        return cls.from_config(self.scheduler_config, **overrides)

    def check_prompt_length(self, field: str, text: str) -> None:
        """Refuse (never silently cut) a prompt longer than a text encoder reads."""
        for tokenizer in self.tokenizers():
            limit = tokenizer.model_max_length
            count = len(tokenizer(text, truncation=False).input_ids)
            if count > limit:
                raise BadInput(
                    f"{field} is {count - 2} tokens long; this model reads at most "
                    f"{limit - 2} tokens. Shorten it (it is refused rather than cut, so the "
                    f"image matches the whole prompt).")

    def tokenizers(self) -> list:
        return [t for t in (getattr(self.pipe, "tokenizer", None),
                            getattr(self.pipe, "tokenizer_2", None)) if t is not None]


def _resume_state(ctx: RunContext, inputs: dict[str, Any]) -> dict[str, Any] | None:
    data = getattr(ctx, "resume_from", None)
    if not data:
        return None
    return checkpoints.loads(data, kind="diffusion", inputs=inputs)


# Progress previews: a few per job, decoded from the latents by the linear map that
# approximates SD's VAE (no VAE call: microseconds, and the latents are untouched, so the
# run's bytes do not change). SDXL's latents are close enough for a thumbnail.
PREVIEWS_PER_JOB = 4
_LATENT_RGB = ((0.298, 0.207, 0.208), (0.187, 0.286, 0.173), (-0.158, 0.189, 0.264),
               (-0.184, -0.271, -0.473))


def latent_preview(latent: torch.Tensor, max_px: int = 64) -> bytes:
    """A WebP thumbnail (at most ``max_px`` a side, a few KiB) of one image's latents."""
    with torch.no_grad():
        factors = torch.tensor(_LATENT_RGB, dtype=torch.float32)
        rgb = torch.einsum("chw,cr->hwr", latent[:4].detach().float().cpu(), factors)
        rgb = ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8).numpy()
    im = Image.fromarray(rgb, "RGB")
    if max(im.size) < max_px:  # tiny latents: upscale a little, still small
        im = im.resize((max_px, max_px * im.height // im.width), Image.NEAREST)
    im.thumbnail((max_px, max_px))
    out = io.BytesIO()
    im.save(out, format="WEBP", quality=60)
    return out.getvalue()


class _Stepper:
    """The pipeline's step callback: progress, cancellation, checkpoints, and resuming.

    Checkpoint: every ``ctx.checkpoint_every`` steps (0: never) the callback writes the
    latents, the scheduler's whole state and every image generator's RNG state as they are
    after that step (see ``plugins.checkpoints``).

    Resume from step k: the pipeline runs its own loop unchanged (text encoding, timesteps,
    initial noise, the final decode are all exactly those of an uninterrupted run), but for
    the first k steps the UNet returns zeros and the scheduler's step leaves the latents as
    they are (``replaying``), which costs next to nothing; after step k the callback puts
    back the latents, the scheduler state and the RNG states of the checkpoint. From there
    every operation is the one the uninterrupted run did on the same values, so on the same
    hardware class and dtype the image is the same to the byte.

    Final latents: at the last step the callback hashes the latents it hands back (those
    the pipeline decodes), one ``latent_digest`` per image; ``final_digests()`` returns them.
    """

    def __init__(self, pipe, ctx: RunContext, generators: list, inputs: dict[str, Any],
                 seed: int, resume: dict[str, Any] | None):
        self.pipe, self.ctx, self.generators = pipe, ctx, generators
        self.inputs, self.seed, self.resume = inputs, seed, resume
        self.every = int(getattr(ctx, "checkpoint_every", 0) or 0)
        self.skip_until = int(resume["step"]) if resume else 0
        self.skipping = self.skip_until > 0
        self.digests: list[str] | None = None
        self.last_latents = None  # the latents after the latest step (a reference, no copy)
        # step -> each image's latent trace point (plugins.api.trace_point); a resumed run
        # takes those recorded before its checkpoint from the checkpoint
        self.trace: dict[int, list[str]] = {int(k): list(v) for k, v in
                                            (resume or {}).get("trace", [])}
        self.total = 0
        self.trace_shape: tuple = ()

    def final_digests(self) -> list[str]:
        """``latent_digest`` of each image's final latents (computed at the last step; from
        the latest step's latents should the pipeline have counted its steps otherwise)."""
        if self.digests is None and self.last_latents is not None:
            self.digests = [latent_digest(x) for x in self.last_latents]
        return self.digests or []

    def traces(self) -> list[dict]:
        """Each image's ``latent_trace`` meta (``plugins.api.latent_trace``); [] when a
        point is missing (a pipeline that counted its steps otherwise)."""
        steps = trace_steps(self.total) if self.total else []
        if not steps or any(s not in self.trace for s in steps):
            return []
        n = min(len(self.trace[s]) for s in steps)
        return [latent_trace([self.trace[s][i] for s in steps], steps, self.total,
                             self.trace_shape) for i in range(n)]

    def _finish_step(self, step: int, total: int, callback_kwargs):
        latents = callback_kwargs["latents"]
        self.last_latents = latents
        self.total = total
        if step in trace_steps(total):
            c, h, w = latents.shape[1:]
            self.trace_shape = (int(c), min(int(h), TRACE_SIDE), min(int(w), TRACE_SIDE))
            self.trace[step] = [trace_point(x) for x in latents]
        if step < total and step % max(1, total // PREVIEWS_PER_JOB) == 0:
            send = getattr(self.ctx, "preview", None)
            if send is not None:  # hosts that take previews (provider_agent/host)
                send(step, latent_preview(latents[0]), "image/webp")
        if step >= total:
            self.digests = [latent_digest(x) for x in latents]
        return callback_kwargs

    @contextlib.contextmanager
    def replaying(self):
        if not self.skipping:
            yield
            return
        unet, scheduler = self.pipe.unet, self.pipe.scheduler
        real_forward, real_step = unet.forward, scheduler.step

        # functools.wraps: pipelines read the step's signature to decide which keyword
        # arguments (generator, eta) to pass it.
        @functools.wraps(real_forward)
        def forward(sample, *args, **kwargs):
            if self.skipping:
                return (torch.zeros_like(sample),)
            return real_forward(sample, *args, **kwargs)

        @functools.wraps(real_step)
        def step(model_output, timestep, sample, *args, **kwargs):
            if self.skipping:
                return (sample,)
            return real_step(model_output, timestep, sample, *args, **kwargs)

        unet.forward, scheduler.step = forward, step  # instance attributes, removed below
        try:
            yield
        finally:
            del unet.forward
            del scheduler.step

    def on_step_end(self, pipe, step_index, timestep, callback_kwargs):
        self.ctx.check_cancelled()
        step, total = step_index + 1, pipe.num_timesteps
        if self.skipping:
            if step < self.skip_until:
                return callback_kwargs
            if self.resume["total"] != total:
                raise checkpoints.BadCheckpoint(
                    f"checkpoint is of a {self.resume['total']}-step run, this run has {total}")
            latents = callback_kwargs["latents"]
            checkpoints.load_scheduler_state(pipe.scheduler, self.resume["scheduler_state"],
                                             latents.device)
            for gen, state in zip(self.generators, self.resume["rng"]):
                gen.set_state(state)
            callback_kwargs["latents"] = self.resume["latents"].to(latents.device, latents.dtype)
            self.skipping = False
            self.ctx.progress(step, total, "resumed from a checkpoint")
            return self._finish_step(step, total, callback_kwargs)
        self.ctx.progress(step, total)
        if self.every and step % self.every == 0 and step < total:
            self.ctx.checkpoint(step, checkpoints.dumps({
                "kind": "diffusion", "step": step, "total": total,
                "fingerprint": checkpoints.fingerprint(self.inputs), "seed": self.seed,
                "scheduler": type(pipe.scheduler).__name__,
                "dtype": str(callback_kwargs["latents"].dtype),
                "device": callback_kwargs["latents"].device.type,
                "latents": callback_kwargs["latents"],
                "scheduler_state": checkpoints.scheduler_state(pipe.scheduler),
                "rng": [g.get_state() for g in self.generators],
                "trace": [[k, v] for k, v in sorted(self.trace.items())]}))
        return self._finish_step(step, total, callback_kwargs)
