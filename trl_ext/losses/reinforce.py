"""Score-function (REINFORCE) losses for the policy ``p_θ``, and the RePULSe p-losses built on them.

Layout: ``logprobs``/``mask`` are ``(P, N, T)`` (P prompts × N samples, right padding, mask 1 on real tokens) and
sequence-level rewards ``(P, N)``. A flat ``(B, T)`` / ``(B,)`` batch is treated as a single group (P = 1), which
matters for the per-prompt baselines.

All losses reduce their ``(P, N, T)`` per-token loss with :func:`~trl_ext.losses.base.aggregate`; the default
``"seq-mean-token-mean"`` is the original code's ``mean_{P,N} masked_mean_t`` (docs/algorithms.md §5.1). Rewards,
baselines and importance weights are always treated as constants (detached); inputs are never modified and
masked-out positions are never read.
"""

from __future__ import annotations

import torch

from .._deprecation import moved_names
from ..ops.advantages import compute_baseline as _compute_baseline
from ..ops.stats import masked_mean
from .base import (
    LossOutput,
    aggregate,
    as_grouped,
    check_sequence_shape,
    check_token_shape,
    is_flat_batch,
    second_normalizer,
    zero_masked,
)
from .registry import register_loss
from .weights import effective_sample_size

__all__ = [
    "neg_reinforce_loss",
    "neg_training_loss",
    "push_down_loss",
    "reinforce_loss",
]

ALPHA_CONVENTIONS: tuple[str, ...] = ("reference", "code", "expectation")


