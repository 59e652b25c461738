"""Output formats and the result cache (issue #24).

**Output format.** A client may ask for image outputs as ``png`` (lossless, the plugins'
own), ``webp`` or ``jpeg`` with ``output_quality`` 1–100 (default 90). The envelope carries
it; the agent encodes the plugin's images before hashing them (provider_agent/encode.py), so
the receipt signs the bytes the client gets. Checked at submit: a text plugin or an unknown
format is refused with the allowed values.

**Result cache** (opt-in per job, ``"cache": true``, off by default). A job that opts in gets
a key: the sha256 of its plugin, version, inputs (seed included: the inputs as they will
run, defaults filled in) and output format. A later job that opts in with the same key is
answered from an earlier job's outputs, without running, when that job

- settled and was **verified** (a provider of another operator reproduced it, DESIGN §6);
- ran on the weights the new job pins (``weights_digest``), when it pins any;
- carries a reproducibility class in its signed receipt (``repro``: hardware class, dtype,
  plugin build with the weights digest), i.e. it was a real run; the hit's job shows the
  source's receipt, so the client sees which class produced its bytes;
- still has its outputs (not past retention, all blobs present).

Both sides opt in: a job that did not ask for the cache is never served to anyone else. A
hit costs the plugin's ``cache_price_micro`` (set by the admin, like the other prices); the
platform takes its fee from it and **the rest goes to the provider whose verified run is
served** (to its vesting balance, under the same vesting window): the work was that
provider's, and verification confirmed it. No adapter royalty is charged on a hit.
"""
from __future__ import annotations

from typing import Callable

from sdk.protocol.canonical import canonical_bytes, sha256_hex

from broker.errors import InvalidRequest

from .model import Job, JobOutput

OUTPUT_FORMATS = ("png", "webp", "jpeg")
DEFAULT_QUALITY = 90


def parse_output_format(body: dict, manifest) -> dict | None:
    """The job's output format from a submit body, or None (the plugin's own)."""
    fmt, quality = body.get("output_format"), body.get("output_quality")
    if fmt is None:
        if quality is not None:
            raise InvalidRequest("output_quality needs output_format \"webp\" or \"jpeg\"",
                                 field="output_quality")
        return None
    if not isinstance(fmt, str) or fmt.lower() not in OUTPUT_FORMATS:
        raise InvalidRequest(f"output_format is {fmt!r}; use one of "
                             f"{', '.join(OUTPUT_FORMATS)} (png is lossless; webp and jpeg "
                             "take output_quality 1-100)", field="output_format")
    fmt = fmt.lower()
    if manifest.output != "images":
        raise InvalidRequest(f"output_format applies to image outputs; {manifest.ref} returns "
                             f"{manifest.output}: leave output_format out",
                             field="output_format")
    if fmt == "png":
        if quality is not None:
            raise InvalidRequest("output_quality applies to webp and jpeg; png is lossless: "
                                 "leave output_quality out", field="output_quality")
        return {"format": "png"}
    if quality is None:
        quality = DEFAULT_QUALITY
    if type(quality) is not int or not 1 <= quality <= 100:
        raise InvalidRequest(f"output_quality is {quality!r}; it must be an integer from 1 "
                             "(smallest) to 100 (best)", field="output_quality")
    return {"format": fmt, "quality": quality}


def result_cache_key(manifest, inputs: dict, output_format: dict | None) -> str:
    return sha256_hex(canonical_bytes({"plugin": manifest.name, "version": manifest.version,
                                       "inputs": inputs, "output_format": output_format}))


class ResultCache:
    """Finds the verified job a cache-enabled job can be answered from (see above)."""

    def __init__(self, repo, blobs, verified: Callable[[str], bool],
                 expired: Callable[[float | None], bool] = lambda finished_at: False):
        self.repo = repo              # broker.jobs.ports.JobRepository
        self.blobs = blobs            # broker.jobs.ports.BlobStore
        self.verified = verified      # job id -> whether its verification says verified
        self.expired = expired        # finished_at -> whether its outputs are past retention
        self.hits = self.misses = 0

    def find(self, cache_key: str, weights_digest: str | None) -> tuple[Job, list[JobOutput]] | None:
        for job in self.repo.cache_sources(cache_key):
            ran_on = (job.envelope or {}).get("weights_digest") or None
            if weights_digest is not None and ran_on != weights_digest:
                continue
            if not isinstance((job.receipt or {}).get("repro"), dict):
                continue
            if self.expired(job.finished_at) or not self.verified(job.id):
                continue
            outputs = self.repo.outputs(job.id)
            if outputs and all(self.blobs.exists(o.sha256) for o in outputs):
                self.hits += 1
                return job, outputs
        self.misses += 1
        return None
