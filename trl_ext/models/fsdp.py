"""Running a part of an FSDP2-sharded model outside its ``forward`` (the implementation; `trl_ext.rollout.fsdp`
re-exports it and explains where the rollout needs it).

Under FSDP2 (``fully_shard``) each sharded unit all-gathers its weights in its forward pre-hook, and the root module's
own weights (embeddings, final norm, LM head, a score head...) are gathered in the *root's* forward pre-hook, which
also decides, on the first forward it sees, which module is the root. Code that calls a submodule directly — a
reward model's backbone and then its score head (:func:`~trl_ext.models.reward.get_sequence_scores`), a policy's
``generate`` — bypasses that hook: the root's weights are still shards (``aten.embedding got mixed torch.Tensor and
DTensor``) and the first block to run would wrongly become the root.

:func:`call_as_root_forward` runs a callable between the root's pre- and post-forward hooks, through PyTorch's public
`torch.distributed.fsdp.register_fsdp_forward_method`; the blocks below still gather their weights one block at a
time. :func:`is_fsdp_sharded` tells whether a module holds FSDP2-sharded weights at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["call_as_root_forward", "is_fsdp_root", "is_fsdp_sharded"]

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


def is_fsdp_root(model: nn.Module) -> bool:
    """Whether ``model`` itself is an FSDP2 module (``fully_shard`` was applied to it: the root of its sharding)."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(model, cls)


def _call(fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def call_as_root_forward(root: nn.Module, fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, run as if it were ``root.forward`` when ``root`` is an FSDP2 root module (its weights
    gathered for the call, the root initialised as the root); a plain call otherwise."""
    if not is_fsdp_root(root):
        return fn(*args, **kwargs)
    if _METHOD not in root.__dict__:
        from torch.distributed.fsdp import register_fsdp_forward_method

        object.__setattr__(root, _METHOD, _call)
        register_fsdp_forward_method(root, _METHOD)
    return getattr(root, _METHOD)(fn, *args, **kwargs)
