"""The name of the KV cache, across transformers releases.

transformers 5.24 renamed the key/value cache that models take and return: the forward's keyword and the output
field are ``cache``, where up to 5.23 they were ``past_key_values``. 5.24 still accepts the old keyword (renamed
inside a decorator, with a ``FutureWarning``: it goes in 5.40 for ``forward``, 6.0 for ``generate``), but

- ``generate`` now passes the cache to a model's ``forward`` as ``cache=`` and reads it back from ``outputs["cache"]``,
  so a custom model (`ModulatedCausalLM`, the value-head wrapper) must take it under that name;
- code that checks a forward's signature for ``past_key_values`` finds nothing on a 5.24 model and would quietly
  turn features off (shared-prefix rollouts did).

Every place in trl_ext that passes, reads or looks for a cache goes through this module, so the same code runs on
both sides of the rename without warnings. Our own forwards take the cache under either name.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["CACHE_KWARG", "cache_kwargs", "output_cache", "pop_cache", "takes_cache"]

#: The keyword (and output field) of the KV cache in the installed transformers: ``"cache"`` from 5.24 on,
#: ``"past_key_values"`` before.
CACHE_KWARG: str = (
    "cache" if any(f.name == "cache" for f in dataclasses.fields(CausalLMOutputWithPast)) else "past_key_values"
)
_NAMES = ("cache", "past_key_values")


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{CACHE_KWARG: cache}``: the keyword argument that hands ``cache`` to a model (forward or ``generate``), or
    that builds a model output carrying it."""
    return {CACHE_KWARG: cache}


def output_cache(output: Any) -> Any:
    """The KV cache a model output carries (``None`` when it has none), under whichever name it was stored."""
    if output is None:
        return None
    if isinstance(output, dict):  # a `ModelOutput` is a mapping of its non-None fields
        for name in (CACHE_KWARG, *_NAMES):
            if output.get(name) is not None:
                return output[name]
        return None
    for name in (CACHE_KWARG, *_NAMES):
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def pop_cache(kwargs: dict[str, Any], given: Any = None) -> Any:
    """The cache passed to one of our own forwards: ``given`` (its ``past_key_values`` / ``cache`` parameter) or
    either name left in ``kwargs`` (removed from it). Passing two different caches is a ``ValueError``."""
    found = [kwargs.pop(name) for name in _NAMES if name in kwargs]
    found = [value for value in (given, *found) if value is not None]
    if len({id(value) for value in found}) > 1:
        raise ValueError("Pass the KV cache once: as `cache` or as `past_key_values`, not both.")
    return found[0] if found else None


def takes_cache(module_or_fn: Any) -> bool:
    """Whether a module's ``forward`` (or a function) names a KV-cache parameter, under either name (a bare
    ``**kwargs`` does not count)."""
    fn = getattr(module_or_fn, "forward", module_or_fn)
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in _NAMES)
