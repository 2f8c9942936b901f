"""Advantage estimators, in one place: how a rollout's rewards become the advantages the policy losses weigh.

- :func:`gae_advantages` (PPO with a critic: GAE(γ, λ) and the value targets) and :func:`discounted_returns`;
- :func:`compute_baseline` (REINFORCE's per-prompt baselines: none, leave-one-out "rloo", a constant, another sample
  set's mean) and :func:`sequence_advantages` (PPO without a critic: each response's return minus its baseline, on
  every one of its tokens);
- :func:`importance_corrected_advantages`: the truncated importance-sampling correction of advantages whose samples
  another engine (vLLM) drew (the weights: :func:`~trl_ext.ops.importance.vllm_importance_weights`).

Token-level conventions (docs/algorithms.md §5.5): rewards and values are ``(B, T)`` over action tokens with a
``(B, T)`` mask. Values at masked positions count as ``0``, so the value after the last valid token of a row bootstraps
nothing, and advantages/returns are ``0`` where the mask is ``0``. The recursion runs right to left and treats a masked
position as the end of an episode segment; masks are expected to be one contiguous block per row (right padding is the
norm, left padding works too). Inputs are not modified and gradients are not stopped: pass detached values.
"""

from __future__ import annotations

import torch

from .importance import vllm_importance_weights
from .stats import masked_mean, masked_sum

__all__ = [
    "BASELINES",
    "compute_baseline",
    "discounted_returns",
    "gae_advantages",
    "importance_corrected_advantages",
    "sequence_advantages",
]

#: Baseline names accepted by :func:`compute_baseline` (``"expectation"`` is the original name of ``"rloo"``).
BASELINES: tuple[str, ...] = ("none", "rloo", "expectation", "hardcoded", "other_expectation")


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


def compute_baseline(
    rewards: torch.Tensor,
    baseline: str | None,
    *,
    baseline_value: float | torch.Tensor = 0.0,
    other_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample baseline ``b_i`` for REINFORCE, computed per prompt.

    * ``"none"`` (or ``None``): ``b_i = 0``.
    * ``"rloo"`` (alias ``"expectation"``, the original name): leave-one-out mean over the prompt's other samples,
      ``b_i = (Σ_j R_j − R_i)/(N − 1)``; needs N ≥ 2.
    * ``"hardcoded"``: the constant ``baseline_value``.
    * ``"other_expectation"``: the per-prompt mean of ``other_rewards`` ``(P, M)`` (e.g. the returns of another set
      of samples of the same prompts), broadcast over the N samples.

    Args:
        rewards: ``(P, N)`` sequence returns (``(B,)`` = one prompt group).

    Returns:
        ``(P, N)`` (or ``(B,)``) detached baseline, in the rewards' floating dtype (at least fp32).
    """
    name = "none" if baseline is None else baseline
    if name not in BASELINES:
        raise ValueError(f"Unknown baseline {baseline!r}; choose one of {', '.join(BASELINES)}.")
    if rewards.dim() not in (1, 2):
        raise ValueError(f"`rewards` must be (P, N) or (B,); got shape {tuple(rewards.shape)}.")
    flat = rewards.dim() == 1
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    r = r.unsqueeze(0) if flat else r
    n = r.shape[-1]
    if name == "none":
        b = torch.zeros_like(r)
    elif name in ("rloo", "expectation"):
        if n < 2:
            raise ValueError(f"The {name!r} (leave-one-out) baseline needs at least 2 samples per prompt; got N={n}.")
        b = (r.sum(dim=-1, keepdim=True) - r) / (n - 1)
    elif name == "hardcoded":
        b = torch.zeros_like(r) + torch.as_tensor(baseline_value, dtype=r.dtype, device=r.device).detach()
    else:  # other_expectation
        if other_rewards is None:
            raise ValueError("The 'other_expectation' baseline needs `other_rewards` of shape (P, M).")
        other = other_rewards.detach().to(r.dtype)
        other = other.unsqueeze(0) if other.dim() == 1 else other
        if other.dim() != 2 or other.shape[0] != r.shape[0]:
            raise ValueError(
                f"`other_rewards` has shape {tuple(other_rewards.shape)}; expected (P={r.shape[0]}, M) per prompt."
            )
        b = other.mean(dim=-1, keepdim=True).expand_as(r).clone()
    return b.reshape(rewards.shape)


def sequence_advantages(
    token_rewards: torch.Tensor,
    score_mask: torch.Tensor,
    response_mask: torch.Tensor,
    num_samples_per_prompt: int,
    baseline: str | None,
    baseline_value: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """REINFORCE-style advantages without a critic: each response's return ``G_i = Σ_t r_t`` (over ``score_mask``)
    minus its baseline ``b_i`` (:func:`compute_baseline`, computed over the ``num_samples_per_prompt`` consecutive rows
    of each prompt), on every response token: ``A_{i,t} = (G_i − b_i)·m_{i,t}``, ``(B, T)`` like ``response_mask``."""
    returns = masked_sum(token_rewards, score_mask, dim=-1)
    grouped = returns.view(-1, num_samples_per_prompt)
    b = compute_baseline(grouped, baseline, baseline_value=baseline_value)
    advantages = (returns - b.reshape(-1).to(returns.dtype)).unsqueeze(-1)
    return advantages * (response_mask != 0)


def importance_corrected_advantages(
    advantages: torch.Tensor,
    train_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    correct: bool,
    mode: str = "token_truncate",
    clip_max: float | None = None,
    clip_min: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(advantages × w, stats)``: ``w`` the truncated importance weights of samples drawn by another engine
    (``engine_logprobs``, see :func:`~trl_ext.ops.importance.vllm_importance_weights` for ``mode`` and the clips) when
    ``correct``, else the advantages unchanged. ``stats``: ``logprob_diff`` (mean ``|log π_train − log π_engine|`` per
    token) and, when corrected, ``is_weight_mean``; empty without engine log-probs (the policy sampled itself)."""
    if engine_logprobs is None:
        return advantages, {}
    stats = {"logprob_diff": float(masked_mean((train_logprobs.float() - engine_logprobs.float()).abs(), mask))}
    if not correct:
        return advantages, stats
    weights = vllm_importance_weights(train_logprobs, engine_logprobs, mask, mode, clip_max, clip_min)
    stats["is_weight_mean"] = float(masked_mean(weights, mask))
    return advantages * weights.to(advantages.dtype), stats
