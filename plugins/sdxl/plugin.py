"""The sdxl plugin: Stable Diffusion XL text-to-image and image-to-image on diffusers.

Weights are a StableDiffusionXLPipeline folder (two text encoders and tokenizers, a
``text_time`` UNet; the published SDXL base layout, or the tiny one from
``plugins.tiny.build_tiny_sdxl``). The prompt goes to both text encoders and must fit
both. Everything per job is in ``plugins.diffusion.DiffusersImagePlugin``.
"""
from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline

from plugins.diffusion import DiffusersImagePlugin


class StableDiffusionXL(DiffusersImagePlugin):
    """Stable Diffusion XL: txt2img, or img2img when ``init_image`` is given."""

    pipeline_class = StableDiffusionXLPipeline
    family = "sdxl"
    img2img_class = StableDiffusionXLImg2ImgPipeline
