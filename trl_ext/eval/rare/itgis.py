r"""Independent token gradient importance sampling (ITGIS) of ``p* = E_{x~D}[P(y | x)]`` (docs/algorithms.md §10.5).

ITGIS keeps a table ``S`` of shape ``(L, V)``: how much putting token ``v`` at position ``k`` is expected to raise
the score ``s(x)`` (by default the logit of the first target token after ``x``). Iteration ``i`` draws a batch
from the tilted product distribution

    q_i(x) = Π_k q_{i,k}(x_k),        q_{i,k}(v) = p_k(v)·exp(S_k[v]/T_i) / Σ_u p_k(u)·exp(S_k[u]/T_i),

weighs each draw by ``w = D(x)/q_i(x)`` and accumulates ``w·P(y|x)``, whose expectation under ``q_i`` is ``p*``
whatever ``S`` is. The table then moves towards the batch's mean gradient signal,

    S ← d·S + mean_b G_b,        G_b[k, v] = ∂s(x_b)/∂e_{b,k} · W_E[v]     (gradient w.r.t. input embedding k),

so it is an exponential moving *sum* with decay ``d``. Its weights ``1, d, d², …`` add up to
``c_i = (1 − d^i)/(1 − d)`` after ``i`` updates (``c_i = i`` when ``d = 1``), and the temperature follows

    T_i = temperature · c_i     for i ≥ 1,        T_0 = temperature   (c_0 := 1),

so that ``S/T_i`` is a weighted *average* of the gradient signals divided by ``temperature``. At ``i = 0`` the
table is zero, so ``q_0 = D`` whatever finite ``T_0`` is; defining ``c_0 = 1`` just keeps it finite (the formula
gives ``0``).

The importance log-weight is computed exactly, with the per-position normalisers of both ``D`` and ``q_i``:

    log w(x) = Σ_k [ logsumexp_v(log p_k(v) + S_k[v]/T_i) − logsumexp_v(log p_k(v)) − S_k[x_k]/T_i ].

With ``S = 0`` both log-sum-exps are the same number and ``w = 1`` exactly.

Because ``G`` is linear in the embedding gradient, ``mean_b G_b = (mean_b ∂s/∂e_b) @ W_Eᵀ``: the ``(B, L, V)``
tensor is never built.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from ._common import PhaseTimer, check_common, check_tilt, progress, seeded_generator
from .distributions import InputDistribution
from .estimate import Estimate, effective_sample_size, log_space_mean, term_diagnostics, term_reasons
from .target import evaluate_inputs, token_scores

__all__ = ["importance_log_weights", "itgis", "itgis_temperature", "proposal_log_probs", "score_normaliser"]

_LOG10 = math.log(10.0)
logger = logging.getLogger(__name__)


def score_normaliser(iteration: int, decay_rate: float) -> float:
    """``c_i = Σ_{j<i} d^j = (1 − d^i)/(1 − d)`` (``i`` for ``d = 1``), with ``c_0 = 1`` (see the module doc)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}.")
    if iteration == 0:
        return 1.0
    if decay_rate == 1.0:
        return float(iteration)
    return (1.0 - decay_rate**iteration) / (1.0 - decay_rate)


def itgis_temperature(iteration: int, temperature: float, decay_rate: float) -> float:
    """``T_i = temperature · c_i`` (:func:`score_normaliser`)."""
    return temperature * score_normaliser(iteration, decay_rate)


