r"""Exact probability that a short sampled response contains a "bad" token (ALGORITHMS.md §7, with B18 fixed).

For a prompt ``x``, a set ``B`` of bad token ids and a stop set ``E`` (EOS ids), a response is sampled ancestrally,
token by token, and ends at its first stop token or after ``L = max_new_tokens`` tokens. It is *bad* when one of its
tokens is in ``B`` (a stop token counts only if it is listed in ``B``). Its probability is a sum over the "good"
prefixes ``g`` — no bad token and no stop token — of length ``0 … L−1``:

    P(bad) = Σ_{k=0}^{L-1}  Σ_{g ∈ G^k}  p(g | x) · Σ_{b ∈ B} p(b | x, g),        G = V \ (B ∪ E).

Stop tokens end a response, so their mass is never expanded (the original code, B18, treated EOS as an ordinary
token). The sum is enumerated level by level: the prompt is run once with a KV cache, then every good prefix is
scored in batches of ``batch_size`` rows that share a copy of that cache repeated along the batch. With
``prune_below > 0`` prefixes less likely than it are not expanded; their mass bounds the error, so the result is
the certified interval ``[lower, upper] = [P_found, P_found + pruned_mass]``.

Terms are accumulated in log-space in float64, so ``log_probability`` stays accurate when P(bad) is tiny.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..utils import eval_mode

__all__ = ["BadOutputProbability", "bad_output_probability", "prompt_token_ids"]

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")


@dataclass
class BadOutputProbability:
    """Result of :func:`bad_output_probability`."""

    probability: float
    """P(bad): the exact value, or the certified lower bound when prefixes were pruned."""
    lower: float
    """Lower bound (the mass found); equals ``probability``."""
    upper: float
    """Upper bound ``min(1, lower + pruned_mass)``; equals ``lower`` when exact."""
    exact: bool
    """Whether no prefix was pruned (then ``lower == upper``)."""
    pruned_mass: float
    """Probability mass of the prefixes that were not expanded."""
    num_forward_passes: int
    """Model calls made (one for the prompt, then one per batch of prefixes)."""
    log_probability: float
    """``log(probability)`` computed in log-space (``-inf`` when the probability is 0)."""
    num_prefixes: int = 0
    """Good prefixes that were expanded (scored for their next token), the empty prefix included."""


# ------------------------------------------------------------------------------------------------ input checks
def _as_id_list(ids, name: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"{name} must hold integer token ids, got a {ids.dtype} tensor.")
        return [int(i) for i in ids.reshape(-1).tolist()]
    if isinstance(ids, (int, bool)):
        return [int(ids)]
    out = []
    for i in ids:
        if isinstance(i, torch.Tensor):
            i = i.item()
        if isinstance(i, bool) or not isinstance(i, int) and not hasattr(i, "__index__"):
            raise ValueError(f"{name} must hold integer token ids, got {i!r}.")
        out.append(int(i))
    return out


def _prompt_tensor(prompt_ids) -> torch.Tensor:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(
                f"prompt_ids must be one unpadded prompt (a 1-D tensor or a list of ints), got shape "
                f"{tuple(prompt_ids.shape)}; call once per prompt."
            )
    ids = _as_id_list(prompt_ids, "prompt_ids")
    if not ids:
        raise ValueError("prompt_ids is empty; pass at least one token (e.g. the tokenizer's bos id).")
    if min(ids) < 0:
        raise ValueError(f"prompt_ids holds a negative id ({min(ids)}); pass real, unpadded token ids.")
    return torch.tensor(ids, dtype=torch.long)


def _default_eos(model: nn.Module) -> list[int]:
    """The stop ids a model generates with: its generation config's ``eos_token_id``, else its config's."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None and source is not None and hasattr(source, "get_text_config"):
            eos = getattr(source.get_text_config(), "eos_token_id", None)
        if eos is not None:
            return _as_id_list(eos, "eos_token_id")
    return []


def _vocab_limit(model: nn.Module) -> int | None:
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return getattr(embeddings, "num_embeddings", None)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    for _ in range(4):
        declared = getattr(model, "supports_logits_to_keep", None)
        if isinstance(declared, bool):
            return declared
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            return False
        if "logits_to_keep" in params:
            return True
        # value-head and PEFT wrappers forward **kwargs to the model they wrap
        inner = getattr(model, "pretrained_model", None)
        if not isinstance(inner, nn.Module) and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if not isinstance(inner, nn.Module) or inner is model:
            return False
        model = inner
    return False


