"""Preference losses that push undesirable completions down: negative-only DPO, unlikelihood, SFT-regularised DPO.

They share the ``"preference"`` calling convention of :mod:`trl_ext.losses.preference`::

    loss_fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, ...)

with sequence log-probs of shape ``(B,)`` (the sum of the completion's token log-probs). Losses that also need
token-level log-probs take them as keywords (``chosen_token_logps`` / ``rejected_token_logps`` of shape ``(B, T)``
with a 0/1 mask of the same shape); a trainer passes only the keywords a loss declares.

Losses that never read the chosen completion carry the attribute ``uses_chosen = False`` (see :func:`uses_chosen`);
they accept ``None`` for ``chosen_logps`` / ``ref_chosen_logps`` and so also train on data that has no chosen
completion at all (for instance the bad samples a harmlessness run collected).

Every loss returns a finite value for an empty batch (``B = 0``): ``0``, still connected to the inputs' graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .base import AGGREGATIONS, LossOutput, aggregate, check_same_shape
from .preference import dpo_loss
from .registry import register_loss

__all__ = ["negative_dpo_loss", "sft_regularised_dpo_loss", "unlikelihood_loss", "uses_chosen"]


def uses_chosen(loss_fn: Callable) -> bool:
    """Whether a preference loss reads the chosen completion (``False`` for losses marked ``uses_chosen=False``)."""
    return bool(getattr(loss_fn, "uses_chosen", True))


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"`beta` must be > 0, got {beta}.")


def _mean_or_zero(x: torch.Tensor) -> torch.Tensor:
    """Mean of ``x``; for an empty ``x`` a ``0`` that stays attached to ``x``'s graph (so ``backward()`` works)."""
    return x.mean() if x.numel() > 0 else x.sum() * 0.0


@register_loss("negative_dpo", kind="preference", aliases=("npo",))
def negative_dpo_loss(
    chosen_logps: torch.Tensor | None,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
) -> LossOutput:
    """Negative-only DPO: push the rejected completion below the reference, without a chosen one.

    With the rejected log-ratio ``z_r = log π(y_l|x) − log π_ref(y_l|x)`` (shape ``(B,)``)::

        ℓ = −log σ(−β·z_r) = softplus(β·z_r),        loss = mean_B ℓ

    This is DPO's loss with the chosen term removed (the chosen log-ratio set to 0). It is the NPO loss of Zhang et
    al. 2024 ("Negative Preference Optimization", ``(2/β)·log(1 + (π/π_ref)^β)``) without NPO's ``2/β`` factor, so
    ``beta`` plays the same role as in DPO: the gradient ``β·σ(β z_r)·∇log π(y_l)`` fades once the completion is
    already much less likely than under the reference, which keeps the policy from collapsing the way plain
    likelihood minimisation (``−log π`` ascent) does. The reference log-probs are constants. ``chosen_logps`` and
    ``ref_chosen_logps`` are ignored (pass ``None``).

    Metrics: ``rejected_rewards`` (mean ``β·z_r``), ``rejected_logps`` (mean ``log π(y_l)``), ``count/rejected``.
    """
    check_same_shape(rejected_logps=rejected_logps, ref_rejected_logps=ref_rejected_logps)
    _check_beta(beta)
    rejected_logratios = rejected_logps - ref_rejected_logps.detach()
    loss = _mean_or_zero(F.softplus(beta * rejected_logratios))
    with torch.no_grad():
        metrics = {
            "rejected_rewards": _mean_or_zero(beta * rejected_logratios),
            "rejected_logps": _mean_or_zero(rejected_logps),
            "count/rejected": torch.tensor(float(rejected_logps.numel())),
        }
    return LossOutput(loss, metrics)


negative_dpo_loss.uses_chosen = False


