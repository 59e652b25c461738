"""Simulated cheating, for the verification harness only (DESIGN §6, bench/cheaters.py).

Nothing here is part of the production agent: ``provider_agent`` has no cheat code path and
no switch for one (tests/unit/provider_agent/test_no_cheat_harness.py). A cheating agent is
the real agent built with :class:`CheatingHosts` as its host factory (``Agent(...,
host_factory=...)``, ``provider_agent.cli.cmd_run(args, host_factory=...)``): every plugin
host it starts is a :class:`CheatingHost`, a ``PluginHost`` that rewrites a job's inputs
before the plugin runs it, or its outputs and figures after. ``bench/cheat_agent.py`` starts
such an agent as a process (what bench/cheaters.py runs); it logs a loud WARNING at start.

Options (``bench/cheat_agent.py --mode ... -- agent run ...``; the fields of :class:`Cheat`):

``--mode``     the mode (below)
``--rate``     fraction of jobs cheated on, 0..1, drawn per job (default 1)
``--seed``     seeds that draw (and the random bytes/tokens) for repeatable runs
``--weights``  other-model / other-text-model: the weights folder to run
``--log``      optional JSON-lines file: one line per job, with the mode and whether it was
               cheated on (the harness's ground truth)
``--role``, ``--shared``  the account pairs (collude, fail-checks), below

Modes (the plugin code stays honest: a cheat rewrites a job's inputs on their way into the
plugin host or its outputs on their way out; the agent around it signs a valid receipt and
uploads the outputs as usual; meta keeps claiming what the job asked, e.g. its seed). The
agent's own benchmark runs (job ids ``benchmark-…``) run honestly:

``wrong-seed``        runs with seed + 1 (a job without a seed: a random one)
``fewer-steps``       runs ``steps`` (or ``num_inference_steps``) halved, at least 1, and
                      reports the work units of the job as asked
``other-model``       image plugins run on ``--weights`` instead of their own weights (the
                      host is started on them; the sandbox binds what the host is given);
                      the agent still advertises its own weights' digest. Every job of
                      those plugins runs on the other weights: the rate is ignored.
``other-text-model``  the same for text plugins (llama)
``adapter-dropped``   removes the ``adapters`` / ``loras`` input (jobs without adapters run
                      honestly); meta still names the adapters asked for
``random-image``      image plugins: each image is a random PNG of the asked size; the
                      model is not run (meta carries a random latent_sha256)
``cached-output``     returns the first outputs it ever produced for the plugin for every
                      later cheated job (the first job runs honestly to fill the cache)
``truncate-text``     text outputs: token_ids / logprobs / scores and the text cut to half,
                      finish_reason kept
``pad-text``          text outputs: 8 extra random tokens appended to the claim (token ids,
                      made-up logprobs and scores, some random characters in the text)
``greedy-as-sampled`` sampled text jobs (temperature > 0) run greedy (temperature 0); meta
                      claims the job's temperature and top_p
``colder-sampling``   sampled text jobs run at half the job's temperature (meta claims it)
``narrow-top-p``      sampled text jobs run with half the job's top_p (meta claims it)
``early-stop``        text jobs run with half max_new_tokens (at least 1); an output that
                      reached that limit claims finish_reason "stop" by the stop string
                      (stopped_by_string, stop_at), and the meta the job's max_new_tokens
``altered-text``      text outputs: the delivered text gets a line appended (the claimed
                      tokens and their meta are the honest run's)

Issue #20, what a provider claims about its work and who it is (trust-market):

``inflated-units``    runs honestly; the run's figures claim 10× the work units and a run
                      time of 1 ms (θ used to be the receipt's units over its run time)
``fake-progress``     reports the job 100 % done as soon as it starts, then runs it as
                      usual (a cancel used to pay by reported progress)
``collude``           two accounts of one person (``--role``): the ``cheat`` runs every job
                      with a wrong seed and leaves its outputs in ``--shared`` (a folder
                      both agents see); the ``pal`` runs honestly except a job with inputs
                      the cheat ran, for which it returns the cheat's outputs (agreeing with
                      it as checker or third run)
``fail-checks``       the same pair, but the ``pal`` fails the jobs the cheat ran (its
                      checks) as "non-retryable" (a check so failed used to be given up)
``detect-checks``     cheats (a wrong seed) only on what looks like a client job, and runs
                      honestly what looks like a check or a canary by the tells a plugin
                      host can see: client job ids derived as version-5 UUIDs while checks
                      and canaries were version 4; a canary's benchmark inputs. Its log says
                      what it took each job for (``looked_like``). (The envelope's tells,
                      e.g. a canary without ``weights_digest``, are out of a host's sight.)
``half-steps``        image jobs run half the steps (as ``fewer-steps``) and the meta's
                      ``latent_trace`` is relabelled as the job's own schedule (its points
                      of a quarter, half, ... of the way claimed as the job's), so that only
                      the latents themselves can tell
``false-class``       ``half-steps``, and its hosts report hardware no other machine has
                      (a made-up GPU name on a GPU, a made-up thread count on a CPU), so the
                      agent declares that class at connect and names it in every receipt:
                      where the class decided exact or structural comparison, a class of its
                      own was compared structurally
``cached-unseeded``   returns the outputs of an earlier job with the same inputs but for the
                      seed (the first such job runs honestly), meta naming the seed they
                      were made with: where the broker let a check re-run a job without a
                      seed with the seed its provider reported, it passed
``reduced-res``       image jobs run at half the width and height (multiples of 8, not below
                      the plugin's smallest size: about a quarter of the work), each image scaled up to the asked
                      size (bicubic) and its latent trace's points scaled up (bilinear) to
                      the shape a run at the asked size records, the work of the whole job
                      billed: only the latents' own trajectory can tell
``duplicate-images``  image jobs of n ≥ 2 images run one image and return it n times, each
                      copy's meta claiming its own index and seed (seed + index), the work
                      of all n billed
"""
from __future__ import annotations

