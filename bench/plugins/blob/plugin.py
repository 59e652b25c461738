"""BENCH ONLY: ``size_kib`` KiB of pseudo-random bytes from ``seed`` (bench/blobs.py)."""
import random

from plugins.api import Output, Plugin


class Blob(Plugin):
    def setup(self, weights_dir, device):
        pass

    def run(self, inputs, ctx):
        data = random.Random(inputs["seed"]).randbytes(inputs["size_kib"] * 1024)
        return [Output(data=data, media_type="application/octet-stream")]