def _reinforce_terms(
    logprobs: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    baseline: str | None,
    baseline_value: float | torch.Tensor,
    other_rewards: torch.Tensor | None,
    seq_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared core: grouped per-token loss ``−[w_i]·log p(s_{i,t})·sg(R_i − b_i)`` (0 at masked positions).

    Returns ``(per_token, grouped mask, advantage, baseline)``.
    """
    flat = is_flat_batch(mask)
    check_token_shape(logprobs, "logprobs", mask)
    check_sequence_shape(rewards, "rewards", mask)
    lp = as_grouped(logprobs, "logprobs", 3, flat)
    m = as_grouped(mask, "mask", 3, flat)
    r = as_grouped(rewards, "rewards", 2, flat).detach()
    if other_rewards is not None and flat and other_rewards.dim() == 1:
        other_rewards = other_rewards.unsqueeze(0)
    b = _compute_baseline(r, baseline, baseline_value=baseline_value, other_rewards=other_rewards)
    adv = r.to(b.dtype) - b
    coef = adv if seq_weights is None else adv * seq_weights
    lp = zero_masked(lp, m != 0)
    per_token = -lp * coef.unsqueeze(-1).to(torch.promote_types(lp.dtype, coef.dtype))
    return per_token, m, adv, b


@register_loss("reinforce", kind="reinforce")
def reinforce_loss(
    logprobs: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    baseline: str | None = "none",
    baseline_value: float | torch.Tensor = 0.0,
    other_rewards: torch.Tensor | None = None,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """REINFORCE with a per-prompt baseline: ``ℓ_{i,t} = −log p_θ(s_{i,t}) · sg(R_i − b_i)``.

    With the default aggregation, ``L = mean_{P,N}[ masked_mean_t(−log p_θ(s_{i,t})) · (R_i − b_i) ]``, the original
    REINFORCELoss (the length-normalised score function). ``b`` comes from
    :func:`~trl_ext.ops.advantages.compute_baseline`.

    Args:
        logprobs: ``(P, N, T)`` log-probs of the sampled tokens under ``p_θ`` (with gradient).
        rewards: ``(P, N)`` sequence returns, e.g. ``r − λ Σ_t k1_t``; detached inside.
        mask: ``(P, N, T)``, 1 on real tokens. Flat ``(B, T)``/``(B,)`` inputs form one prompt group.
        baseline, baseline_value, other_rewards: see :func:`~trl_ext.ops.advantages.compute_baseline`.
        aggregation, normalizer: see :func:`~trl_ext.losses.base.aggregate`.

    Stop-gradients: rewards and baseline (the gradient reaches ``logprobs`` only).

    Metrics: ``advantage_mean``, ``advantage_std``, ``baseline_mean``, ``reward_mean``.
    """
    per_token, m, adv, b = _reinforce_terms(
        logprobs, rewards, mask, baseline=baseline, baseline_value=baseline_value, other_rewards=other_rewards
    )
    loss = aggregate(per_token, m, aggregation, normalizer)
    metrics = {
        "advantage_mean": adv.mean(),
        "advantage_std": adv.std(correction=0),
        "baseline_mean": b.mean(),
        "reward_mean": (adv + b).mean(),
    }
    return LossOutput(loss, metrics)


def _neg_scale(alpha: float, convention: str, n: int) -> float:
    if convention not in ALPHA_CONVENTIONS:
        raise ValueError(f"Unknown alpha_convention {convention!r}; choose 'reference' or 'expectation'.")
    if not alpha >= 0:
        raise ValueError(f"`alpha` must be >= 0; got {alpha}.")
    return float(alpha) * (n if convention == "expectation" else 1)


def _neg_weights(neg_weights: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
    check_sequence_shape(neg_weights, "neg_weights", neg_mask)
    w = neg_weights.detach()
    return w.to(torch.promote_types(w.dtype, torch.float32))


def _p_term(logprobs, rewards, mask, baseline, baseline_value, other_rewards, aggregation, normalizer) -> LossOutput:
    """The p-samples' REINFORCE term of the RePULSe p-losses."""
    return reinforce_loss(
        logprobs, rewards, mask, baseline=baseline, baseline_value=baseline_value, other_rewards=other_rewards,
        aggregation=aggregation, normalizer=normalizer,
    )  # fmt: skip


@register_loss("neg_training", kind="harmlessness")
def neg_training_loss(
    logprobs: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    neg_logprobs: torch.Tensor,
    neg_weights: torch.Tensor,
    neg_mask: torch.Tensor,
    *,
    alpha: float,
    alpha_convention: str = "reference",
    baseline: str | None = "rloo",
    baseline_value: float | torch.Tensor = 0.0,
    other_rewards: torch.Tensor | None = None,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
    neg_normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """RePULSe p-loss: REINFORCE on the p-samples plus a σ-weighted log-likelihood of the q-samples.

    ``L = REINFORCE(logprobs, rewards) + agg_{P,N,T}( c · log p_θ(s̃_{i,t}) · sg(w̃_i) )``

    where ``s̃`` are the proposal's samples (their own mask ``neg_mask``, aggregated with the same mode) and
    ``w̃`` ``(P, N)`` their σ-weights from :func:`~trl_ext.losses.weights.sigma_weights` (summing to 1 per prompt,
    or 0 under the indicator). Minimising the second term pushes the probability of the weighted — low-reward —
    q-samples down; its gradient estimates ``α ∇ log Z_σ(θ)`` (docs/algorithms.md §1).

    ``alpha_convention`` fixes the scale ``c`` of the negative term (docs/algorithms.md §8.2, B2):

    * ``"reference"`` (alias ``"code"``): ``c = α``. With the default aggregation the term is
      ``α · mean_{P,N}(w̃_i · tokenmean_i) = (α/N) · mean_P E_w̃[tokenmean]``, as in the original code; the paper's
      α values assume this.
    * ``"expectation"``: ``c = α·N`` (N = q-samples per prompt), so the term is ``α · mean_P Σ_i w̃_i tokenmean_i``,
      i.e. ``α·E_σ[...]``. The two differ by exactly a factor N.

    Args:
        logprobs, rewards, mask: the p-samples, as in :func:`reinforce_loss`.
        neg_logprobs: ``(P, N', T')`` log-probs of the q-samples under ``p_θ`` (with gradient).
        neg_weights: ``(P, N')`` σ-weights; detached inside.
        neg_mask: ``(P, N', T')``.
        alpha: ``α ≥ 0``.
        baseline, baseline_value, other_rewards: the REINFORCE baseline (default RLOO).
        aggregation, normalizer: as in :func:`~trl_ext.losses.base.aggregate`; ``neg_normalizer`` is the
            normalizer of the negative term (defaults to ``normalizer``; required with ``token-mean``).

    Stop-gradients: rewards, baselines and ``neg_weights``.

    Metrics: ``reinforce_loss``, ``neg_loss`` (the scaled negative term), ``neg_logprob_weighted``
    (``mean_P Σ_i w̃_i·masked_mean_t log p_θ(s̃_i)``), ``neg_logprob_mean``, ``neg_weight_ess``, ``neg_weight_max``,
    ``neg_active_frac`` (prompts with non-zero weights), plus the REINFORCE metrics.
    """
    rl = _p_term(logprobs, rewards, mask, baseline, baseline_value, other_rewards, aggregation, normalizer)
    neg = push_down_loss(
        neg_logprobs,
        neg_weights,
        neg_mask,
        alpha=alpha,
        alpha_convention=alpha_convention,
        aggregation=aggregation,
        normalizer=second_normalizer(aggregation, normalizer, neg_normalizer, "neg_normalizer"),
    )
    metrics = {"reinforce_loss": rl.loss.detach(), **neg.metrics, **rl.metrics}
    return LossOutput(rl.loss + neg.loss, metrics)


def push_down_loss(
    neg_logprobs: torch.Tensor,
    neg_weights: torch.Tensor,
    neg_mask: torch.Tensor,
    *,
    alpha: float,
    alpha_convention: str = "reference",
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """The negative ("push-down") term of RePULSe alone: ``agg_{P,N,T}( c · log p_θ(s̃_{i,t}) · sg(w̃_i) )``.

    This is the second term of :func:`neg_training_loss` (which calls it), usable on its own by a trainer whose
    main loss is computed elsewhere (e.g. `trl_ext.RePULSeGRPOTrainer`, which adds it to GRPO's loss). ``c = α``
    with ``alpha_convention="reference"`` (alias ``"code"``) and ``c = α·N'`` with ``"expectation"``, ``N'`` the
    negatives per prompt. Minimising it lowers the probability of the σ-weighted samples; its gradient estimates
    ``α ∇ log Z_σ(θ)`` up to the convention's constant.

    Args:
        neg_logprobs: ``(P, N', T')`` log-probs of the negatives (the proposal's samples) under ``p_θ`` (with
            gradient); a flat ``(B, T')`` batch is one prompt group.
        neg_weights: ``(P, N')`` σ-weights (:func:`~trl_ext.losses.weights.sigma_weights`); detached inside.
        neg_mask: ``(P, N', T')``, 1 on real tokens.
        alpha: ``α ≥ 0``.
        alpha_convention: ``"reference"``, ``"code"`` or ``"expectation"``.
        aggregation, normalizer: as in :func:`~trl_ext.losses.base.aggregate`.

    Metrics: ``neg_loss`` (the term), ``neg_logprob_weighted`` (``mean_P Σ_i w̃_i·masked_mean_t log p_θ(s̃_i)``),
    ``neg_logprob_mean``, ``neg_weight_ess``, ``neg_weight_max``, ``neg_active_frac`` (prompts with non-zero
    weights).
    """
    flat = is_flat_batch(neg_mask, "neg_mask")
    check_token_shape(neg_logprobs, "neg_logprobs", neg_mask)
    w = _neg_weights(neg_weights, neg_mask)
    nm = as_grouped(neg_mask, "neg_mask", 3, flat)
    w = as_grouped(w, "neg_weights", 2, flat)
    c = _neg_scale(alpha, alpha_convention, nm.shape[-2])
    nlp = zero_masked(as_grouped(neg_logprobs, "neg_logprobs", 3, flat), nm != 0)
    per_token = nlp * (c * w).unsqueeze(-1).to(torch.promote_types(nlp.dtype, w.dtype))
    neg = aggregate(per_token, nm, aggregation, normalizer)
    with torch.no_grad():
        tokmean = masked_mean(nlp.detach().to(w.dtype), nm, dim=-1)
        metrics = {
            "neg_loss": neg.detach(),
            "neg_logprob_weighted": (w * tokmean).sum(dim=-1).mean(),
            "neg_logprob_mean": tokmean.mean(),
            "neg_weight_ess": effective_sample_size(w).mean(),
            "neg_weight_max": w.max(),
            "neg_active_frac": (w.sum(dim=-1) > 0).to(w.dtype).mean(),
        }
    return LossOutput(neg, metrics)


@register_loss("neg_reinforce", kind="harmlessness")
def neg_reinforce_loss(
    logprobs: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    neg_logprobs: torch.Tensor,
    neg_rewards: torch.Tensor,
    neg_weights: torch.Tensor,
    neg_mask: torch.Tensor,
    *,
    alpha: float,
    alpha_convention: str = "reference",
    neg_baseline: str | None = "other_expectation",
    neg_baseline_value: float | torch.Tensor = 0.0,
    neg_other_rewards: torch.Tensor | None = None,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
    neg_normalizer: float | torch.Tensor | None = None,
    baseline: str | None = "rloo",
    baseline_value: float | torch.Tensor = 0.0,
    other_rewards: torch.Tensor | None = None,
) -> LossOutput:
    """REINFORCE on the p-samples plus a σ-weighted REINFORCE on the q-samples (``neg_reinforce``).

    ``L = REINFORCE(logprobs, rewards) + agg_{P,N,T}( −c · sg(w̃_i) · log p_θ(s̃_{i,t}) · sg(R̃_i − b̃_i) )``

    ``R̃`` (``neg_rewards``, ``(P, N')``) are the q-samples' returns **in reward units** (``r̃ − λ Σ_t k1_t``, the
    KL measured against ``p_0``), detached inside (fix of B11). The default baseline ``b̃`` is the per-prompt mean
    of the p-samples' returns (``"other_expectation"`` with ``neg_other_rewards`` defaulting to ``rewards``), so a
    q-sample worse than what ``p_θ`` usually produces has a negative advantage and its probability is pushed down.

    The original code used ``β·r̃`` as ``R̃``; with ``β < 0`` that flips the sign, so low-reward samples got a
    *positive* advantage and were pushed **up** — the opposite of the intent. We use the reward itself.

    ``c`` and ``alpha_convention`` are as in :func:`neg_training_loss` (``"reference"``: c = α, ``"expectation"``:
    c = α·N').

    Args:
        logprobs, rewards, mask, baseline, baseline_value, other_rewards: the p-samples' REINFORCE term.
        neg_logprobs: ``(P, N', T')`` q-samples' log-probs under ``p_θ`` (with gradient).
        neg_rewards: ``(P, N')`` q-samples' returns (reward units); detached inside.
        neg_weights: ``(P, N')`` σ-weights; detached inside.
        neg_mask: ``(P, N', T')``.
        neg_baseline, neg_baseline_value, neg_other_rewards: the q-term's baseline (see
            :func:`~trl_ext.ops.advantages.compute_baseline`).
        aggregation, normalizer, neg_normalizer: as in :func:`neg_training_loss`.

    Stop-gradients: rewards, ``neg_rewards``, both baselines and ``neg_weights``.

    Metrics: ``reinforce_loss``, ``neg_loss``, ``neg_advantage_mean``, ``neg_baseline_mean``, ``neg_weight_ess``,
    plus the REINFORCE metrics.
    """
    flat = is_flat_batch(neg_mask, "neg_mask")
    check_token_shape(neg_logprobs, "neg_logprobs", neg_mask)
    w = as_grouped(_neg_weights(neg_weights, neg_mask), "neg_weights", 2, flat)
    c = _neg_scale(alpha, alpha_convention, neg_mask.shape[-2])
    rl = _p_term(logprobs, rewards, mask, baseline, baseline_value, other_rewards, aggregation, normalizer)
    if neg_other_rewards is None and neg_baseline == "other_expectation":
        neg_other_rewards = rewards
    per_token, nm, adv, b = _reinforce_terms(
        neg_logprobs,
        neg_rewards,
        neg_mask,
        baseline=neg_baseline,
        baseline_value=neg_baseline_value,
        other_rewards=neg_other_rewards,
        seq_weights=c * w,
    )
    neg = aggregate(
        per_token, nm, aggregation, second_normalizer(aggregation, normalizer, neg_normalizer, "neg_normalizer")
    )
    metrics = {
        "reinforce_loss": rl.loss,
        "neg_loss": neg,
        "neg_advantage_mean": adv.mean(),
        "neg_advantage_weighted": (w * adv).sum(dim=-1).mean(),
        "neg_baseline_mean": b.mean(),
        "neg_weight_ess": effective_sample_size(w).mean(),
        **rl.metrics,
    }
    return LossOutput(rl.loss + neg, metrics)


# The baselines are advantage estimators: they moved to trl_ext.ops.advantages.
__getattr__ = moved_names(
    __name__, {"BASELINES": "trl_ext.ops.advantages", "compute_baseline": "trl_ext.ops.advantages"}
)