import copy
import io
import json
import logging
import random
import secrets
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from provider_agent.errors import ConfigError, HostError
from provider_agent.host.manager import HostOutput, HostResult, PluginHost
from sdk.protocol.manifest import Manifest, load_manifest

log = logging.getLogger("agent.cheat")

MODES = ("wrong-seed", "fewer-steps", "other-model", "adapter-dropped", "random-image",
         "cached-output", "truncate-text", "pad-text", "other-text-model",
         "greedy-as-sampled", "colder-sampling", "narrow-top-p", "early-stop", "altered-text",
         "half-steps", "false-class", "cached-unseeded", "reduced-res",
         "duplicate-images")
# issue #20 (trust-market): claims about the work, and one person's two accounts
TRUST_MODES = ("inflated-units", "fake-progress", "collude", "fail-checks", "detect-checks")
MODES += TRUST_MODES
#: Modes run by a pair of agents of two accounts (``role`` cheat / pal).
PAIR_MODES = ("collude", "fail-checks")
INFLATE_UNITS = 10.0
#: Image cheats that run half the steps and claim the job's schedule in the latent trace.
HALF_STEP_MODES = ("half-steps", "false-class")
#: false-class: the GPU name (on a GPU) or thread count (on a CPU) its hosts report.
FALSE_GPU = "NVIDIA Imaginary 9000"
FALSE_THREADS = 977
FALSE_CLASS = f"cuda:{FALSE_GPU}:torch=2.13.0"  # the class it declares on a GPU of torch 2.13
#: Text cheats that run the job with other sampling settings than it asked, and claim its own.
SAMPLING_MODES = ("greedy-as-sampled", "colder-sampling", "narrow-top-p", "early-stop")
ALTERED_TEXT = b"\n\nSponsored: visit example.com"
WEIGHT_MODES = {"other-model": "images", "other-text-model": "text"}
PAD_TOKENS = 8


@dataclass
class Outcome:
    """What one job's cheat did: ``cheated`` False means the job ran honestly."""

    cheated: bool
    job_inputs: dict[str, Any]          # the inputs as the job asked them
    run_inputs: dict[str, Any]          # what the plugin host is given
    skip_run: bool = False              # random-image / cached-output: no host.run
    validated: dict[str, Any] | None = None  # the job's inputs with defaults (None: invalid)
    fail: bool = False                  # fail-checks' pal: fail the job as non-retryable
    shared: list | None = None          # collude's pal: the cheat's outputs to return


