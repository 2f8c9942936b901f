"""The mixed-precision default of trl_ext's configs: TRL's bf16 default where a GPU can use it, off on a CPU.

TRL's `_BaseConfig` turns ``bf16`` on when it is left unset (``bf16=None`` → ``not fp16``), and `transformers`
then refuses to start on a machine without a GPU ("Your setup doesn't support bf16/gpu"). trl_ext's configs call
:func:`default_bf16_off_without_gpu` first, so that a config with default settings also works on a CPU-only machine.
"""

from __future__ import annotations

import logging

__all__ = ["default_bf16_off_without_gpu", "has_accelerator"]

logger = logging.getLogger(__name__)


def has_accelerator() -> bool:
    """Whether a CUDA (or XPU) device is available."""
    import torch

    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())


def default_bf16_off_without_gpu(config) -> None:
    """Set ``config.bf16 = False`` (with a logged note) when it was left unset, fp16 is off, and there is no GPU
    (or ``use_cpu=True``); otherwise leave it to TRL (bf16 on by default). Call before TRL's ``__post_init__``."""
    if config.bf16 is None and not config.fp16 and (config.use_cpu or not has_accelerator()):
        config.bf16 = False
        logger.info(
            "%s: no GPU found (or use_cpu=True): bf16 defaults to False (TRL's default, bf16=True, needs a GPU).",
            type(config).__name__,
        )
