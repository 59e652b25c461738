"""The llama plugin: text generation with a Llama-family causal LM on transformers.

Weights are a transformers folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template): a published Llama checkpoint, or the tiny
one from ``plugins.tiny.build_tiny_llama``.

Generation is a plain sampling loop over the KV cache rather than ``model.generate``,
because the market needs three things generate() does not give together: sampling from
a seeded *CPU* generator on float32 probabilities (the same seed picks the same tokens on
any device whose logits agree), the log-probability of every chosen token under the
model's own distribution (what a verifier re-scores by teacher forcing, DESIGN §6), and
a cancellation check and a streamed piece of text after every token.

The output's meta (what a verifier needs to re-score the claim, DESIGN §6):
``token_ids``, ``logprobs`` (each chosen token's log-probability under the raw, T=1
distribution), ``finish_reason`` ("stop" or "length"), ``stopped_by_string``, ``eos_ids``,
``temperature``, ``top_p``, ``max_new_tokens``, ``dtype``, ``seed`` and ``scores``, one per
generated token::

    {"top": [[token_id, logprob_at_T1, prob_sampled], ...],  # the 5 likeliest raw tokens
     "eos_lp": logsumexp of the eos ids' raw logprobs,
     "eos_p": eos mass in the distribution sampled from (after temperature, top_p and the
              ignore_eos ban; 0 for greedy),
     "mass_above": mass, at the job's temperature before top_p (ignore_eos ban applied), of
                   the tokens strictly likelier than the chosen one (0 for greedy),
     # sampled jobs only: where the chosen token sits in the distribution sampled from, for
     # the verifier's test that the tokens are a sample of it (broker.verification.sampled_text)
     "lp_t": the chosen token's log-probability at the job's temperature, before top_p,
     "mass_tied": mass (same distribution) of the tokens exactly as likely, itself included,
     "top_mass": mass of the likeliest tokens (those tied for the top),
     "nucleus_mass": mass top_p keeps (1 without top_p),
     "tilts": [[g, log sum over the kept tokens of (p / nucleus_mass) ** g], ...] for g in
              TILTS: what a sample sharpened or flattened by the power g would weigh}

**Scoring** (``score_tokens``: a JSON array of token ids): instead of sampling, the plugin
scores those tokens as the continuation of the prompt (teacher forcing: one forward pass
over prompt + tokens) and reports exactly the meta a run that generated them would: the
same ``token_ids``, their ``logprobs`` and ``scores`` under the model's own distribution at
the job's temperature and top_p, and ``"scored": true``. A verifier asks a checker for this
where the checker's own run parted from a claimed completion (DESIGN §6): past the parting
only a teacher-forced pass says how likely the claimed tokens are.

``stop_at`` is the index of the token with which the job's ``stop`` string first appears in
the text (null when it does not): a scoring run reports it for the tokens it scored, so that
a verifier knows, from the job's own stop string and not from the claim, whether a claimed
completion ended there; the scoring run's text is the one a run that generated those tokens
would have returned (up to the stop string).

``prob_sampled`` is the token's probability in the distribution sampled from (greedy: 1 for
the token taken, 0 for the others). Floats in ``scores`` are rounded to 6 decimals; a
log-probability of -inf (a token the model masks) is written as -10000 (canonical JSON has
no infinities). ``ignore_eos`` is reported too (the eos ids are banned from the sampler).
"""
from __future__ import annotations

import inspect
import json
import math
import secrets
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer

from plugins import checkpoints
from plugins.adapters import AdapterCache, AdapterRequest, adapter_roots, parse_adapters
from plugins.api import BadInput, Output, Plugin, PluginError, RunContext, run_dtype

ROLES = ("system", "user", "assistant")
# transformers 4.56 renamed from_pretrained's torch_dtype to dtype (the old name warns).
_DTYPE_KWARG = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


