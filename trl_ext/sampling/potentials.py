r"""Final potentials ``φ`` of the SMC target ``σ(s) ∝ p(s)·φ(s)``, as callables on complete responses.

A potential is a callable ``log_phi(prompt_ids, prompt_mask, response_ids, response_mask) -> (n,)`` float64 tensor
of ``log φ`` for ``n`` complete responses (``(n, P)`` left-padded prompts, ``(n, t)`` right-padded responses whose
mask is 1 up to and including the first stop token). ``-inf`` means ``φ = 0``.

- :class:`TokenSetPotential`: ``φ`` depends only on whether the response holds one of a set of token ids — the
  indicator ``1[bad]`` (default; then ``Z_σ = P(bad)``) or any pair of values, e.g. ``exp(β·r)`` of a lexical reward
  ``r ∈ {r_bad, r_good}``;
- :class:`RewardPotential`: ``log φ = β·r(s)`` for any scoring function ``r`` (e.g. a reward model), so that
  ``σ ∝ p·exp(β·r)`` as in RePULSe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["Potential", "RewardPotential", "TokenSetPotential", "contains_any"]

Potential = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def contains_any(response_ids: torch.Tensor, response_mask: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``(n,)`` bool: the masked part of each response holds one of ``token_ids``."""
    ids = torch.as_tensor(list(token_ids), dtype=response_ids.dtype, device=response_ids.device)
    return (torch.isin(response_ids, ids) & (response_mask != 0)).any(dim=-1)


class TokenSetPotential:
    """``log φ(s) = log_phi_bad`` when the response holds a token of ``token_ids``, else ``log_phi_good``.

    Args:
        token_ids: the "bad" token ids.
        log_phi_bad: ``log φ`` of a bad response (default 0: ``φ = 1``).
        log_phi_good: ``log φ`` of any other response (default ``-inf``: the indicator, ``Z_σ = P(bad)``).
            For ``σ ∝ p·exp(β·r)`` with a reward ``r_bad`` / ``r_good``: ``log_phi_bad = β·r_bad``,
            ``log_phi_good = β·r_good``.
    """

    def __init__(self, token_ids: Sequence[int], log_phi_bad: float = 0.0, log_phi_good: float = -math.inf):
        self.token_ids = [int(i) for i in token_ids]
        if not self.token_ids:
            raise ValueError("token_ids is empty; give the token ids that make a response bad.")
        for name, value in (("log_phi_bad", log_phi_bad), ("log_phi_good", log_phi_good)):
            if math.isnan(value) or value == math.inf:
                raise ValueError(f"{name} must be finite or -inf, got {value}.")
        if log_phi_bad == -math.inf and log_phi_good == -math.inf:
            raise ValueError("log_phi_bad and log_phi_good are both -inf: φ would be 0 everywhere.")
        self.log_phi_bad = float(log_phi_bad)
        self.log_phi_good = float(log_phi_good)

    def __call__(self, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
        bad = contains_any(response_ids, response_mask, self.token_ids)
        good = torch.full(bad.shape, self.log_phi_good, dtype=torch.float64, device=bad.device)
        return torch.where(bad, torch.full_like(good, self.log_phi_bad), good)


class RewardPotential:
    """``log φ(s) = β·r(s)`` for a scoring function ``r``.

    Args:
        score: ``(prompt_ids, prompt_mask, response_ids, response_mask) -> (n,)`` raw rewards ``r`` (higher =
            better), e.g. a wrapped reward model.
        beta: ``β``; ``β < 0`` targets low-reward outputs (RePULSe's σ).
    """

    def __init__(self, score: Callable[..., torch.Tensor], beta: float):
        if not math.isfinite(beta):
            raise ValueError(f"beta must be finite, got {beta}.")
        self.score = score
        self.beta = float(beta)

    def __call__(self, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
        r = torch.as_tensor(self.score(prompt_ids, prompt_mask, response_ids, response_mask)).double()
        if r.shape != (response_ids.shape[0],):
            raise ValueError(f"score returned shape {tuple(r.shape)}; expected ({response_ids.shape[0]},).")
        return self.beta * r
