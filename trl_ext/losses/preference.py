"""Preference losses: reward-model (Bradley–Terry) losses, DPO / IPO, KTO and the paired "vanilla" KTO.

All inputs are per-example tensors of shape ``(B,)`` (sequence log-probs summed over the response, or reward-model
scores); every loss is a mean over the batch. Metrics are detached batch means; where a metric would be the mean of an
empty set it is reported as ``0`` (never ``nan``), and a count is logged next to it so a trainer can weight-average.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import LossOutput, check_same_shape
from .registry import register_loss

__all__ = ["pairwise_loss", "log_exp_loss", "dpo_loss", "ipo_loss", "kto_loss", "vanilla_kto_loss"]

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"`beta` must be > 0, got {beta}.")


def _safe_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of ``x``, or ``0`` for an empty tensor (instead of ``nan``)."""
    return x.mean() if x.numel() > 0 else x.new_zeros(())


# ----------------------------------------------------------------------------------------------- reward models


def _margin_like(margin: float | torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor | float:
    """``margin`` as a scalar or a tensor of ``ref``'s shape; refuses shapes that would broadcast to a matrix."""
    if margin is None:
        return 0.0
    if not torch.is_tensor(margin):
        return float(margin)
    if margin.numel() == 1:
        return margin.reshape(()).to(ref.dtype)
    if margin.numel() != ref.numel():
        raise ValueError(
            f"`margin` has shape {tuple(margin.shape)} but the rewards have shape {tuple(ref.shape)}; pass one margin "
            "per pair (or a scalar)."
        )
    return margin.reshape(ref.shape).to(ref.dtype)


def _reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        gap = chosen - rejected
        return {
            "accuracy": (gap > 0).float().mean(),
            "margin": gap.mean(),
            "chosen_rewards": chosen.mean(),
            "rejected_rewards": rejected.mean(),
        }


@register_loss("pairwise", kind="reward")
def pairwise_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: float | torch.Tensor | None = None,
) -> LossOutput:
    """Bradley–Terry pairwise reward-model loss: ``mean −log σ(r_c − r_r − m)``.

    ``r_c``/``r_r`` are the scores of the chosen/rejected responses, shapes ``(B,)`` (or any equal shapes, e.g.
    ``(B, 1)``). ``m`` is the margin by which the chosen score must exceed the rejected one (the convention of TRL's
    ``RewardTrainer``, Llama-2 paper §3.2.2): a scalar, or one value per pair (reshaped to the rewards' shape; a
    shape that would silently broadcast to a ``(B, B)`` matrix is refused). Computed with ``logsigmoid`` so large gaps
    neither overflow nor underflow.

    Metrics: ``accuracy`` (fraction with ``r_c > r_r``), ``margin`` (mean ``r_c − r_r``), ``chosen_rewards`` and
    ``rejected_rewards`` (means).
    """
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    m = _margin_like(margin, chosen_rewards)
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards - m).mean()
    return LossOutput(loss, _reward_metrics(chosen_rewards, rejected_rewards))


@register_loss("log_exp", kind="reward")
def log_exp_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: float | torch.Tensor | None = None,
) -> LossOutput:
    """Log-exp reward-model loss: ``mean log(1 + exp(r_r − r_c + m))``, computed as ``softplus``.

    This is the form used by OpenRLHF's ``LogExpLoss`` (and Anthropic's "preference model" papers). Mathematically it
    equals :func:`pairwise_loss` (``−log σ(x) = softplus(−x)``); it is kept as its own name so configs written for
    either code base resolve. Shapes, ``margin`` and metrics are as in :func:`pairwise_loss`.
    """
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    m = _margin_like(margin, chosen_rewards)
    loss = F.softplus(rejected_rewards - chosen_rewards + m).mean()
    return LossOutput(loss, _reward_metrics(chosen_rewards, rejected_rewards))


# ------------------------------------------------------------------------------------------------------ DPO / IPO