@dataclass
class Cheat:
    mode: str
    rate: float = 1.0
    weights: Path | None = None
    log_path: Path | None = None
    rng: random.Random = field(default_factory=random.Random)
    cached: dict[str, list] = field(default_factory=dict)  # plugin -> first HostOutputs
    cached_inputs: dict[str, dict] = field(default_factory=dict)  # plugin -> their inputs
    role: str = "cheat"                 # PAIR_MODES: "cheat" or "pal"
    shared_dir: Path | None = None      # PAIR_MODES: the folder the pair shares
    uuid_versions: set = field(default_factory=set)  # detect-checks: versions of ids seen
    # cached-unseeded: (plugin, the inputs but the seed) -> the outputs of the first such job
    by_inputs: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"cheat mode {self.mode!r}; one of {list(MODES)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError(f"cheat rate {self.rate}; must be between 0 and 1")
        if self.mode in WEIGHT_MODES:
            if self.weights is None:
                raise ConfigError(f"cheat mode {self.mode} needs --weights "
                                  "(the other weights folder to run)")
            if not self.weights.is_dir():
                raise ConfigError(f"cheat --weights {self.weights} is not a folder")
        if self.mode in PAIR_MODES:
            if self.role not in ("cheat", "pal"):
                raise ConfigError(f"cheat --role {self.role!r}; cheat or pal")
            if self.shared_dir is None:
                raise ConfigError(f"cheat mode {self.mode} needs --shared "
                                  "(a folder both agents of the pair can write)")
            self.shared_dir.mkdir(parents=True, exist_ok=True)

    # ---- start ---------------------------------------------------------------------------
    def announce(self) -> None:
        bar = "!" * 72
        log.warning("%s\nTHIS AGENT CHEATS ON PURPOSE (verification harness): "
                    "mode %s, rate %.2f%s\nNever run this against a real "
                    "marketplace: its providers get slashed.\n%s", bar, self.mode, self.rate,
                    f", weights {self.weights}" if self.weights else "", bar)

    def weights_for(self, output_kind: str, honest: Path | None) -> Path | None:
        """The weights folder a plugin whose manifest output is ``output_kind`` is run on."""
        if WEIGHT_MODES.get(self.mode) == output_kind:
            return self.weights
        return honest

    # ---- per job -------------------------------------------------------------------------
    def before(self, job_id: str, manifest: Manifest, inputs: dict[str, Any]) -> Outcome:
        """Decide (per job, at ``rate``) and rewrite the inputs the plugin will get
        (``manifest``: the served plugin's; an input rewrite starts from the validated
        inputs, so a default the job left out is cheated on too)."""
        plugin, output_kind = manifest.name, manifest.output
        if self.mode in TRUST_MODES:
            return self._claims_and_pairs(job_id, manifest, inputs)
        try:
            validated = manifest.validate_inputs(inputs)
        except Exception:  # noqa: BLE001 - the host refuses it honestly
            validated = None
        job_inputs = dict(inputs)
        honest = Outcome(False, job_inputs, inputs, validated=validated)
        if self.mode in WEIGHT_MODES:
            honest.cheated = WEIGHT_MODES[self.mode] == output_kind  # runs other weights
            return self._record(job_id, plugin, honest)
        if validated is None or self.rng.random() >= self.rate:
            return self._record(job_id, plugin, honest)
        run = copy.deepcopy(validated)
        out = Outcome(False, job_inputs, run, validated=validated)
        if self.mode == "wrong-seed":
            if "seed" not in manifest.inputs.names:
                return self._record(job_id, plugin, honest)
            seed = run.get("seed")
            run["seed"] = (int(seed) + 1) % 2**32 if seed is not None else self.rng.randrange(2**32)
            out.cheated = True
        elif self.mode == "fewer-steps" or (self.mode in HALF_STEP_MODES
                                            and output_kind == "images"):
            for key in ("steps", "num_inference_steps"):
                if isinstance(run.get(key), int) and run[key] > 1:
                    run[key] = max(1, run[key] // 2)
                    out.cheated = True
        elif self.mode == "reduced-res" and output_kind == "images":
            for key in ("width", "height"):
                if isinstance(run.get(key), int) and run[key] >= 16:
                    run[key] = max(8, run[key] // 2 // 8 * 8)
                    out.cheated = True
            try:
                manifest.validate_inputs(run)
            except Exception:  # noqa: BLE001 - below the schema's smallest size: run honestly
                out.cheated = False
        elif self.mode == "duplicate-images" and output_kind == "images":
            if int(run.get("n") or 1) >= 2:
                run["n"] = 1
                out.cheated = True
        elif self.mode == "adapter-dropped":
            for key in ("adapters", "loras"):
                if run.get(key):
                    run.pop(key)
                    out.cheated = True
        elif self.mode == "random-image":
            out.cheated = out.skip_run = output_kind == "images"
        elif self.mode == "cached-output":
            # a job of the very inputs the cache was made from gets their honest answer:
            # no cheat (a canary may replay a client job's inputs)
            out.cheated = out.skip_run = (bool(self.cached.get(plugin))
                                          and self.cached_inputs.get(plugin) != validated)
        elif self.mode == "cached-unseeded":
            cached = self.by_inputs.get(_unseeded_key(plugin, validated))
            # made with this very seed: the honest answer, no cheat (a canary may replay a
            # client job's inputs, seed and all)
            out.cheated = out.skip_run = bool(cached) and (
                (cached[0].meta or {}).get("seed") != validated.get("seed"))
        elif self.mode in ("truncate-text", "pad-text", "altered-text"):
            out.cheated = output_kind == "text"
        elif self.mode in SAMPLING_MODES and output_kind == "text":
            out.cheated = _resample(self.mode, run)
        if not out.cheated:
            return self._record(job_id, plugin, honest)
        return self._record(job_id, plugin, out)

    def fake_outputs(self, plugin: str, outcome: Outcome, dtype: str = "float32") -> list:
        """The outputs of a job that is not run (random-image, cached-output); ``dtype``:
        what an honest run would report (float16 on a GPU)."""
        validated = outcome.validated or {}
        if outcome.shared is not None:  # collude's pal: the cheat's outputs
            return self.shared_outputs(outcome)
        if self.mode == "cached-output":
            outs = [HostOutput(o.index, o.media_type, o.data, copy.deepcopy(o.meta))
                    for o in self.cached[plugin]]
            return self._claim_job_meta(outs, outcome.job_inputs)
        if self.mode == "cached-unseeded":  # the meta keeps the seed they were made with
            return [HostOutput(o.index, o.media_type, o.data, copy.deepcopy(o.meta))
                    for o in self.by_inputs[_unseeded_key(plugin, validated)]]
        width, height = int(validated.get("width", 512)), int(validated.get("height", 512))
        outs = []
        for i in range(int(validated.get("n", 1) or 1)):
            meta = {"seed": (int(validated.get("seed") or 0) + i), "index": i,
                    "dtype": dtype, "latent_sha256": self._hex(64)}
            outs.append(HostOutput(i, "image/png", random_png(width, height, self.rng), meta))
        return outs

    def after(self, plugin: str, outcome: Outcome, outputs: list) -> list:
        """Rewrite the outputs of a run (cheated or not: the cache fills from the first)."""
        if self.mode in PAIR_MODES or self.mode == "detect-checks":
            if self.mode in PAIR_MODES and self.role == "cheat" and outcome.cheated:
                self._share(plugin, outcome.job_inputs, outputs)
            return (self._claim_job_meta(outputs, outcome.job_inputs) if outcome.cheated
                    else outputs)
        if self.mode == "cached-output" and not self.cached.get(plugin) and outputs:
            self.cached[plugin] = [copy.deepcopy(o) for o in outputs]
            self.cached_inputs[plugin] = copy.deepcopy(outcome.validated)
        if self.mode == "cached-unseeded" and outputs and outcome.validated is not None:
            self.by_inputs.setdefault(_unseeded_key(plugin, outcome.validated),
                                      [copy.deepcopy(o) for o in outputs])
        if not outcome.cheated:
            return outputs
        if self.mode in ("wrong-seed", "adapter-dropped"):
            return self._claim_job_meta(outputs, outcome.job_inputs)
        if self.mode in HALF_STEP_MODES:
            return [claim_schedule(o, outcome.validated or {}) for o in outputs]
        if self.mode == "reduced-res":
            return [claim_size(o, outcome.validated or {}) for o in outputs]
        if self.mode == "duplicate-images" and outputs:
            return duplicate(outputs[0], int((outcome.validated or {}).get("n") or 1))
        if self.mode == "truncate-text":
            return [truncate_text(o) for o in outputs]
        if self.mode == "pad-text":
            return [pad_text(o, self.rng) for o in outputs]
        if self.mode == "altered-text":
            for o in outputs:
                o.data += ALTERED_TEXT
            return outputs
        if self.mode in SAMPLING_MODES:
            return [claim_sampling(o, outcome.validated or {}, self.mode) for o in outputs]
        return outputs

    # ---- issue #20: claims about the work, one person's two accounts ----------------------
    def _claims_and_pairs(self, job_id: str, manifest: Manifest,
                          inputs: dict[str, Any]) -> Outcome:
        plugin = manifest.name
        try:
            validated = manifest.validate_inputs(inputs)
        except Exception:  # noqa: BLE001 - the host refuses it honestly
            validated = None
        out = Outcome(False, dict(inputs), inputs, validated=validated)
        if validated is None:
            return self._record(job_id, plugin, out)
        if self.mode in ("inflated-units", "fake-progress"):
            out.cheated = self.rng.random() < self.rate  # the receipt or the progress lies
            return self._record(job_id, plugin, out)
        if self.mode in PAIR_MODES:
            key = _inputs_key(plugin, inputs)
            if self.role == "cheat":
                if self.rng.random() < self.rate:
                    out.run_inputs = _wrong_seed(validated, self.rng)
                    out.cheated = True
                return self._record(job_id, plugin, out)
            shared = self._shared(key)  # the pal: a job the cheat ran is being checked
            if shared is not None:
                out.cheated = True
                if self.mode == "fail-checks":
                    out.fail = True
                else:
                    out.skip_run, out.shared = True, shared
            return self._record(job_id, plugin, out)
        # detect-checks
        looked = self._looks_like(job_id, manifest, inputs)
        if looked == "client" and self.rng.random() < self.rate:
            out.run_inputs = _wrong_seed(validated, self.rng)
            out.cheated = True
        return self._record(job_id, plugin, out, looked_like=looked)

    def _looks_like(self, job_id: str, manifest: Manifest, inputs: dict[str, Any]) -> str:
        """"check", "canary" or "client", by the tells plugin hosts used to see."""
        import uuid as _uuid

        bench = dict(manifest.benchmark_inputs or {})
        try:
            same = bench and _unseeded(manifest.validate_inputs(inputs)) == _unseeded(
                manifest.validate_inputs(bench))
        except Exception:  # noqa: BLE001 - inputs the plugin refuses are no canary's
            same = False
        if same:
            return "canary"
        try:
            version = _uuid.UUID(job_id).version
        except ValueError:
            return "client"
        self.uuid_versions.add(version)
        if 5 in self.uuid_versions and version == 4:
            return "check"  # client jobs' ids are derived (v5): a random one is a check
        return "client"

    def fake_progress(self, outcome: Outcome) -> bool:
        """fake-progress: report the job done as it starts."""
        return self.mode == "fake-progress" and outcome.cheated

    def receipt_figures(self, outcome: Outcome, work_units: float,
                        run_ms: int) -> tuple[float, int]:
        """inflated-units: the work units and run time the receipt claims."""
        if self.mode == "inflated-units" and outcome.cheated:
            return float(work_units) * INFLATE_UNITS, 1
        return work_units, run_ms

    def shared_outputs(self, outcome: Outcome) -> list:
        """collude's pal: the cheat's outputs for the job, as its own."""
        return [HostOutput(o["index"], o["media_type"], bytes.fromhex(o["data"]), o["meta"])
                for o in outcome.shared or []]

    def _share(self, plugin: str, job_inputs: dict[str, Any], outputs: list) -> None:
        path = self.shared_dir / f"{_inputs_key(plugin, job_inputs)}.json"
        doc = [{"index": o.index, "media_type": o.media_type, "data": o.data.hex(),
                "meta": o.meta} for o in outputs]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, default=str))
        tmp.replace(path)

    def _shared(self, key: str) -> list | None:
        path = self.shared_dir / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def hardware(self, hardware: dict) -> dict:
        """The hardware its hosts report (the ready message's ``hardware``, from which the
        agent derives the class it declares and names in receipts): false-class makes up a
        GPU name on a GPU, a thread count on a CPU, so no other machine shares its class."""
        if self.mode != "false-class":
            return hardware
        if hardware.get("device") == "cuda":
            return {**hardware, "gpu_name": FALSE_GPU}
        return {**hardware, "threads": FALSE_THREADS}

    # ---- helpers -------------------------------------------------------------------------
    def _claim_job_meta(self, outputs: list, job_inputs: dict[str, Any]) -> list:
        """Meta that claims the job as asked: its seed, its adapters."""
        seed = job_inputs.get("seed")
        adapters = _adapter_meta(job_inputs.get("adapters") or job_inputs.get("loras"))
        for o in outputs:
            if seed is not None and "seed" in o.meta:
                o.meta["seed"] = int(seed) + int(o.meta.get("index", 0) or 0)
            if adapters:
                o.meta["adapters"] = adapters
        return outputs

    def _hex(self, n: int) -> str:
        return "".join(self.rng.choice("0123456789abcdef") for _ in range(n))

    def _record(self, job_id: str, plugin: str, outcome: Outcome, **extra) -> Outcome:
        if outcome.cheated:
            log.warning("CHEAT %s on job %s (%s)", self.mode, job_id, plugin)
        if self.log_path is not None:
            try:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps({"job_id": job_id, "plugin": plugin, "mode": self.mode,
                                        "cheated": outcome.cheated, "time": time.time(),
                                        "role": self.role, **extra}) + "\n")
            except OSError as exc:
                log.error("cannot write the cheat log %s: %s", self.log_path, exc)
        return outcome


