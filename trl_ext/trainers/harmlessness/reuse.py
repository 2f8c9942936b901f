"""Reusing the proposal's samples as the policy's negatives over several steps (``proposal_reuse_steps``, issue 35).

A RePULSe step samples the proposal, trains it on those samples and uses them as the policy's negatives. With
``proposal_reuse_steps = k > 1`` a proposal rollout serves ``k`` policy steps: the first samples and trains the
proposal as usual, the next ``k − 1`` sample only the policy and take the negatives from that rollout again, and the
proposal is not stepped. What keeps the estimator right: the σ-weights of the reused samples are recomputed at each
step, ``softmax_j(log p_θ(s̃_j) + β·R(s̃_j) − log q_old(s̃_j))`` with *this* step's policy and β and the log-probs
of the proposal that drew them (stored at sampling time), which is self-normalised importance sampling of
``σ_θ ∝ p_θ·exp(β·R)`` from ``q_old``; the negatives' prompts are an earlier batch's, drawn from the same prompt
distribution, so the negative term still estimates its average over prompts. Where the policy has moved so far that
the weights degenerate, ``proposal_reuse_min_ess`` draws fresh samples instead: the reused rollout is dropped when
the mean effective sample size of its re-weighted samples falls below that fraction of their count.
"""

from __future__ import annotations

import dataclasses

import torch

from ...losses.weights import effective_sample_size
from ...rollout import Rollout
from .steps import HarmlessnessRewards, HarmlessnessRollouts, negative_sample_weights

__all__ = ["ProposalReuse", "ProposalReuseMixin", "sigma_weights_of"]


@dataclasses.dataclass
class ProposalReuse:
    """The proposal rollout kept for reuse, and how many policy steps it has served."""

    steps: int
    """``proposal_reuse_steps``: policy steps one proposal rollout serves (1: no reuse)."""
    min_ess: float = 0.0
    """``proposal_reuse_min_ess``: the lowest mean ESS fraction of re-weighted samples that may still be reused."""
    rollout: Rollout | None = None
    served: int = 0

    def available(self) -> bool:
        """Whether this step may take its negatives from the kept rollout instead of sampling the proposal."""
        return self.steps > 1 and self.rollout is not None and self.served < self.steps

    def keep(self, rollout: Rollout) -> None:
        """A fresh proposal rollout (its first step is this one)."""
        if self.steps > 1:
            self.rollout, self.served = rollout, 1

    def take(self) -> Rollout:
        """The kept rollout for one more step: a shallow copy whose ``ref_logprobs`` (``log p_θ`` at the step that
        drew it) are dropped, to be set from this step's policy."""
        self.served += 1
        return dataclasses.replace(self.rollout, ref_logprobs=None, timings={"generation": 0.0, "scoring": 0.0})

    def drop(self) -> None:
        self.rollout, self.served = None, 0

    def weights_hold(self, weights: torch.Tensor) -> bool:
        """Whether ``(P, M)`` re-weighted σ-weights are still usable: mean ESS / M ≥ ``min_ess``."""
        if self.min_ess <= 0:
            return True
        return float(effective_sample_size(weights).mean()) / weights.shape[-1] >= self.min_ess


class ProposalReuseMixin:
    """`HarmlessnessTrainer`'s side of the reuse: decide, per step, whether the negatives come from the kept rollout
    and attach it. Reads the trainer's ``args``, ``accelerator``, ``_proposal_reuse`` and its sampling helpers."""

    def _reused_proposal(self, rollouts, fused: bool) -> bool:
        """Attach the kept proposal rollout to ``rollouts`` for this step when it may serve again (same decision on
        every process); ``False`` when this step must sample the proposal (nothing kept, served its steps, or its
        re-weighted samples' ESS fell below ``proposal_reuse_min_ess``)."""
        reuse = self._proposal_reuse
        if not reuse.available():
            return False
        proposal = reuse.take()
        if reuse.min_ess > 0 or not fused:  # the weights' check, or the reference log-probs without the fused pass
            proposal.ref_logprobs = self._policy_logprobs(proposal)
        ok = True
        if reuse.min_ess > 0:
            log_phi = self._target_log_phi(proposal.scores)
            weights = sigma_weights_of(self.args, proposal, log_phi, proposal.ref_logprobs)
            ok = reuse.weights_hold(weights)
        if self.accelerator.num_processes > 1:  # every process reuses, or none does
            flag = torch.tensor([float(ok)], device=self.accelerator.device)
            ok = bool(self.accelerator.gather(flag).min() > 0)
        if not ok:
            reuse.drop()
            return False
        rollouts.proposal, rollouts.proposal_reused = proposal, True
        return True


def sigma_weights_of(args, rollout: Rollout, log_phi: torch.Tensor, policy_logprobs: torch.Tensor) -> torch.Tensor:
    """``(P, M)`` σ-weights of a proposal rollout's samples with the given ``log p_θ`` (as the policy loss computes
    them, `steps.negative_sample_weights`)."""
    rollouts = HarmlessnessRollouts(policy=rollout, proposal=rollout)
    zeros = torch.zeros_like(log_phi)
    rewards = HarmlessnessRewards(zeros, torch.zeros_like(rollout.logprobs), zeros, zeros, proposal_log_phi=log_phi)
    return negative_sample_weights(args, rollouts, rewards, policy_logprobs)