class Llama(Plugin):
    """A causal LM: raw ``prompt`` completion or chat ``messages``, streamed per token."""

    family = "llama"  # the base model LoRA adapters must be made for (plugins.adapters)
    model: Any = None
    tokenizer: Any = None

    def setup(self, weights_dir: Path | None, device: str) -> None:
        if weights_dir is None:
            raise PluginError("llama needs a weights folder in the transformers layout "
                              "(config.json, model.safetensors, tokenizer.json)", retryable=False)
        self.device = torch.device(device)
        dtype = run_dtype(self.device.type, "bfloat16" if self.device.type == "cuda"
                          and torch.cuda.is_bf16_supported() else "float16")
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # keep the host's log readable
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(weights_dir)
            self.model = AutoModelForCausalLM.from_pretrained(weights_dir, **{_DTYPE_KWARG: dtype})
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        self.model.to(self.device).eval()
        self.context_tokens = int(getattr(self.model.config, "max_position_embeddings", 0)
                                  or self.tokenizer.model_max_length)
        # transformers 5.x renamed the KV cache argument and output field past_key_values
        # to cache; use whichever this version has.
        self._forward_params = set(inspect.signature(self.model.forward).parameters)
        self._cache_arg = "cache" if "cache" in self._forward_params else "past_key_values"
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(i) for i in [*eos, self.tokenizer.eos_token_id] if i is not None}
        self.adapters = AdapterCache(adapter_roots(weights_dir, self.family), self.family,
                                     load=self._load_adapter, unload=self._unload_adapter)

    def teardown(self) -> None:
        self.model = self.tokenizer = None
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- one job -----------------------------------------------------------------------
    def run(self, inputs: dict[str, Any], ctx: RunContext) -> list[Output]:
        if self.model is None:
            raise PluginError("run() called before setup()")
        ctx.check_cancelled()
        prompt_ids = self.encode(inputs)
        adapters = parse_adapters(inputs.get("adapters"))
        max_new = inputs["max_new_tokens"]
        if len(prompt_ids) + max_new > self.context_tokens:
            raise BadInput(
                f"the prompt is {len(prompt_ids)} tokens and max_new_tokens is {max_new}; "
                f"together they must fit this model's context of {self.context_tokens} tokens. "
                f"Shorten the prompt or lower max_new_tokens.")
        self.use_adapters(adapters)
        if inputs.get("score_tokens") is not None:
            return [self._score_tokens(inputs, prompt_ids, adapters, ctx)]
        seed = inputs.get("seed")
        if seed is None:
            seed = secrets.randbelow(2**32)
        resume = (checkpoints.loads(ctx.resume_from, kind="tokens", inputs=inputs)
                  if getattr(ctx, "resume_from", None) else None)
        every = int(getattr(ctx, "checkpoint_every", 0) or 0)
        if resume is not None:
            seed = int(resume["seed"])
        generator = torch.Generator("cpu").manual_seed(seed)
        text = _StreamingText(self.tokenizer, inputs.get("stop"), ctx)

        token_ids: list[int] = []
        logprobs: list[float] = []
        scores: list[dict[str, Any] | None] = []
        if resume is not None:
            # The tokens of the earlier attempt: already streamed to the client, so they
            # only rebuild the text here; the sampler continues from the saved RNG state.
            token_ids, logprobs = list(resume["token_ids"]), list(resume["logprobs"])
            scores = list(resume.get("scores") or [])[:len(token_ids)]
            scores += [None] * (len(token_ids) - len(scores))  # a checkpoint without them
            generator.set_state(resume["rng"])
            text.quiet = True
            for token in token_ids:
                text.add(token)
            text.quiet = False
            ctx.progress(len(token_ids), max_new, "resumed from a checkpoint")
        finish = "length"
        stopped_by_string = False
        banned = sorted(self.eos_ids) if inputs.get("ignore_eos") else []
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        with torch.inference_mode():
            out = self._forward(prompt_ids + token_ids, cache=None, last_only=True)
            for step in range(len(token_ids) + 1, max_new + 1):
                logits = out.logits[0, -1].float().cpu()
                token, dist = _sample_dist(logits, inputs["temperature"], inputs["top_p"],
                                           generator, banned)
                logp = torch.log_softmax(logits, dim=-1)
                token_ids.append(token)
                logprobs.append(float(logp[token]))
                scores.append(_score(logp, token, dist, eos))
                ctx.check_cancelled()
                ctx.progress(step, max_new)
                if token in self.eos_ids:
                    finish = "stop"
                    break
                if text.add(token):  # the stop string appeared
                    finish = "stop"
                    stopped_by_string = True
                    break
                if every and step % every == 0 and step < max_new:
                    ctx.checkpoint(step, checkpoints.dumps({
                        "kind": "tokens", "step": step, "total": max_new,
                        "fingerprint": checkpoints.fingerprint(inputs), "seed": seed,
                        "token_ids": token_ids, "logprobs": logprobs, "scores": scores,
                        "rng": generator.get_state()}))
                if step < max_new:
                    out = self._forward([token], cache=self._cache_of(out))
        final = text.finish()
        meta = self._meta(inputs, prompt_ids, adapters, seed=seed, token_ids=token_ids,
                          logprobs=logprobs, scores=scores, finish_reason=finish,
                          stopped_by_string=stopped_by_string,
                          stop_at=len(token_ids) - 1 if stopped_by_string else None)
        return [Output(data=final.encode("utf-8"), media_type="text/plain", meta=meta)]

    def _meta(self, inputs: dict[str, Any], prompt_ids: list[int],
              adapters: list[AdapterRequest], **run: Any) -> dict[str, Any]:
        """An output's meta (see the module docstring): ``run``'s own fields (seed,
        token_ids, logprobs, scores, finish_reason, stopped_by_string) and what follows
        from the job and the model."""
        meta = {**run, "prompt_tokens": len(prompt_ids),
                "generated_tokens": len(run["token_ids"]),
                "work_units": len(prompt_ids) + len(run["token_ids"]),
                "eos_ids": sorted(self.eos_ids), "ignore_eos": bool(inputs.get("ignore_eos")),
                "temperature": float(inputs["temperature"]), "top_p": float(inputs["top_p"]),
                "max_new_tokens": int(inputs["max_new_tokens"]),
                "dtype": str(self.model.dtype).removeprefix("torch.")}
        if adapters:
            meta["adapters"] = {a.name: a.scale for a in adapters}
        return meta

    def _score_tokens(self, inputs: dict[str, Any], prompt_ids: list[int],
                      adapters: list[AdapterRequest], ctx: RunContext) -> Output:
        """Teacher-forced scores of ``inputs["score_tokens"]`` after the prompt: the meta a
        run that generated exactly those tokens would report (see the module docstring)."""
        token_ids = _token_ids(inputs["score_tokens"], self.model.config.vocab_size,
                               inputs["max_new_tokens"])
        temperature, top_p = inputs["temperature"], inputs["top_p"]
        banned = sorted(self.eos_ids) if inputs.get("ignore_eos") else []
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        n = len(token_ids)
        kwargs: dict[str, Any] = {"use_cache": False}
        if "logits_to_keep" in self._forward_params:
            kwargs["logits_to_keep"] = n + 1  # no vocabulary-sized row for the prompt
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([prompt_ids + token_ids],
                                                       device=self.device), **kwargs).logits[0]
            # position p predicts token p + 1: the rows for the tokens are the last n + 1
            # but one (the last predicts what would follow them)
            rows = logits[-(n + 1):-1].float().cpu()
        logprobs: list[float] = []
        scores: list[dict[str, Any]] = []
        for i, token in enumerate(token_ids):
            ctx.check_cancelled()
            logp = torch.log_softmax(rows[i], dim=-1)
            logprobs.append(float(logp[token]))
            scores.append(_score(logp, token, _distribution(rows[i], temperature, top_p,
                                                            banned), eos))
        ctx.progress(n, n, "scored")
        # The text, and where the job's stop string first appears, as a run that generated
        # these tokens would have streamed it (nothing is streamed to anyone here).
        text = _StreamingText(self.tokenizer, inputs.get("stop"), ctx)
        text.quiet = True
        stop_at = None
        for i, token in enumerate(token_ids):
            if token in self.eos_ids:
                break  # a generation ends here, before the token reaches the text
            if text.add(token):
                stop_at = i
                break
        stopped = stop_at is not None and stop_at == n - 1
        finish = ("stop" if (token_ids[-1] in self.eos_ids and not banned) or stopped
                  else "length")
        meta = self._meta(inputs, prompt_ids, adapters, seed=inputs.get("seed"),
                          token_ids=token_ids, logprobs=logprobs, scores=scores,
                          finish_reason=finish, stopped_by_string=stopped, stop_at=stop_at,
                          scored=True)
        return Output(data=text.finish().encode("utf-8"), media_type="text/plain", meta=meta)

    # -- LoRA adapters (peft) ------------------------------------------------------------
    # peft injects LoRA layers into self.model in place (the PeftModel wrapper is only
    # the handle that loads, activates and deletes them), so _forward runs unchanged.
    peft_model: Any = None

    def use_adapters(self, adapters: list[AdapterRequest]) -> None:
        """Make exactly ``adapters`` active at their scales on the warm model; several are
        summed, each at its own scale. Loads only adapters not already cached."""
        if not adapters:
            if self.peft_model is not None and self.adapters.loaded:
                self.peft_model.base_model.disable_adapter_layers()
            return
        from peft.tuners.lora import LoraLayer

        self.adapters.prepare(adapters)
        lora = self.peft_model.base_model
        lora.enable_adapter_layers()
        # in name order (plugins.adapters.parse_adapters): the order of the sum is fixed
        lora.set_adapter([a.name for a in adapters])
        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                for a in adapters:
                    module.set_scale(a.name, a.scale)  # scale × alpha / r of its config

    def _load_adapter(self, name: str, folder: Path) -> None:
        from peft import PeftModel

        if not (folder / "adapter_config.json").exists():
            raise BadInput(f"adapters: {name!r} is not a peft adapter (no adapter_config.json "
                           f"in its folder); is it an adapter for another base model?")
        _check_lora_fits(self.model, folder / "adapter_model.safetensors", name)
        if self.peft_model is None:
            self.peft_model = PeftModel.from_pretrained(self.model, str(folder),
                                                        adapter_name=name, is_trainable=False)
        else:
            self.peft_model.load_adapter(str(folder), adapter_name=name, is_trainable=False)
        self.model.eval()

    def _unload_adapter(self, name: str) -> None:
        if self.peft_model is not None and name in self.peft_model.peft_config:
            self.peft_model.base_model.delete_adapter(name)
            self.peft_model.peft_config.pop(name, None)

    def _forward(self, ids: list[int], cache, last_only: bool = False):
        kwargs: dict[str, Any] = {"use_cache": True}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        if last_only and "logits_to_keep" in self._forward_params:
            kwargs["logits_to_keep"] = 1  # a long prompt needs no vocab-sized row per token
        return self.model(input_ids=torch.tensor([ids], device=self.device), **kwargs)

    def _cache_of(self, out):
        return getattr(out, self._cache_arg)

    def encode(self, inputs: dict[str, Any]) -> list[int]:
        """Token ids of the raw prompt, or of the messages through the chat template."""
        prompt, messages = inputs.get("prompt"), inputs.get("messages")
        if (prompt is None) == (messages is None):
            raise BadInput("give exactly one of prompt (raw text) or messages (a JSON array "
                           "of chat messages)")
        if prompt is not None:
            return list(self.tokenizer(prompt).input_ids)
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadInput("this model has no chat template; send a raw prompt instead")
        chat = _parse_messages(messages)
        # Render to text, then tokenize without adding special tokens: the template
        # already holds them (and the tokenize=True return type differs across versions).
        rendered = self.tokenizer.apply_chat_template(chat, tokenize=False,
                                                      add_generation_prompt=True)
        return list(self.tokenizer(rendered, add_special_tokens=False).input_ids)


