"""Per-token KL estimators between the policy ``π`` and the reference ``π_ref``.

All estimators work on the log-probabilities of the *sampled* tokens only (tokens drawn from ``π``), so they are
Monte Carlo estimates of ``KL(π‖π_ref) = E_{x∼π}[log π(x) − log π_ref(x)]`` (Schulman, "Approximating KL
Divergence", 2020). With the log-ratio ``logr = log π_ref(x) − log π(x)``:

- ``k1 = −logr``: unbiased; single tokens may be negative (that is normal, only the mean is ``≥ 0``).
- ``k2 = logr² / 2``: biased, low variance, ``≥ 0``.
- ``k3 = exp(logr) − 1 − logr``: unbiased and ``≥ 0``.

``k1`` is what the research code uses in the reward (``−λ·k1`` per token). ``k3`` is unbiased *and* non-negative,
which is why GRPO-style losses prefer it. ``k2`` is a biased estimate of the value, but used as a loss on on-policy
samples its expected gradient is that of ``KL(π‖π_ref)``.
"""

from __future__ import annotations

import torch

__all__ = ["KL_ESTIMATORS", "kl_k1", "kl_k2", "kl_k3", "kl_estimate", "full_kl"]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = log π − log π_ref`` elementwise. Shapes: any, broadcastable; returns the broadcast shape."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = (log π_ref − log π)² / 2`` elementwise (always ``≥ 0``)."""
    logr = ref_logprobs - logprobs
    return 0.5 * logr.square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(logr) − 1 − logr`` with ``logr = log π_ref − log π`` (always ``≥ 0``).

    Evaluated as ``expm1(logr) − logr``, which keeps full relative precision when ``|logr|`` is small.
    """
    logr = ref_logprobs - logprobs
    return torch.expm1(logr) - logr


_ESTIMATOR_FNS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate ``k(log π, log π_ref)`` for the sampled tokens, zeroed where ``mask == 0``.

    Args:
        logprobs: ``(B, T)`` (or any shape) log-probabilities of the sampled tokens under the policy.
        ref_logprobs: same shape, log-probabilities of the same tokens under the reference.
        estimator: ``"k1"`` (``log π − log π_ref``), ``"k2"`` (``(log π_ref − log π)²/2``) or ``"k3"``
            (``exp(log π_ref − log π) − 1 − (log π_ref − log π)``). See the module docstring.
        mask: optional tensor of the same shape; entries where it is zero are set to exactly ``0`` in the output,
            whatever the inputs hold there (``inf``/``nan`` included).

    Returns:
        Tensor of the broadcast shape of the inputs holding the per-token estimate.
    """
    fn = _ESTIMATOR_FNS.get(estimator)
    if fn is None:
        raise ValueError(f"Unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}.")
    if mask is None:
        return fn(logprobs, ref_logprobs)
    keep = mask != 0
    zero = torch.zeros((), dtype=torch.result_type(logprobs, ref_logprobs), device=logprobs.device)
    # Zero the inputs first so that garbage in padded positions cannot leak into the gradient as nan.
    kl = fn(torch.where(keep, logprobs, zero), torch.where(keep, ref_logprobs, zero))
    return torch.where(keep, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


def full_kl(
    logprobs_full: torch.Tensor, ref_logprobs_full: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact per-position ``KL(π‖π_ref) = Σ_v π(v)·(log π(v) − log π_ref(v))`` from full-vocabulary log-probs.

    Args:
        logprobs_full: ``(..., V)`` normalised log-probabilities of the policy (e.g. from ``full_logprobs``).
        ref_logprobs_full: ``(..., V)`` normalised log-probabilities of the reference.
        mask: optional ``(...)`` mask; positions where it is zero give ``0``.

    Returns:
        ``(...)`` tensor. Vocabulary entries with ``π(v) = 0`` contribute ``0`` (the ``0·log 0`` convention).
    """
    p = logprobs_full.exp()
    terms = torch.where(p > 0, p * (logprobs_full - ref_logprobs_full), torch.zeros_like(p))
    kl = terms.sum(-1)
    if mask is not None:
        kl = torch.where(mask != 0, kl, torch.zeros_like(kl))
    return kl
