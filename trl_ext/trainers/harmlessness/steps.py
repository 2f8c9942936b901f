"""Pieces of one RePULSe step that are not the trainer's orchestration: the data it passes around, the
log-spaced schedules, the policy-side and target-side reward shapings, stacking two rollouts into one forward pass,
and the per-step metrics.

Everything here is a plain function or dataclass on tensors (no model, no `Trainer`), so it is easy to test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...losses.weights import ORIGINAL_INDICATOR_THRESHOLD, effective_sample_size, sigma_weights
from ...ops import group_rows, kl_estimate, masked_sum
from ...rewards import RewardShaping
from ...rollout import Rollout

__all__ = [
    "HarmlessnessRewards",
    "HarmlessnessRollouts",
    "HarmlessnessStep",
    "group",
    "log_spaced_value",
    "negative_sample_weights",
    "negative_term_scale",
    "reward_shapings",
    "sample_metrics",
    "stack_rollouts",
    "step_metrics",
]


@dataclass
class HarmlessnessRollouts:
    """The samples of one step, for the same prompts: the policy's and (when a proposal is trained) the proposal's.

    ``policy.ref_logprobs`` are ``log p_0``; ``proposal.ref_logprobs`` are ``log p_θ`` of the current policy (the
    proposal's target base), refreshed after the policy's update with ``order="p_then_q"``.
    """

    policy: Rollout
    proposal: Rollout | None = None
    negatives: Rollout | None = None
    """With ``negative_sampler="smc"``: the SMC particles used as negatives (else the proposal's samples are)."""
    negative_weights: torch.Tensor | None = None
    """``(P, N)`` the sampler's normalised weights of ``negatives``."""
    proposal_reused: bool = False
    """``proposal`` is an earlier step's rollout taken again (``proposal_reuse_steps``): no proposal step now."""


@dataclass
class HarmlessnessRewards:
    """Rewards of one step (:meth:`HarmlessnessTrainer.compute_rewards`). ``(B,)`` per sample unless stated.

    Policy side (reward units, the original's "p-maker": ``rm_type="rlhf"``, the cap and the optional transform):
    ``policy_reward`` ``r'`` (with ``normalize_reward``: ``(r' − mean) / std``, running statistics), ``policy_kl``
    ``(B, T)`` the per-token KL estimate against ``p_0`` at sampling time,
    ``policy_return`` ``r' − λ·Σ_t kl_t`` (a constant for the loss). Target side (``rm_type`` map, ``β`` of this
    step): ``policy_log_phi`` and ``proposal_log_phi`` ``log φ = β·R`` of the raw reward (transformed first with
    ``transform_both_sides``). ``proposal_return``: the proposal samples' return in reward units (``r'`` minus the
    KL of ``p_θ`` to ``p_0`` on them), only for losses that take ``neg_rewards``.
    """

    policy_reward: torch.Tensor
    policy_kl: torch.Tensor
    policy_return: torch.Tensor
    policy_log_phi: torch.Tensor
    proposal_log_phi: torch.Tensor | None = None
    proposal_reward: torch.Tensor | None = None
    proposal_return: torch.Tensor | None = None


@dataclass
class HarmlessnessStep:
    """One micro-step as `HarmlessnessTrainer.compute_loss` receives it (``inputs["step"]``): the rollouts and rewards,
    which model's loss closes the step through `Trainer` (``"policy"``, ``"proposal"``, or ``"both"`` under DeepSpeed;
    `trainers/common/stepping.py`), and the losses as they are computed."""

    rollouts: HarmlessnessRollouts
    rewards: HarmlessnessRewards
    scale: float
    """``1 / gradient_accumulation_steps``: every loss of the step is multiplied by it before its backward."""
    closing: str = "policy"
    forward: tuple | None = None
    """The policy forward of a fused step (``(policy_lp, neg_lp, negatives)``), done before the proposal's step."""
    policy_out: object | None = None
    """The policy loss's `LossOutput`, once computed."""
    policy_logprobs: torch.Tensor | None = None
    """Detached ``log p_θ`` of the policy's samples from the policy loss's forward."""
    proposal_out: object | None = None
    """The proposal loss's `TwistLossOutput`, when the step has one."""


def log_spaced_value(start: float, end: float, index: int, total: int) -> float:
    """Value ``index`` of ``total`` log-spaced values from ``start`` to ``end`` (same sign, non-zero).

    ``v_k = sign·exp(log|start| + (log|end| − log|start|)·k/(total − 1))`` for ``k = 0 … total − 1``; ``k`` is
    clamped to that range (``total = 1`` gives ``end``). Used for the ``β`` and ``α`` schedules, indexed by the
    number of policy updates done.
    """
    if start == 0 or end == 0 or (start > 0) != (end > 0):
        raise ValueError(f"A log-spaced schedule needs two non-zero values of the same sign; got {start} and {end}.")
    if total <= 1:
        return float(end)
    k = min(max(int(index), 0), total - 1)
    sign = 1.0 if end > 0 else -1.0
    lo, hi = math.log(abs(start)), math.log(abs(end))
    return sign * math.exp(lo + (hi - lo) * k / (total - 1))


def group(x: torch.Tensor, num_samples_per_prompt: int) -> torch.Tensor:
    """``(B, ...)`` rows grouped prompt by prompt → ``(P, N, ...)`` (:func:`trl_ext.ops.group_rows`)."""
    return group_rows(x, samples_per_prompt=num_samples_per_prompt, what="a RePULSe batch")


def negative_sample_weights(
    args, rollouts: HarmlessnessRollouts, rewards: HarmlessnessRewards, weight_logprobs: torch.Tensor
) -> torch.Tensor:
    """``(P, N)`` σ-weights of the negative samples (`trl_ext.losses.weights.sigma_weights`, masked sums — the fix
    of B1): ``softmax_N(Σ_t log p_θ(s̃_t) + log φ(s̃) − Σ_t log q_old(s̃_t))`` per prompt, or uniform, times the
    indicator with ``indicator_mask``. The samples are the proposal's, or the policy's own with
    ``use_base_as_proposal``; ``weight_logprobs``: ``(B, T)`` ``log p_θ`` on them; ``args``: the
    `HarmlessnessConfig`. The weights of a prompt are normalised over its negatives: the policy's
    ``num_samples_per_prompt`` or the proposal's ``proposal_samples_per_prompt``."""
    if args.use_base_as_proposal:
        rollout, log_phi = rollouts.policy, rewards.policy_log_phi
        N = args.num_samples_per_prompt
    else:
        rollout, log_phi = rollouts.proposal, rewards.proposal_log_phi
        N = args.proposal_num_samples
    if args.separate_reweighting_beta is not None:
        log_phi = args.separate_reweighting_beta * rollout.scores.float()
    return sigma_weights(
        group(weight_logprobs, N), group(rollout.logprobs, N), group(log_phi, N), group(rollout.response_mask, N),
        indicator_threshold=ORIGINAL_INDICATOR_THRESHOLD if args.indicator_mask else None,
        uniform=args.uniform_reweight,
    )  # fmt: skip


def negative_term_scale(args) -> float:
    """Factor on ``alpha`` that keeps the negative term's size when the proposal draws ``M`` samples per prompt and
    the policy ``N`` (``proposal_samples_per_prompt``): ``M / N`` with ``alpha_convention="reference"``, 1 otherwise.

    With the ``"reference"`` convention the negative term is ``α`` times the mean over the batch's negatives of
    ``w·log p_θ(s̃)`` (σ-weights ``w`` summing to 1 per prompt), i.e. ``α / (P·M) · Σ_x Ê_σ[log p_θ]``: with
    ``M < N`` it would grow by ``N / M``. Scaling by ``M / N`` gives ``α / (P·N) · Σ_x Ê_σ[log p_θ]``, the term
    of equal counts (exactly for the sequence-mean aggregations, in expectation over lengths for ``token-mean``).
    The ``"expectation"`` convention multiplies by the number of negatives inside the loss, so its term does not
    depend on ``M``."""
    if args.alpha_convention != "reference":
        return 1.0
    return args.negative_samples_per_prompt / args.num_samples_per_prompt


def stack_rollouts(rollouts: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``prompt + response`` rows of several rollouts in one layout, for a single forward pass.

    Prompts are left-aligned to the widest prompt (left padding) and responses right-padded to the longest response
    ``T``; returns ``(input_ids, attention_mask, T)``. The response tokens of rollout ``k`` are the first
    ``rollouts[k].response_length`` of the last ``T`` columns of its rows.
    """
    width_p = max(r.prompt_ids.shape[1] for r in rollouts)
    width_t = max(r.response_length for r in rollouts)
    ids_parts, mask_parts = [], []
    for r in rollouts:
        rows, P, T = r.batch_size, r.prompt_ids.shape[1], r.response_length
        ids = r.prompt_ids.new_zeros(rows, width_p + width_t)
        mask = r.prompt_mask.new_zeros(rows, width_p + width_t)
        ids[:, width_p - P : width_p] = r.prompt_ids
        mask[:, width_p - P : width_p] = r.prompt_mask
        ids[:, width_p : width_p + T] = r.response_ids
        mask[:, width_p : width_p + T] = r.response_mask
        ids_parts.append(ids)
        mask_parts.append(mask)
    return torch.cat(ids_parts), torch.cat(mask_parts), width_t


def sample_metrics(
    rollout: Rollout,
    *,
    log_phi: torch.Tensor,
    kl: torch.Tensor,
    reward: torch.Tensor,
    kl_coef: float,
    weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Scalar summaries of one model's samples (means over the samples).

    With ``log π`` the sampler's log-probs (``rollout.logprobs``) and ``log π_ref`` its reference's
    (``rollout.ref_logprobs``), summed over each response:

    - ``reward``: the mean of ``reward``; ``return``: of ``reward − kl_coef·Σ_t kl_t``; ``kl``: of ``Σ_t kl_t``;
    - ``f_q``: of ``log π_ref(s) + log φ(s) − log π(s)`` (the ELBO of ``log Z_σ``: its mean is ≤ ``log Z_σ``);
      ``kl`` and ``f_q`` are left out when the rollout has no reference log-probs (``kl_coef == 0``);
    - ``entropy``: of ``−log π(s)``; ``response_length``: of the number of response tokens;
    - ``ess``: the mean over prompts of the effective sample size of ``weights`` ``(P, N)``, when given.
    """
    mask = rollout.response_mask
    logp = masked_sum(rollout.logprobs, mask, dim=-1)
    kl_sum = masked_sum(kl, mask, dim=-1)
    out = {
        "reward": reward.float().mean(),
        "return": (reward.float() - kl_coef * kl_sum).mean(),
        "entropy": (-logp).mean(),
        "response_length": mask.float().sum(-1).mean(),
    }
    if rollout.ref_logprobs is not None:  # else no reference was scored (kl_coef == 0): no kl, no f_q
        ref = masked_sum(rollout.ref_logprobs, mask, dim=-1)
        out.update(kl=kl_sum.mean(), f_q=(ref + log_phi.float() - logp).mean())
    if weights is not None:
        out["ess"] = effective_sample_size(weights).mean()
    return out


def reward_shapings(args) -> tuple[RewardShaping, RewardShaping]:
    """The policy side's reward shaping (``rlhf`` map, cap, optional transform; β ≡ 1) and the target side's
    (``rm_type`` map; its β is replaced by the current one each step)."""
    transform = {}
    if args.reward_transform is not None:
        transform = {
            "transform": args.reward_transform,
            "transform_alpha": args.alpha if args.reward_transform_alpha is None else args.reward_transform_alpha,
            "transform_threshold": args.reward_transform_threshold,
        }
        if args.reward_transform == "minus_alpha_exp_beta_r":
            beta = args.reward_transform_beta
            transform["transform_beta"] = args.target_dist_beta if beta is None else beta
    policy_side = RewardShaping(rm_type="rlhf", reward_cap=args.reward_cap, beta=1.0, **transform)
    start_beta = args.target_dist_beta if args.anneal_target_dist_beta is None else args.anneal_target_dist_beta
    target_side = RewardShaping(
        rm_type=args.rm_type,
        reward_cap=args.reward_cap if args.rm_type == "rlhf" else None,
        threshold=args.reward_threshold if args.rm_type == "indicator_below_threshold" else None,
        beta=start_beta,
        **(transform if args.transform_both_sides else {}),
    )
    return policy_side, target_side


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    diff = (a.float() - b.float()).abs()
    return torch.where(mask != 0, diff, torch.zeros_like(diff)).max()


def step_metrics(
    args, rollouts: HarmlessnessRollouts, rewards: HarmlessnessRewards, p_out, p_lp, q_out, weights,
    kl_coef: float | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The metrics of one step: ``base/*`` (:func:`sample_metrics` of the policy's samples, KL against ``p_0``)
    with ``base/untransformed_reward`` (raw) and ``base/logprob_diff``; ``proposal/*`` of the proposal's samples
    (raw reward, KL against the current policy, ``ess`` of the σ-weights; with ``use_base_as_proposal`` only
    ``proposal/ess``); ``loss/policy``, ``loss/neg``, ``loss/proposal``; ``p_bad`` = fraction of the policy's
    samples with raw reward below ``save_negdata_threshold``.

    ``p_out``: the policy's `LossOutput`; ``p_lp``: its detached log-probs on its samples; ``q_out``: the
    proposal's `TwistLossOutput` or ``None``; ``weights``: the ``(P, N)`` σ-weights or ``None``.
    ``*/logprob_diff`` is the largest ``|log-prob at training − log-prob at sampling|`` (~0 before an update).
    ``kl_coef``: the step's KL coefficient in ``*/return`` (default ``args.kl_coef``; the adaptive controller's).
    """
    kl_coef = args.kl_coef if kl_coef is None else kl_coef
    p = rollouts.policy
    base = sample_metrics(
        p, log_phi=rewards.policy_log_phi, kl=rewards.policy_kl, reward=rewards.policy_reward, kl_coef=kl_coef
    )
    values = {f"base/{k}": v for k, v in base.items()}
    values["base/untransformed_reward"] = p.scores.float().mean()
    values["base/logprob_diff"] = _max_abs_diff(p_lp, p.logprobs, p.response_mask)
    values["p_bad"] = (p.scores.float() < args.save_negdata_threshold).float().mean()
    values["loss/policy"] = p_out.loss.detach()
    if "neg_loss" in p_out.metrics:
        values["loss/neg"] = p_out.metrics["neg_loss"]
    q = rollouts.proposal
    if q is not None:
        q_kl = kl_estimate(q.logprobs, q.ref_logprobs, args.kl_estimator, q.response_mask)
        proposal = sample_metrics(
            q, log_phi=rewards.proposal_log_phi, kl=q_kl, reward=q.scores, kl_coef=kl_coef, weights=weights
        )
        values.update({f"proposal/{k}": v for k, v in proposal.items()})
        values["proposal/reused"] = torch.tensor(float(rollouts.proposal_reused))
        if q_out is not None:  # (a reused rollout has no proposal step)
            values["proposal/logprob_diff"] = _max_abs_diff(q_out.q_logprobs, q.logprobs, q.response_mask)
            values["loss/proposal"] = q_out.loss.loss.detach()
    elif weights is not None:
        values["proposal/ess"] = effective_sample_size(weights).mean()
    return values