def _paired_metrics(
    beta: float,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios
        rejected_rewards = beta * rejected_logratios
        return {
            "chosen_rewards": chosen_rewards.mean(),
            "rejected_rewards": rejected_rewards.mean(),
            "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
            "reward_margin": (chosen_rewards - rejected_rewards).mean(),
            "chosen_logps": chosen_logps.mean(),
            "rejected_logps": rejected_logps.mean(),
        }


@register_loss("dpo", kind="preference", aliases=("sigmoid",))
def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> LossOutput:
    """Direct Preference Optimisation loss (Rafailov et al. 2023) and its IPO variant (Azar et al. 2023).

    With sequence log-probs ``π_c, π_r`` (policy) and ``ref_c, ref_r`` (reference), all ``(B,)``::

        Δ = (π_c − ref_c) − (π_r − ref_r)

    * ``loss_type="sigmoid"`` (DPO, with the *conservative* label smoothing ``ε`` of Mitchell 2023 / cDPO, which
      assumes a fraction ``ε`` of the labels is flipped)::

          ℓ = −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)

    * ``loss_type="ipo"`` (IPO, eq. 17 of Azar et al., with ``τ = β``)::

          ℓ = (Δ − 1/(2β))²

      IPO's log-probs are conventionally *averaged* over the response tokens (TRL's convention); the caller chooses
      what it passes here.

    The loss is the mean of ``ℓ`` over the batch. The reference log-probs are treated as constants.

    Args:
        beta: ``β > 0``, the inverse temperature of the implicit reward (IPO's ``τ``).
        loss_type: ``"sigmoid"`` or ``"ipo"``.
        label_smoothing: ``ε ∈ [0, 0.5]``; only for ``"sigmoid"`` (a non-zero value with ``"ipo"`` is an error).

    Metrics (detached means): ``chosen_rewards = β(π_c − ref_c)``, ``rejected_rewards = β(π_r − ref_r)``,
    ``reward_accuracy`` (fraction with chosen reward > rejected reward), ``reward_margin``, ``chosen_logps``,
    ``rejected_logps``.
    """
    check_same_shape(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    _check_beta(beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"Unknown DPO `loss_type` {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}.")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"`label_smoothing` must be in [0, 0.5], got {label_smoothing}.")
    if loss_type == "ipo" and label_smoothing != 0.0:
        raise ValueError("`label_smoothing` only applies to loss_type='sigmoid'; set it to 0 for IPO.")

    chosen_logratios = chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = rejected_logps - ref_rejected_logps.detach()
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
        if label_smoothing > 0:
            losses = (1.0 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-beta * delta)
    else:
        losses = (delta - 1.0 / (2.0 * beta)).square()
    metrics = _paired_metrics(beta, chosen_logps, rejected_logps, chosen_logratios, rejected_logratios)
    return LossOutput(losses.mean(), metrics)


@register_loss("ipo", kind="preference")
def ipo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """IPO loss (Azar et al. 2023): ``mean (Δ − 1/(2β))²``; :func:`dpo_loss` with ``loss_type="ipo"``.

    ``label_smoothing`` is accepted so that a trainer can call every ``"preference"`` loss with the same keywords,
    but it must be 0.
    """
    return dpo_loss(
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=beta,
        loss_type="ipo",
        label_smoothing=label_smoothing,
    )


# ------------------------------------------------------------------------------------------------------------ KTO


def _check_1d_pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    check_same_shape(**{name_a: a, name_b: b})
    if a.dim() != 1:
        raise ValueError(f"`{name_a}` must be 1-D (one log-prob per example), got shape {tuple(a.shape)}.")


def _kto_reference_point(policy_kl_logps: torch.Tensor | None, ref_kl_logps: torch.Tensor | None) -> torch.Tensor:
    """``clamp(mean(policy_kl_logps − ref_kl_logps), min=0)``, detached; ``0`` when no KL sample is given."""
    if policy_kl_logps is None or ref_kl_logps is None:
        if policy_kl_logps is not None or ref_kl_logps is not None:
            raise ValueError("Pass both `policy_kl_logps` and `ref_kl_logps`, or neither (KL reference point 0).")
        return torch.zeros(())
    _check_1d_pair("policy_kl_logps", policy_kl_logps, "ref_kl_logps", ref_kl_logps)
    with torch.no_grad():
        return _safe_mean(policy_kl_logps - ref_kl_logps).clamp(min=0)


@register_loss("kto", kind="unpaired")
def kto_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    policy_kl_logps: torch.Tensor | None,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> LossOutput:
    """Kahneman–Tversky Optimisation loss (Ethayarajh et al. 2024, eq. 7), on unpaired desirable/undesirable data.

    Inputs are 1-D sequence log-probs: ``(B_d,)`` for the desirable ("chosen") examples, ``(B_u,)`` for the
    undesirable ("rejected") ones, and ``(B_kl,)`` for the mismatched (prompt, completion) pairs that estimate the KL
    reference point. With log-ratios ``z = log π − log π_ref``::

        KL   = sg(clamp(mean(policy_kl_logps − ref_kl_logps), min=0))
        ℓ_d  = λ_d · (1 − σ(β(z_d − KL)))        for each desirable example
        ℓ_u  = λ_u · (1 − σ(β(KL − z_u)))        for each undesirable example
        loss = (Σ ℓ_d + Σ ℓ_u) / (B_d + B_u)

    i.e. the mean over all examples of the weighted per-example losses (TRL's convention; the KL is detached as in
    the paper). Passing ``policy_kl_logps=ref_kl_logps=None`` (or empty tensors) uses ``KL = 0``.

    Empty groups: a batch without desirable (``B_d = 0``) or without undesirable (``B_u = 0``) examples is valid and
    gives a finite loss and finite gradients from the other group. A batch with neither gives a loss of exactly ``0``
    that is still connected to the graph of the (empty) inputs, so ``backward()`` works and yields zero gradients
    (every rank of a distributed run can then call ``backward()``).

    Metrics: ``rewards/chosen`` and ``rewards/rejected`` (mean ``β·z`` of each group, ``0`` for an empty group),
    ``count/chosen``, ``count/rejected`` (the group sizes, for weighting the reward means across batches) and ``kl``.
    """
    _check_1d_pair("policy_chosen_logps", policy_chosen_logps, "ref_chosen_logps", ref_chosen_logps)
    _check_1d_pair("policy_rejected_logps", policy_rejected_logps, "ref_rejected_logps", ref_rejected_logps)
    _check_beta(beta)
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"`desirable_weight` and `undesirable_weight` must be >= 0, got {desirable_weight}, {undesirable_weight}."
        )
    kl = _kto_reference_point(policy_kl_logps, ref_kl_logps).to(
        device=policy_chosen_logps.device, dtype=policy_chosen_logps.dtype
    )

    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()
    # An empty group gives an empty loss tensor (sigmoid of an empty tensor), so its sum below is 0 and no nan appears.
    chosen_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (chosen_logratios - kl)))
    rejected_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - rejected_logratios)))
    count = chosen_losses.numel() + rejected_losses.numel()
    loss = (chosen_losses.sum() + rejected_losses.sum()) / max(count, 1)

    with torch.no_grad():
        metrics = {
            "rewards/chosen": _safe_mean(beta * chosen_logratios),
            "rewards/rejected": _safe_mean(beta * rejected_logratios),
            "count/chosen": torch.tensor(float(chosen_losses.numel())),
            "count/rejected": torch.tensor(float(rejected_losses.numel())),
            "kl": kl,
        }
    return LossOutput(loss, metrics)