class CheatingHost:
    """A wrapper around a real plugin host (``inner``) whose jobs ``cheat`` rewrites: inputs
    on their way in, outputs and the run's figures (work units, run time) on their way out;
    a job it fails or fakes never reaches the plugin. Its ready message reports
    ``Cheat.hardware``. Everything else is the inner host's (the agent sees a PluginHost)."""

    def __init__(self, cheat: Cheat, manifest: Manifest, inner: PluginHost):
        self.cheat = cheat
        self.manifest = manifest
        self.inner = inner

    def __getattr__(self, name: str):  # stop, alive, cancel, weights_dir, name, ...
        return getattr(self.inner, name)

    @property
    def ready(self) -> dict:
        ready = self.inner.ready
        if not ready.get("hardware"):
            return ready
        return {**ready, "hardware": self.cheat.hardware(ready["hardware"])}

    def start(self) -> dict:
        self.inner.start()
        return self.ready

    def run(self, job_id: str, inputs: dict, **run) -> HostResult:
        if job_id.startswith("benchmark-"):  # the agent's own benchmark: honest
            return self.inner.run(job_id, inputs, **run)
        t0 = time.perf_counter()
        outcome = self.cheat.before(job_id, self.manifest, inputs)
        if outcome.fail:
            raise HostError("out_of_memory", "the GPU ran out of memory", retryable=False)
        if self.cheat.fake_progress(outcome):
            total = int((outcome.validated or {}).get("steps")
                        or (outcome.validated or {}).get("max_new_tokens") or 1)
            run.get("on_progress", lambda *a: None)(total, total, "")
        if outcome.skip_run:
            dtype = (self.manifest.dtype if (self.ready.get("hardware") or {}).get("device")
                     == "cuda" else "float32")  # what an honest run would report
            result = HostResult(self.cheat.fake_outputs(self.manifest.name, outcome, dtype),
                                int((time.perf_counter() - t0) * 1000), 0.0)
        else:
            result = self.inner.run(job_id, outcome.run_inputs, **run)
        result.outputs = self.cheat.after(self.manifest.name, outcome, result.outputs)
        if outcome.cheated and outcome.validated is not None:  # claim the work asked for
            result.work_units = self.manifest.work_units_for(outcome.validated)
        result.work_units, result.run_ms = self.cheat.receipt_figures(
            outcome, result.work_units, result.run_ms)
        return result


