r"""The arithmetic of sequential Monte Carlo (SMC) over particle groups, as pure tensor functions.

Particles come in *groups* of ``K`` (one group per prompt, or per independent run): weights, effective sample sizes,
resampling and evidence estimates are computed within a group, along the last axis of ``(G, K)`` tensors. Weights are
carried as log-weights in float64; a ``-inf`` log-weight is a particle of weight zero.

Twisted SMC (Zhao et al., ICML 2024, "Probabilistic Inference in Language Models via Twisted SMC") targets
``σ(s) ∝ p(s)·φ(s)`` through intermediate targets ``π_t(s_{1:t}) ∝ p(s_{1:t})·ψ_t(s_{1:t})``. A particle extended by
``s_t ~ q(·|s_{<t})`` has the incremental log-weight (:func:`incremental_log_weight`)

    log w_t = log p(s_t|s_{<t}) + log ψ_t(s_{1:t}) − log q(s_t|s_{<t}) − log ψ_{t−1}(s_{1:t−1}),

with ``ψ_0 ≡ 1`` and, at the step where a sequence is complete, ``φ`` in place of ``ψ_t``. The products of these
weights telescope to ``p(s)·φ(s)/q(s)`` when nothing is resampled (plain importance sampling).

Evidence: every time a group is resampled, the mean of its weights since the last resampling is a factor of the
estimate (:func:`log_mean_exp`), and so is the mean of the final weights:

    Ẑ = Π_{resampling epochs e} (1/K) Σ_k w_k^{(e)}.

``E[Ẑ] = Z`` (unbiased) and, by Jensen, ``E[log Ẑ] ≤ log Z`` (a stochastic lower bound).

Resampling schemes (``(G, K)`` log-weights → ``(G, K)`` ancestor indices in ``[0, K)``):

- :func:`multinomial_resample`: ``K`` independent draws from the normalised weights;
- :func:`systematic_resample`: one uniform ``u ~ U[0, 1)`` per group and the points ``(u + k)/K``; every particle is
  copied ``⌊K·w_k⌋`` or ``⌈K·w_k⌉`` times (lower variance than multinomial);
- :func:`conditional_multinomial_resample`: particle 0 keeps itself as ancestor and the others are drawn
  multinomially — the resampling of conditional SMC, used with an exact sample from σ in slot 0 for the upper bound
  on ``log Z``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "RESAMPLING_SCHEMES",
    "effective_sample_size",
    "incremental_log_weight",
    "log_mean_exp",
    "multinomial_resample",
    "normalized_weights",
    "resample",
    "systematic_resample",
    "conditional_multinomial_resample",
]

RESAMPLING_SCHEMES = ("multinomial", "systematic", "none")


def _check_groups(log_weights: torch.Tensor) -> torch.Tensor:
    if log_weights.dim() != 2 or log_weights.shape[1] < 1:
        raise ValueError(f"log_weights must be (groups, particles), got shape {tuple(log_weights.shape)}.")
    if torch.isnan(log_weights).any() or (log_weights == math.inf).any():
        raise ValueError("log_weights hold nan or +inf; every log-weight must be finite or -inf.")
    return log_weights.double()


def log_mean_exp(log_values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log((1/K) Σ_k exp(x_k))`` along ``dim``, stable for very negative values; ``-inf`` when every value is."""
    k = log_values.shape[dim]
    return torch.logsumexp(log_values, dim=dim) - math.log(k)


def normalized_weights(log_weights: torch.Tensor) -> torch.Tensor:
    """``(G, K)`` weights ``w_k / Σ_j w_j`` per group (float64). A group whose weights are all zero gets zeros."""
    lw = _check_groups(log_weights)
    total = torch.logsumexp(lw, dim=-1, keepdim=True)
    dead = total == -math.inf
    out = (lw - torch.where(dead, torch.zeros_like(total), total)).exp()
    return torch.where(dead, torch.zeros_like(out), out)


