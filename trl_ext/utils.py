"""Small helpers every layer uses, in one place: the train/eval-mode guard, stripping wrapper modules, and the
check that the optional PEFT dependency is installed.

This module imports only torch, so any layer (ops, models, rollout, trainers, eval) may use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["eval_mode", "require_peft", "unwrap_model"]


def require_peft(feature: str) -> None:
    """Raise a clear `ImportError` naming ``feature`` when PEFT (an optional dependency) is not installed."""
    import importlib.util

    try:
        found = importlib.util.find_spec("peft") is not None
    except (ImportError, ValueError):  # a broken or stubbed-out module
        found = False
    if not found:
        raise ImportError(f"{feature} needs PEFT, an optional dependency: pip install 'trl_ext[peft]'.")


@contextlib.contextmanager
def eval_mode(*models: nn.Module | None) -> Iterator[nn.Module | None]:
    """Put every given model in eval mode (no dropout) for the block and restore each one's own mode afterwards,
    also when the block raises. ``None`` entries are skipped; yields the first model."""
    modes = [(m, m.training) for m in models if m is not None]
    for model, _ in modes:
        model.eval()
    try:
        yield models[0] if models else None
    finally:
        for model, was_training in modes:
            model.train(was_training)


def _is_peft_wrapper(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def unwrap_model(model: nn.Module, *, peft: bool = True) -> nn.Module:
    """``model`` without its wrappers: DDP / DeepSpeed engines (``.module``), ``torch.compile`` (``._orig_mod``)
    and, with ``peft=True``, PEFT's `PeftModel` (its base model, with the LoRA layers still inside)."""
    for _ in range(16):  # wrappers nest a few levels at most; the bound guards against a module that wraps itself
        if isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif peft and _is_peft_wrapper(model):
            model = model.get_base_model()
        else:
            break
    return model
