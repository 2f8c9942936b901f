"""Running a part of an FSDP2-sharded model outside its ``forward``: generation, critic values, a PEFT reference.

Under FSDP2 (``fully_shard``, `accelerate_configs/fsdp2.yaml`) the trained module is sharded in place: each
transformer block all-gathers its own weights in a forward pre-hook and frees them afterwards, and the root module's
weights (embeddings, final norm, LM head, a value head...) are all-gathered in the *root's* forward pre-hook, which
also decides, on the first forward it sees, which module is the root. A rollout calls ``policy.generate`` or the
critic directly, below the root: the root's weights would still be shards (``aten.embedding got mixed torch.Tensor
and DTensor``), and the first block to run would wrongly become the root.

:func:`call_as_root_forward` runs a callable between the root's pre- and post-forward hooks, through PyTorch's public
`torch.distributed.fsdp.register_fsdp_forward_method`; the blocks below still gather their weights one module at a
time. :func:`is_fsdp_sharded` tells generation to keep every process stepping until all are done (``synced_gpus``),
since each step's all-gathers need every process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["call_as_root_forward", "is_fsdp_sharded"]

_METHOD = "_trl_ext_call_as_forward"


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def is_fsdp_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is sharded with FSDP2 (``fully_shard``)."""
    cls = _fsdp_module_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def _call(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def call_as_root_forward(root: nn.Module, fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, run as if it were ``root.forward`` when ``root`` is an FSDP2 root module (its weights
    gathered for the call, the root initialised as the root); a plain call otherwise."""
    cls = _fsdp_module_class()
    if cls is None or not isinstance(root, cls):
        return fn(*args, **kwargs)
    if _METHOD not in root.__dict__:
        from torch.distributed.fsdp import register_fsdp_forward_method

        object.__setattr__(root, _METHOD, _call)
        register_fsdp_forward_method(root, _METHOD)
    return getattr(root, _METHOD)(fn, *args, **kwargs)