def effective_sample_size(log_weights: torch.Tensor) -> torch.Tensor:
    """``(G,)`` Kish effective sample size ``(Σ w)² / Σ w²`` per group (between 1 and ``K``; 0 when every weight of
    the group is zero)."""
    lw = _check_groups(log_weights)
    num = 2.0 * torch.logsumexp(lw, dim=-1)
    den = torch.logsumexp(2.0 * lw, dim=-1)
    dead = den == -math.inf
    return torch.where(dead, torch.zeros_like(den), (num - torch.where(dead, torch.zeros_like(den), den)).exp())


def incremental_log_weight(
    log_p: torch.Tensor, log_q: torch.Tensor, log_psi: torch.Tensor, log_psi_prev: torch.Tensor
) -> torch.Tensor:
    """``log p + log ψ_t − log q − log ψ_{t−1}`` elementwise (module doc), in float64.

    A particle whose new numerator ``log p + log ψ_t`` is ``-inf`` gets ``-inf`` (zero weight), also when
    ``ψ_{t−1}`` was zero as well (``-inf − -inf`` would be nan). ``log q`` must be finite at sampled tokens.
    """
    numerator = log_p.double() + log_psi.double()
    out = numerator - log_q.double() - log_psi_prev.double()
    return torch.where(numerator == -math.inf, torch.full_like(out, -math.inf), out)


def _check_all_alive(lw: torch.Tensor) -> None:
    dead = ~torch.isfinite(lw).any(dim=-1)
    if dead.any():
        raise ValueError(
            f"Groups {dead.nonzero().flatten().tolist()} have no particle of positive weight and cannot be "
            "resampled; leave them out (their evidence estimate is 0)."
        )


def multinomial_resample(log_weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(G, K)`` ancestor indices drawn i.i.d. from each group's normalised weights."""
    lw = _check_groups(log_weights)
    _check_all_alive(lw)
    probs = normalized_weights(lw)
    return torch.multinomial(probs.cpu(), lw.shape[1], replacement=True, generator=generator).to(lw.device)


def systematic_resample(log_weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(G, K)`` ancestor indices by systematic resampling: one ``u ~ U[0,1)`` per group, particle ``k`` of the
    output descends from the first index whose cumulative weight exceeds ``(u + k)/K``. Indices come out sorted."""
    lw = _check_groups(log_weights)
    _check_all_alive(lw)
    G, K = lw.shape
    cdf = normalized_weights(lw).cpu().cumsum(dim=-1)
    cdf[:, -1] = 1.0  # no rounding gap at the end
    u = torch.rand(G, 1, dtype=torch.float64, generator=generator)
    points = (u + torch.arange(K, dtype=torch.float64)[None, :]) / K
    index = torch.searchsorted(cdf, points, right=True).clamp_(max=K - 1)
    return index.to(lw.device)


def conditional_multinomial_resample(
    log_weights: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Conditional-SMC resampling: index 0 of every group keeps ancestor 0 (the reference trajectory), indices
    ``1 … K−1`` are drawn i.i.d. from the normalised weights (which include the reference's)."""
    index = multinomial_resample(log_weights, generator)
    index[:, 0] = 0
    return index


def resample(
    log_weights: torch.Tensor, scheme: str, generator: torch.Generator | None = None, conditional: bool = False
) -> torch.Tensor:
    """Ancestor indices by ``scheme`` (``"multinomial"`` or ``"systematic"``); ``conditional=True`` keeps particle 0
    (conditional SMC, multinomial only)."""
    if conditional:
        if scheme != "multinomial":
            raise ValueError(
                f"Conditional SMC (a reference trajectory in particle 0) resamples multinomially; got "
                f"resampling={scheme!r}. Use resampling='multinomial' for the upper bound."
            )
        return conditional_multinomial_resample(log_weights, generator)
    if scheme == "multinomial":
        return multinomial_resample(log_weights, generator)
    if scheme == "systematic":
        return systematic_resample(log_weights, generator)
    raise ValueError(f"Unknown resampling scheme {scheme!r}; choose 'multinomial' or 'systematic'.")
