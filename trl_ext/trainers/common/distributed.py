"""Distributed set-up that `transformers.Trainer` and `accelerate` leave out: FSDP on CPU processes.

`accelerate launch --config_file accelerate_configs/fsdp2.yaml` sets ``ACCELERATE_USE_FSDP=true``, but accelerate
(1.15) only turns that into FSDP for GPU-like process groups: with ``--use_cpu true`` (CPU processes on ``gloo``) the
state stays ``MULTI_CPU`` and the model is silently wrapped in plain DDP. PyTorch's FSDP2 (``fully_shard``) itself
runs on CPU tensors with ``gloo``, so :class:`CpuFsdpMixin` lets accelerate take its FSDP branch there too: the same
sharding, gathering and saving code as on GPUs runs in a 2-process CPU test (``tests/test_distributed_matrix.py``).

Only FSDP version 2 is enabled this way (FSDP1's flat parameters need a CUDA device); with FSDP1 on CPU the run stays
DDP, as accelerate decides.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["CpuFsdpMixin", "cpu_fsdp_requested", "fsdp_on_cpu"]


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


class CpuFsdpMixin:
    """Mixin for a `transformers.Trainer` subclass (before TRL's trainer in the bases): an FSDP2 launch on CPU
    processes really shards the model (:func:`fsdp_on_cpu`) instead of falling back on DDP."""

    def create_accelerator_and_postprocess(self):
        with fsdp_on_cpu():
            return super().create_accelerator_and_postprocess()
