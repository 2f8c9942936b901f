"""Per-token rewards for RLHF: KL penalty on every action token plus the sequence score at the last one.

docs/algorithms.md §4: ``rewards_t = −λ·kl_t`` on every valid action token, and the scalar reward ``R`` of the
sequence is added at its last valid action token. ``λ`` is the KL coefficient (``init_kl_coef``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .sequences import last_token_index

__all__ = ["TokenRewards", "assemble_token_rewards", "clamp_scores"]


class TokenRewards(NamedTuple):
    """Result of :func:`assemble_token_rewards`; both ``(B, T)`` and zero where the mask is zero."""

    rewards: torch.Tensor
    """Total per-token reward ``−λ·kl_t + 1[t = last]·score``."""
    non_score_rewards: torch.Tensor
    """The KL part only, ``−λ·kl_t`` (TRL's ``non_score_reward``)."""


def clamp_scores(scores: torch.Tensor, clamp: float | tuple[float | None, float | None] | None) -> torch.Tensor:
    """Clamp sequence scores: ``clamp=c`` means ``[−c, c]``, ``clamp=(lo, hi)`` means ``[lo, hi]`` (either may be
    ``None`` for no bound), ``clamp=None`` returns the scores unchanged."""
    if clamp is None:
        return scores
    if isinstance(clamp, (int, float)):
        if clamp < 0:
            raise ValueError(f"A scalar clamp c means [-c, c] and must be >= 0, got {clamp}.")
        lo, hi = -float(clamp), float(clamp)
    else:
        lo, hi = clamp
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clamp lower bound {lo} is above the upper bound {hi}.")
    return scores.clamp(min=lo, max=hi)


def assemble_token_rewards(
    kl: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    clamp: float | tuple[float | None, float | None] | None = None,
) -> TokenRewards:
    """Per-token rewards ``r_t = −λ·kl_t·m_t + 1[t = last_b]·clamp(score_b)``.

    ``last_b`` is the last position with ``mask ≠ 0`` in row ``b`` (found from the mask, so right padding, left
    padding and ``pad == eos`` all work). Masked positions are exactly ``0``, even if ``kl`` holds ``inf``/``nan``.

    Args:
        kl: ``(B, T)`` per-token KL estimate (e.g. :func:`trl_ext.ops.kl_estimate`).
        scores: ``(B,)`` sequence scores (reward-model output after shaping).
        mask: ``(B, T)`` action mask; every row needs at least one valid token.
        kl_coef: ``λ``, a float or a tensor broadcastable to ``(B, T)`` (e.g. ``(B, 1)`` for per-row values).
        clamp: optional clamp applied to ``scores`` first (see :func:`clamp_scores`).

    Returns:
        :class:`TokenRewards` ``(rewards, non_score_rewards)``, both ``(B, T)`` in ``kl``'s float dtype.
    """
    if kl.dim() != 2 or mask.shape != kl.shape:
        raise ValueError(f"kl and mask must both be (B, T); got {tuple(kl.shape)} and {tuple(mask.shape)}.")
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"scores must have shape (B,) = ({kl.shape[0]},), got {tuple(scores.shape)}.")
    keep = mask != 0
    if not bool(keep.any(dim=-1).all()):
        rows = (~keep.any(dim=-1)).nonzero().flatten()[:5].tolist()
        raise ValueError(f"Rows {rows} have no valid token in the mask: there is no token to put their score on.")
    dtype = kl.dtype if kl.is_floating_point() else torch.float32
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    non_score = torch.where(keep, -kl_coef * torch.where(keep, kl.to(dtype), zero), zero)
    last = last_token_index(mask)
    score = clamp_scores(scores.to(dtype), clamp)
    rewards = non_score.scatter_add(1, last.unsqueeze(-1), score.unsqueeze(-1))
    return TokenRewards(rewards, non_score)