@register_loss("vanilla_kto", kind="preference")
def vanilla_kto_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
) -> LossOutput:
    """Paired ("vanilla") KTO: each group's reference point is the other group's batch KL estimate.

    On paired data ``(B,)`` with log-ratios ``z_c = π_c − ref_c`` and ``z_r = π_r − ref_r``::

        KL_c = sg(clamp(mean(z_c), min=0)),   KL_r = sg(clamp(mean(z_r), min=0))
        loss = mean(cat(1 − σ(β(z_c − KL_r)),  1 − σ(β(KL_c − z_r))))

    (the form of OpenRLHF's ``VanillaKTOLoss``; the reference points are detached here, as in the KTO paper, so the
    gradient only flows through the per-example log-ratios). Requires ``B ≥ 1``.

    Metrics: ``chosen_rewards = β·z_c`` and ``rejected_rewards = β·z_r`` (means), ``reward_accuracy``,
    ``reward_margin``, ``chosen_logps``, ``rejected_logps``, ``kl_chosen``, ``kl_rejected``.
    """
    check_same_shape(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    _check_beta(beta)
    if chosen_logps.numel() == 0:
        raise ValueError("`vanilla_kto_loss` needs at least one (chosen, rejected) pair; got an empty batch.")
    chosen_logratios = chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = rejected_logps - ref_rejected_logps.detach()
    kl_chosen = chosen_logratios.detach().mean().clamp(min=0)
    kl_rejected = rejected_logratios.detach().mean().clamp(min=0)
    losses = torch.cat(
        (
            (1.0 - torch.sigmoid(beta * (chosen_logratios - kl_rejected))).reshape(-1),
            (1.0 - torch.sigmoid(beta * (kl_chosen - rejected_logratios))).reshape(-1),
        )
    )
    metrics = _paired_metrics(beta, chosen_logps, rejected_logps, chosen_logratios, rejected_logratios)
    metrics["kl_chosen"] = kl_chosen
    metrics["kl_rejected"] = kl_rejected
    return LossOutput(losses.mean(), metrics)
