"""Importance-sampling correction for samples drawn by a different engine (vLLM) than the trained model.

Responses sampled by vLLM come from ``π_vLLM``, whose numerics (kernels, dtype, fused ops) differ slightly from the
trained model's ``π_train``. Truncated importance sampling (TIS, as in TRL 1.16's GRPO) weighs each sample's loss by
the ratio ``ρ = π_train / π_vLLM`` of the sampled tokens, bounded to ``[C_min, C_max]``:

- token level: ``ρ_t = exp(log π_train(y_t) − log π_vLLM(y_t))`` per response token;
- sequence level: ``ρ = exp(Σ_t (log π_train(y_t) − log π_vLLM(y_t)))`` over the response, the same for its tokens;
- ``*_truncate`` clips ``ρ`` to ``[C_min, C_max]``; ``*_mask`` sets ``ρ`` outside it to 0 (the sample or token is
  left out).

The weights are constants (no gradient). A weight ``w ≥ 0`` on a token's loss equals the same weight on its
advantage for the clipped PPO objective (``min(r·A·w, clip(r)·A·w) = w·min(r·A, clip(r)·A)``) and for REINFORCE.
"""

from __future__ import annotations

import torch

__all__ = ["IS_MODES", "vllm_importance_weights"]

#: TRL 1.16's ``vllm_importance_sampling_mode`` values.
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def vllm_importance_weights(
    train_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """``(B, T)`` fp32 importance weights of sampled tokens, 0 where ``mask`` is 0.

    Args:
        train_logprobs: ``(B, T)`` log-probs of the sampled tokens under the trained model.
        engine_logprobs: ``(B, T)`` log-probs of the same tokens under the engine that sampled them.
        mask: ``(B, T)`` 1 on response tokens.
        mode: one of :data:`IS_MODES`.
        clip_max: ``C_max`` (``None``: no upper bound).
        clip_min: ``C_min`` (``None``: 0).
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; choose one of {', '.join(IS_MODES)}.")
    if train_logprobs.shape != engine_logprobs.shape or train_logprobs.shape != mask.shape:
        raise ValueError(
            f"train_logprobs {tuple(train_logprobs.shape)}, engine_logprobs {tuple(engine_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same (B, T) shape."
        )
    keep = mask != 0
    diff = train_logprobs.float() - engine_logprobs.float()
    diff = torch.where(keep, diff, torch.zeros_like(diff))
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True).expand_as(diff)
    ratio = diff.exp()
    low = 0.0 if clip_min is None else float(clip_min)
    high = float("inf") if clip_max is None else float(clip_max)
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=low, max=high)
    else:
        ratio = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    return torch.where(keep, ratio, torch.zeros_like(ratio))
