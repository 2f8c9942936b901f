"""Generalised advantage estimation and discounted returns over masked token sequences.

Conventions (docs/algorithms.md §5.5): rewards and values are ``(B, T)`` over action tokens with a ``(B, T)`` mask.
Values at masked positions count as ``0``, so the value after the last valid token of a row bootstraps nothing, and
advantages/returns are ``0`` where the mask is ``0``. The recursion runs right to left and treats a masked position
as the end of an episode segment; masks are expected to be one contiguous block per row (right padding is the norm,
left padding works too). Inputs are not modified and gradients are not stopped: pass detached values.
"""

from __future__ import annotations

import torch

__all__ = ["gae_advantages", "discounted_returns"]


def _check(rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor | None = None) -> None:
    if rewards.dim() != 2 or mask.shape != rewards.shape or (values is not None and values.shape != rewards.shape):
        shapes = [tuple(t.shape) for t in (rewards, values, mask) if t is not None]
        raise ValueError(f"rewards, values and mask must all be (B, T); got {shapes}.")


def _masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    x = x if x.is_floating_point() else x.float()
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(γ, λ) advantages and value targets.

    With ``m`` the mask, ``r`` and ``V`` zeroed where ``m = 0``, and ``V_T = A_T = 0``:

    - ``δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t``
    - ``A_t = m_t·(δ_t + γ·λ·m_{t+1}·A_{t+1})``
    - ``returns_t = A_t + V_t`` (``0`` where ``m_t = 0``).

    With ``γ = λ = 1``, ``A_t = G_t − V_t`` where ``G_t`` is the reward-to-go of :func:`discounted_returns`.

    Args:
        rewards: ``(B, T)`` per-token rewards.
        values: ``(B, T)`` value estimates ``V_t`` of the state before token ``t``.
        mask: ``(B, T)`` action mask.
        gamma: discount ``γ``.
        lam: GAE ``λ``.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``.
    """
    _check(rewards, mask, values)
    keep = mask != 0
    r, v = _masked(rewards, keep), _masked(values, keep)
    B, T = r.shape
    next_value = r.new_zeros(B)
    next_adv = r.new_zeros(B)
    advs = []
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = torch.where(keep[:, t], delta + gamma * lam * next_adv, torch.zeros_like(delta))
        advs.append(adv)
        next_value, next_adv = v[:, t], adv  # already zero where m_t = 0
    advantages = torch.stack(advs[::-1], dim=1) if T else r.clone()
    returns = torch.where(keep, advantages + v, torch.zeros_like(advantages))
    return advantages, returns


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Rewards-to-go ``G_t = m_t·(r_t + γ·m_{t+1}·G_{t+1})``, i.e. ``Σ_{k≥t} γ^{k−t} r_k`` over the valid block.

    Args:
        rewards: ``(B, T)`` per-token rewards (masked positions are ignored).
        mask: ``(B, T)`` action mask.
        gamma: discount ``γ``.

    Returns:
        ``(B, T)`` returns, ``0`` where the mask is ``0``.
    """
    _check(rewards, mask)
    keep = mask != 0
    r = _masked(rewards, keep)
    B, T = r.shape
    running = r.new_zeros(B)
    out = []
    for t in reversed(range(T)):
        running = torch.where(keep[:, t], r[:, t] + gamma * running, torch.zeros_like(running))
        out.append(running)
    return torch.stack(out[::-1], dim=1) if T else r.clone()
