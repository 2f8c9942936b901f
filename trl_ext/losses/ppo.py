"""PPO losses: the clipped surrogate policy loss (with optional dual clip) and the clipped value loss.

Both are per-token losses on ``(..., T)`` tensors with a mask of the same shape (1 = action token). They are reduced
to a scalar with :func:`trl_ext.losses.base.aggregate`; see there for the ``aggregation`` modes and ``normalizer``.
Masked-out positions are replaced by neutral values (log-ratio 0, advantage 0, value = return) before any arithmetic,
so garbage there (``inf``/``nan``) reaches neither the loss, the metrics nor the gradients.
"""

from __future__ import annotations

import torch

from ..ops.stats import masked_mean
from .base import LossOutput, aggregate, check_same_shape
from .registry import register_loss

__all__ = ["MAX_LOG_RATIO", "ppo_policy_loss", "clipped_value_loss"]

#: Log-ratios ``log π − log π_old`` are clamped to ``[−MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``ρ = exp(·)`` (verl's
#: convention): ``ρ ≤ e^20 ≈ 4.9e8`` stays finite in fp32/bf16, where ``exp(100) = inf`` made ``0·inf`` a NaN loss and
#: gradient for a token with a zero advantage.
MAX_LOG_RATIO = 20.0


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask != 0


