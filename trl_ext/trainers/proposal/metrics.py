"""Diagnostics of a proposal ``q`` against its target ``σ ∝ p_ref·exp(log φ)``, as pure tensor functions, and the
collector :class:`ProposalTrainer <trl_ext.trainers.proposal.proposal_trainer.ProposalTrainer>` logs them with.

For ``N`` samples ``s_i ~ q`` of a prompt, with sequence log-probs ``log q(s) = Σ_t m_t log q(s_t|s_<t)`` (and the
same for ``p_ref``):

- ``f_q(s) = log p_ref(s) + log φ(s) − log q(s)``; ``E_q[f_q] ≤ log Z_σ`` (the ELBO of ``log Z_σ``,
  ``Z_σ = E_{p_ref}[φ]``), with equality iff ``q = σ``;
- the IWAE bound ``logsumexp_i f_q(s_i) − log N`` (per prompt, then averaged), which lies between the mean and the
  maximum of the ``f_q(s_i)`` and is a tighter lower bound of ``log Z_σ`` in expectation;
- ``KL(q‖p_ref) ≈ mean_i [log q(s_i) − log p_ref(s_i)]`` (the k1 Monte-Carlo estimate, per sequence);
- the sequence entropy estimate ``mean_i −log q(s_i)``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ...ops import masked_sum

__all__ = ["ProposalMetrics", "proposal_diagnostics"]


@torch.no_grad()
def proposal_diagnostics(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    log_phi: torch.Tensor,
    mask: torch.Tensor,
    num_samples_per_prompt: int,
) -> dict[str, torch.Tensor]:
    """Scalar diagnostics of a batch of ``q``-samples (see the module docstring for the formulas).

    Args:
        logprobs: ``(B, T)`` per-token ``log q`` of the samples (at sampling time).
        ref_logprobs: ``(B, T)`` per-token ``log p_ref``.
        log_phi: ``(B,)`` ``log φ = β·R``.
        mask: ``(B, T)`` 1 on real response tokens.
        num_samples_per_prompt: ``N``; rows are grouped prompt by prompt (``B = P·N``).

    Returns:
        fp32 scalars ``f_q``, ``iwae_bound``, ``kl_q_ref``, ``entropy``, ``log_phi`` (batch means).
    """
    B = mask.shape[0]
    N = int(num_samples_per_prompt)
    if N < 1 or B % N:
        raise ValueError(f"{B} rows are not a whole number of prompts with num_samples_per_prompt={N} samples.")
    log_q = masked_sum(logprobs.float(), mask, dim=-1)
    log_p = masked_sum(ref_logprobs.float(), mask, dim=-1)
    phi = log_phi.float()
    f_q = log_p + phi - log_q
    iwae = torch.logsumexp(f_q.view(B // N, N), dim=-1) - math.log(N)
    return {
        "f_q": f_q.mean(),
        "iwae_bound": iwae.mean(),
        "kl_q_ref": (log_q - log_p).mean(),
        "entropy": (-log_q).mean(),
        "log_phi": phi.mean(),
    }


def _is_maximum(key: str) -> bool:
    """Whether the metric ``key`` is a maximum over rows (combined over processes by taking the largest)."""
    return key.startswith("max_") or key.endswith("logprob_diff")


class ProposalMetrics:
    """Values collected between two `Trainer` logs; :meth:`pop` returns their means."""

    def __init__(self):
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, key: str, value) -> None:
        self.values[key].append(float(value))

    def add_many(self, values: dict[str, torch.Tensor], prefix: str, gather=None) -> None:
        """Record scalar tensors under ``prefix + name``, combined over processes when ``gather`` (e.g.
        ``accelerator.gather``) is given: averaged, or the largest for a maximum (``max_*``, ``*logprob_diff``)."""
        if not values:
            return
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in values.values()])
        if gather is not None:
            every = gather(stacked.unsqueeze(0)).float()
            largest = torch.tensor([_is_maximum(key) for key in values], device=every.device)
            stacked = torch.where(largest, every.max(0).values, every.mean(0))
        for key, value in zip(values, stacked.tolist()):
            self.add(prefix + key, value)

    def pop(self) -> dict[str, float]:
        logs = {key: sum(v) / len(v) for key, v in self.values.items() if v}
        self.values.clear()
        return logs