@register_loss("unlikelihood", kind="preference")
def unlikelihood_loss(
    chosen_logps: torch.Tensor | None,
    rejected_logps: torch.Tensor | None,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    rejected_token_logps: torch.Tensor,
    rejected_mask: torch.Tensor,
    eps: float = 1e-6,
    aggregation: str = "seq-mean-token-sum",
) -> LossOutput:
    """Token-level unlikelihood on the rejected completion (Welleck et al. 2020): lower ``π`` of each of its tokens.

    With the per-token log-probs ``log π(y_t | x, y_<t)`` of the rejected completion (``(B, T)``, mask ``m``)::

        ℓ_t  = −log(1 − π(y_t | x, y_<t))      computed as −log(max(−expm1(log π), eps))
        loss = aggregate(ℓ, m)                 default: Σ_t ℓ_t m_t per sequence, mean over sequences

    ``eps`` bounds each token's term by ``−log eps`` (≈ 13.8 for the default) when a token is already almost
    certain, where ``1 − π`` would round to 0; such a token then gets no gradient. ``aggregation`` is one of
    :data:`~trl_ext.losses.AGGREGATIONS` (``"seq-mean-token-mean"`` averages over each sequence's tokens instead of
    summing). The sequence-level arguments are unused (the loss needs no reference); they are there so every
    ``"preference"`` loss can be called the same way.

    Metrics: ``rejected_token_prob`` (mean ``π`` over the real tokens), ``count/rejected``.
    """
    check_same_shape(rejected_token_logps=rejected_token_logps, rejected_mask=rejected_mask)
    if not 0.0 < eps < 1.0:
        raise ValueError(f"`eps` must be in (0, 1), got {eps}.")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"Unknown aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}.")
    mask = rejected_mask.to(rejected_token_logps.dtype)
    if rejected_token_logps.shape[0] == 0:
        return LossOutput(rejected_token_logps.sum() * 0.0, {"rejected_token_prob": 0.0, "count/rejected": 0.0})
    # Masked positions may hold anything (padding): zero them before exp so they cannot overflow or produce nan.
    safe_logps = torch.where(mask != 0, rejected_token_logps, torch.zeros_like(rejected_token_logps))
    complement = (-torch.expm1(safe_logps.clamp(max=0.0))).clamp(min=eps)
    per_token = -torch.log(complement)
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        probs = safe_logps.exp() * mask
        metrics = {
            "rejected_token_prob": probs.sum() / mask.sum().clamp(min=1),
            "count/rejected": torch.tensor(float(rejected_token_logps.shape[0])),
        }
    return LossOutput(loss, metrics)


unlikelihood_loss.uses_chosen = False


@register_loss("sft_regularised", kind="preference", aliases=("sft_regularized",))
def sft_regularised_dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    chosen_token_logps: torch.Tensor,
    chosen_mask: torch.Tensor,
    beta: float = 0.1,
    sft_coef: float = 1.0,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """DPO plus an NLL term on the chosen completion, so the chosen log-probs do not fall during DPO.

    With the DPO loss of :func:`~trl_ext.losses.preference.dpo_loss` (sigmoid, conservative ``label_smoothing``)
    and the chosen per-token log-probs ``log π(y_c,t | ·)`` (``(B, T)``, mask ``m``)::

        NLL  = −Σ_{b,t} m·log π(y_c,t) / Σ_{b,t} m          (token mean over the batch's chosen tokens)
        loss = DPO + sft_coef · NLL

    The NLL is the token mean used by TRL's ``loss_type="sft"`` (and the length-normalised NLL of RPO, Pang et al.
    2024), so ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, c]`` in TRL matches ``sft_coef=c`` here.

    Metrics: those of :func:`~trl_ext.losses.preference.dpo_loss`, plus ``dpo`` and ``nll`` (the two terms).
    """
    check_same_shape(chosen_token_logps=chosen_token_logps, chosen_mask=chosen_mask)
    if sft_coef < 0:
        raise ValueError(f"`sft_coef` must be >= 0, got {sft_coef}.")
    dpo = dpo_loss(
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    mask = chosen_mask.to(chosen_token_logps.dtype)
    safe_logps = torch.where(mask != 0, chosen_token_logps, torch.zeros_like(chosen_token_logps))
    nll = -(safe_logps * mask).sum() / mask.sum().clamp(min=1)
    metrics = dict(dpo.metrics)
    metrics.update({"dpo": dpo.loss.detach(), "nll": nll.detach()})
    return LossOutput(dpo.loss + sft_coef * nll, metrics)
