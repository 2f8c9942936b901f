r"""RePULSe's negative samples drawn by twisted SMC (``negative_sampler="smc"``).

RePULSe's negative term is ``α·E_σ[ℓ(s)]`` with ``σ ∝ p_θ·φ`` and ``ℓ`` the token-mean log-likelihood under
``p_θ``. By default (``negative_sampler="proposal"``) it is estimated with the proposal's own samples and
self-normalised importance weights ``w̃_i ∝ p_θ(s_i)φ(s_i)/q(s_i)``. With ``"smc"``, the ``N`` negatives of a prompt
are the final particles of a twisted SMC run (:func:`trl_ext.sampling.twisted_smc`) towards the same ``σ``: target
``p_θ`` (the current policy), the learned proposal ``q`` as twist and proposal
(:class:`trl_ext.sampling.LMTwist` with the trainer's ``parameterization``; the policy is the twist's reference),
final potential ``log φ = β·R`` of the raw reward, and weights ``w̃`` = the sampler's normalised final weights.
Both are consistent estimates of ``E_σ[ℓ]`` (self-normalised, with an ``O(1/N)`` bias); ``Ẑ``-weighted averages
of either over independent draws are unbiased. SMC resamples particles whose twisted weights fall behind, so its
``N`` negatives concentrate on σ's mass when the proposal alone would waste samples.

The proposal is still trained on its own samples (the twist loss needs them), so the SMC draw comes on top: about
``N·T`` rows through ``q`` and through ``p_θ`` per prompt, plus one reward call per completed particle and one for
the final particles' scores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ...rollout import Rollout, RolloutReward
from ...sampling import LMTwist, SMCConfig, twisted_smc

__all__ = ["SMCNegatives", "smc_negatives"]


class SMCNegatives(NamedTuple):
    """Result of :func:`smc_negatives`."""

    rollout: Rollout
    """The final particles as a `Rollout` (``N`` rows per prompt): ``logprobs`` = ``log q`` and ``ref_logprobs`` =
    ``log p_θ`` of their tokens along each particle's ancestral line, ``scores`` = raw rewards."""
    weights: torch.Tensor
    """``(P, N)`` fp32 normalised final weights (zero where the indicator mask removes a particle)."""
    log_z: torch.Tensor
    """``(P,)`` float64 ``log Ẑ`` of each prompt's run."""
    num_resampling: torch.Tensor
    """``(P,)`` resampling events of each run."""


def _penalised(scores, response_ids, response_mask, stops: list[int], missing_eos_penalty: float | None):
    if not missing_eos_penalty or not stops:
        return scores
    ended = (torch.isin(response_ids, torch.tensor(stops, device=response_ids.device)) & (response_mask != 0)).any(-1)
    return torch.where(ended, scores, scores - missing_eos_penalty)


@torch.no_grad()
def smc_negatives(
    policy: nn.Module,
    proposal: nn.Module,
    parameterization: str,
    reward: RolloutReward,
    log_phi_of_scores: Callable[[torch.Tensor], torch.Tensor],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    num_particles: int,
    max_new_tokens: int,
    stop_token_ids: list[int],
    pad_token_id: int,
    resampling: str = "multinomial",
    ess_threshold: float = 0.5,
    missing_eos_penalty: float | None = None,
    indicator_threshold: float | None = None,
    generator: torch.Generator | None = None,
) -> SMCNegatives:
    """``num_particles`` negatives per left-padded prompt ``(P, L)`` by twisted SMC towards ``σ ∝ p_θ·φ``.

    Args:
        policy: ``p_θ`` (target base and twist reference).
        proposal: the learned proposal ``q`` (a causal LM, or a `ModulatedCausalLM` for ``modulation_*``).
        parameterization: how ``q`` gives the twist (the trainer's ``parameterization``).
        reward: scores ``prompt + response`` rows with raw rewards.
        log_phi_of_scores: raw scores ``(n,)`` → ``log φ`` ``(n,)`` (the trainer's ``β·R`` of this step).
        num_particles, max_new_tokens, stop_token_ids, pad_token_id, resampling, ess_threshold: the sampler's
            settings (:class:`~trl_ext.sampling.SMCConfig`).
        missing_eos_penalty: subtracted from the raw score of a response without a stop token, as in rollouts.
        indicator_threshold: multiply the weights by ``1[log φ > threshold]`` without renormalising (the
            original's indicator mask).
        generator: randomness of the sampler (default: torch's global generator).
    """
    stops = [int(i) for i in stop_token_ids]

    def scores_of(p_ids, p_mask, r_ids, r_mask):
        raw = reward(p_ids, p_mask, r_ids, r_mask)
        return _penalised(raw, r_ids, r_mask, stops, missing_eos_penalty)

    def potential(p_ids, p_mask, r_ids, r_mask):
        return log_phi_of_scores(scores_of(p_ids, p_mask, r_ids, r_mask)).double()

    source = LMTwist(proposal, parameterization, reference_model=policy)
    config = SMCConfig(
        num_particles=num_particles, max_new_tokens=max_new_tokens, resampling=resampling,
        ess_threshold=ess_threshold, stop_token_ids=stops, pad_token_id=pad_token_id,
    )  # fmt: skip
    result = twisted_smc(source, prompt_ids, potential, config, prompt_mask=prompt_mask, generator=generator)
    device = prompt_ids.device
    ids, mask = result.response_ids.to(device), result.response_mask.to(device)
    p_ids, p_mask = result.prompt_ids.to(device), result.prompt_mask.to(device)
    scores = scores_of(p_ids, p_mask, ids, mask).float()
    weights = result.normalized_weights().float().to(device)
    if indicator_threshold is not None:
        keep = (result.log_phi.to(device) > indicator_threshold).view_as(weights)
        weights = weights * keep.float()
    if stops:
        contains = (torch.isin(ids, torch.tensor(stops, device=device)) & (mask != 0)).any(-1)
    else:
        contains = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    rollout = Rollout(
        prompt_ids=p_ids, prompt_mask=p_mask, response_ids=ids, response_mask=mask,
        logprobs=result.token_log_q.to(device), ref_logprobs=result.token_log_p.to(device), scores=scores,
        contains_stop=contains, num_samples_per_prompt=num_particles,
    )  # fmt: skip
    return SMCNegatives(rollout, weights, result.log_z, result.num_resampling)