class CheatingHosts:
    """The host factory of a cheating agent (``provider_agent.host.manager.HostFactory``):
    each plugin's host is a :class:`CheatingHost` of ``cheat`` around a real
    ``PluginHost`` started on the weights the cheat runs (other-model: its other weights,
    which the sandbox binds as it binds any host's; the agent still advertises its own)."""

    def __init__(self, cheat: Cheat):
        self.cheat = cheat
        self._announced = False

    def __call__(self, plugin_dir: Path, weights_dir: Path | None, *, device: str,
                 launcher=None, name: str | None = None,
                 max_vram_gb: float = 0.0) -> CheatingHost:
        if not self._announced:  # once per agent process, in the agent's log format
            self.cheat.announce()
            self._announced = True
        manifest = load_manifest(plugin_dir)
        inner = PluginHost(plugin_dir, self.cheat.weights_for(manifest.output, weights_dir),
                           device=device, launcher=launcher, name=name, max_vram_gb=max_vram_gb)
        return CheatingHost(self.cheat, manifest, inner)


def add_arguments(parser) -> None:
    """The options of a cheat (bench/cheat_agent.py)."""
    parser.add_argument("--mode", required=True, choices=MODES, help="the cheat")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="fraction of jobs cheated on, 0..1, drawn per job (default 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the draws and the random bytes/tokens")
    parser.add_argument("--weights", type=Path, default=None,
                        help="other-model / other-text-model: the weights folder to run")
    parser.add_argument("--log", type=Path, default=None,
                        help="JSON-lines file: one line per job, cheated or not")
    parser.add_argument("--role", default="cheat", choices=("cheat", "pal"),
                        help="collude / fail-checks: which account of the pair")
    parser.add_argument("--shared", type=Path, default=None,
                        help="collude / fail-checks: the folder both agents of the pair see")


