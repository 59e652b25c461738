"""What the market reads from a plugin build's manifest: the weights digest a job is pinned
to, and a cold-start estimate for a provider that does not hold the model warm.

Pinning (DESIGN §4: "serves the plugin version with matching weight hashes"). A job runs
only on providers whose advertised weights digest (``Capabilities.plugins[].weights_digest``,
:func:`sdk.protocol.digest.folder_digest` over the agent's weights folder) equals the digest
the broker pins for it. The pin comes, first match wins, from

1. the catalog manifest's ``[[weights]]`` list, when it has one: every file's path and
   sha256 give :func:`sdk.protocol.digest.files_digest`, exactly what an agent holding those
   files (and nothing else) in its weights folder advertises;
2. the job's own pinned digest, when it carries one;
3. otherwise ``ANY_WEIGHTS``: any provider of the plugin version qualifies.

The manifest wins over a job's pin because it is the published, signed description of the
build (issue #3); a job naming other weights for a version that lists its weights would
never match an honest provider.
"""
from __future__ import annotations

from sdk.protocol.digest import files_digest
from sdk.protocol.manifest import Manifest

ANY_WEIGHTS = "any"
#: The bucket of providers that advertise no weights for a plugin while its manifest pins
#: some: they cannot take its jobs, but refusals still count them ("another version or
#: weights").
NO_WEIGHTS = "none"

#: Cold start = this fixed part (process start, imports, CUDA context) plus the weights'
#: size read at ``COLD_LOAD_BYTES_PER_S``: an estimate for providers that did not report
#: their own load time.
COLD_FIXED_S = 3.0
COLD_LOAD_BYTES_PER_S = 500e6


def pinned_digest(manifest: Manifest | None, job_pin: str | None = None) -> str:
    """The weights digest a job of this build must run on (see the module docstring)."""
    if manifest is not None and manifest.weights:
        return files_digest((w.path, w.sha256) for w in manifest.weights)
    if job_pin:
        return job_pin
    return ANY_WEIGHTS


def manifest_cold_start_s(manifest: Manifest | None) -> float | None:
    """Seconds to load the build from disk, estimated from the sizes its manifest lists;
    None when it lists no weights (the market's default constant applies)."""
    if manifest is None or not manifest.weights:
        return None
    return COLD_FIXED_S + sum(w.size for w in manifest.weights) / COLD_LOAD_BYTES_PER_S
