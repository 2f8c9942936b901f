"""The trained policy's weights, one tensor at a time, under the names vLLM's loader expects (HF checkpoint names).

- plain models: ``named_parameters()`` as they are (tied weights come once, as vLLM wants);
- PEFT models: each LoRA layer's weight is sent as ``W + Σ_active ΔW`` (``get_delta_weight``), computed on the side —
  the model is never merged and unmerged, so its frozen base weights do not drift by rounding; names lose
  ``base_model.model.`` and ``.base_layer``, LoRA tensors are skipped, ``modules_to_save`` copies replace originals;
- DeepSpeed ZeRO-3: parameters are gathered **one module at a time** (`deepspeed.zero.GatheredParameters` on that
  module's own parameters), so no process ever holds the whole model; a PEFT model is gathered whole (merging
  LoRA into sharded weights is not possible), as TRL does.

Gathering is a collective: under ZeRO-3 every process must walk the iterator, also those that send nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ...models.lora import is_peft_model

__all__ = ["iter_vllm_weights", "is_zero3_partitioned"]


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are ZeRO-3 partitioned (they carry DeepSpeed's ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _gathered(params: list[nn.Parameter], enabled: bool):
    if not enabled or not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _vllm_name(name: str, peft_prefix: str | None) -> str | None:
    """The checkpoint name of a (PEFT) parameter, or ``None`` when vLLM has no such tensor."""
    if peft_prefix is None:
        return name.replace("_checkpoint_wrapped_module.", "")
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if peft_prefix in name or "original_module" in name:
        return None
    return name.replace("modules_to_save.default.", "").replace("_checkpoint_wrapped_module.", "")


def _merged(model: nn.Module, name: str, param: nn.Parameter) -> torch.Tensor:
    """``param`` plus the active LoRA deltas of its layer when it is a LoRA layer's base weight, else ``param``."""
    if not name.endswith(".base_layer.weight"):
        return param.data
    layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
    if not hasattr(layer, "get_delta_weight") or getattr(layer, "merged", False):
        return param.data
    weight = param.data
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {}):
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def iter_vllm_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every weight of the (unwrapped) causal LM ``model``, see the module docs.

    The tensors are the live (or gathered) parameter data: consume each before asking for the next one (vLLM's
    loader copies it), or clone it.
    """
    zero3 = is_zero3_partitioned(model)
    if is_peft_model(model):
        prefix = getattr(model, "prefix", "lora_")
        with _gathered(list(model.parameters()), zero3), torch.no_grad():
            for name, param in model.named_parameters():
                target = _vllm_name(name, prefix)
                if target is not None:
                    yield target, _merged(model, name, param)
        return
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        with _gathered([p for _, p in own], zero3):
            for name, param in own:
                seen.add(id(param))
                yield _vllm_name(f"{module_name}.{name}" if module_name else name, None), param.data