def from_args(args) -> Cheat:
    """The cheat ``add_arguments``' options name."""
    return Cheat(args.mode, args.rate, args.weights.expanduser() if args.weights else None,
                 args.log, random.Random(args.seed) if args.seed is not None else random.Random(),
                 role=args.role, shared_dir=args.shared.expanduser() if args.shared else None)


def _unseeded_key(plugin: str, inputs: dict[str, Any] | None) -> str:
    """What cached-unseeded matches jobs on: the plugin and every input but the seed."""
    rest = {k: v for k, v in (inputs or {}).items() if k != "seed"}
    return json.dumps([plugin, rest], sort_keys=True, default=str)


def claim_schedule(out, job: dict[str, Any]):
    """half-steps: the output's latent trace relabelled as a run of the job's step count
    (``plugins.api.trace_steps`` of it), each of its own points claimed for the job's
    point at the same fraction of the way; the latents are its own."""
    trace = out.meta.get("latent_trace")
    steps = job.get("steps") or job.get("num_inference_steps")
    if not isinstance(trace, dict) or not isinstance(steps, int):
        return out
    from plugins.api import trace_steps  # the plugins' own rule

    claimed = trace_steps(steps)
    points = list(trace.get("points") or [])
    if len(points) != len(claimed):  # fewer points of its own: the nearest for each
        own = trace.get("steps") or []
        total = max(1, int(trace.get("total") or 1))
        points = [points[min(range(len(own)), key=lambda j: abs(own[j] / total - k / steps))]
                  for k in claimed] if own and points else points
    out.meta["latent_trace"] = {**trace, "total": steps, "steps": claimed, "points": points}
    return out


