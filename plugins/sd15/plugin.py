"""The sd15 plugin: Stable Diffusion 1.5 text-to-image and image-to-image on diffusers.

Weights are a StableDiffusionPipeline folder (the published SD 1.5 layout, or the tiny
one from ``plugins.tiny.build_tiny_sd15``). Everything per job is in
``plugins.diffusion.DiffusersImagePlugin``; this class only names the pipelines.
"""
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

from plugins.diffusion import DiffusersImagePlugin


class StableDiffusion15(DiffusersImagePlugin):
    """Stable Diffusion 1.5: txt2img, or img2img when ``init_image`` is given."""

    pipeline_class = StableDiffusionPipeline
    family = "sd15"
    img2img_class = StableDiffusionImg2ImgPipeline
