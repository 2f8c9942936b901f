"""Self-normalised importance weights used by the twist (proposal) losses and the RePULSe p-loss.

Notation (docs/algorithms.md §2, §7.1): for a prompt, N responses ``s_1..s_N`` were sampled from a proposal ``q_old``
(log-probs recorded at sampling time). ``p`` is the target's base model, ``log φ_i = β·R(s_i)`` the sequence-level
potential, and ``v_{i,t} = log ψ_t`` the twist. The target is ``σ(s) ∝ p(s)·φ(s)``.

Layout: per-token tensors are ``(P, N, T)`` (P prompts × N samples, right padding, ``mask`` 1 on real tokens) and
sequence-level ones ``(P, N)``. Weights are normalised over the N samples **of each prompt**. A flat batch
``(B, T)`` / ``(B,)`` is accepted everywhere and treated as a single group (P = 1); the result then has the flat
layout too (``(B,)`` or ``(B, T)``).

Every function here returns **detached** tensors computed in fp32 (fp64 when an input is fp64), and never reads a
masked-out value: those may hold anything, ``inf`` and ``nan`` included.
"""

from __future__ import annotations

import math

import torch

from ..ops.stats import masked_sum
from .base import check_sequence_shape, check_token_shape, is_flat_batch, zero_masked

__all__ = [
    "ORIGINAL_INDICATOR_THRESHOLD",
    "effective_sample_size",
    "per_step_log_weights",
    "per_step_weights",
    "sequence_log_weights",
    "sigma_weights",
]

#: The indicator threshold of the original code, which kept a sample when ``exp(log φ) > 2e-16``.
ORIGINAL_INDICATOR_THRESHOLD: float = math.log(2e-16)