def duplicate(out, n: int) -> list:
    """duplicate-images: one image as the job's ``n``, copy ``i`` claiming index ``i`` and
    seed ``seed + i`` in its meta."""
    seed = out.meta.get("seed")
    copies = []
    for i in range(n):
        meta = {**copy.deepcopy(out.meta), "index": i}
        if isinstance(seed, int):
            meta["seed"] = seed + i
        copies.append(HostOutput(i, out.media_type, out.data, meta))
    return copies


def claim_size(out, job: dict[str, Any]):
    """reduced-res: an image made at a smaller size claimed as one of the job's size: the
    image scaled up (bicubic), the latent trace's points scaled up (bilinear) to the shape
    a run of the job's size records (``plugins.api.trace_point``: at most TRACE_SIDE a
    side of the latents, an eighth of the image's)."""
    width, height = job.get("width"), job.get("height")
    if out.media_type != "image/png" or not isinstance(width, int) or not isinstance(height, int):
        return out
    from PIL import Image

    image = Image.open(io.BytesIO(out.data))
    if image.size != (width, height):
        buf = io.BytesIO()
        image.resize((width, height), Image.Resampling.BICUBIC).save(buf, format="PNG")
        out.data = buf.getvalue()
    trace = out.meta.get("latent_trace")
    if isinstance(trace, dict) and trace.get("points"):
        import base64

        import numpy as np
        import torch

        from plugins.api import TRACE_SIDE

        c, h, w = (int(d) for d in trace["shape"])
        side = (min(height // 8, TRACE_SIDE), min(width // 8, TRACE_SIDE))
        points = []
        for point in trace["points"]:
            x = torch.from_numpy(np.frombuffer(base64.b64decode(point), dtype=np.float16)
                                 .astype(np.float32).reshape(1, c, h, w))
            x = torch.nn.functional.interpolate(x, size=side, mode="bilinear")
            points.append(base64.b64encode(np.ascontiguousarray(
                x[0].numpy().astype(np.float16)).tobytes()).decode())
        out.meta["latent_trace"] = {**trace, "shape": [c, *side], "points": points}
    for key, value in (("width", width), ("height", height)):
        if key in out.meta:
            out.meta[key] = value
    return out


def random_png(width: int, height: int, rng: random.Random | None = None) -> bytes:
    from PIL import Image

    raw = (rng.randbytes(width * height * 3) if rng is not None
           else secrets.token_bytes(width * height * 3))
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), raw).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


