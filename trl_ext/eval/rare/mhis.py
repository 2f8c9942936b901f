r"""Metropolis–Hastings importance sampling (MHIS) of ``p* = E_{x~D}[P(y | x)]`` (docs/algorithms.md §10.5).

Independent Markov chains, each started from a draw of ``D``, target the tilted distribution

    π(x) ∝ D(x)·exp(s(x)/T),

which favours inputs with a high score ``s`` (by default the logit of the first target token after ``x``). One step
of a chain at ``x``:

1. pick a position ``k`` uniformly at random;
2. propose a new token there from ``q(v | x) = softmax_v(log p_k(v) + G(x)[k, v]/T)``, where
   ``G(x)[k, v] = ∂s(x)/∂e_k · W_E[v]`` is the first-order gain of the score from putting ``v`` at ``k``;
3. accept ``x'`` with probability ``min(1, A)``,

       log A = (s(x') − s(x))/T + log p_k(x'_k) − log p_k(x_k) + log q(x_k | x') − log q(x'_k | x),

   where the reverse proposal ``q(x_k | x')`` uses the gradient at the proposed state ``x'``, so the chain leaves
   ``π`` exactly invariant.

A proposal may be the current token itself; it is then accepted with ``A = 1``. The acceptance rate counts those
(as the original did); ``details["move_rate"]`` counts only the accepted steps that changed the state.

After ``burn_in`` steps, the states of ``ceil(num_samples / num_chains)`` further steps are kept. Because
``D(x)/π(x) ∝ exp(−s(x)/T)``, the self-normalised estimate is

    p̂ = Σ_{c,t} P(y|x_{c,t})·e^{−s(x_{c,t})/T} / Σ_{c,t} e^{−s(x_{c,t})/T}.

Standard error: the within-chain states are autocorrelated, so the error comes from the spread *between* the
independent chains. With per-chain means ``A_c = mean_t P·e^{−s/T}`` and ``B_c = mean_t e^{−s/T}``,
``p̂ = Σ_c A_c / Σ_c B_c`` is a ratio estimator over ``C`` i.i.d. chain summaries, and the delta method gives

    SE(p̂)² = Σ_c (A_c − p̂·B_c)² / (C·(C − 1)·B̄²),        B̄ = mean_c B_c

(:func:`chain_ratio_estimate`). Like any MCMC error estimate it assumes the chains have mixed; a burn-in that is too
short or chains stuck in different modes show up as a large spread of the per-chain estimates ``A_c / B_c``.

Choosing ``T``: the weights ``e^{−s/T}`` span ``e^{(max s − min s)/T}``. When that range is huge (a small ``T``
with a wide spread of scores), the rare visits to low-score inputs dominate both sums, a handful of chains carry
all the weight and the self-normalised estimate can be off by orders of magnitude with a small-looking error.
:func:`mhis` reports the chain-level effective sample size (``details["chain_weight_ess"]``) and warns when it is
below a tenth of the chains; raise ``T`` then. When the tilt is so strong that every chain sits on the same
high-score input, the weights are all equal and the estimate is just ``P(y|x)`` of that input with a zero error:
:func:`mhis` warns when fewer than 1% of the kept steps changed a chain's state.

Reliability (:attr:`Estimate.diagnostics`, :attr:`Estimate.reliable`): besides those two checks, the estimate is
flagged unreliable (and a warning logged) with fewer than 10 chains (the between-chain error then rests on too few
values), or when the chain numerators ``A_c`` are carried by fewer than 10 effective chains or one chain carries
more than 30% of their sum (:func:`~.estimate.term_diagnostics` over chains: ``chain_term_ess``,
``max_chain_share``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from ._common import PhaseTimer, check_common, check_tilt, progress, seeded_generator
from .distributions import InputDistribution
from .estimate import MIN_CHAINS, Estimate, effective_sample_size, tail_reasons, term_diagnostics, term_reasons
from .target import evaluate_inputs, token_scores

__all__ = ["chain_ratio_estimate", "mh_log_acceptance", "mh_proposal_log_probs", "mhis"]

_LOG10 = math.log(10.0)
logger = logging.getLogger(__name__)


def mh_proposal_log_probs(log_p_k: torch.Tensor, gain: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(C, V)`` ``log q(v | x) = log_softmax_v(log p_k(v) + G(x)[k, v]/T)`` for each chain's chosen position."""
    return torch.log_softmax(log_p_k + gain.to(log_p_k) / temperature, dim=-1)