def proposal_log_probs(log_p: torch.Tensor, scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(L, V)`` ``log q_k(v) = log_softmax_v(log p_k(v) + S_k[v]/T)``; tokens outside ``D``'s support stay
    ``-inf``."""
    return torch.log_softmax(log_p + scores.to(log_p) / temperature, dim=-1)


def importance_log_weights(
    log_p: torch.Tensor, scores: torch.Tensor, temperature: float, x: torch.Tensor
) -> torch.Tensor:
    """``(n,)`` ``log D(x) − log q(x)`` for the tilted proposal of :func:`proposal_log_probs` (module doc formula).

    Args:
        log_p: ``(L, V)`` log-probabilities of ``D`` (``-inf`` outside its support).
        scores: ``(L, V)`` score table ``S``.
        temperature: ``T > 0``.
        x: ``(n, L)`` token ids inside the support.
    """
    tilt = scores.to(log_p) / temperature
    normaliser = torch.logsumexp(log_p + tilt, dim=-1) - torch.logsumexp(log_p, dim=-1)  # (L,)
    picked = tilt.gather(1, x.T.long().to(tilt.device))  # (L, n)
    return (normaliser[:, None] - picked).sum(0)


def itgis(
    model: nn.Module,
    dist: InputDistribution,
    target_ids: Sequence[int],
    num_samples: int,
    batch_size: int = 256,
    temperature: float = 1.0,
    decay_rate: float = 0.9,
    score: str = "logit",
    generator: torch.Generator | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> Estimate:
    """Estimate ``p*`` by ITGIS (see the module docstring for the proposal, the weights and the update).

    Estimate: ``p̂ = (1/n) Σ_i w_i·P(y|x_i)`` over all ``n`` draws of all iterations. Standard error:
    ``std_i(w_i·P(y|x_i)) / √n``. This treats the adaptive draws as independent — the usual approximation for
    adaptive importance sampling: every term is unbiased for ``p*`` given the past iterations (``q_i`` depends only
    on them), so ``p̂`` is unbiased, and the terms are uncorrelated, but their variances differ by iteration.
    Like every importance-sampling error bar it is itself estimated from the draws: when the proposal tilts so far
    that inputs carrying much of ``p*`` are almost never drawn (a small ``temperature``, few samples), both ``p̂`` and
    the error can come out too small. Compare two temperatures or seeds, and watch ``ess`` and
    ``details["log10_weight_range"]``.

    Reliability (:attr:`Estimate.diagnostics`, :attr:`Estimate.reliable`): the :func:`~.estimate.term_diagnostics`
    of the terms ``w_i·P(y|x_i)`` plus ``weight_ess`` (Kish ESS of the weights ``w_i``, the same as ``ess``). The
    interval is flagged unreliable, with a logged warning, when fewer than 10 effective terms carry the estimate or
    one term carries more than 30% of it.

    Args:
        model: causal LM (eval mode; gradients only w.r.t. the input embeddings).
        dist: the input distribution ``D``.
        target_ids: token ids of the target ``y``.
        num_samples: total draws ``n ≥ 2`` (``ceil(n / batch_size)`` iterations, the last one possibly smaller).
        batch_size: draws per iteration (one forward + backward pass each).
        temperature: ``T > 0``: larger keeps ``q`` closer to ``D``; smaller follows the gradients more greedily.
        decay_rate: ``d ∈ [0, 1]`` of the score table's moving sum.
        score: ``"logit"`` (first target token's logit after ``x``, as the original) or ``"logprob"``
            (``log P(y|x)``).
        generator: CPU generator for sampling; default a new one seeded with ``seed``.
        seed: seed used when ``generator`` is ``None``.
        show_progress: show a progress bar.
    """
    target_ids = check_common(model, dist, target_ids, batch_size, num_samples)
    check_tilt(temperature, score)
    if not 0.0 <= decay_rate <= 1.0:
        raise ValueError(f"decay_rate must be in [0, 1], got {decay_rate}.")
    generator, used_seed = seeded_generator(generator, seed)
    weight_matrix = model.get_input_embeddings().weight
    log_p = dist.log_probs
    scores = torch.zeros_like(log_p)
    timer, log_terms, log_weights = PhaseTimer(), [], []
    iteration, done = 0, 0
    with progress(num_samples, "itgis", show_progress) as bar:
        while done < num_samples:
            n = min(batch_size, num_samples - done)
            t_i = itgis_temperature(iteration, temperature, decay_rate)
            with timer("sampling"):
                q = proposal_log_probs(log_p, scores, t_i).exp()
                x = torch.multinomial(q, n, replacement=True, generator=generator).T.contiguous()
                log_w = importance_log_weights(log_p, scores, t_i, x)
            with timer("model"):
                ev = evaluate_inputs(model, x, target_ids, score, dist.prefix_ids, with_grad=True)
            log_terms.append(log_w + ev.target_logprob)
            log_weights.append(log_w)
            done += n
            iteration += 1
            if done < num_samples:
                with timer("scores"):
                    mean_signal = token_scores(ev.embedding_grad.mean(0), weight_matrix, dist.vocab_size)
                    scores = decay_rate * scores + mean_signal.double().cpu()
            bar.update(n)
    log_terms, log_weights = torch.cat(log_terms), torch.cat(log_weights)
    mean, se, log_mean = log_space_mean(log_terms)
    weight_ess = effective_sample_size(log_weights)
    diagnostics = {**term_diagnostics(log_terms), "weight_ess": weight_ess}
    est = Estimate(
        method="itgis",
        estimate=mean,
        std_error=se,
        num_samples=num_samples,
        log10_estimate=log_mean / _LOG10,
        ess=weight_ess,
        seconds=timer.total,
        timings=timer.seconds,
        details={
            "temperature": temperature,
            "decay_rate": decay_rate,
            "score": score,
            "iterations": iteration,
            "batch_size": batch_size,
            "seed": used_seed,
            "max_abs_tilt": float((scores / itgis_temperature(iteration - 1, temperature, decay_rate)).abs().max()),
            "log10_weight_range": [float(log_weights.min()) / _LOG10, float(log_weights.max()) / _LOG10],
        },
        diagnostics=diagnostics,
    )
    return est.flag(term_reasons(diagnostics, num_samples), logger)
