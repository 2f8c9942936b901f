r"""Expectations of any score of a short response: exact over the likely responses, Monte Carlo over the rest.

:func:`bad_output_probability` sums the probability of a *token set*. A classifier reward (e.g.
:class:`~trl_ext.rewards.OffensivenessReward` on prompt + completion) scores whole decoded texts, so its expectation
needs the responses themselves. :func:`response_score_expectations` splits the responses ``y`` (at most
``max_new_tokens`` tokens, ended by the first stop token, as in :mod:`trl_ext.eval.analytic`) by probability:

- the **enumerated** set ``E = {y : p(y | x) ≥ prune_below}``, found level by level (a prefix less likely than
  ``prune_below`` has no extension in ``E``), is scored exactly: ``Σ_{y∈E} p(y) f(y)``;
- the **pruned** rest, of mass ``m = 1 − p(E)``, is estimated from ``n`` draws of ``p(y | y ∉ E)``: the pruned
  candidates are drawn in proportion to their probability while the enumeration streams past them (the reservoir
  of :func:`bad_output_probability`), and a drawn prefix that has not ended is completed from the model. Then
  ``estimate = Σ_{y∈E} p(y) f(y) + m · mean_i f(y_i)``, unbiased, with ``SE = m · std_i f(y_i) / √n``.

For a score in ``[lo, hi]`` the certified interval is ``exact part + m·[lo, hi]``; the caller knows the range.
The same split gives the response entropy ``E[−log p(y)]`` (± SE) and the probability of the single most likely
response, which say whether a policy has collapsed onto a few responses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..utils import eval_mode
from .analytic import (
    _NEG_INF,
    _as_generator,
    _as_id_list,
    _default_eos,
    _draw,
    _NextTokenScorer,
    _prompt_tensor,
    _PrunedReservoir,
)

__all__ = ["ResponseScores", "ScoreEstimate", "response_score_expectations"]

ScoreFn = Callable[[list[list[int]]], Mapping[str, Sequence[float]]]


@dataclass
class ScoreEstimate:
    """``E_p[f(y)]`` of one score: an unbiased estimate ± SE, and its enumerated part."""

    estimate: float
    stderr: float
    enumerated: float
    """``Σ_{y∈E} p(y) f(y)``, the exact part."""
    remainder_mean: float
    """Mean of ``f`` over the draws of the pruned rest (``nan`` with no pruned mass)."""

    def interval(self, low: float, high: float, pruned_mass: float) -> tuple[float, float]:
        """The certified interval for a score known to lie in ``[low, high]``."""
        return self.enumerated + pruned_mass * low, self.enumerated + pruned_mass * high


@dataclass
class ResponseScores:
    """Result of :func:`response_score_expectations`."""

    scores: dict[str, ScoreEstimate]
    entropy: float
    """``E_p[−log p(y)]`` of whole responses (nats), exact part + Monte Carlo remainder."""
    entropy_stderr: float
    top_probability: float
    """Probability of the most likely response (exact when it is at least ``prune_below``, else that bound)."""
    top_response: list[int]
    enumerated_mass: float
    pruned_mass: float
    num_enumerated: int
    remainder_samples: int
    samples: dict = field(default_factory=dict, repr=False)
    """The drawn pruned responses, their log-probabilities and scores (for inspection)."""


def _score_matrix(score_fn: ScoreFn, responses: list[list[int]], names: list[str] | None):
    if not responses:
        return names, np.zeros((len(names or []), 0))
    out = score_fn(responses)
    if not isinstance(out, Mapping) or not out:
        raise TypeError("score_fn must return a non-empty mapping {name: one score per response}.")
    if names is not None and sorted(out) != sorted(names):
        raise ValueError(f"score_fn returned the scores {sorted(out)} once and {sorted(names)} another time.")
    names = list(out) if names is None else names
    rows = []
    for name in names:
        values = np.asarray(out[name], dtype=np.float64).reshape(-1)
        if values.shape[0] != len(responses):
            raise ValueError(f"score {name!r} has {values.shape[0]} values for {len(responses)} responses.")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"score {name!r} holds non-finite values; score_fn must return finite numbers.")
        rows.append(values)
    return names, np.stack(rows)


def response_score_expectations(
    model: nn.Module,
    prompt_ids: Sequence[int] | torch.Tensor,
    score_fn: ScoreFn,
    *,
    max_new_tokens: int = 2,
    eos_token_id: int | Sequence[int] | None = None,
    temperature: float = 1.0,
    prune_below: float = 1e-5,
    remainder_samples: int = 512,
    generator: torch.Generator | int | None = None,
    batch_size: int = 256,
    use_cache: bool = True,
) -> ResponseScores:
    r"""``E_{y∼p(·|x)}[f(y)]`` for every score ``f`` that ``score_fn`` returns (see the module docstring).

    Args:
        model: the policy (run in eval mode under ``no_grad``).
        prompt_ids: one unpadded prompt.
        score_fn: ``responses -> {name: scores}``; each response is its list of token ids (a stop token that ended
            it included), each score a finite float per response.
        max_new_tokens: the longest response.
        eos_token_id: the stop ids (default: the model's generation config).
        prune_below: responses (and prefixes) less likely than this are not enumerated (``> 0``).
        remainder_samples: draws of the pruned rest (``≥ 2``, for a standard error).
        generator: an int seed or a generator for those draws (the global RNG is untouched).
    """
    prompt = _prompt_tensor(prompt_ids)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if not 0 < float(prune_below) < 1:
        raise ValueError(f"prune_below must be in (0, 1), got {prune_below}; it bounds how many responses are scored.")
    if isinstance(remainder_samples, bool) or not isinstance(remainder_samples, int) or remainder_samples < 2:
        raise ValueError(f"remainder_samples must be an integer >= 2, got {remainder_samples!r}.")
    stops = sorted(set(_default_eos(model) if eos_token_id is None else _as_id_list(eos_token_id, "eos_token_id")))
    device = next(model.parameters()).device
    log_prune = math.log(float(prune_below))
    with eval_mode(model), torch.no_grad():
        scorer = _NextTokenScorer(model, prompt.to(device), float(temperature), use_cache)
        vocab = scorer.prompt_logprobs.shape[-1]
        all_ids = torch.arange(vocab, device=device)
        is_stop = torch.zeros(vocab, dtype=torch.bool, device=device)
        if stops:
            is_stop[stops] = True
        gen = _as_generator(generator, device)
        reservoir = _PrunedReservoir(remainder_samples, gen)
        complete, complete_logp = [], []
        prefixes = torch.zeros(1, 0, dtype=torch.long, device=device)
        prefix_logp = torch.zeros(1, dtype=torch.float64, device=device)
        pruned = torch.tensor(_NEG_INF, dtype=torch.float64)
        for level in range(1, max_new_tokens + 1):
            last = level == max_new_tokens
            next_prefixes, next_logp = [], []
            for start in range(0, prefixes.shape[0], batch_size):
                rows, row_logp = prefixes[start : start + batch_size], prefix_logp[start : start + batch_size]
                step = scorer.prompt_logprobs[None] if level == 1 else scorer(rows)
                cand = row_logp[:, None] + step.double()  # (r, V): log p(prefix + token)
                keep = cand >= log_prune
                ends = keep & (is_stop[None] | last)
                grows = keep & ~ends
                row_idx, col_idx = torch.nonzero(ends, as_tuple=True)
                complete.append(torch.cat([rows[row_idx], col_idx[:, None]], dim=1).cpu())
                complete_logp.append(cand[row_idx, col_idx].cpu())
                row_idx, col_idx = torch.nonzero(grows, as_tuple=True)
                next_prefixes.append(torch.cat([rows[row_idx], col_idx[:, None]], dim=1))
                next_logp.append(cand[row_idx, col_idx])
                if not bool(keep.all()):
                    dropped = cand.masked_fill(keep, _NEG_INF)
                    pruned = torch.logaddexp(pruned, torch.logsumexp(dropped.reshape(-1), 0).cpu())
                    reservoir.offer(rows, all_ids, dropped)
            if last or not next_prefixes:
                break
            prefixes, prefix_logp = torch.cat(next_prefixes), torch.cat(next_logp)
            if prefixes.shape[0] == 0:
                break
        # the enumerated responses, each a list of ids
        responses, logps = [], []
        for ids, lp in zip(complete, complete_logp):
            responses += [[int(t) for t in row] for row in ids]
            logps.append(lp)
        logp = torch.cat(logps).numpy() if logps else np.zeros(0)
        names, values = _score_matrix(score_fn, responses, None)
        probs = np.exp(logp)
        enumerated_mass = float(probs.sum())
        pruned_mass = float(math.exp(float(pruned)))
        # the pruned rest: complete each drawn prefix from the model, then score it
        drawn, drawn_logp = [], np.zeros(0)
        if pruned_mass > 0 and reservoir.tokens is not None:
            drawn, drawn_logp = _complete_draws(scorer, reservoir, is_stop, max_new_tokens, batch_size, gen)
            names, drawn_values = _score_matrix(score_fn, drawn, names)
        else:
            drawn_values = np.zeros((len(names), 0))
        if len(responses) == 0:
            values = np.zeros((len(names), 0))
    estimates = {}
    for i, name in enumerate(names):
        exact = float((probs * values[i]).sum()) if len(responses) else 0.0
        mean = float(drawn_values[i].mean()) if drawn else math.nan
        se = float(drawn_values[i].std(ddof=1)) / math.sqrt(len(drawn)) if drawn else 0.0
        estimates[name] = ScoreEstimate(exact + (pruned_mass * mean if drawn else 0.0), pruned_mass * se, exact, mean)
    neg_logp = -logp
    entropy = float((probs * neg_logp).sum())
    entropy_se = 0.0
    if drawn:
        entropy += pruned_mass * float((-drawn_logp).mean())
        entropy_se = pruned_mass * float((-drawn_logp).std(ddof=1)) / math.sqrt(len(drawn))
    top = int(np.argmax(probs)) if len(responses) else None
    return ResponseScores(
        scores=estimates,
        entropy=entropy,
        entropy_stderr=entropy_se,
        top_probability=float(probs[top]) if top is not None else float(prune_below),
        top_response=responses[top] if top is not None else [],
        enumerated_mass=enumerated_mass,
        pruned_mass=pruned_mass,
        num_enumerated=len(responses),
        remainder_samples=len(drawn),
        samples={"responses": drawn, "logp": drawn_logp.tolist(), "scores": dict(zip(names, drawn_values.tolist()))},
    )


def _complete_draws(scorer, reservoir, is_stop, max_new_tokens, batch_size, gen):
    """Each reservoir draw (a pruned prefix + token) finished from the model up to a stop token or the length
    limit; returns the responses and their log-probabilities ``log p(y | x)``."""
    responses, logps = [], []
    for k in reservoir.lengths.unique().tolist():
        index = torch.nonzero(reservoir.lengths == k).reshape(-1)
        for part in index.split(batch_size):
            rows = reservoir.tokens[part, :k]
            alive = ~is_stop[rows[:, -1]]
            while rows.shape[1] < max_new_tokens and bool(alive.any()):
                live = torch.nonzero(alive).reshape(-1)
                nxt = torch.zeros_like(rows[:, :1])
                nxt[live] = _draw(scorer(rows[live]).exp().float(), gen)
                rows = torch.cat([rows, nxt], dim=1)
                alive = alive.clone()
                alive[live] = ~is_stop[nxt[live, 0]]
            lengths = torch.full((rows.shape[0],), rows.shape[1], dtype=torch.long, device=rows.device)
            ended = is_stop[rows]  # the first stop ends a response; later columns are padding
            first_stop = torch.where(ended.any(1), ended.float().argmax(1) + 1, lengths)
            logp = _path_logprob(scorer, rows, first_stop, batch_size)
            for row, n, lp in zip(rows.tolist(), first_stop.tolist(), logp.tolist()):
                responses.append(row[:n])
                logps.append(lp)
    return responses, np.asarray(logps, dtype=np.float64)


def _path_logprob(scorer, rows: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``Σ_t log p(y_t | x, y_<t)`` over the first ``lengths[i]`` tokens of each row."""
    total = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    total += scorer.prompt_logprobs[rows[:, 0]].double()
    for t in range(1, rows.shape[1]):
        live = torch.nonzero(lengths > t).reshape(-1)
        for part in live.split(batch_size):
            step = scorer(rows[part, :t])
            total[part] += step.gather(1, rows[part, t : t + 1])[:, 0].double()
    return total