def _weight_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when any input is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _masked_softmax(logits: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax over ``dim`` among the ``valid`` entries; invalid entries get exactly 0, an all-invalid slice all 0."""
    x = torch.where(valid, logits, torch.full((), -math.inf, dtype=logits.dtype, device=logits.device))
    top = x.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(x - top)
    total = e.sum(dim=dim, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


# ----------------------------------------------------------------------------------------------------------------
# Sequence-level (σ) weights
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def sequence_log_weights(
    ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor, log_phi: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Unnormalised log importance weights of whole samples towards ``σ ∝ p·φ``.

    ``log w^σ_i = Σ_t m_{i,t} log p(s_{i,t}) + log φ_i − Σ_t m_{i,t} log q_old(s_{i,t})``

    The sums are **masked** (fix of docs/algorithms.md B1: the original summed unmasked fresh log-probs over a
    left-padded window, so the padding of a response changed its weight).

    Args:
        ref_logprobs: ``(P, N, T)`` per-token ``log p`` of the sampled tokens.
        old_logprobs: ``(P, N, T)`` per-token ``log q_old`` (the proposal at sampling time).
        log_phi: ``(P, N)`` sequence-level ``log φ = β·R``.
        mask: ``(P, N, T)``, 1 on real tokens.

    Returns:
        ``(P, N)`` log-weights (``(B,)`` for a flat batch), detached, fp32.
    """
    flat = is_flat_batch(mask)
    check_token_shape(ref_logprobs, "ref_logprobs", mask)
    check_token_shape(old_logprobs, "old_logprobs", mask)
    check_sequence_shape(log_phi, "log_phi", mask)
    dtype = _weight_dtype(ref_logprobs, old_logprobs, log_phi)
    ref, old, phi = (x.detach().to(dtype) for x in (ref_logprobs, old_logprobs, log_phi))
    out = masked_sum(ref, mask, dim=-1) + phi - masked_sum(old, mask, dim=-1)
    return out if not flat else out.reshape(log_phi.shape)


@torch.no_grad()
def sigma_weights(
    ref_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    *,
    indicator_threshold: float | None = None,
    uniform: bool = False,
) -> torch.Tensor:
    """Self-normalised σ-weights ``w_i = softmax_i(log w^σ_i)`` over the N samples of each prompt.

    ``w_i = exp(log w^σ_i) / Σ_j exp(log w^σ_j)`` with ``log w^σ`` from :func:`sequence_log_weights` (masked sums).

    Args:
        ref_logprobs, old_logprobs, log_phi, mask: as in :func:`sequence_log_weights`.
        indicator_threshold: if set, the normalised weights are multiplied by ``1[log φ_i > indicator_threshold]``
            **without renormalising**, so a prompt with no sample above the threshold gets all-zero weights (no
            update) instead of uniform ones. The original code used ``exp(log φ) > 2e-16``, i.e.
            :data:`ORIGINAL_INDICATOR_THRESHOLD`.
        uniform: use ``w_i = 1/N`` (the original ``--uniform_reweight``); the indicator, if set, still applies.

    Returns:
        ``(P, N)`` weights summing to 1 over N per prompt (or 0 under the indicator), ``(B,)`` for a flat batch;
        detached, fp32. A prompt whose log-weights are all ``-inf`` gets all-zero weights rather than ``nan``.
    """
    log_w = sequence_log_weights(ref_logprobs, old_logprobs, log_phi, mask)
    grouped = log_w.unsqueeze(0) if is_flat_batch(mask) else log_w
    if uniform:
        w = torch.full_like(grouped, 1.0 / grouped.shape[-1])
    else:
        w = _masked_softmax(grouped, torch.ones_like(grouped, dtype=torch.bool), dim=-1)
    if indicator_threshold is not None:
        phi = log_phi.detach().to(w.dtype).reshape(w.shape)
        w = w * (phi > indicator_threshold).to(w.dtype)
    return w.reshape(log_w.shape)


# ----------------------------------------------------------------------------------------------------------------
# Per-step (π_t) weights
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def per_step_log_weights(
    ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Unnormalised log weights of the prefixes ``s_{1:t}`` towards ``π_t ∝ p(s_{1:t})·ψ_t(s_{1:t})``.

    ``log w^π_{i,t} = Σ_{k≤t} m_{i,k} log p(s_{i,k}) + v_{i,t} − Σ_{k≤t} m_{i,k} log q_old(s_{i,k})``

    (cumulative masked sums). A masked-out position ``(i, t)`` is *absent* from the per-step population and gets
    ``-inf`` (fix of docs/algorithms.md B5: the original gave padded samples log-weight 0, i.e. a real weight).

    Args:
        ref_logprobs, old_logprobs, mask: ``(P, N, T)`` (or ``(B, T)``).
        v: ``(P, N, T)`` twist values ``log ψ_t``; detached here.

    Returns:
        ``(P, N, T)`` log-weights, ``-inf`` at masked positions; detached, fp32.
    """
    is_flat_batch(mask)
    for name, x in (("ref_logprobs", ref_logprobs), ("old_logprobs", old_logprobs), ("v", v)):
        check_token_shape(x, name, mask)
    dtype = _weight_dtype(ref_logprobs, old_logprobs, v)
    valid = mask != 0
    ref, old, vv = (zero_masked(x.detach().to(dtype), valid) for x in (ref_logprobs, old_logprobs, v))
    log_w = torch.cumsum(ref - old, dim=-1) + vv
    return torch.where(valid, log_w, torch.full((), -math.inf, dtype=dtype, device=log_w.device))


@torch.no_grad()
def per_step_weights(
    ref_logprobs: torch.Tensor, old_logprobs: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-step self-normalised weights ``u_{i,t} = softmax_i(log w^π_{i,t})`` per prompt and per position t.

    The softmax at position t runs over the samples **valid at t** (``m_{i,t} = 1``); padded entries get weight
    exactly 0 and the valid ones are renormalised among themselves (fix of B5). A position with no valid sample
    gets all-zero weights.

    Returns:
        ``(P, N, T)`` (or ``(B, T)``) weights; each ``(p, :, t)`` slice sums to 1 or is all 0. Detached, fp32.
    """
    log_w = per_step_log_weights(ref_logprobs, old_logprobs, v, mask)
    return _masked_softmax(log_w, (mask != 0), dim=-2)


def effective_sample_size(weights: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Kish effective sample size ``(Σ_i w_i)² / Σ_i w_i²`` over ``dim`` (for logging).

    For weights that sum to 1 this is ``1/Σ w²`` (between 1 and N). All-zero weights (e.g. a prompt removed by the
    indicator) give 0. ``weights`` ``(P, N)`` → ``(P,)``; ``(P, N, T)`` with ``dim=-2`` → ``(P, T)``.
    """
    w = weights.detach().to(_weight_dtype(weights))
    sq = (w * w).sum(dim=dim)
    total = w.sum(dim=dim)
    return torch.where(sq > 0, total * total / torch.where(sq > 0, sq, torch.ones_like(sq)), torch.zeros_like(sq))
