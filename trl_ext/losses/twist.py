"""Twist (proposal) losses: train ``q`` / the twist ``ψ`` towards the target ``σ(s) ∝ p(s)·φ(s)``.

Common arguments (registry kind ``"twist"``, docs/algorithms.md §6–§7):

* ``v`` ``(P, N, T)``: the twist ``log ψ_t`` at each sampled token, **with gradient** (e.g. for the paper's
  ``policy_psi_q_p_s_t`` parameterisation ``v_t = log q_ξ(s_t|s_<t) − sg log p(s_t|s_<t)``).
* ``log_phi`` ``(P, N)``: ``log φ = β·R`` of each sample (constant).
* ``mask`` ``(P, N, T)``: 1 on real tokens (right padding).
* ``old_logprobs`` ``(P, N, T)``: ``log q_old`` of the samples at sampling time (constant).
* ``ref_logprobs`` ``(P, N, T)``: ``log p`` of the target's base model (constant).

Importance weights (:mod:`trl_ext.losses.weights`) are normalised over the N samples of each prompt, computed in
fp32 and detached; a flat ``(B, T)``/``(B,)`` batch is one prompt group. Each loss reduces its ``(P, N, T)``
per-token loss with :func:`~trl_ext.losses.base.aggregate` (default ``"seq-mean-token-mean"``, the original
``mean_{P,N} masked_mean_t``). Inputs are never modified and masked-out positions are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
from .ppo import clipped_value_loss
from .registry import register_loss
from .weights import effective_sample_size, per_step_weights, sigma_weights

__all__ = ["ctl_loss", "ctl_no_second_term_loss", "dpg_loss", "mixed_ctl_value_loss", "sixo_approx_loss", "sixo_loss"]


def _twist_inputs(v, log_phi, mask, old_logprobs, ref_logprobs):
    """Check shapes and return the grouped ``(v, log_phi, mask, old, ref)``."""
    flat = is_flat_batch(mask)
    for name, x in (("v", v), ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        check_token_shape(x, name, mask)
    check_sequence_shape(log_phi, "log_phi", mask)
    return (
        as_grouped(v, "v", 3, flat),
        as_grouped(log_phi, "log_phi", 2, flat),
        as_grouped(mask, "mask", 3, flat),
        as_grouped(old_logprobs, "old_logprobs", 3, flat),
        as_grouped(ref_logprobs, "ref_logprobs", 3, flat),
    )


def _weight_metrics(w: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"ess": effective_sample_size(w).mean(), "max_weight": w.max()}


def _coef_times(coef: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``coef · x`` in the wider of the two dtypes (at least fp32)."""
    dtype = torch.promote_types(coef.dtype, x.dtype)
    return coef.to(dtype) * x.to(dtype)


