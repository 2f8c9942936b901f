"""Distributed set-up that `transformers.Trainer` and `accelerate` leave out: FSDP on CPU processes, and weights that
FSDP's memory-saving load leaves on the meta device.

`accelerate launch --config_file accelerate_configs/fsdp2.yaml` sets ``ACCELERATE_USE_FSDP=true``, but accelerate
(1.15) only turns that into FSDP for GPU-like process groups: with ``--use_cpu true`` (CPU processes on ``gloo``) the
state stays ``MULTI_CPU`` and the model is silently wrapped in plain DDP. PyTorch's FSDP2 (``fully_shard``) itself runs
on CPU tensors with ``gloo``, so :class:`CpuFsdpMixin` lets accelerate take its FSDP branch there too: the same
sharding, gathering and saving code as on GPUs runs in a 2-process CPU test
(``tests/trainers/common/test_distributed_matrix.py``).

Only FSDP version 2 is enabled this way (FSDP1's flat parameters need a CUDA device); with FSDP1 on CPU the run stays
DDP, as accelerate decides.

With ``fsdp_cpu_ram_efficient_loading: true`` (our `fsdp2.yaml`), transformers loads the checkpoint on the first
process only and leaves the weights the checkpoint does not have (a fresh classification or value head, resized
embedding rows) on the *meta* device in the other processes, to be broadcast from the first when the model is
sharded. Accelerate then maps the optimizer's parameters to the sharded ones by storage address, which is 0 for every
meta tensor: two fresh weights collide, one of them is left out of the optimizer and that process never updates its
shard of it (seen with a PRM's ``classifier.weight``; the checkpoint save then fails in
``get_optimizer_state_dict`` with ``KeyError``). :func:`materialize_meta_parameters` gives such weights real
(uninitialised) storage before the optimizer is built; their values still come from the first process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from .lifecycle import TrainLifecycle

__all__ = ["CpuFsdpMixin", "cpu_fsdp_requested", "fsdp_on_cpu", "materialize_meta_parameters"]


def cpu_fsdp_requested() -> bool:
    """Whether ``accelerate launch`` asked for FSDP2 (``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``) while this
    process group runs on CPU (accelerate's ``MULTI_CPU``)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() not in ("1", "true"):
        return False
    if os.environ.get("FSDP_VERSION", "1") != "2":
        return False
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    shared = PartialState._shared_state
    return bool(shared) and shared.get("distributed_type") == DistributedType.MULTI_CPU


@contextlib.contextmanager
def fsdp_on_cpu() -> Iterator[None]:
    """While an `accelerate.Accelerator` is built in the block, let a CPU process group take accelerate's FSDP branch
    (:func:`cpu_fsdp_requested`; a no-op otherwise). The device stays the CPU and the backend ``gloo``; if the
    accelerator does not end up on FSDP the state is put back to ``MULTI_CPU``."""
    if not cpu_fsdp_requested():
        yield
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    shared = PartialState._shared_state
    # AcceleratorState copies PartialState's type and routes MULTI_GPU-like types to FSDP when ACCELERATE_USE_FSDP is
    # set; the type ends as FSDP (written back into PartialState's shared state by accelerate itself).
    shared["distributed_type"] = DistributedType.MULTI_GPU
    try:
        yield
    finally:
        if shared.get("distributed_type") == DistributedType.MULTI_GPU:
            shared["distributed_type"] = DistributedType.MULTI_CPU


def materialize_meta_parameters(model: nn.Module, device: torch.device | str | None = None) -> list[str]:
    """Give every parameter of ``model`` that sits on the meta device real, uninitialised storage on ``device``
    (default: where the model's other parameters are, else the CPU), same shape, dtype and ``requires_grad``; return
    their names. See the module docs for why (FSDP's memory-saving load); the values are overwritten by the first
    process's when the model is sharded."""
    if device is None:
        device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    names = []
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                value = torch.empty_like(param, device=device)
                setattr(module, name, nn.Parameter(value, requires_grad=param.requires_grad))
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


class CpuFsdpMixin(TrainLifecycle):
    """Mixin for a `transformers.Trainer` subclass (before TRL's trainer in the bases): an FSDP2 launch on CPU
    processes really shards the model (:func:`fsdp_on_cpu`) instead of falling back on DDP, and under FSDP the
    weights a memory-saving load left on the meta device get storage before the optimizer is built
    (:func:`materialize_meta_parameters`)."""

    def create_accelerator_and_postprocess(self):
        with fsdp_on_cpu():
            return super().create_accelerator_and_postprocess()

    def _before_train(self, resume_from_checkpoint):
        if getattr(self, "is_fsdp_enabled", False):
            materialize_meta_parameters(self.model)
        return resume_from_checkpoint
