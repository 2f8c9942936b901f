"""KV caching for modulated policies: one `Cache` object that carries the base model's and the modulation's caches.

A modulated policy ``q(·|s_<t) ∝ p(·|s_<t)·exp(m_t)`` (docs/algorithms.md §6) runs two networks on the same tokens: the
frozen base LM ``p`` and, for the ``"model"`` kind, a second transformer that produces the modulation ``m``. Each
needs its own key/value cache. :class:`ModulatedCache` bundles them so that the standard
``transformers.GenerationMixin`` loop (``model.generate(...)``) sees a single ``Cache`` and needs no special case:

- ``generate`` stores whatever ``outputs.past_key_values`` the forward returns and hands it back at the next step,
  so the forward of `ModulatedCausalLM` creates a :class:`ModulatedCache` at the prefill step and reuses it after;
- every query ``generate`` makes about the cache (``get_seq_length``, ``get_mask_sizes``, ``is_compileable``...)
  is answered by the base cache, every edit (``crop``, ``reorder_cache`` for beam search,
  ``batch_select_indices``...) is applied to both caches.

Why not a plain tuple of two caches: transformers 5 refuses tuples as ``past_key_values`` in ``generate``. Why not
let ``generate`` build the cache: it builds a ``DynamicCache`` from the *wrapper's* config, which knows nothing of
the base's layer types (sliding windows...), so `ModulatedCausalLM` declines the default cache
(``_supports_default_dynamic_cache() -> False``) and builds both caches from the right configs itself.
Only dynamic caches are supported (``cache_implementation="static"`` is ignored with a transformers warning).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache

__all__ = ["ModulatedCache", "resolve_modulated_cache"]


class ModulatedCache(Cache):
    """The key/value caches of a modulated policy: ``base`` (frozen LM) and ``modulation`` (``None`` for head kinds).

    Read-only queries are answered by ``base`` (both caches always hold the same tokens); edits are applied to both.
    """

    def __init__(self, base: Cache, modulation: Cache | None = None):
        # `Cache.__init__` is deliberately not called: this object owns no layers, its two sub-caches do (the same
        # pattern as `transformers.EncoderDecoderCache`). Every `Cache` method that would read `self.layers` is
        # overridden below.
        if not isinstance(base, Cache) or (modulation is not None and not isinstance(modulation, Cache)):
            raise TypeError(
                f"ModulatedCache expects Cache objects, got base={type(base).__name__}, "
                f"modulation={type(modulation).__name__}."
            )
        self.base = base
        self.modulation = modulation

    @classmethod
    def from_configs(cls, base_config, modulation_config=None) -> ModulatedCache:
        """Empty dynamic caches laid out for the base model's config (and the modulation backbone's, if any)."""
        return cls(
            DynamicCache(config=base_config),
            DynamicCache(config=modulation_config) if modulation_config is not None else None,
        )

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def caches(self) -> list[Cache]:
        """The sub-caches that exist: ``[base]`` or ``[base, modulation]``."""
        return [self.base] if self.modulation is None else [self.base, self.modulation]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base={self.base!r}, modulation={self.modulation!r})"

    def __len__(self) -> int:
        return len(self.base)

    @property
    def layers(self):
        """The base cache's layers (what generic code inspecting ``cache.layers`` should see)."""
        return self.base.layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise TypeError(
            "ModulatedCache holds two caches; attention layers must update `cache.base` or `cache.modulation`. "
            "Pass the ModulatedCache to ModulatedCausalLM.forward, not to a bare transformer."
        )

    # -------------------------------------------------------------------------------- queries (base answers)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.base.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.base.get_max_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.base.get_mask_sizes(query_length, layer_idx)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.base.get_query_offset(layer_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return self.base.is_recording_past(layer_idx)

    @property
    def batch_size(self) -> int:
        return self.base.batch_size

    @property
    def is_compileable(self) -> bool:
        # Dynamic caches are not compileable; saying False also keeps `generate` from building 4D static masks.
        return False

    @property
    def is_initialized(self) -> bool:
        return all(c.is_initialized for c in self.caches)

    @property
    def is_croppable(self) -> bool:
        return all(c.is_croppable for c in self.caches)

    @property
    def is_sliding(self) -> list[bool]:
        return self.base.is_sliding

    @property
    def is_linear(self) -> list[bool]:
        return self.base.is_linear

    @property
    def is_dummy(self) -> list[bool]:
        return self.base.is_dummy

    # -------------------------------------------------------------------------------------- edits (both caches)
    def reset(self) -> None:
        for c in self.caches:
            c.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for c in self.caches:
            c.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        for c in self.caches:
            c.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for c in self.caches:
            c.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for c in self.caches:
            c.batch_select_indices(indices)

    def activate_past_recording(self) -> None:
        for c in self.caches:
            c.activate_past_recording()


def resolve_modulated_cache(
    past_key_values, use_cache: bool, base_config, modulation_config=None
) -> ModulatedCache | None:
    """The cache a `ModulatedCausalLM` forward should use.

    - ``use_cache=False`` and no cache given → ``None`` (every step recomputes the whole prefix);
    - a :class:`ModulatedCache` → used as is (its ``modulation`` part must exist iff the model has a modulation
      backbone);
    - ``None`` with ``use_cache=True``, or any *empty* foreign ``Cache`` (e.g. a ``DynamicCache()`` a caller built
      for a plain LM) → a fresh :class:`ModulatedCache` built from the right configs;
    - anything else (a filled foreign cache, a legacy tuple) → ``ValueError``: its content cannot be split between
      the two networks.
    """
    if isinstance(past_key_values, ModulatedCache):
        if (past_key_values.modulation is None) != (modulation_config is None):
            kind = "a modulation backbone" if modulation_config is not None else "no modulation backbone"
            raise ValueError(f"This ModulatedCache does not match the model, which has {kind}.")
        return past_key_values
    if past_key_values is None:
        return ModulatedCache.from_configs(base_config, modulation_config) if use_cache else None
    if isinstance(past_key_values, Cache) and past_key_values.get_seq_length() == 0:
        return ModulatedCache.from_configs(base_config, modulation_config)
    raise ValueError(
        f"ModulatedCausalLM needs a ModulatedCache (or None) as past_key_values, got a filled "
        f"{type(past_key_values).__name__}; the tokens it holds cannot be attributed to the base model and the "
        "modulation. Start from past_key_values=None or ModulatedCache.from_configs(...)."
    )