def _check_lora_fits(model, weights: Path, name: str) -> None:
    """Refuse a peft LoRA whose matrices do not fit ``model``'s layers, before anything
    is injected (peft would otherwise leave half-added layers behind)."""
    from safetensors import safe_open

    if not weights.exists():
        raise BadInput(f"adapters: {name!r} has no adapter_model.safetensors in its folder")
    with safe_open(str(weights), framework="pt") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    for key, shape in shapes.items():
        path, part, _ = key.removeprefix("base_model.model.").partition(".lora_")
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            raise BadInput(f"adapters: {name!r} changes a layer {path!r} this llama model does "
                           f"not have; is it an adapter for another base model?") from None
        want = (getattr(layer, "in_features", None) if part.startswith("A")
                else getattr(layer, "out_features", None) if part.startswith("B") else None)
        have = shape[1] if part.startswith("A") else shape[0]
        if want is not None and have != want:
            raise BadInput(f"adapters: {name!r} was made for a model whose {path} has "
                           f"{have} features, this one has {want}; is it an adapter for "
                           f"another base model?")


def _parse_messages(raw: str) -> list[dict[str, str]]:
    try:
        chat = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadInput(f"messages is not valid JSON ({exc.msg} at character {exc.pos}); "
                       f'send [{{"role": "user", "content": "..."}}]') from None
    if not isinstance(chat, list) or not chat:
        raise BadInput('messages must be a non-empty JSON array like '
                       '[{"role": "user", "content": "Hello"}]')
    for i, message in enumerate(chat):
        if (not isinstance(message, dict) or set(message) != {"role", "content"}
                or message["role"] not in ROLES or not isinstance(message["content"], str)):
            raise BadInput(f"messages[{i}] is {message!r}; each message must be "
                           f'{{"role": one of {list(ROLES)}, "content": a string}}')
    return chat


