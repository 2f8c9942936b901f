"""The checks of `HarmlessnessConfig` that concern σ ∝ p·exp(β·R), the distribution of the negative samples: its
reward and β (`check_target`), how its samples are drawn (`check_negative_sampler`) and how many the proposal draws
(`check_proposal_samples`, `check_proposal_reuse`). Each takes the config and its ``fail(message)``."""

from __future__ import annotations

import inspect

from ...losses import get_loss_spec
from ...models.twist import MODULATION_PARAMETERIZATIONS, POLICY_PARAMETERIZATIONS
from ...rewards import REWARD_TRANSFORMS

__all__ = ["check_negative_sampler", "check_proposal_reuse", "check_proposal_samples", "check_target"]


def check_target(config, fail) -> None:
    """The reward σ targets: `rm_type`, `reward_transform`, and a `target_dist_beta` (and its annealing start) whose
    sign puts σ's mass on the bad outputs."""
    if config.rm_type == "indicator_below_threshold" and config.reward_threshold is None:
        fail("rm_type='indicator_below_threshold' needs reward_threshold (raw rewards below it count as bad).")
    if config.reward_transform is not None and config.reward_transform not in REWARD_TRANSFORMS:
        fail(
            f"unknown reward_transform {config.reward_transform!r}; choose one of "
            f"{', '.join(REWARD_TRANSFORMS)} or None."
        )
    if config.transform_both_sides and config.reward_transform is None:
        fail("transform_both_sides=True but reward_transform is None: set a reward_transform or drop the flag.")
    uses_sigma = config.uses_negative_samples
    # rm_type 'rlhf' keeps "higher = better", so the bad outputs need beta < 0; the indicator and the toxicity
    # log-probability are high on bad outputs, so there beta > 0 targets them.
    sign, wanted = (-1, "< 0") if config.rm_type == "rlhf" else (1, "> 0")
    beta_used = uses_sigma and (config.separate_reweighting_beta is None or config.uses_proposal_model)
    if beta_used and not config.target_dist_beta * sign > 0:
        fail(
            f"target_dist_beta={config.target_dist_beta} with rm_type={config.rm_type!r}: loss_type="
            f"{config.loss_type!r} targets sigma ∝ p·exp(beta·R), which must put its mass on the bad (low-reward) "
            f"outputs; set target_dist_beta {wanted} (the paper uses -1 ... -30 with rm_type='rlhf', and 1 with "
            "'indicator_below_threshold')."
        )
    if config.anneal_target_dist_beta is not None and not (
        config.anneal_target_dist_beta * sign > 0 and config.target_dist_beta * sign > 0
    ):
        fail(
            f"anneal_target_dist_beta={config.anneal_target_dist_beta} -> target_dist_beta={config.target_dist_beta}: "
            f"a log-spaced beta schedule needs both values {wanted} with rm_type={config.rm_type!r}."
        )


def check_negative_sampler(config, fail) -> None:
    """`negative_sampler`: the learned proposal's samples, or SMC with the proposal as its twist (which then needs a
    trained proposal, temperature 1 and its own weights)."""
    if config.negative_sampler not in ("proposal", "smc"):
        fail(f"negative_sampler={config.negative_sampler!r}: choose 'proposal' or 'smc'.")
    if not 0.0 <= config.smc_ess_threshold <= 1.0:
        fail(f"smc_ess_threshold={config.smc_ess_threshold}: choose a value in [0, 1].")
    if config.negative_sampler != "smc":
        return
    if not config.uses_proposal_model:
        fail(
            "negative_sampler='smc' uses the learned proposal as the SMC twist, but no proposal is trained "
            f"(loss_type={config.loss_type!r}, use_base_as_proposal={config.use_base_as_proposal}); use a loss with "
            "negative samples (e.g. 'neg_training') without use_base_as_proposal, or negative_sampler='proposal'."
        )
    if config.temperature != 1.0:
        fail(
            f"negative_sampler='smc' targets σ ∝ p_θ·φ with p_θ at temperature 1, but temperature="
            f"{config.temperature}; set temperature=1.0 or use negative_sampler='proposal'."
        )
    if config.uniform_reweight or config.separate_reweighting_beta is not None:
        fail(
            "negative_sampler='smc' weights the negatives with the sampler's own weights; uniform_reweight and "
            "separate_reweighting_beta only apply to negative_sampler='proposal'."
        )
    if "neg_rewards" in inspect.signature(get_loss_spec(config.loss_type).fn).parameters:
        fail(
            f"loss_type={config.loss_type!r} also takes the negatives' returns, measured on the proposal's samples; "
            "negative_sampler='smc' replaces those samples. Use negative_sampler='proposal'."
        )