def _keep(x: torch.Tensor, valid: torch.Tensor, fill: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``x`` where ``valid``, ``fill`` elsewhere (out of place; the masked entries of ``x`` are never used)."""
    if not torch.is_tensor(fill):
        fill = torch.tensor(fill, dtype=x.dtype, device=x.device)
    return torch.where(valid, x, fill)


@register_loss("ppo", kind="policy", aliases=("clipped_surrogate",))
def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate policy loss (Schulman et al. 2017), with the optional dual clip of Ye et al. 2020.

    Per token, with ``ρ = exp(log π − log π_old)``, advantage ``A`` and ``ε = cliprange``::

        ℓ = max(−ρ·A, −clip(ρ, 1 − ε, 1 + ε)·A)

    With ``dual_clip = c > 1`` ("Mastering Complex Control in MOBA Games with Deep RL", Ye et al. 2020), the loss of
    tokens with ``A < 0`` is also capped, so that a huge ratio on a bad action cannot blow the update up::

        ℓ = min(ℓ, −c·A)    if A < 0

    When the clipped (or capped) term is the active one, ``ℓ`` does not depend on ``log π`` and the token gets no
    gradient. On a tie (e.g. ``ρ = 1``) the unclipped term is taken, so the gradient is the plain policy gradient.

    ``ρ`` is computed in at least fp32 from the log-ratio clamped to ``±MAX_LOG_RATIO`` (20, as verl does): a token
    whose policy moved that far (``ρ > 4.9e8``, far outside any clip range) adds a finite term and no gradient,
    instead of ``inf`` or ``0·inf = nan``. Within that range the loss is exact. Half-precision inputs give an fp32
    loss.

    Args:
        logprobs: ``(..., T)`` log-probs of the taken actions under the current policy (with gradient).
        old_logprobs: ``(..., T)`` log-probs under the behaviour policy that sampled them (treated as constants).
        advantages: ``(..., T)`` advantage estimates (treated as constants).
        mask: ``(..., T)``, 1 for action tokens, 0 for padding.
        cliprange: ``ε > 0``.
        dual_clip: ``c > 1`` or ``None`` (no dual clip).
        aggregation: ``"seq-mean-token-mean"`` (default), ``"seq-mean-token-sum"`` or ``"token-mean"``.
        normalizer: global number of sequences / tokens for gradient accumulation (see :func:`aggregate`).

    Returns:
        :class:`LossOutput` with metrics ``clipfrac`` (fraction of valid tokens where the clipped term is strictly
        larger, i.e. active), ``approxkl`` (``0.5·mean (log π − log π_old)²``, TRL's convention), ``ratio`` (mean
        ``ρ``) and, with a dual clip, ``dual_clipfrac`` (fraction of valid tokens where the cap ``−c·A`` is active).
        Metric means are global token means over valid tokens.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if not cliprange > 0:
        raise ValueError(f"`cliprange` must be > 0, got {cliprange}.")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"`dual_clip` must be > 1 (or None to disable it), got {dual_clip}.")

    valid = _valid(mask)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # fp16 overflows exp() beyond 11; compute in fp32
    logprobs, old_logprobs, advantages = (t.to(dtype) for t in (logprobs, old_logprobs, advantages))
    log_ratio = _keep(logprobs - _keep(old_logprobs, valid), valid)
    adv = _keep(advantages, valid)
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    clip_active = clipped > unclipped
    per_token = torch.where(clip_active, clipped, unclipped)

    metrics: dict[str, torch.Tensor] = {}
    if dual_clip is not None:
        cap = -dual_clip * adv
        cap_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(cap_active, cap, per_token)
        metrics["dual_clipfrac"] = masked_mean(cap_active.float(), mask)

    loss = aggregate(per_token, mask, aggregation, normalizer)
    with torch.no_grad():
        metrics["clipfrac"] = masked_mean(clip_active.float(), mask)
        metrics["approxkl"] = 0.5 * masked_mean(log_ratio.square(), mask)
        metrics["ratio"] = masked_mean(ratio, mask)
    return LossOutput(loss, metrics)


@register_loss("clipped_value", kind="value", aliases=("value",))
def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float | None = 0.2,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """Clipped value (critic) loss of PPO, as in OpenAI baselines / TRL / OpenRLHF.

    Per token, with value ``V``, old value ``V_old``, return ``G`` and ``ε = cliprange_value``::

        V_clip = V_old + clip(V − V_old, −ε, ε)
        ℓ      = 0.5 · max((V − G)², (V_clip − G)²)

    With ``cliprange_value=None`` the loss is the plain squared error ``ℓ = 0.5·(V − G)²`` (``old_values`` is then
    only checked for its shape and may be ``None``).

    Args:
        values: ``(..., T)`` current value predictions (with gradient).
        old_values: ``(..., T)`` value predictions at rollout time (treated as constants), or ``None`` without clip.
        returns: ``(..., T)`` value targets ``G`` (treated as constants).
        mask: ``(..., T)``, 1 for action tokens, 0 for padding.
        cliprange_value: ``ε > 0`` or ``None`` (no clipping).
        aggregation: ``"seq-mean-token-mean"`` (default), ``"seq-mean-token-sum"`` or ``"token-mean"``.
        normalizer: global number of sequences / tokens for gradient accumulation (see :func:`aggregate`).

    Returns:
        :class:`LossOutput` with metrics ``clipfrac`` (fraction of valid tokens where the clipped error is strictly
        larger, i.e. active; 0 without clipping), ``value_mean`` (mean ``V``) and ``error`` (mean ``(V − G)²``).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if cliprange_value is not None and not cliprange_value > 0:
        raise ValueError(f"`cliprange_value` must be > 0 (or None to disable clipping), got {cliprange_value}.")
    if cliprange_value is not None and old_values is None:
        raise ValueError("`old_values` is required when `cliprange_value` is set; pass cliprange_value=None.")

    valid = _valid(mask)
    v = _keep(values, valid)
    g = _keep(returns, valid)
    err = (v - g).square()
    if cliprange_value is None:
        clip_active = torch.zeros_like(valid)
        per_token = 0.5 * err
    else:
        v_old = _keep(old_values, valid)
        # V itself where it moved by at most ε: V_old + (V − V_old) can differ from V by a rounding error, which
        # would count as clipping in `clipfrac` (the gradient is the same either way).
        moved = v - v_old
        v_clip = torch.where(moved.abs() > cliprange_value, v_old + moved.clamp(-cliprange_value, cliprange_value), v)
        err_clip = (v_clip - g).square()
        clip_active = err_clip > err
        per_token = 0.5 * torch.where(clip_active, err_clip, err)

    loss = aggregate(per_token, mask, aggregation, normalizer)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(clip_active.float(), mask),
            "value_mean": masked_mean(v, mask),
            "error": masked_mean(err, mask),
        }
    return LossOutput(loss, metrics)