def _sample_dist(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator, banned: list[int] = ()):
    """One token id from float32 CPU logits: greedy at temperature 0, else nucleus
    sampling; ``banned`` ids (end-of-text under ignore_eos) are never picked. Returns what
    it sampled from too, for ``_score``:
    ``(token, dist)`` with ``dist`` None for greedy, else ``(probs, sorted_probs, head,
    order)``: the softmax at ``temperature`` (banned ids at 0) before top_p, the same in
    descending order, that order after top_p (the dropped tail zeroed, not renormalised)
    and the token ids of that order."""
    dist = _distribution(logits, temperature, top_p, banned)
    if dist is None:
        return int(torch.argmax(_banning(logits, banned))), None
    _, _, head, order = dist
    pick = torch.multinomial(head, 1, generator=generator)
    return int(order[pick]), dist


def _distribution(logits: torch.Tensor, temperature: float, top_p: float,
                  banned: list[int] = ()):
    """What :func:`_sample_dist` samples from (its ``dist``; None for greedy)."""
    if temperature == 0:
        return None
    probs = torch.softmax(_banning(logits, banned) / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    head = sorted_probs
    if top_p < 1.0:
        # keep the smallest head whose mass reaches top_p (always at least one token)
        outside = (torch.cumsum(sorted_probs, dim=0) - sorted_probs) >= top_p
        head = sorted_probs.masked_fill(outside, 0.0)
    return probs, sorted_probs, head, order


def _banning(logits: torch.Tensor, banned: list[int]) -> torch.Tensor:
    """``logits`` with the ``banned`` ids at -inf (a copy; the same tensor if none)."""
    if not banned:
        return logits
    logits = logits.clone()
    logits[list(banned)] = float("-inf")
    return logits


def _token_ids(raw: str, vocab_size: int, max_new_tokens: int) -> list[int]:
    """``score_tokens``: a JSON array of 1 to ``max_new_tokens`` token ids of this model."""
    try:
        ids = json.loads(raw)
    except ValueError:
        ids = None
    if (not isinstance(ids, list) or not ids
            or not all(type(i) is int and 0 <= i < vocab_size for i in ids)):
        raise BadInput(f"score_tokens must be a JSON array of token ids, each from 0 to "
                       f"{vocab_size - 1} (this model's vocabulary), for example [791, 4062]")
    if len(ids) > max_new_tokens:
        raise BadInput(f"score_tokens has {len(ids)} tokens, more than max_new_tokens "
                       f"({max_new_tokens}); raise max_new_tokens to at least {len(ids)}")
    return ids


TOP_SCORES = 5
#: The powers g of the ``tilts`` in a sampled token's score (see the module docstring).
TILTS = (0.6, 1.5, 3.0)


LOGPROB_FLOOR = -10000.0  # how a log-probability of -inf is written (JSON has no inf)


def _r6(x: float) -> float:
    """A score for the receipt: rounded to 6 decimals; LOGPROB_FLOOR when not finite."""
    x = float(x)
    return round(x, 6) if math.isfinite(x) else LOGPROB_FLOOR


def _score(logp: torch.Tensor, token: int, dist, eos: torch.Tensor) -> dict[str, Any]:
    """One token's entry of meta["scores"] (see the module docstring). Costs a top-k and a
    few element reads beside the sort the sampler already did, one comparison count and,
    for a sampled token, the passes of its place in the distribution (below)."""
    top_lp, top_ids = torch.topk(logp, min(TOP_SCORES, logp.numel()))
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    eos_lp = float(torch.logsumexp(logp[eos], dim=0)) if eos.numel() else float("-inf")
    if dist is None:  # greedy: the sampled distribution is all on the token taken
        return {"top": [[i, _r6(lp), 1.0 if i == token else 0.0]
                        for lp, i in zip(top_lp, top_ids)],
                "eos_lp": _r6(eos_lp), "eos_p": 0.0, "mass_above": 0.0}
    probs, sorted_probs, head, order = dist
    total = float(head.sum())
    # top_p keeps a prefix of ``order``: its length, and its smallest probability
    kept = int(torch.count_nonzero(head)) if head is not sorted_probs else order.numel()
    floor = float(sorted_probs[kept - 1]) if kept else float("inf")

    def sampled_p(ids: list[int]) -> list[float]:
        out = []
        for i, p in zip(ids, probs[ids].tolist()):
            inside = p > floor or (p == floor and p > 0 and bool((order[:kept] == i).any()))
            out.append(p / total if inside and total > 0 else 0.0)
        return out

    top = [[i, _r6(lp), _r6(p)] for lp, i, p in zip(top_lp, top_ids, sampled_p(top_ids))]
    eos_p = sum(sampled_p(eos.tolist())) if eos.numel() else 0.0
    # tokens strictly likelier than the chosen one: a prefix of the descending order
    above = int(torch.count_nonzero(sorted_probs > probs[token]))
    mass_above = float(sorted_probs[:above].sum())
    # The chosen token's neighbours in the order sampled from: where another run of the
    # same seeded job parts from this one by a numeric hair, it took one of these.
    pos = int((order == token).nonzero()[0]) if order.numel() else 0
    near_ids = [int(order[i]) for i in (pos - 1, pos + 1) if 0 <= i < kept]
    near = [[i, _r6(float(logp[i])), _r6(p)] for i, p in zip(near_ids, sampled_p(near_ids))]
    # The chosen token's band in the descending order sampled from, and the nucleus: what
    # the verifier's test of the sampling needs (two binary searches of the order, a log
    # over the kept head and a logsumexp per tilt: about 3 ms a token on one CPU thread for
    # a 128k vocabulary, a third of the sort the sampler does anyway).
    ascending = -sorted_probs
    upto = int(torch.searchsorted(ascending, -probs[token:token + 1], right=True))
    mass_tied = float(sorted_probs[above:upto].sum())
    top_mass = float(sorted_probs[:int(torch.searchsorted(ascending, ascending[:1],
                                                          right=True))].sum())
    log_kept = torch.log(sorted_probs[:kept]) - math.log(total) if total > 0 else None
    tilts = [[g, _r6(torch.logsumexp(g * log_kept, dim=0)) if log_kept is not None
              else LOGPROB_FLOOR] for g in TILTS]
    return {"top": top, "eos_lp": _r6(eos_lp), "eos_p": _r6(eos_p),
            "mass_above": _r6(mass_above), "near": near,
            "lp_t": _r6(math.log(float(probs[token]))) if float(probs[token]) > 0
            else LOGPROB_FLOOR,
            "mass_tied": _r6(mass_tied), "top_mass": _r6(top_mass),
            "nucleus_mass": _r6(total), "tilts": tilts}


class _StreamingText:
    """Turns tokens into streamed text pieces whose concatenation is the final text.

    Text is held back while it ends in an incomplete UTF-8 character (byte-level tokens
    can split one) or in what may be the start of the stop string. Decoding restarts at
    the last point where everything was sent, so a long answer is not re-decoded from the
    start at every token.
    """

    def __init__(self, tokenizer, stop: str | None, ctx: RunContext):
        self.tokenizer, self.stop, self.ctx = tokenizer, stop, ctx
        self.ids: list[int] = []       # text tokens since the last clean restart point
        self.sent_chars = 0            # characters of decode(self.ids) already streamed
        self.unsent_ids: list[int] = []
        self.pieces: list[str] = []
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    quiet = False  # True while replaying the tokens of a checkpoint: nothing is streamed

    def _send(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            if not self.quiet:
                self.ctx.stream(piece, self.unsent_ids)
            self.unsent_ids = []

    def add(self, token: int) -> bool:
        """Take one generated token; True once the stop string has appeared."""
        self.ids.append(token)
        self.unsent_ids.append(token)
        text = self._decode()
        if self.stop:
            at = text.find(self.stop, self.sent_chars)
            if at >= 0:
                self._send(text[self.sent_chars:at])
                self.stopped = True
                return True
        end = len(text.rstrip("\ufffd"))
        if self.stop:
            for k in range(min(len(self.stop) - 1, end), 0, -1):
                if text[:end].endswith(self.stop[:k]):
                    end -= k
                    break
        end = max(end, self.sent_chars)
        self._send(text[self.sent_chars:end])
        if end == len(text):  # all sent and nothing pending: restart decoding here
            self.ids, self.sent_chars = [], 0
        else:
            self.sent_chars = end
        return False

    def finish(self) -> str:
        """Send whatever is held back (unless stopped) and return the whole text."""
        if not self.stopped:
            self._send(self._decode()[self.sent_chars:])
        return "".join(self.pieces)