# ------------------------------------------------------------------------------------------------ the scorer
class _NextTokenScorer:
    """Next-token log-probs ``(n, V)`` (float64, tempered) after ``prompt + prefix`` for batches of prefixes."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, temperature: float, use_cache: bool):
        self.model, self.prompt, self.temperature = model, prompt, temperature
        self.keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
        self.num_calls = 0
        out = self._call(prompt[None], use_cache=use_cache)
        self.prompt_logprobs = self._logprobs(out.logits)[0]
        cache = getattr(out, "past_key_values", None) if use_cache else None
        self.cache = cache if cache is not None and hasattr(cache, "batch_repeat_interleave") else None
        if use_cache and self.cache is None:
            logger.info("bad_output_probability: the model returned no batchable cache; prompts are recomputed.")

    def _call(self, input_ids: torch.Tensor, past=None, position_ids=None, use_cache: bool = False):
        self.num_calls += 1
        length = input_ids.shape[1] + (self.prompt.numel() if past is not None else 0)
        mask = torch.ones(input_ids.shape[0], length, dtype=torch.long, device=input_ids.device)
        kwargs = dict(input_ids=input_ids, attention_mask=mask, use_cache=use_cache, **self.keep)
        if past is not None:
            kwargs.update(past_key_values=past, position_ids=position_ids)
        return self.model(**kwargs)

    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits[:, -1].double() / self.temperature, dim=-1)

    def __call__(self, prefixes: torch.Tensor) -> torch.Tensor:
        n, k = prefixes.shape
        if self.cache is None:
            full = torch.cat([self.prompt[None].expand(n, -1), prefixes], dim=1)
            return self._logprobs(self._call(full).logits)
        past = copy.deepcopy(self.cache)
        past.batch_repeat_interleave(n)
        start = self.prompt.numel()
        positions = torch.arange(start, start + k, device=prefixes.device)[None].expand(n, -1)
        return self._logprobs(self._call(prefixes, past=past, position_ids=positions, use_cache=True).logits)


def _logaddexp(running: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    if terms.numel() == 0:
        return running
    return torch.logaddexp(running, torch.logsumexp(terms.reshape(-1).double(), dim=0))


def bad_output_probability(
    model: nn.Module,
    prompt_ids: Sequence[int] | torch.Tensor,
    bad_token_ids: Iterable[int] | torch.Tensor,
    *,
    max_new_tokens: int = 2,
    eos_token_id: int | Sequence[int] | None = None,
    temperature: float = 1.0,
    prune_below: float = 0.0,
    batch_size: int = 256,
    use_cache: bool = True,
    max_prefixes: int | None = 10_000_000,
) -> BadOutputProbability:
    r"""P(a response of at most ``max_new_tokens`` tokens, sampled from ``model`` after ``prompt_ids``, contains a
    token of ``bad_token_ids``), by exact enumeration of the good prefixes (see the module docstring).

    Args:
        model: a causal LM whose output has ``logits`` ``(B, T, V)``: a `transformers` model,
            `trl_ext.models.ModulatedCausalLM` (its ``logits`` are already log-probs; ``log_softmax`` leaves them
            unchanged) or `trl_ext.models.AutoModelForCausalLMWithValueHead`. Run in eval mode under ``no_grad``;
            its previous mode is restored.
        prompt_ids: one unpadded prompt: a list of ints or a 1-D ``LongTensor`` (see :func:`prompt_token_ids`).
        bad_token_ids: the bad ids (a list, a tensor, or an object with a ``bad_token_ids`` attribute such as
            `trl_ext.rewards.LexicalReward`). An empty set gives probability 0 without running the model.
        max_new_tokens: the longest response ``L`` (≥ 1). The work grows like ``|G|^{L-1}`` without pruning.
        eos_token_id: stop id(s) that end a response. ``None`` takes the model's (generation) config
            ``eos_token_id``; pass ``[]`` for responses that never stop early. A stop id is bad only if listed.
        temperature: the sampling temperature ``T > 0``: next-token log-probs are ``log_softmax(logits / T)``.
        prune_below: do not expand prefixes whose probability is below this (``0``: exact result).
        batch_size: prefixes per forward pass.
        use_cache: run the prompt once and reuse its KV cache for every batch (``False``: recompute it per batch;
            also the automatic fallback when the model returns no batchable cache).
        max_prefixes: refuse (``ValueError``) to hold more good prefixes than this at one level; raise
            ``prune_below`` or lower ``max_new_tokens`` instead. ``None``: no limit.

    Returns:
        :class:`BadOutputProbability`.
    """
    if hasattr(bad_token_ids, "bad_token_ids") and not isinstance(bad_token_ids, torch.Tensor):
        bad_token_ids = bad_token_ids.bad_token_ids
    prompt = _prompt_tensor(prompt_ids)
    bad = sorted(set(_as_id_list(bad_token_ids, "bad_token_ids")))
    stops = sorted(set(_default_eos(model) if eos_token_id is None else _as_id_list(eos_token_id, "eos_token_id")))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}.")
    prune_below = float(prune_below)
    if not 0.0 <= prune_below < 1.0:
        raise ValueError(f"prune_below must be in [0, 1), got {prune_below} (0 gives the exact value).")
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    batch_size = int(batch_size)
    for name, ids in (("bad_token_ids", bad), ("eos_token_id", stops)):
        if ids and ids[0] < 0:
            raise ValueError(f"{name} holds a negative id ({ids[0]}); token ids are >= 0.")
    limit = _vocab_limit(model)
    if limit is not None and int(prompt.max()) >= limit:
        raise ValueError(f"prompt_ids holds id {int(prompt.max())}, outside the model's vocabulary of {limit} ids.")
    if not bad:
        logger.warning("bad_output_probability: bad_token_ids is empty, so P(bad) = 0.")
        return BadOutputProbability(0.0, 0.0, 0.0, True, 0.0, 0, _NEG_INF, 0)

    device = next(model.parameters()).device
    with eval_mode(model):
        with torch.no_grad():
            scorer = _NextTokenScorer(model, prompt.to(device), temperature, use_cache)
            vocab = scorer.prompt_logprobs.shape[-1]
            for name, ids in (("bad_token_ids", bad), ("eos_token_id", stops)):
                if ids and ids[-1] >= vocab:
                    raise ValueError(f"{name} holds id {ids[-1]}, outside the model's {vocab} output logits.")
            result = _enumerate(scorer, bad, stops, vocab, max_new_tokens, prune_below, batch_size, max_prefixes)
    return result


def _enumerate(scorer, bad, stops, vocab, max_new_tokens, prune_below, batch_size, max_prefixes):
    """The level-by-level enumeration (see the module docstring)."""
    device = scorer.prompt_logprobs.device
    bad_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    bad_mask[bad] = True
    good_mask = ~bad_mask
    if stops:
        good_mask[stops] = False
    good_ids = torch.nonzero(good_mask).reshape(-1)
    log_prune = math.log(prune_below) if prune_below > 0 else _NEG_INF

    zero = torch.tensor(_NEG_INF, dtype=torch.float64, device=device)
    found, pruned = zero.clone(), zero.clone()
    prefixes = torch.zeros(1, 0, dtype=torch.long, device=device)  # the empty prefix
    prefix_logp = torch.zeros(1, dtype=torch.float64, device=device)
    num_prefixes = 0
    for level in range(1, max_new_tokens + 1):
        last = level == max_new_tokens
        next_prefixes, next_logp = [], []
        for start in range(0, prefixes.shape[0], batch_size):
            rows, row_logp = prefixes[start : start + batch_size], prefix_logp[start : start + batch_size]
            step = scorer.prompt_logprobs[None] if level == 1 else scorer(rows)
            num_prefixes += rows.shape[0]
            found = _logaddexp(found, row_logp + torch.logsumexp(step[:, bad_mask].double(), dim=-1))
            if last:
                continue
            cand = row_logp[:, None] + step[:, good_ids].double()  # (n, |G|)
            keep = cand >= log_prune
            pruned = _logaddexp(pruned, cand[~keep])
            row_idx, col_idx = torch.nonzero(keep, as_tuple=True)
            next_prefixes.append(torch.cat([rows[row_idx], good_ids[col_idx][:, None]], dim=1))
            next_logp.append(cand[row_idx, col_idx])
            held = sum(p.shape[0] for p in next_prefixes)
            if max_prefixes is not None and held > max_prefixes:
                raise ValueError(
                    f"More than {max_prefixes} good prefixes of length {level} to expand; raise prune_below (e.g. "
                    "1e-6), lower max_new_tokens, or raise max_prefixes."
                )
        if last or not next_prefixes:
            break
        prefixes, prefix_logp = torch.cat(next_prefixes), torch.cat(next_logp)
        if prefixes.shape[0] == 0:
            break

    log_found, log_pruned = float(found), float(pruned)
    lower, pruned_mass = math.exp(log_found), math.exp(log_pruned)
    exact = log_pruned == _NEG_INF
    upper = lower if exact else min(1.0, lower + pruned_mass)
    return BadOutputProbability(
        probability=lower,
        lower=lower,
        upper=upper,
        exact=exact,
        pruned_mass=pruned_mass,
        num_forward_passes=scorer.num_calls,
        log_probability=log_found,
        num_prefixes=num_prefixes,
    )


def prompt_token_ids(tokenizer, prompt, *, chat_template: bool = False) -> list[int]:
    """The token ids of a text prompt, as the trainers feed it to the policy.

    ``chat_template=False``: ``tokenizer(prompt, add_special_tokens=False)``. ``chat_template=True``: the prompt as
    one user turn (or a given list of ``{"role", "content"}`` messages) rendered with the tokenizer's chat template
    and its generation prompt, then tokenised without extra special tokens (the template holds them).
    """
    if chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat_template=True but the tokenizer has no chat template; set one or pass False.")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif not isinstance(prompt, str):
        raise ValueError(
            f"prompt must be a string (or messages with chat_template=True), got {type(prompt).__name__}."
        )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("The prompt tokenises to no tokens; pass a non-empty prompt.")
    return list(ids)