def mh_log_acceptance(
    score_new: torch.Tensor,
    score_old: torch.Tensor,
    log_p_new: torch.Tensor,
    log_p_old: torch.Tensor,
    log_q_reverse: torch.Tensor,
    log_q_forward: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``log A = (s' − s)/T + log p_k(x'_k) − log p_k(x_k) + log q(x_k|x') − log q(x'_k|x)`` (all ``(C,)``)."""
    return (score_new - score_old) / temperature + log_p_new - log_p_old + log_q_reverse - log_q_forward


def chain_ratio_estimate(log_values: torch.Tensor, log_weights: torch.Tensor) -> tuple[float, float, float, list]:
    """Self-normalised estimate over chains and its between-chain delta-method standard error (module doc).

    Args:
        log_values: ``(C, T)`` ``log P(y|x_{c,t})`` of the kept states.
        log_weights: ``(C, T)`` ``log w = −s(x_{c,t})/T``.

    Returns:
        ``(estimate, std_error, log_estimate, per_chain_log_estimates)``; computed after subtracting the largest
        log-terms, so a tiny ``p̂`` keeps an accurate ``log_estimate``.
    """
    log_values = torch.as_tensor(log_values, dtype=torch.float64)
    log_weights = torch.as_tensor(log_weights, dtype=torch.float64)
    if log_values.dim() != 2 or log_values.shape != log_weights.shape:
        raise ValueError("log_values and log_weights must be (num_chains, steps) tensors of the same shape.")
    num_chains = log_values.shape[0]
    if num_chains < 2:
        raise ValueError("A between-chain standard error needs at least 2 chains.")
    log_num = log_values + log_weights
    shift_num, shift_den = float(log_num.max()), float(log_weights.max())
    den = (log_weights - shift_den).exp().mean(1)  # B_c / e^{shift_den}
    per_chain = (torch.logsumexp(log_num, 1) - torch.logsumexp(log_weights, 1)).tolist()
    if shift_num == -math.inf:
        return 0.0, 0.0, -math.inf, per_chain
    num = (log_num - shift_num).exp().mean(1)  # A_c / e^{shift_num}
    ratio = float(num.sum() / den.sum())  # p̂ / e^{shift_num − shift_den}
    residual = num - ratio * den
    rel_se = math.sqrt(float((residual**2).sum()) / (num_chains * (num_chains - 1))) / float(den.mean()) / ratio
    log_estimate = shift_num - shift_den + math.log(ratio)
    estimate = math.exp(log_estimate) if log_estimate < 709.0 else math.inf
    return estimate, estimate * rel_se, log_estimate, per_chain


def mhis(
    model: nn.Module,
    dist: InputDistribution,
    target_ids: Sequence[int],
    num_samples: int,
    batch_size: int = 256,
    temperature: float = 1.0,
    burn_in: int = 1024,
    num_chains: int | None = None,
    score: str = "logit",
    generator: torch.Generator | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> Estimate:
    """Estimate ``p*`` by MHIS (see the module docstring for the chain, the estimate and its standard error).

    Args:
        model: causal LM (eval mode; gradients only w.r.t. the input embeddings).
        dist: the input distribution ``D``.
        target_ids: token ids of the target ``y``.
        num_samples: kept states ``n``: every chain runs ``ceil(n / num_chains)`` steps after burn-in (the report's
            ``num_samples`` is the number actually kept).
        batch_size: chains per forward pass; also the number of chains unless ``num_chains`` is given.
        temperature: ``T > 0`` of the target ``π ∝ D·e^{s/T}`` and of the proposal; as ``T → ∞`` the chain samples
            ``D`` itself.
        burn_in: steps per chain before states are kept.
        num_chains: independent chains ``C ≥ 2`` (default ``batch_size``).
        score: ``"logit"`` (as the original) or ``"logprob"`` (``s = log P(y|x)``).
        generator: CPU generator for sampling and acceptance; default a new one seeded with ``seed``.
        seed: seed used when ``generator`` is ``None``.
        show_progress: show a progress bar.
    """
    target_ids = check_common(model, dist, target_ids, batch_size, num_samples)
    num_chains = batch_size if num_chains is None else num_chains
    if not isinstance(num_chains, int) or num_chains < 2:
        raise ValueError(f"MHIS needs at least 2 chains (its standard error compares chains), got {num_chains!r}.")
    check_tilt(temperature, score)
    if not isinstance(burn_in, int) or burn_in < 0:
        raise ValueError(f"burn_in must be a non-negative int, got {burn_in!r}.")
    generator, used_seed = seeded_generator(generator, seed)
    weight_matrix = model.get_input_embeddings().weight
    kept_steps = math.ceil(num_samples / num_chains)
    log_p, rows = dist.log_probs, torch.arange(num_chains)
    timer = PhaseTimer()

    def evaluate(x):
        with timer("model"):
            return evaluate_inputs(model, x, target_ids, score, dist.prefix_ids, with_grad=True, batch_size=batch_size)

    def gains(grad, positions):
        with timer("proposal"):
            picked = grad[rows.to(grad.device), positions.to(grad.device)]  # (C, H): ∂s/∂e at each chain's position
            return token_scores(picked, weight_matrix, dist.vocab_size).double().cpu()

    x = dist.sample(num_chains, generator)
    state = evaluate(x)
    kept_logp, kept_score, accepted, moves = [], [], [0, 0], 0  # accepted: [burn-in, kept]
    with progress(burn_in + kept_steps, "mhis", show_progress) as bar:
        for step in range(burn_in + kept_steps):
            positions = torch.randint(dist.length, (num_chains,), generator=generator)
            log_p_k = log_p[positions]  # (C, V)
            log_q_fwd = mh_proposal_log_probs(log_p_k, gains(state.embedding_grad, positions), temperature)
            new_tokens = torch.multinomial(log_q_fwd.exp(), 1, generator=generator)[:, 0]
            old_tokens = x[rows, positions]
            proposal = x.clone()
            proposal[rows, positions] = new_tokens
            new_state = evaluate(proposal)
            log_q_rev = mh_proposal_log_probs(log_p_k, gains(new_state.embedding_grad, positions), temperature)
            log_accept = mh_log_acceptance(
                new_state.score,
                state.score,
                log_p_k[rows, new_tokens],
                log_p_k[rows, old_tokens],
                log_q_rev[rows, old_tokens],
                log_q_fwd[rows, new_tokens],
                temperature,
            )
            accept = torch.rand(num_chains, generator=generator, dtype=torch.float64).log() < log_accept
            x = torch.where(accept[:, None], proposal, x)
            state.target_logprob = torch.where(accept, new_state.target_logprob, state.target_logprob)
            state.score = torch.where(accept, new_state.score, state.score)
            state.embedding_grad = torch.where(
                accept.to(state.embedding_grad.device)[:, None, None], new_state.embedding_grad, state.embedding_grad
            )
            kept = step >= burn_in
            accepted[kept] += int(accept.sum())
            if kept:
                moves += int((accept & (new_tokens != old_tokens)).sum())
                kept_logp.append(state.target_logprob.clone())
                kept_score.append(state.score.clone())
            bar.update(1)
    log_values = torch.stack(kept_logp, 1)  # (C, T)
    log_weights = -torch.stack(kept_score, 1) / temperature
    estimate, se, log_estimate, per_chain = chain_ratio_estimate(log_values, log_weights)
    chain_ess = effective_sample_size(torch.logsumexp(log_weights, 1))
    move_rate = moves / (num_chains * kept_steps)
    chain_terms = term_diagnostics(torch.logsumexp(log_values + log_weights, 1))
    state_terms = term_diagnostics(log_values + log_weights)
    diagnostics = {
        "num_chains": num_chains,
        "chain_term_ess": chain_terms["term_ess"],
        "max_chain_share": chain_terms["max_term_share"],
        "chain_pareto_k": chain_terms["pareto_k"],
        "pareto_k": state_terms["pareto_k"],
        "max_term_share": state_terms["max_term_share"],
        "term_ess": state_terms["term_ess"],
        "chain_weight_ess": chain_ess,
        "move_rate": move_rate,
    }
    reasons = []
    if num_chains < MIN_CHAINS:
        reasons.append(f"only {num_chains} chains (fewer than {MIN_CHAINS}) for the between-chain standard error")
    reasons += term_reasons(chain_terms, num_chains, "chains", tail=False)
    reasons += tail_reasons(state_terms, num_chains * kept_steps)
    if move_rate < 0.01:
        reasons.append(f"the chains changed their state in only {move_rate:.2%} of the kept steps")
    if chain_ess < 0.1 * num_chains:
        reasons.append(f"the chain-level weight ESS is {chain_ess:.1f} of {num_chains} chains")
    if move_rate < 0.01:
        warnings.warn(
            f"MHIS: the chains changed their state in only {move_rate:.2%} of the steps after burn-in (most "
            "proposals were rejected or proposed the current token); the estimate reflects only the few inputs "
            "visited and its standard error is unreliable. Raise temperature.",
            RuntimeWarning,
            stacklevel=2,
        )
    elif chain_ess < 0.1 * num_chains:
        warnings.warn(
            f"MHIS: a few of the {num_chains} chains carry almost all the importance weight (chain-level ESS "
            f"{chain_ess:.1f}); the estimate and its standard error are unreliable. Raise temperature (or burn_in), "
            "or use itgis.",
            RuntimeWarning,
            stacklevel=2,
        )
    est = Estimate(
        method="mhis",
        estimate=estimate,
        std_error=se,
        num_samples=num_chains * kept_steps,
        log10_estimate=log_estimate / _LOG10,
        ess=effective_sample_size(log_weights),
        acceptance_rate=accepted[1] / (num_chains * kept_steps),
        seconds=timer.total,
        timings=timer.seconds,
        details={
            "temperature": temperature,
            "score": score,
            "num_chains": num_chains,
            "burn_in": burn_in,
            "kept_steps": kept_steps,
            "move_rate": move_rate,
            "burn_in_acceptance_rate": accepted[0] / (num_chains * burn_in) if burn_in else None,
            "seed": used_seed,
            "chain_weight_ess": chain_ess,
            "chain_log10_estimates": [v / _LOG10 for v in per_chain],
        },
        diagnostics=diagnostics,
    )
    return est.flag(reasons, logger)