_TOKEN_LISTS = ("token_ids", "logprobs", "scores")


def _resample(mode: str, run: dict[str, Any]) -> bool:
    """Rewrite a text job's validated inputs ``run`` for a sampling cheat; False where it
    would change nothing (a greedy job, one token)."""
    temperature = float(run.get("temperature") or 0.0)
    if mode == "early-stop":
        n = int(run.get("max_new_tokens") or 0)
        if n < 2:
            return False
        run["max_new_tokens"] = n // 2
        return True
    if temperature <= 0:
        return False  # greedy already: nothing to cheat on
    if mode == "greedy-as-sampled":
        run["temperature"] = 0.0
    elif mode == "colder-sampling":
        run["temperature"] = temperature / 2
    elif mode == "narrow-top-p":
        run["top_p"] = max(0.01, float(run.get("top_p") or 1.0) / 2)
    return True


def claim_sampling(out, job: dict[str, Any], mode: str):
    """A text output run with other settings, claimed as the job asked them: its meta names
    the job's temperature, top_p and max_new_tokens; an early-stopped one that reached its
    cut claims it met the stop string."""
    meta = out.meta
    for key in ("temperature", "top_p", "max_new_tokens"):
        if key in job and key in meta:
            meta[key] = job[key]
    ids = meta.get("token_ids")
    if (mode == "early-stop" and meta.get("finish_reason") == "length"
            and isinstance(ids, list) and ids):
        meta.update(finish_reason="stop", stopped_by_string=True, stop_at=len(ids) - 1)
    return out


def truncate_text(out):
    """Half the tokens of a text output's claim (at least one kept) and half its text."""
    meta = out.meta
    ids = meta.get("token_ids")
    if out.media_type != "text/plain" or not isinstance(ids, list) or len(ids) < 2:
        return out
    keep = len(ids) // 2
    for key in _TOKEN_LISTS:
        if isinstance(meta.get(key), list):
            meta[key] = meta[key][:keep]
    if "generated_tokens" in meta:
        meta["generated_tokens"] = keep
    text = out.data.decode("utf-8", errors="ignore")
    out.data = text[:len(text) // 2].encode("utf-8")
    return out


def pad_text(out, rng: random.Random):
    """Append PAD_TOKENS random token ids (below the largest id seen, never an eos id)
    with made-up logprobs and scores; some random letters go onto the text."""
    meta = out.meta
    ids = meta.get("token_ids")
    if out.media_type != "text/plain" or not isinstance(ids, list):
        return out
    eos = set(meta.get("eos_ids") or [])
    top = max([*ids, 255])
    extra = []
    while len(extra) < PAD_TOKENS:
        t = rng.randrange(top + 1)
        if t not in eos:
            extra.append(t)
    lps = [round(-rng.uniform(0.05, 3.0), 6) for _ in extra]
    meta["token_ids"] = ids + extra
    if isinstance(meta.get("logprobs"), list):
        meta["logprobs"] = meta["logprobs"] + lps
    if isinstance(meta.get("scores"), list):
        meta["scores"] = meta["scores"] + [
            {"top": [[t, lp, 1.0]], "eos_lp": -20.0, "eos_p": 0.0, "mass_above": 0.0}
            for t, lp in zip(extra, lps)]
    if "generated_tokens" in meta:
        meta["generated_tokens"] = len(meta["token_ids"])
    out.data += "".join(rng.choice(string.ascii_lowercase + " ")
                        for _ in range(PAD_TOKENS * 3)).encode()
    return out


def _adapter_meta(text: Any) -> dict[str, float] | None:
    if not text:
        return None
    try:
        from plugins.adapters import parse_adapters

        return {a.name: a.scale for a in parse_adapters(str(text))} or None
    except Exception:  # noqa: BLE001 - best effort: a cheater's claim, not a check
        return None


def _inputs_key(plugin: str, inputs: dict[str, Any]) -> str:
    """What a pair of cheating accounts recognise a job by: its plugin and inputs (a check
    re-runs the inputs of the job it checks)."""
    from sdk.protocol.canonical import canonical_bytes, sha256_hex

    return sha256_hex(canonical_bytes({"plugin": plugin, "inputs": inputs}))[:32]


def _wrong_seed(validated: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    run = copy.deepcopy(validated)
    seed = run.get("seed")
    run["seed"] = (int(seed) + 1) % 2**32 if seed is not None else rng.randrange(2**32)
    return run


def _unseeded(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k != "seed"}

