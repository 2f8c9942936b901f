"""Offloading frozen models: keep them on the CPU and move them to the accelerator only for their forward passes.

``ref_offload`` / ``reward_offload`` (the online trainers' reference and reward models) and ``teacher_offload`` (the
KD teacher) trade host-to-device copies for accelerator memory: between its forward passes a frozen model holds no
accelerator memory at all, so the policy's generation and backward pass get it. Per rollout the reference is moved
once (for all its scoring passes) and the reward model once; the KD teacher once per micro-step.

:func:`on_device` does the moving::

    with on_device(ref_model, accelerator.device, enabled=args.ref_offload):
        logprobs = forward(ref_model, ...)

It is a no-op when disabled, when the target is ``None``, when the module is already there (a CPU run, or a nested
call), so it can wrap every forward pass unconditionally. After the block the module goes back where it was and, on
CUDA, the freed blocks are returned to the driver (``torch.cuda.empty_cache()``). The results are those of a model
that stays on the accelerator (the same weights, the same kernels); only the time differs.

Not with DeepSpeed (ZeRO partitions the frozen models itself: use its ``offload_param``) or FSDP (use its CPU
offload), and not for bitsandbytes-quantized models, which cannot be moved; :func:`check_offloadable` says so.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from .quantization import is_quantized

__all__ = ["check_offloadable", "module_device", "on_device"]

# Modules inside an `on_device` block, and where they are: a nested block on the same device does nothing.
_PLACED: weakref.WeakKeyDictionary[nn.Module, torch.device] = weakref.WeakKeyDictionary()


def _normalized(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); the CPU for a module without tensors."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def check_offloadable(module: nn.Module, option: str) -> None:
    """Fail with a clear message when ``module`` cannot be moved between devices (bitsandbytes 4/8-bit weights)."""
    if is_quantized(module):
        raise ValueError(
            f"{option}=True: {type(module).__name__} is a bitsandbytes-quantized model, which cannot be moved between "
            f"the CPU and the GPU. Load it unquantized (it is frozen, so bf16 is the usual choice), or set "
            f"{option}=False."
        )


@contextlib.contextmanager
def on_device(module: nn.Module | None, device: torch.device | str | None, enabled: bool = True) -> Iterator:
    """Context in which ``module`` is on ``device``; afterwards it goes back where it was (see the module docs).

    Args:
        module: the frozen model (``None``: nothing to do).
        device: where its forward passes run (the accelerator's device; ``None``: nothing to do).
        enabled: ``False`` makes the block a no-op (the option is off).

    Yields the module.
    """
    if not enabled or module is None or device is None:
        yield module
        return
    device = _normalized(device)
    if _PLACED.get(module) == device:  # inside an outer block that already moved it
        yield module
        return
    home = module_device(module)
    if home == device:
        yield module
        return
    module.to(device)
    _PLACED[module] = device
    try:
        yield module
    finally:
        _PLACED.pop(module, None)
        module.to(home)
        if device.type == "cuda":
            torch.cuda.empty_cache()
