"""Shared-prefix rollouts: run each distinct prompt through a model once and fan its key/value cache out to every row
that holds it (the ``num_samples_per_prompt`` samples of a prompt), in sampling and in the no-grad scoring passes.

A rollout repeats every prompt ``N`` times. Without sharing, ``generate`` prefills ``N`` identical copies of it and
the reference, critic and reward passes each run ``N`` identical copies of it again; with sharing, each distinct
prompt is run once and its cache is copied to its rows (``Cache.batch_select_indices``), so a batch of ``B`` rows of
``P`` prompt and ``T`` response tokens costs ``B/N·P + B·T`` token-forwards instead of ``B·(P + T)``.

What is computed is unchanged: a row's tokens attend to the same keys and values at the same positions (taken from
the attention mask, as everywhere in :mod:`trl_ext.rollout`), so the outputs equal the unshared pass's up to
floating-point rounding (~1e-6 in fp32; both are then the same cached-attention computation ``generate`` does).

- :func:`prefill_prompts`: the cache of all prompt tokens but the last, for ``generate(..., cache=...)``
  (``past_key_values=`` before transformers 5.24),
  which then runs only each row's last prompt token before sampling; the sampler sees the same logits and draws in
  the same order, so a seeded run samples the same tokens as without sharing.
- :func:`shared_prompt_logprobs` (reference log-probs), :func:`shared_prompt_values` (a separate critic's values) and
  :func:`shared_prompt_scores` (a reward model's scores): the prompt with the cache kept, then the responses on it.
- :func:`hidden_with_shared_prompt`: the same two passes *with* gradients, for the training forward
  (``PPOConfig.shared_prefix_training``): the gradient of every row's loss flows back through the copied cache into
  the one prompt pass, so the summed gradient equals the unshared one's up to rounding.

Every function returns ``None`` when it cannot share (no repeated prompt in the rows, a one-token prompt, a model
whose forward returns no cache, a prompt-learning PEFT model, an encoder reward model, an FSDP2-sharded model); the
caller then runs the rows as they are. An FSDP2-sharded model (a frozen model with ``frozen_models_placement=
"sharded"``) all-gathers its weights in every forward, so every process must make the same forward calls; whether
rows share a prompt depends on each process's own rows, so such a model always runs its rows whole.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache

from .._deprecation import moved_names
from ..models.fsdp import is_fsdp_sharded
from ..models.kv_cache import cache_kwargs, output_cache, takes_cache
from ..models.lora import is_peft_model
from ..models.reward import _decoder_parts, apply_reward_normalization
from ..ops.logprobs import DEFAULT_CHUNK_SIZE, logprobs_from_logits
from ..ops.sequences import distinct_prompts as _distinct_prompts
from ..ops.sequences import last_token_index, position_ids_from_attention_mask
from .probing import prefill_module, supports_logits_to_keep

__all__ = [
    "can_share_prompt",
    "hidden_with_shared_prompt",
    "prefill_prompts",
    "shared_prompt_logprobs",
    "shared_prompt_scores",
    "shared_prompt_values",
]


def _cached_forward(module: nn.Module, ids, mask, position_ids, cache=None, **kwargs):
    """``module`` on ``ids`` with the cache kept; ``(output, cache)``, the cache ``None`` when none came back."""
    out = module(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, **cache_kwargs(cache), use_cache=True, **kwargs
    )
    cache = output_cache(out)
    return out, cache if isinstance(cache, Cache) else None


@torch.no_grad()
def prefill_prompts(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Cache | None:
    """The key/value cache of the first ``P − 1`` tokens of the left-padded ``(B, P)`` prompts, each distinct prompt
    run once and its cache copied to its rows, for ``model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
    past_key_values=cache)``; ``None`` when there is nothing to share (see the module docstring).

    The last prompt token is left to ``generate`` (it needs one uncached token to start from); it is always real in
    a left-padded row. ``model`` is what ``generate`` is called on, in eval mode."""
    if prompt_ids.shape[1] < 2 or is_fsdp_sharded(model):
        return None
    distinct = _distinct_prompts(prompt_ids, prompt_mask)
    module = prefill_module(model)
    if distinct is None or module is None:
        return None
    ids, mask, inverse = distinct
    ids, mask = ids[:, :-1], mask[:, :-1]
    keep = {"logits_to_keep": 1} if supports_logits_to_keep(module) else {}
    _, cache = _cached_forward(module, ids, mask, position_ids_from_attention_mask(mask), **keep)
    if cache is None:
        return None
    cache.batch_select_indices(inverse)
    return cache


def _prompt_then_responses(module: nn.Module, prompt_ids, prompt_mask, response_ids, response_mask, **prompt_kwargs):
    """``module`` on each distinct prompt (cache kept, copied to its rows), then on the ``(B, T)`` responses.

    Returns ``(prompt_out, response_out, inverse)`` — ``prompt_out`` has one row per distinct prompt, ``inverse``
    maps rows to them — or ``None`` when nothing is shared."""
    distinct = _distinct_prompts(prompt_ids, prompt_mask)
    if distinct is None:
        return None
    ids, mask, inverse = distinct
    prompt_out, cache = _cached_forward(module, ids, mask, position_ids_from_attention_mask(mask), **prompt_kwargs)
    if cache is None:
        return None
    cache.batch_select_indices(inverse)
    full_mask = torch.cat([prompt_mask, response_mask], dim=1)
    positions = position_ids_from_attention_mask(full_mask)[:, prompt_ids.shape[1] :]
    response_out, _ = _cached_forward(module, response_ids, full_mask, positions, cache)
    return prompt_out, response_out, inverse


def hidden_with_shared_prompt(
    backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> torch.Tensor | None:
    """``(B, T + 1, H)`` last hidden states of ``backbone`` on ``prompt + response`` rows (left-padded prompts in the
    first ``prompt_length`` columns) at the last prompt position and the ``T`` response positions — the last
    ``T + 1`` positions of one pass over the rows — with each distinct prompt run once; ``None`` when no prompt
    repeats or the backbone returns no cache. Gradients flow, through the copied cache into the prompt pass."""
    P = prompt_length
    shared = _prompt_then_responses(
        backbone, input_ids[:, :P], attention_mask[:, :P], input_ids[:, P:], attention_mask[:, P:]
    )
    if shared is None:
        return None
    prompt_out, response_out, inverse = shared
    return torch.cat([prompt_out.last_hidden_state[:, -1:][inverse], response_out.last_hidden_state], dim=1)


def can_share_prompt(backbone: nn.Module) -> bool:
    """Whether :func:`hidden_with_shared_prompt` can run ``backbone`` (its forward takes a cache; PEFT models pass
    it on) and the cache is kept (no activation checkpointing, which turns ``use_cache`` off while training)."""
    if getattr(backbone, "is_activation_checkpointing", False):
        return False
    return takes_cache(backbone) or is_peft_model(backbone)


@torch.no_grad()
def shared_prompt_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor | None:
    """``(B, T)`` fp32 ``log_softmax(logits / temperature)`` of a causal LM at the response tokens, zero where
    ``response_mask`` is zero — what :func:`~trl_ext.rollout.generator.forward_response` gives on ``prompt +
    response`` — with each distinct prompt run once; ``None`` when nothing is shared.

    Token ``t`` is predicted by the logits of the position before it: the last prompt position (from the prompt
    pass, ``logits_to_keep=1`` where the model takes it) for ``t = 0``, response position ``t − 1`` otherwise."""
    if is_fsdp_sharded(model):
        return None
    keep = {"logits_to_keep": 1} if supports_logits_to_keep(model) else {}
    shared = _prompt_then_responses(model, prompt_ids, prompt_mask, response_ids, response_mask, **keep)
    if shared is None:
        return None
    prompt_out, response_out, inverse = shared
    first = logprobs_from_logits(
        prompt_out.logits[:, -1:][inverse], response_ids[:, :1], temperature=temperature, chunk_size=chunk_size
    )
    # Response position t predicts token t + 1; the last position predicts nothing (ignored label, log-prob 0).
    labels = torch.cat([response_ids[:, 1:], torch.full_like(response_ids[:, :1], -100)], dim=1)
    rest = logprobs_from_logits(response_out.logits, labels, temperature=temperature, chunk_size=chunk_size)
    logprobs = torch.cat([first, rest[:, :-1]], dim=1)
    return torch.where(response_mask != 0, logprobs, torch.zeros_like(logprobs))


def _shared_hidden(model: nn.Module, prompt_ids, prompt_mask, response_ids, response_mask):
    """``(head, hidden)``: a decoder score model's head and its backbone's ``(B, T + 1, H)`` last hidden states at
    the last prompt position and the ``T`` response positions; ``None`` when nothing is shared."""
    parts = _decoder_parts(model)
    if parts is None or is_fsdp_sharded(model):
        return None
    backbone, head = parts
    if not takes_cache(backbone) and not is_peft_model(backbone):
        return None
    shared = _prompt_then_responses(backbone, prompt_ids, prompt_mask, response_ids, response_mask)
    if shared is None:
        return None
    prompt_out, response_out, inverse = shared
    hidden = torch.cat([prompt_out.last_hidden_state[:, -1:][inverse], response_out.last_hidden_state], dim=1)
    return head, hidden


@torch.no_grad()
def shared_prompt_values(
    critic: nn.Module, prompt_ids, prompt_mask, response_ids, response_mask
) -> torch.Tensor | None:
    """``(B, T)`` fp32 values ``V_t = head(h)`` of a separate critic at the state before each response token, zero
    where that state is padding — what ``PolicyAndValueModel.critic_values`` gives — with each distinct prompt run
    once; ``None`` when nothing is shared."""
    shared = _shared_hidden(critic, prompt_ids, prompt_mask, response_ids, response_mask)
    if shared is None:
        return None
    head, hidden = shared
    apply_reward_normalization(critic)
    values = head(hidden[:, :-1])
    if values.shape[-1] != 1:
        raise ValueError(f"A critic needs a single-output head; got {values.shape[-1]} outputs.")
    state = torch.cat([prompt_mask[:, -1:], response_mask[:, :-1]], dim=1) != 0
    values = values[..., 0].float()
    return torch.where(state, values, torch.zeros_like(values))


@torch.no_grad()
def shared_prompt_scores(
    reward_model: nn.Module, prompt_ids, prompt_mask, response_ids, response_mask
) -> torch.Tensor | None:
    """``(B,)`` fp32 scores of a decoder reward model read at each row's last real token — what
    :func:`~trl_ext.models.get_sequence_scores` gives on ``prompt + response`` — with each distinct prompt run once;
    ``None`` when nothing is shared."""
    shared = _shared_hidden(reward_model, prompt_ids, prompt_mask, response_ids, response_mask)
    if shared is None:
        return None
    head, hidden = shared
    apply_reward_normalization(reward_model)
    # The window starts at the last prompt position, which is always real (left padding), so the index is >= 0.
    index = last_token_index(torch.cat([prompt_mask[:, -1:], response_mask], dim=1)).to(hidden.device)
    scores = head(hidden[torch.arange(hidden.shape[0], device=hidden.device), index])
    if scores.shape[-1] != 1:
        raise ValueError(f"A reward model must have a single output; this one has {scores.shape[-1]} (num_labels).")
    return scores[..., 0].float()


# Moved: distinct_prompts to trl_ext.ops.sequences, _prefill_module to trl_ext.rollout.probing (as prefill_module).
__getattr__ = moved_names(__name__, {"distinct_prompts": "trl_ext.ops.sequences"})