@register_loss("ctl", kind="twist")
def ctl_loss(
    v: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    second_term: bool = True,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """Contrastive twist learning (CTL): ``ℓ_{i,t} = −(w_i − u_{i,t})·v_{i,t}``.

    * ``w_i = softmax_i(Σ_t m log p + log φ_i − Σ_t m log q_old)`` — σ-weights of whole samples
      (:func:`~trl_ext.losses.weights.sigma_weights`).
    * ``u_{i,t} = softmax_{i valid at t}(Σ_{k≤t} m log p + v_{i,t} − Σ_{k≤t} m log q_old)`` — weights towards the
      intermediate target ``π_t ∝ p(s_{1:t})ψ_t`` (:func:`~trl_ext.losses.weights.per_step_weights`, with ``sg(v)``).

    The gradient ``−Σ (w_i − u_{i,t}) ∇v_{i,t}`` is the SIS estimate of ``−(E_σ[∇log ψ_t] − E_{π_t}[∇log ψ_t])``.
    For ``v_t = log q_ξ(s_t|s_<t) − sg log p`` the u-term has exactly zero expectation (a control variate) and the
    loss is a σ-weighted maximum likelihood of q, i.e. forward KL(σ‖q). ``second_term=False`` drops it
    (``ℓ = −w_i v_{i,t}``, the ``ctl_nosecondterm`` variant).

    Shapes: see the module docstring. Stop-gradients: ``w`` and ``u`` (computed from ``sg(v)``); the gradient reaches
    ``v`` only. Metrics: ``ess`` (mean over prompts of ``1/Σw²``), ``max_weight``, ``v_mean``.
    """
    v3, phi, m, old, ref = _twist_inputs(v, log_phi, mask, old_logprobs, ref_logprobs)
    valid = m != 0
    w = sigma_weights(ref, old, phi, m)
    coef = w.unsqueeze(-1).expand(m.shape)
    if second_term:
        coef = coef - per_step_weights(ref, old, v3, m)
    vz = zero_masked(v3, valid)
    loss = aggregate(-_coef_times(coef, vz), m, aggregation, normalizer)
    metrics = {**_weight_metrics(w), "v_mean": masked_mean(vz.detach(), m)}
    return LossOutput(loss, metrics)


@register_loss("ctl_no_second_term", kind="twist", aliases=("ctl_nosecondterm",))
def ctl_no_second_term_loss(
    v: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """CTL without the per-step term: ``ℓ_{i,t} = −w_i·v_{i,t}`` (σ-weighted likelihood of the twist).

    Equivalent to :func:`ctl_loss` with ``second_term=False``; only sensible when the u-term has zero expectation
    anyway (the ``policy_psi_q_p_*`` parameterisations).
    """
    return ctl_loss(
        v, log_phi, mask, old_logprobs, ref_logprobs, second_term=False, aggregation=aggregation, normalizer=normalizer
    )


@register_loss("sixo", kind="twist")
def sixo_loss(
    v: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    variant: str = "exact",
    base_v: torch.Tensor | None = None,
    base_mask: torch.Tensor | None = None,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
    base_normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """SIXO: the twist as a classifier of σ-samples (positives) against base samples (negatives).

    ``L = −( agg_{mask}( w_i · logσ(v_{i,t}) ) + agg( neg ) )`` with ``w`` the σ-weights and

    * ``variant="exact"`` (registered ``"sixo"``): ``neg_{j,t} = logσ(−v^{base}_{j,t}) / N`` on fresh samples of
      the base ``p_0`` for the same prompts (``base_v``, ``(P, N_b, T_b)``), aggregated over **their own**
      ``base_mask`` (fix of B10: the original used the q-samples' mask). ``N`` is the number of q-samples per
      prompt, so that both terms carry the same ``1/N`` scale of the outer mean (``Σ_i w_i`` vs ``mean_j``).
    * ``variant="approx"`` (registered ``"sixo_approx"``/``"sixo_approxneg"``): ``neg_{i,t} = ũ_i · logσ(−v_{i,t})``
      on the q-samples, with ``ũ = softmax_i(Σ m log p − Σ m log q_old)`` (σ-weights with ``log φ = 0``, i.e.
      self-normalised IS towards ``p``).

    ``logσ(−x)`` is computed with ``F.logsigmoid`` (finite for large ``|x|``), never as ``log(1 − sigmoid(x))``.
    ``base_normalizer`` is the normalizer of the exact negative term (defaults to ``normalizer``).

    Stop-gradients: ``w``, ``ũ``. Metrics: ``ess``, ``max_weight``, ``pos_term``, ``neg_term``.
    """
    if variant not in ("exact", "approx"):
        raise ValueError(f"Unknown SIXO variant {variant!r}; choose 'exact' or 'approx'.")
    v3, phi, m, old, ref = _twist_inputs(v, log_phi, mask, old_logprobs, ref_logprobs)
    valid = m != 0
    w = sigma_weights(ref, old, phi, m)
    vz = zero_masked(v3, valid)
    pos = aggregate(_coef_times(w.unsqueeze(-1), F.logsigmoid(vz)), m, aggregation, normalizer)
    if variant == "approx":
        u = sigma_weights(ref, old, torch.zeros_like(phi, dtype=w.dtype), m)
        neg = aggregate(_coef_times(u.unsqueeze(-1), F.logsigmoid(-vz)), m, aggregation, normalizer)
    else:
        if base_v is None or base_mask is None:
            raise ValueError(
                "SIXO's exact variant ('sixo') needs `base_v` and `base_mask` from fresh samples of the base model "
                "p_0 for the same prompts; pass them, or use the 'sixo_approx' loss (variant='approx')."
            )
        flat_b = is_flat_batch(base_mask, "base_mask")
        check_token_shape(base_v, "base_v", base_mask)
        bm = as_grouped(base_mask, "base_mask", 3, flat_b)
        bv = zero_masked(as_grouped(base_v, "base_v", 3, flat_b), bm != 0)
        n = v3.shape[-2]
        neg_norm = second_normalizer(aggregation, normalizer, base_normalizer, "base_normalizer")
        neg = aggregate(F.logsigmoid(-bv) / n, bm, aggregation, neg_norm)
    metrics = {**_weight_metrics(w), "pos_term": pos, "neg_term": neg}
    return LossOutput(-(pos + neg), metrics)


@register_loss("sixo_approx", kind="twist", aliases=("sixo_approxneg",))
def sixo_approx_loss(
    v: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    base_v: torch.Tensor | None = None,
    base_mask: torch.Tensor | None = None,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """SIXO with the approximate (IS-reweighted q-sample) negative term; see :func:`sixo_loss` ``variant="approx"``.

    ``base_v``/``base_mask`` are accepted so a trainer can call every SIXO variant alike, and ignored.
    """
    return sixo_loss(
        v, log_phi, mask, old_logprobs, ref_logprobs, variant="approx", aggregation=aggregation, normalizer=normalizer
    )


@register_loss("dpg", kind="twist")
def dpg_loss(
    v: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    log_psi_all: torch.Tensor,
    ref_logprobs_all: torch.Tensor,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """Distributional policy gradient for a twisted proposal ``q_t(y) ∝ p(y|s_<t)·ψ_t(y)``.

    ``E_t[v] = Σ_y sg[softmax_y(log p_all + log ψ_all)]_y · log ψ_all[y]`` and
    ``ℓ_{i,t} = −w_i · (v_{i,t} − E_t[v])``, the SIS estimate of the forward-KL(σ‖q) gradient.

    Args:
        v: ``(P, N, T)`` twist at the sampled tokens; must equal ``log_psi_all`` gathered at them (not checked).
        log_psi_all: ``(P, N, T, V)`` twist for every vocabulary token, with gradient.
        ref_logprobs_all: ``(P, N, T, V)`` ``log p`` over the vocabulary (constant).
        Others: see the module docstring. Flat ``(B, T[, V])`` inputs form one prompt group.

    Stop-gradients: ``w`` and the softmax weights of the expectation; the gradient flows into ``v`` and into
    ``log_psi_all`` through the expectation term. Metrics: ``ess``, ``max_weight``, ``expected_v_mean``.
    """
    v3, phi, m, old, ref = _twist_inputs(v, log_phi, mask, old_logprobs, ref_logprobs)
    flat = is_flat_batch(mask)
    if log_psi_all.shape[:-1] != mask.shape or ref_logprobs_all.shape != log_psi_all.shape:
        raise ValueError(
            f"`log_psi_all` {tuple(log_psi_all.shape)} and `ref_logprobs_all` {tuple(ref_logprobs_all.shape)} must "
            f"both be the mask's shape {tuple(mask.shape)} plus a vocabulary axis."
        )
    valid = m != 0
    psi = zero_masked(as_grouped(log_psi_all, "log_psi_all", 4, flat), valid)
    w = sigma_weights(ref, old, phi, m)
    with torch.no_grad():
        ref_all = zero_masked(as_grouped(ref_logprobs_all, "ref_logprobs_all", 4, flat).detach(), valid)
        dtype = torch.promote_types(torch.promote_types(psi.dtype, ref_all.dtype), torch.float32)
        probs = torch.softmax(ref_all.to(dtype) + psi.detach().to(dtype), dim=-1)
    expected_v = (probs * psi.to(dtype)).sum(dim=-1)
    vz = zero_masked(v3, valid)
    loss = aggregate(-_coef_times(w.unsqueeze(-1), vz.to(dtype) - expected_v), m, aggregation, normalizer)
    metrics = {**_weight_metrics(w), "expected_v_mean": masked_mean(expected_v.detach(), m)}
    return LossOutput(loss, metrics)


@register_loss("mixed_ctl_value", kind="twist")
def mixed_ctl_value_loss(
    v: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    alpha: float = 1.0,
    cliprange_value: float | None = 0.2,
    second_term: bool = True,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """``L = α·CTL + clipped value loss`` (the original MixedCTLValueLoss; note the sum is not convex).

    The CTL part is :func:`ctl_loss`; the value part is
    :func:`~trl_ext.losses.ppo.clipped_value_loss` ``(values, old_values, returns, mask)`` with
    ``0.5·max((V − G)², (V_old + clip(V − V_old, ±ε) − G)²)`` per token, on the same mask and aggregation.

    Metrics: ``ctl_loss``, ``value_loss``, the CTL metrics, and the value-loss metrics prefixed ``value_``.
    """
    ctl = ctl_loss(
        v,
        log_phi,
        mask,
        old_logprobs,
        ref_logprobs,
        second_term=second_term,
        aggregation=aggregation,
        normalizer=normalizer,
    )
    val = clipped_value_loss(
        values,
        old_values,
        returns,
        mask,
        cliprange_value=cliprange_value,
        aggregation=aggregation,
        normalizer=normalizer,
    )
    metrics = {
        "ctl_loss": ctl.loss,
        "value_loss": val.loss,
        **ctl.metrics,
        **{(k if k.startswith("value") else f"value_{k}"): x for k, x in val.metrics.items()},
    }
    return LossOutput(alpha * ctl.loss + val.loss, metrics)
