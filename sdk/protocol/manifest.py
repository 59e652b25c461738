"""Plugin manifests (plugin.toml) read as data: the broker never imports plugin code.

::

    name = "sd15"                       # [a-z0-9][a-z0-9_-]*
    version = "1.0.0"                   # semantic version, immutable once published
    publisher = "sparecycles"           # publisher name (its key signs published versions)
    entrypoint = "plugin:StableDiffusion15"   # module:Class inside the plugin folder
    output = "images"                   # images | text
    description = "..."
    work_units = "steps * width * height / 1048576 * n"   # arithmetic over inputs
    wall_clock_s = 600                  # a job running longer is killed

    [hardware]
    min_vram_gb = 4.0
    dtype = "float16"                   # preferred dtype on GPU (CPU runs float32)

    [inputs.prompt]                     # see sdk.protocol.schema
    type = "string"
    required = true

    [[rules]]                           # what else the plugin refuses (sdk.protocol.schema)
    field = "prompt"
    require = "clip_tokens(prompt) <= 75"
    message = "is at least {clip_tokens(prompt)} tokens long; this model reads at most 75"

    [benchmark]                         # the payload the agent times itself on
    inputs = { prompt = "a lighthouse", steps = 10 }

    [[weights]]                         # files with their sha256 and size (optional)
    path = "unet/diffusion_pytorch_model.safetensors"
    sha256 = "..."
    size = 123
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .canonical import is_sha256_hex
from .formula import compile_formula, evaluate_formula
from .schema import InputError, InputSchema, SchemaDeclarationError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+([-+][0-9A-Za-z.-]+)?$")
MAX_VERSION_LEN = 64  # the registry's and the jobs' version columns are String(64)
ENTRY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
OUTPUTS = ("images", "text", "json")
_TOP = {"name", "version", "publisher", "entrypoint", "output", "description", "work_units",
        "wall_clock_s", "hardware", "inputs", "rules", "benchmark", "weights"}


def version_key(version: str) -> tuple:
    """The sort key of a version that ``VERSION_RE`` accepts, in semver precedence: the
    numeric core, then a release above its pre-releases (``1.0.0-rc.1`` < ``1.0.0``),
    pre-release identifiers compared one by one (numeric ones numerically and below
    alphanumeric ones); build metadata (``+...``) is ignored. The one ordering the broker
    uses to pick a "latest" version."""
    core, _, pre = version.partition("+")[0].partition("-")
    nums = tuple(int(x) for x in core.split("."))
    if not pre:
        return (nums, 1, ())
    return (nums, 0, tuple((0, int(p), "") if p.isdigit() else (1, 0, p)
                           for p in pre.split(".")))


class ManifestError(ValueError):
    """A malformed manifest; the message names the field."""


@dataclass(frozen=True)
class WeightFile:
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    publisher: str
    entrypoint: str
    output: str
    inputs: InputSchema
    work_units: str
    description: str = ""
    wall_clock_s: int = 600
    min_vram_gb: float = 0.0
    dtype: str = "float32"
    benchmark_inputs: dict = field(default_factory=dict)
    weights: tuple[WeightFile, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def validate_inputs(self, inputs: Any, defaults: Mapping[str, Any] | None = None) -> dict:
        """``inputs`` checked and completed; ``defaults``: what the weights give inputs
        declared ``default_from = "weights"`` (see sdk.protocol.schema)."""
        return self.inputs.validate(inputs, defaults)

    def work_units_for(self, inputs: Mapping[str, Any]) -> float:
        """Evaluate the work-unit formula on validated inputs."""
        return evaluate_formula(self.work_units, inputs)

    def to_public(self) -> dict:
        """What `GET /v1/plugins` shows: everything a client needs, no code."""
        return {
            "name": self.name, "version": self.version, "publisher": self.publisher,
            "output": self.output, "description": self.description,
            "work_units": self.work_units, "wall_clock_s": self.wall_clock_s,
            "hardware": {"min_vram_gb": self.min_vram_gb, "dtype": self.dtype},
            "input_schema": self.inputs.json_schema(),
        }


def check_version(value: Any, what: str = "version") -> str:
    """``value`` when it is a semantic version (``VERSION_RE``) of at most
    ``MAX_VERSION_LEN`` characters; else raises ManifestError (``what`` names the field in
    the message). The one version check of manifests, adapter.toml and package documents."""
    if isinstance(value, str) and len(value) > MAX_VERSION_LEN:
        raise ManifestError(f"{what} is {len(value)} characters long; at most "
                            f"{MAX_VERSION_LEN} are allowed")
    if not isinstance(value, str) or not VERSION_RE.match(value):
        raise ManifestError(f"{what} {value!r} must be a semantic version like 1.2.3")
    return value


def _req(data: Mapping, key: str, typ: type, where: str = "") -> Any:
    name = f"{where}{key}"
    if key not in data:
        raise ManifestError(f"{name} is missing")
    value = data[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ManifestError(f"{name} must be a {typ.__name__}, got {value!r}")
    return value


def parse_manifest(data: Mapping[str, Any], source: str = "plugin.toml") -> Manifest:
    """Check and convert a parsed plugin.toml; raises ManifestError naming the field."""
    try:
        return _parse(data)
    except ManifestError as exc:
        raise ManifestError(f"{source}: {exc}") from None


def _parse(data: Mapping[str, Any]) -> Manifest:
    unknown = set(data) - _TOP
    if unknown:
        raise ManifestError(f"unknown keys {sorted(unknown)}; allowed: {sorted(_TOP)}")
    name = _req(data, "name", str)
    if not NAME_RE.match(name):
        raise ManifestError(f"name {name!r} must match {NAME_RE.pattern}")
    version = check_version(_req(data, "version", str))
    publisher = _req(data, "publisher", str)
    entrypoint = _req(data, "entrypoint", str)
    if not ENTRY_RE.match(entrypoint):
        raise ManifestError(f"entrypoint {entrypoint!r} must look like module:Class")
    output = _req(data, "output", str)
    if output not in OUTPUTS:
        raise ManifestError(f"output is {output!r}; must be one of {list(OUTPUTS)}")
    try:
        inputs = InputSchema.from_tables(data.get("inputs", {}), rules=data.get("rules", []))
    except SchemaDeclarationError as exc:
        raise ManifestError(str(exc)) from None
    work_units = _req(data, "work_units", str)
    try:
        _compile_formula(work_units, set(inputs.names))
    except ValueError as exc:
        raise ManifestError(f"work_units: {exc}") from None
    wall = data.get("wall_clock_s", 600)
    if isinstance(wall, bool) or not isinstance(wall, int) or wall <= 0:
        raise ManifestError(f"wall_clock_s must be a positive integer, got {wall!r}")
    hw = data.get("hardware", {})
    if not isinstance(hw, Mapping):
        raise ManifestError("hardware must be a table")
    vram = hw.get("min_vram_gb", 0.0)
    if isinstance(vram, bool) or not isinstance(vram, (int, float)) or vram < 0:
        raise ManifestError(f"hardware.min_vram_gb must be a number >= 0, got {vram!r}")
    dtype = hw.get("dtype", "float32")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ManifestError(f"hardware.dtype is {dtype!r}; one of float32, float16, bfloat16")
    bench = data.get("benchmark", {})
    bench_inputs = bench.get("inputs", {}) if isinstance(bench, Mapping) else None
    if not isinstance(bench_inputs, Mapping):
        raise ManifestError("benchmark.inputs must be a table of inputs")
    try:
        inputs.validate(bench_inputs)
    except InputError as exc:
        raise ManifestError(f"benchmark.inputs.{exc}") from None
    weights = []
    for i, w in enumerate(data.get("weights", [])):
        where = f"weights[{i}]."
        if not isinstance(w, Mapping):
            raise ManifestError(f"weights[{i}] must be a table")
        sha = _req(w, "sha256", str, where)
        if not is_sha256_hex(sha):
            raise ManifestError(f"{where}sha256 must be 64 lowercase hex digits")
        weights.append(WeightFile(_req(w, "path", str, where), sha, _req(w, "size", int, where)))
    return Manifest(
        name=name, version=version, publisher=publisher, entrypoint=entrypoint, output=output,
        inputs=inputs, work_units=work_units, description=str(data.get("description", "")),
        wall_clock_s=wall, min_vram_gb=float(vram), dtype=dtype,
        benchmark_inputs=dict(bench_inputs), weights=tuple(weights), raw=dict(data),
    )


def load_manifest(folder: Path | str) -> Manifest:
    path = Path(folder) / "plugin.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist; a plugin is a folder with plugin.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from None
    return parse_manifest(data, source=str(path))


# -- work-unit formulas: arithmetic over input names, nothing else (sdk.protocol.formula)
def _compile_formula(expr: str, names: set[str]):
    return compile_formula(expr, names)
