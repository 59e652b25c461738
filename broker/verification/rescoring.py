"""Teacher-forced re-scoring: the checker's side of a text check.

The checker runs the job's model once over prompt + claimed tokens (one forward pass, no
sampling) and summarises, for each claimed token, what its own distribution says about it
(``comparators.TokenScore``). Only these summaries leave the checker, not vocabulary-sized
rows. Works with any transformers causal LM (``model(input_ids).logits``); torch is
imported here only, so ``comparators`` stays free of it.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from broker.verification.comparators import Rescore, TokenScore
from broker.verification.sampled_text import TILTS, Position


def rescore_causal_lm(model: Any, prompt_ids: Sequence[int], token_ids: Sequence[int],
                      eos_ids: Iterable[int], *, temperature: float = 1.0,
                      top_p: float = 1.0, ignore_eos: bool = False, tokenizer: Any = None,
                      stop: str | None = None) -> Rescore:
    """Score ``token_ids`` as continuations of ``prompt_ids`` under ``model`` (at
    ``temperature`` and ``top_p``, the end-of-sequence ids banned when ``ignore_eos``, as
    the llama plugin samples). With a ``tokenizer`` and the job's ``stop`` string, also
    where the stop string first appears in the tokens' text."""
    import torch

    if not prompt_ids:
        raise ValueError("prompt_ids is empty; the llama plugin always starts with the "
                         "begin-of-text token, pass the same prompt ids the job used")
    eos = frozenset(int(i) for i in eos_ids)
    if not token_ids:
        return Rescore(tokens=(), eos_ids=eos, temperature=temperature, top_p=top_p)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float().cpu()
    # position p predicts token p + 1: the rows for the claimed tokens start one before them
    rows = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(token_ids)]
    logp = torch.log_softmax(rows, dim=-1)
    claimed = torch.tensor(list(token_ids))
    tok_lp = logp.gather(1, claimed[:, None])[:, 0]
    eos_list = sorted(eos)
    # the likeliest token the sampler could take (the end of sequence is banned under
    # ignore_eos)
    ranked = logp.clone()
    if ignore_eos and eos_list:
        ranked[:, eos_list] = float("-inf")
    top_lp, top_id = ranked.max(dim=-1)
    rank = (ranked > tok_lp[:, None]).sum(dim=-1)
    eos_lp = torch.logsumexp(logp[:, eos_list], dim=-1) if eos_list else torch.full_like(
        tok_lp, float("-inf"))
    positions: list[Position | None] = [None] * len(token_ids)
    if temperature > 0:
        banned = rows.clone()
        if ignore_eos and eos_list:
            banned[:, eos_list] = float("-inf")
        probs = torch.softmax(banned / temperature, dim=-1)
        tok_p = probs.gather(1, claimed[:, None])
        mass_above = (probs * (probs > tok_p)).sum(dim=-1)
        mass_tied = (probs * (probs == tok_p)).sum(dim=-1)
        top_mass = (probs * (probs == probs.max(dim=-1, keepdim=True).values)).sum(dim=-1)
        sampled, kept_mass = _nucleus(probs, top_p)
        eos_sampled = sampled[:, eos_list].sum(dim=-1) if eos_list else torch.zeros_like(tok_lp)
        tok_lp_t = torch.log_softmax(banned / temperature, dim=-1).gather(1, claimed[:, None])
        q = sampled.double()
        for i in range(len(token_ids)):
            kept = q[i][q[i] > 0]
            positions[i] = Position(
                lp=float(tok_lp_t[i, 0]), mass_above=float(mass_above[i]),
                mass_tied=float(mass_tied[i]), top_mass=float(top_mass[i]),
                nucleus_mass=float(kept_mass[i]),
                tilts=tuple((g, float(torch.log((kept ** g).sum()))) for g in TILTS))
    else:
        mass_above = torch.zeros_like(tok_lp)
        eos_sampled = torch.zeros_like(tok_lp)
    stop_at = None
    if stop and tokenizer is not None:
        stop_at = next((i for i in range(len(token_ids))
                        if int(token_ids[i]) in eos or stop in tokenizer.decode(
                            list(token_ids[:i + 1]), skip_special_tokens=True,
                            clean_up_tokenization_spaces=False)), None)
        if stop_at is not None and int(token_ids[stop_at]) in eos:
            stop_at = None  # the text ends at the end of sequence, without the stop string
    return Rescore(tokens=tuple(
        TokenScore(logprob=float(tok_lp[i]), rank=int(rank[i]), top_logprob=float(top_lp[i]),
                   mass_above=float(mass_above[i]), eos_logprob=float(eos_lp[i]),
                   eos_mass_sampled=float(eos_sampled[i]), eos_top=int(top_id[i]) in eos,
                   position=positions[i])
        for i in range(len(token_ids))), eos_ids=eos, temperature=temperature, top_p=top_p,
        stop_at=stop_at, stop_searched=None if stop is None or tokenizer is not None else 0)


def _nucleus(probs, top_p: float):
    """The top_p-truncated, renormalised distribution the llama plugin samples from, and
    the mass top_p kept of ``probs`` (per row)."""
    import torch

    if top_p >= 1.0:
        return probs, probs.sum(dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True, dim=-1)
    outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    mass = kept.sum(dim=-1, keepdim=True)
    return kept / mass, mass[:, 0]
