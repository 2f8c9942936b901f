"""What a model's forward can do, looked up through its wrappers: the leaf of the rollout layer (it imports no other
rollout module, so every other one may import it).

- :func:`supports_logits_to_keep`: whether the forward accepts ``logits_to_keep`` (scoring, prefill, reference);
- :func:`prefill_module`: the module whose forward ``generate`` runs, or ``None`` when its prompt cannot be prefilled
  outside ``generate`` (shared-prefix prefill, the compiled decode step).
"""

from __future__ import annotations

import inspect

from torch import nn

from ..models.lora import is_peft_model
from ..models.value_head import AutoModelForCausalLMWithValueHead

__all__ = ["prefill_module", "supports_logits_to_keep"]


def supports_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model``'s forward accepts ``logits_to_keep`` (looked up through DDP/DeepSpeed, PEFT and value-head
    wrappers; a wrapper may also declare it with a ``supports_logits_to_keep`` attribute)."""
    for _ in range(8):
        declared = getattr(model, "supports_logits_to_keep", None)
        if isinstance(declared, bool):
            return declared
        if isinstance(getattr(model, "module", None), nn.Module):  # DDP, DeepSpeed engine
            model = model.module
        elif is_peft_model(model):
            model = model.get_base_model()
        elif isinstance(model, AutoModelForCausalLMWithValueHead):
            model = model.pretrained_model
        else:
            break
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def prefill_module(model: nn.Module) -> nn.Module | None:
    """The module whose forward ``model.generate`` runs (value-head wrappers delegate to their LM), or ``None`` for a
    prompt-learning PEFT model (its virtual tokens are added by ``generate`` itself)."""
    while isinstance(model, AutoModelForCausalLMWithValueHead):
        model = model.pretrained_model
    if is_peft_model(model):
        config = getattr(model, "active_peft_config", None)
        if config is None or getattr(config, "is_prompt_learning", False):
            return None
    return model