def check_proposal_samples(config, fail) -> None:
    """``proposal_samples_per_prompt``: an integer >= 2, only where a proposal is sampled and its samples are the
    negatives (not with ``use_base_as_proposal``, nor with SMC particles as negatives) when it differs from
    ``num_samples_per_prompt``."""
    m = config.proposal_samples_per_prompt
    if m is None:
        return
    if isinstance(m, bool) or not isinstance(m, int) or m < 2:
        fail(
            f"proposal_samples_per_prompt={m!r}: set an integer >= 2 (the proposal's weights and its twist loss "
            "compare the samples of a prompt), or None for num_samples_per_prompt."
        )
    if m == config.num_samples_per_prompt:
        return
    if not config.uses_proposal_model:
        fail(
            f"proposal_samples_per_prompt={m} but no proposal model is sampled (loss_type={config.loss_type!r}, "
            f"use_base_as_proposal={config.use_base_as_proposal}); leave it unset."
        )
    if config.negative_sampler == "smc":
        fail(
            f"proposal_samples_per_prompt={m} with negative_sampler='smc': the negatives are the "
            f"num_samples_per_prompt={config.num_samples_per_prompt} SMC particles; leave it unset."
        )


def check_proposal_reuse(config, fail) -> None:
    """``proposal_reuse_steps`` (an integer >= 1; above 1 only with a trained proposal whose own samples are the
    negatives, ``order="q_then_p"`` and one proposal step per policy step) and ``proposal_reuse_min_ess`` (in
    [0, 1))."""
    k, ess = config.proposal_reuse_steps, config.proposal_reuse_min_ess
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        fail(f"proposal_reuse_steps={k!r}: set an integer >= 1 (1: fresh proposal samples at every step).")
    if isinstance(ess, bool) or not isinstance(ess, (int, float)) or not 0 <= ess < 1:
        fail(f"proposal_reuse_min_ess={ess!r}: set a fraction in [0, 1) (0: no check).")
    if k == 1:
        return
    if not config.uses_proposal_model or config.negative_sampler != "proposal":
        fail(
            f"proposal_reuse_steps={k} reuses the proposal's samples as the policy's negatives, but here "
            f"loss_type={config.loss_type!r}, use_base_as_proposal={config.use_base_as_proposal}, "
            f"negative_sampler={config.negative_sampler!r}; it needs a trained proposal whose samples are the "
            "negatives."
        )
    if config.order != "q_then_p" or config.q_steps_per_p_step != 1:
        fail(
            f"proposal_reuse_steps={k} needs order='q_then_p' and q_steps_per_p_step=1 (got {config.order!r}, "
            f"{config.q_steps_per_p_step}): the reused samples stand in for the proposal step of those settings."
        )


#: The modulation parameterisations a RePULSe proposal can have: a head on the live policy's trunk.
HEAD_PARAMETERIZATIONS: tuple[str, ...] = tuple(p for p in MODULATION_PARAMETERIZATIONS if p != "modulation_model")


def check_proposal_parameterization(config, loss_types: tuple[str, ...], fail) -> None:
    """``parameterization``: a policy parameterisation (a full proposal model) or a modulation *head* on the live
    policy (``q ∝ p_θ·exp(m)``); ``proposal_loss_type``: one of ``loss_types`` that fits it."""
    p = config.parameterization
    if p == "modulation_model":
        fail(
            "parameterization='modulation_model' trains a second copy of the transformer on top of the policy, "
            "which costs more than a plain proposal model; use 'modulation_linear_head' / 'modulation_mlp_head' "
            f"(a head on the policy's trunk) or one of {', '.join(POLICY_PARAMETERIZATIONS)}."
        )
    if p not in POLICY_PARAMETERIZATIONS + HEAD_PARAMETERIZATIONS:
        fail(f"unknown parameterization {p!r}; choose one of {POLICY_PARAMETERIZATIONS + HEAD_PARAMETERIZATIONS}.")
    loss = config.proposal_loss_type
    if loss is None:
        return
    if loss not in loss_types:
        fail(
            f"proposal_loss_type={loss!r}: the proposal is trained towards the moving policy with one of "
            f"{', '.join(loss_types)} (SIXO's classifier twist is not offered here)."
        )
    from ..twist.twist_step import validate_twist_setup  # (not imported with the config)

    try:
        validate_twist_setup(p, loss)
    except ValueError as err:
        fail(str(err))
    if p in HEAD_PARAMETERIZATIONS and getattr(config, "use_vllm", False):
        fail(
            f"parameterization={p!r} samples the proposal as the policy's trunk plus a head, which a vLLM engine "
            "cannot run; set use_vllm=False or use a policy_psi_* proposal."
        )
