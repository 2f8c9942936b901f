"""A causal LM stepped one token at a time over a batch of rows, with its key/value cache, for particle methods.

:class:`CachedLM` runs the prompt once (:meth:`CachedLM.start`), then one new token per row per call
(:meth:`CachedLM.advance`), and can reorder its rows — cache included — when particles are resampled
(:meth:`CachedLM.reorder`, which calls the cache's ``reorder_cache``: `transformers`' dynamic caches and
`~trl_ext.models.ModulatedCache` both have it). Prompts may be left-padded: positions come from the attention mask,
as in ``generate``. Only the logits of the last position are computed (``logits_to_keep=1`` where supported).

Every call runs in eval mode without gradient. :attr:`CachedLM.row_forwards` counts the work: one unit per row per
call (the prompt pass counts one per row like any later step), the cost measure of the SMC estimators.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..models.kv_cache import cache_kwargs, output_cache
from ..ops.sequences import position_ids_from_attention_mask
from ..utils import eval_mode

__all__ = ["CachedLM", "model_device"]


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a parameter-free module)."""
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def _takes_logits_to_keep(model: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class CachedLM:
    """Token-by-token forward passes of one causal LM over ``B`` rows with a KV cache.

    Args:
        model: a causal LM (``model(input_ids=..., attention_mask=..., position_ids=..., cache=...,
            use_cache=True)`` returns ``logits`` and the cache; ``past_key_values`` before transformers 5.24),
            e.g. a `transformers` LM or a `~trl_ext.models.ModulatedCausalLM`.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.device = model_device(model)
        self._keep = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
        self.cache = None
        self.mask: torch.Tensor | None = None
        self.row_forwards = 0

    def _call(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        with torch.no_grad(), eval_mode(self.model):
            out = self.model(
                input_ids=input_ids,
                attention_mask=self.mask,
                position_ids=position_ids,
                **cache_kwargs(self.cache),
                use_cache=True,
                **self._keep,
            )
        cache = output_cache(out)
        if cache is None:
            raise ValueError(
                f"{type(self.model).__name__} returned no KV cache (past_key_values / cache) with use_cache=True; SMC "
                "needs a model with a key/value cache."
            )
        self.cache = cache
        self.row_forwards += int(input_ids.shape[0])
        return out

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Run the (left-padded) prompts ``(B, P)``; returns the model output (``logits`` ``(B, 1, V)`` or more)."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must be (B, P) of one shape, got {tuple(input_ids.shape)} and "
                f"{tuple(attention_mask.shape)}."
            )
        if not bool((attention_mask[:, -1] != 0).all()):
            raise ValueError("Prompts must be left-padded: the last column of attention_mask must be all ones.")
        self.cache = None
        self.mask = attention_mask.to(self.device).long()
        return self._call(input_ids.to(self.device), position_ids_from_attention_mask(self.mask))

    def advance(self, tokens: torch.Tensor):
        """Feed one token per row (``(B,)``); returns the output at that new position."""
        if self.mask is None:
            raise RuntimeError("Call start() before advance().")
        if tokens.shape != (self.mask.shape[0],):
            raise ValueError(f"tokens must be ({self.mask.shape[0]},), got {tuple(tokens.shape)}.")
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        position = self.mask.sum(dim=1, keepdim=True) - 1
        return self._call(tokens.to(self.device)[:, None], position)

    def reorder(self, index: torch.Tensor) -> None:
        """Make row ``i`` a copy of row ``index[i]`` (cache and mask), e.g. after resampling."""
        if self.cache is None or self.mask is None:
            raise RuntimeError("Nothing to reorder before start().")
        index = index.to(self.device)
        self.cache.reorder_cache(index)
        self.mask = self.mask.index_select(0, index)
