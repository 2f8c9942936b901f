"""A compiled per-token decode step for ``generate`` (``OnlineConfig.compile_generation``), sampling what the eager
decode samples.

`transformers` (5.x) compiles the decode forward of ``generate`` itself (``GenerationMixin.get_compiled_call``, the
prefill stays eager) when the key/value cache is *compileable* — a ``StaticCache``, preallocated to a fixed length
and updated in place; never the default ``DynamicCache``, whose tensors grow every step — and the device is a GPU or
``generation_config.compile_config._compile_all_devices`` is set (``_valid_auto_compile_criteria`` in
``transformers/generation/utils.py``). ``cache_implementation="static"`` cannot be combined with a cache passed in
(``generate`` raises "Passing both `cache_implementation` ... and `past_key_values` ... is unsupported"), which is how
shared-prefix rollouts hand over their prefilled prompts (:func:`~trl_ext.rollout.shared_prefix.prefill_prompts`).
So the rollout builds the ``StaticCache`` itself (:func:`static_decode_cache`): empty (``generate`` prefills it), or
holding the prefilled prompts, copied in through the cache's own ``update``; ``generate`` then continues from it
exactly as from the dynamic one.

The sampler (:class:`~trl_ext.rollout.sampling.SampleAndRecord`) is a logits processor outside the compiled
forward: it sees the same logits up to floating-point rounding (the static cache's unused slots are masked out), so
in fp32 it draws the same tokens for the same seed, barring a uniform that falls within rounding of a CDF boundary.
Under bf16 autocast the attention over the whole preallocated length rounds differently in bf16: the logits agree
to bf16 rounding, and draws near a CDF boundary can differ (the distribution is the same to that rounding).

A static cache is sized ``prompt + max_new_tokens`` and never shrinks between calls (the length is kept on the
model), so that calls with shorter prompts reuse the compiled graph instead of recompiling. Modulated policies build
their own (dynamic) caches and keep eager decoding; so does a prefilled cache that does not hold every prompt token
of every layer (sliding-window layers), whose prompts ``generate`` then prefills itself.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import CompileConfig
from transformers.cache_utils import Cache, StaticCache

from .probing import prefill_module

__all__ = ["DecodeStaticCache", "decode_compile_config", "static_decode_cache"]

logger = logging.getLogger(__name__)

_LENGTH_ATTR = "_trl_ext_static_cache_length"
_EAGER: set[type] = set()  # the model classes already logged as decoding eagerly


class DecodeStaticCache(StaticCache):
    """A `transformers.StaticCache` that also takes keys and values of different dtypes: under autocast a RoPE model's
    keys come out in fp32 (its fp32 rotary tables promote them) and its values in bf16, and a static layer allocates
    both buffers in the keys' dtype and copies into them with ``index_copy_``, which refuses a dtype mismatch. Both are
    stored in their common dtype (an exact upcast, at the cost of fp32 values); autocast's attention casts them back to
    bf16, as it did the dynamic cache's."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.dtype != value_states.dtype:
            dtype = torch.promote_types(key_states.dtype, value_states.dtype)
            key_states, value_states = key_states.to(dtype), value_states.to(dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def decode_compile_config(backend: str | None = None, mode: str | None = None) -> CompileConfig:
    """``generate``'s `transformers.CompileConfig` for the decode step, on any device (CPU included): ``backend`` and
    ``mode`` as given, else transformers' defaults (``"inductor"``, ``"reduce-overhead"``: CUDA graphs on GPU)."""
    kwargs = {"backend": backend} if backend else {}
    if mode:
        kwargs["mode"] = mode
    config = CompileConfig(**kwargs)
    config._compile_all_devices = True  # transformers compiles only on accelerators unless this is set
    return config


def static_decode_cache(
    model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, prefilled: Cache | None = None
) -> DecodeStaticCache | None:
    """A static cache (:class:`DecodeStaticCache`) for ``model.generate`` on the ``(B, P)`` prompts
    (``P + max_new_tokens`` positions, or the longest length this model has needed so far), holding the
    ``prefilled`` dynamic cache's tokens when given and complete; ``None`` when the model builds its own caches
    (modulated policies, prompt-learning PEFT), so that ``generate`` keeps its eager decode."""
    module = prefill_module(model)
    if module is None or not module._supports_default_dynamic_cache():
        if type(model) not in _EAGER:
            _EAGER.add(type(model))
            logger.info("%s builds its own key/value caches: its decoding is not compiled.", type(model).__name__)
        return None
    length = max(prompt_ids.shape[1] + int(max_new_tokens), getattr(module, _LENGTH_ATTR, 0))
    setattr(module, _LENGTH_ATTR, length)
    cache = DecodeStaticCache(config=module.config, max_cache_len=length)
    if prefilled is None:
        return cache
    held = prompt_ids.shape[1] - 1  # the prefill holds every prompt token but the last
    layers = list(getattr(prefilled, "layers", []))
    keys = [getattr(layer, "keys", None) for layer in layers]
    if len(layers) != len(cache.layers) or any(k is None or k.shape[-2] != held for k in keys):
        return cache  # e.g. a sliding-window layer kept only its window: let `generate` prefill the rows itself
    for index, layer in enumerate(layers):
        cache.update(layer.keys, layer.values, index)
    return cache
