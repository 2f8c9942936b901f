"""`HarmlessnessConfig`: the options of the RePULSe outer loop (`HarmlessnessTrainer`, docs/algorithms.md §9.3)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from ...losses import available_losses, get_loss_spec
from ...losses.reinforce import ALPHA_CONVENTIONS
from ...ops.advantages import BASELINES
from ...ops.kl import KL_ESTIMATORS
from ...ops.kl_control import KLControlConfigMixin, kl_coef_field
from ...rewards import REWARD_TRANSFORMS, RM_TYPES
from ..common.ptx_config import PtxConfigMixin
from ..common.shared_docs import document_shared_options
from ..common.vllm_config import VLLMConfigMixin, document_vllm_options
from ..twist.twist_config import TwistTargetConfig
from .config_checks import (
    check_negative_sampler,
    check_proposal_parameterization,
    check_proposal_reuse,
    check_proposal_samples,
    check_target,
)

__all__ = ["HarmlessnessConfig", "ORDERS", "PROPOSAL_LOSS_TYPES", "REWARD_TRANSFORM_NAMES", "RM_TYPE_NAMES"]

#: When the proposal is updated relative to the policy within one step.
ORDERS: tuple[str, ...] = ("q_then_p", "p_then_q")
#: Twist losses that can train a proposal whose target base is the moving policy.
PROPOSAL_LOSS_TYPES: tuple[str, ...] = ("ctl", "ctl_no_second_term", "ctl_nosecondterm", "dpg")
# The names `trl_ext.rewards` accepts (checked here so that a typo fails when the config is built, not mid-run).
RM_TYPE_NAMES: tuple[str, ...] = RM_TYPES
REWARD_TRANSFORM_NAMES: tuple[str, ...] = REWARD_TRANSFORMS


@document_vllm_options
@document_shared_options
@dataclass
class HarmlessnessConfig(VLLMConfigMixin, PtxConfigMixin, KLControlConfigMixin, TwistTargetConfig):
    r"""
    Configuration class for [`~trl_ext.HarmlessnessTrainer`], the RePULSe training loop: a policy `p_θ` trained with
    REINFORCE plus a term that pushes down the probability of its own low-reward outputs, found by a learned proposal
    `q_ξ` that targets `σ_θ(s) ∝ p_θ(s)·exp(β·R(s))` with `β < 0`.

    One optimizer step is one outer step on `per_device_train_batch_size` **prompts** (not responses), each sampled
    `num_samples_per_prompt` times by `p_θ` and, when a proposal is used, `num_samples_per_prompt` times by `q_ξ`.
    With `gradient_accumulation_steps = k`, an update averages `k` such prompt batches, each with its own rollout.
    For the generic training arguments see [`~transformers.TrainingArguments`].

    Parameters:
        > Parameters that control the losses

        loss_type (`str`, *optional*, defaults to `"neg_training"`):
            Policy loss. `"reinforce"` (REINFORCE with a baseline on the KL-penalised return; no proposal),
            `"neg_training"` (RePULSe: REINFORCE + `α`·σ-weighted log-likelihood of the proposal's samples) or
            `"neg_reinforce"` (REINFORCE + `α`·σ-weighted REINFORCE on the proposal's samples). Any loss registered
            with kind `"harmlessness"` (called by keyword) or `"reinforce"` is accepted too.
        use_base_as_proposal (`bool`, *optional*, defaults to `False`):
            Use the policy's own samples as the proposal's samples (the "p_θ proposal" ablation): no proposal model is
            trained and the σ-weights reduce to about `softmax(β·R)`.
        proposal_loss_type (`str`, *optional*, defaults to `"ctl"`):
            Twist loss of the learned proposal: `"ctl"`, `"ctl_no_second_term"` or `"dpg"`. `None` means no learned
            proposal; `"neg_training"`/`"neg_reinforce"` then need `use_base_as_proposal=True`.
        parameterization (`str`, *optional*, defaults to `"policy_psi_q_p_s_t"`):
            How the twist is read off the proposal: `"policy_psi_q_p_s_t"`, `"policy_psi_q_p_s_1_to_t"` or
            `"policy_psi_unnorm"` (a full proposal model), or `"modulation_linear_head"` / `"modulation_mlp_head"`
            (`"modulation_nn_head"`): ``q ∝ p_θ·exp(m)`` with ``m`` a head on the live policy's final hidden state,
            so q samples with p's trunk and trains and steps only the head (docs/repulse.md).
        modulation_init_scale_divider (`float`, *optional*, defaults to `1.0`):
            A head proposal's last layer starts as `xavier_normal / divider` (seeded by `seed`).
        modulation_init_head_from_base (`bool`, *optional*, defaults to `False`):
            Start a `modulation_linear_head` from the policy's LM head (divided by the divider).
        alpha (`float`, *optional*, defaults to `0.1`):
            Weight `α ≥ 0` of the negative term.
        start_alpha (`float`, *optional*):
            If set, `α` goes from `start_alpha` to `alpha` on a log-spaced schedule over the policy updates.
        alpha_convention (`str`, *optional*, defaults to `"reference"`):
            Scale of the negative term: `"reference"` (the original code's, `α/N` times a σ-expectation; the paper's
            α values assume it) or `"expectation"` (`α` times the σ-expectation).
        reinforce_baseline (`str`, *optional*, defaults to `"rloo"`):
            Baseline of the REINFORCE term: `"rloo"` (leave-one-out, needs `num_samples_per_prompt ≥ 2`), `"none"`
            or `"hardcoded"`.
        reinforce_baseline_value (`float`, *optional*, defaults to `0.0`):
            The constant of the `"hardcoded"` baseline.
        uniform_reweight (`bool`, *optional*, defaults to `False`):
            Use uniform weights `1/N` over the proposal's samples instead of the σ-weights.
        separate_reweighting_beta (`float`, *optional*):
            If set, the σ-weights use `log φ = b·r` (raw reward) with this `b` instead of `β·R`; the proposal is still
            trained with `β`.
        indicator_mask (`bool`, *optional*, defaults to `False`):
            Multiply the σ-weights by `1[exp(log φ) > 2e-16]` (the original's indicator), so a prompt without any
            "bad" proposal sample gets no negative update.
        negative_sampler (`str`, *optional*, defaults to `"proposal"`):
            How the negatives of the σ-weighted term are drawn: `"proposal"` (the proposal's own samples with
            self-normalised importance weights) or `"smc"` (the final particles of twisted SMC towards σ, with the
            learned proposal as twist and the sampler's weights; `trainers.harmlessness.smc_negatives`).
        smc_resampling (`str`, *optional*, defaults to `"multinomial"`):
            With `negative_sampler="smc"`: `"multinomial"`, `"systematic"` or `"none"`.
        smc_ess_threshold (`float`, *optional*, defaults to `0.5`):
            With `negative_sampler="smc"`: resample when the effective sample size is below this fraction of the
            `num_samples_per_prompt` particles.
        loss_aggregation (`str`, *optional*, defaults to `"seq-mean-token-mean"`):
            Reduction of per-token losses: `"seq-mean-token-mean"` (the original's), `"seq-mean-token-sum"` or
            `"token-mean"`.

        > Parameters that control the target and the rewards

        target_dist_beta (`float`, *optional*, defaults to `-10.0`):
            `β` of the proposal's target `σ ∝ p_θ·exp(β·R)`. Must be `< 0` whenever a proposal or σ-weights are used
            (negative β targets the low-reward outputs).
        anneal_target_dist_beta (`float`, *optional*):
            If set, `β` goes from this start value to `target_dist_beta` on a log-spaced schedule over the policy
            updates (both must be negative).
        rm_type (`str`, *optional*, defaults to `"rlhf"`):
            Map from the raw reward `r` to `R` on the proposal side: `"rlhf"` (`min(r, reward_cap)`),
            `"indicator_below_threshold"` or `"toxicity_class_logprob"`. The policy side always uses `"rlhf"`.
        reward_cap (`float`, *optional*):
            Upper cap of `R` for `rm_type="rlhf"` (both sides).
        reward_threshold (`float`, *optional*):
            Threshold of `rm_type="indicator_below_threshold"`.
        reward_transform (`str`, *optional*):
            Reward transform of the policy side: `"minus_alpha_exp_beta_r"` (`r − α_rt·exp(β_rt·r)`) or
            `"minus_alpha_indicator"` (`r − α_rt·1[r < threshold]`).
        reward_transform_alpha (`float`, *optional*):
            `α_rt`; defaults to `alpha`.
        reward_transform_beta (`float`, *optional*):
            `β_rt`; defaults to `target_dist_beta`.
        reward_transform_threshold (`float`, *optional*, defaults to `-5.0`):
            Threshold of `"minus_alpha_indicator"`.
        transform_both_sides (`bool`, *optional*, defaults to `False`):
            Also transform the proposal side's reward (before its `rm_type` map). The original transformed only the
            policy side.
        normalize_reward (`bool`, *optional*, defaults to `False`):
            Normalise the policy's REINFORCE reward at run time: `r'` (the policy-side reward above: the raw score
            unless `reward_cap` / `reward_transform`) becomes `(r' - mean) / max(std, 1e-8)` with the running mean
            and unbiased std of every policy sample's `r'` so far (all processes, this step's included). Only the
            policy's return changes (and `neg_rewards` of losses that take them, with the same statistics): the
            target side (`rm_type`, `reward_threshold`, `log φ`, the σ-weights), `p_bad` and `save_negdata` keep
            reading raw rewards. Logged as `base/reward_mean_running` / `base/reward_std_running`; saved in
            checkpoints (`reward_normalizer.json`).
        kl_coef (`float`, *optional*, defaults to `0.2`):
            Coefficient `λ` of the KL-to-`p_0` penalty in the policy's return `r' − λ·Σ_t kl_t` (the start value
            when `kl_target` is set). `0` without `kl_target`: `p_0` is not run, `base/kl` and `base/f_q` not logged.
        kl_target (`float`, *optional*):
            Target of Ziegler et al. (2019)'s adaptive KL controller for `λ` (`None`: `kl_coef` stays fixed). After
            each policy update (optimizer step) with mean per-sequence KL `kl` (`base/kl`) over its `n` policy
            samples: `λ *= 1 + clip(kl / kl_target − 1, −0.2, 0.2)·n / kl_horizon`; the next update uses the new
            value (logged as `base/kl_coef`; saved in checkpoints).
        kl_horizon (`int`, *optional*, defaults to `10000`):
            Horizon of the adaptive KL controller, in policy samples (larger: slower changes).
        kl_estimator (`str`, *optional*, defaults to `"k1"`):
            Per-token KL estimator: `"k1"`, `"k2"` or `"k3"`.
        missing_eos_penalty (`float`, *optional*):
            Subtracted from the raw reward of responses without a stop token (must be ≥ 0).
        reward_uses_images (`bool`, *optional*, defaults to `False`):
            Pass the prompts' images (PIL) to the reward function as `images=` (vision-language policies; the
            reward must then be a callable or a `RewardFunction`). `False`: rewards score the text only.
        nonfinite_rewards (`str`, *optional*, defaults to `"error"`):
            What a NaN or ±inf reward does: `"error"` stops the run with an error naming the prompt and the
            completion. `"drop"` is refused here (the twist losses weigh a prompt's samples against each other).
        {reward_options}

        > Parameters that control generation

        num_samples_per_prompt (`int`, *optional*, defaults to `4`):
            Responses sampled per prompt by each model.
        response_length (`int`, *optional*, defaults to `20`):
            Maximum number of new tokens per response.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature (log-probs are computed at the same temperature; the paper samples at 1).
        stop_token (`str`, *optional*):
            `"eos"` ends responses at the tokenizer's eos token; mutually exclusive with `stop_token_id`.
        stop_token_id (`int`, *optional*):
            Id of the stop token.
        local_rollout_forward_batch_size (`int`, *optional*, defaults to `64`):
            Rows per generation call and per no-grad scoring pass.
        ds3_gather_for_generation (`bool`, *optional*, defaults to `True`):
            Under DeepSpeed ZeRO-3, gather the weights once per generation call.
        {rollout_options}

        > Parameters that control the schedule and the models

        order (`str`, *optional*, defaults to `"q_then_p"`):
            `"q_then_p"`: the proposal step uses the policy before its update (the original's default);
            `"p_then_q"`: the policy is updated first and the proposal step targets the updated policy.
        q_steps_per_p_step (`int`, *optional*, defaults to `1`):
            Proposal updates per policy update; each extra one samples fresh proposal responses.
        proposal_samples_per_prompt (`int`, *optional*):
            Responses the proposal samples per prompt (at least 2; default `num_samples_per_prompt`). Fewer than the
            policy's cuts the proposal's rollout, its step and the policy's negative term in proportion. The
            σ-weights are self-normalised over these samples, and with `alpha_convention="reference"` the negative
            term is scaled by `proposal_samples_per_prompt / num_samples_per_prompt`, so that `alpha` means what it
            means with equal counts (docs/repulse.md, "Cheaper steps").
        proposal_reuse_steps (`int`, *optional*, defaults to `1`):
            Policy steps one proposal rollout serves: the first samples and trains the proposal, the next ones take
            their negatives from those samples again, re-weighted with the current policy, and skip the proposal's
            sampling and step (docs/repulse.md, "Cheaper steps"). 1: fresh proposal samples at every step.
        proposal_reuse_min_ess (`float`, *optional*, defaults to `0.0`):
            With `proposal_reuse_steps > 1`: draw fresh proposal samples instead when the re-weighted samples' mean
            effective sample size is below this fraction of their count (costs a no-grad policy pass per reuse);
            0: no check.
        proposal_learning_rate (`float`, *optional*):
            Learning rate of the proposal; defaults to `learning_rate`.
        disable_dropout (`bool`, *optional*, defaults to `True`):
            Turn dropout off in every model, so that importance weights and log-probs of the loss agree.
        push_proposal_to_hub (`bool`, *optional*, defaults to `False`):
            With `push_to_hub`, also upload the proposal (in `proposal/`).

        > Parameters that control the pretraining (ptx) loss (InstructGPT's PPO-ptx, on the policy)

        ptx_coef (`float`, *optional*, defaults to `0.0`):
            Weight `γ` of a language-modelling loss on `pretrain_dataset` added to the policy's loss: each
            micro-step adds `ptx_coef × mean token NLL / gradient_accumulation_steps` of one ptx micro-batch, so a
            policy update sees `ptx_coef ×` the mean NLL of its micro-batches (logged unweighted as `loss/ptx`).
            The proposal is not affected. `0`: off, the data is never read.
        ptx_batch_size (`int`, *optional*, defaults to `1`):
            Pretraining texts per micro-step and process.
        ptx_max_length (`int`, *optional*, defaults to `512`):
            Pretraining texts are truncated to this many tokens.
        pretrain_data (`str`, *optional*):
            Pretraining texts loaded by `recipes/harmlessness.py` (a Hub id, a folder or a .json/.jsonl/.csv/.parquet
            file); the trainer takes the dataset itself as `pretrain_dataset=`.
        pretrain_text_column (`str`, *optional*, defaults to `"text"`):
            Column of the pretraining dataset holding the text.
        pretrain_split (`str`, *optional*, defaults to `"train"`):
            Split of the pretraining dataset to read.

        > Parameters that control data and logging

        dataset_num_proc (`int`, *optional*):
            Processes used to tokenise the prompts.
        save_negdata (`str`, *optional*):
            Path of a JSONL file; every sampled response (policy or proposal) whose raw reward is below
            `save_negdata_threshold` is appended as `{"prompt", "response", "reward", "step", "source"}`. A relative
            path is taken under `output_dir` (`"negdata.jsonl"`: `<output_dir>/negdata.jsonl`); an absolute one is
            kept. The config holds the resolved, absolute path. The first line is a header with the run id (see
            `trl_ext.rollout.negdata`): a run only appends to its own file (or, resumed, to the file of the run it
            resumes); an existing file of another run, or one no trl_ext run wrote, is refused.
        save_negdata_threshold (`float`, *optional*, defaults to `-5.0`):
            Raw-reward threshold of `save_negdata`, also the threshold of the logged `p_bad`.

        {frozen_models_options}
        {ema_options}
        {resume_options}
        > Parameters that control non-finite steps (trl_ext additions)

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step (of the policy or of the proposal) whose loss or gradients hold NaN/inf is skipped
            (weights and optimizer state unchanged, logged as `nonfinite/skipped_steps`); more than this many in a
            row stop the run. `0`: stop at the first.

    > [!NOTE]
    > Gradient clipping is per model: `max_grad_norm` is applied to the policy's and to the proposal's gradients
    > separately (the trainer clips and steps the proposal itself with `order="q_then_p"`, the policy with
    > `"p_then_q"`), so a large proposal gradient never shrinks the policy's update. The logged `grad_norm` is then
    > the norm of the model `Trainer` steps (the policy by default) and `grad_norm/proposal` (`grad_norm/policy`)
    > the other's. Under DeepSpeed the two losses are back-propagated together and the engine clips their joint
    > norm.

    > [!NOTE]
    > `per_device_train_batch_size` counts **prompts** here (TRL's PPO counts responses).
    > Defaults that differ from [`~transformers.TrainingArguments`]: `learning_rate=3e-5`, `logging_steps=10`,
    > activation checkpointing on, and `bf16` on when `fp16` is off and a GPU is present (off on a CPU-only machine).
    """

    # ------------------------------------------------------------------------------------- TrainingArguments
    learning_rate: float = field(default=3e-5, metadata={"help": "Learning rate of the policy (AdamW by default)."})
    per_device_train_batch_size: int = field(
        default=8,
        metadata={
            "help": "Prompts per device per micro-step; each is sampled num_samples_per_prompt times by the policy "
            "(and as many times by the proposal)."
        },
    )

    # ------------------------------------------------------------------------------------------------ losses
    loss_type: str = field(
        default="neg_training",
        metadata={
            "help": "Policy loss: 'reinforce' (no proposal), 'neg_training' (RePULSe) or 'neg_reinforce'; or a loss "
            "registered with kind 'harmlessness' or 'reinforce'."
        },
    )
    use_base_as_proposal: bool = field(
        default=False,
        metadata={"help": "Use the policy's own samples as proposal samples (no proposal model is trained)."},
    )
    proposal_loss_type: str | None = field(
        default="ctl",
        metadata={
            "help": "Twist loss of the learned proposal: 'ctl', 'ctl_no_second_term' or 'dpg'; None: no learned "
            "proposal (then the negative losses need use_base_as_proposal=True)."
        },
    )
    alpha: float = field(default=0.1, metadata={"help": "Weight alpha >= 0 of the negative term."})
    start_alpha: float | None = field(
        default=None,
        metadata={"help": "Start value of a log-spaced alpha schedule ending at `alpha` (None: constant alpha)."},
    )
    alpha_convention: Literal["reference", "code", "expectation"] = field(
        default="reference",
        metadata={
            "help": "Scale of the negative term: 'reference' (alias 'code'; the original's alpha/N convention, which "
            "the paper's alpha values assume) or 'expectation' (alpha times the sigma-expectation)."
        },
    )
    reinforce_baseline: str = field(
        default="rloo",
        metadata={"help": "Baseline of the REINFORCE term: 'rloo' (needs N >= 2), 'none' or 'hardcoded'."},
    )
    reinforce_baseline_value: float = field(
        default=0.0, metadata={"help": "The constant of reinforce_baseline='hardcoded'."}
    )
    uniform_reweight: bool = field(
        default=False, metadata={"help": "Uniform weights 1/N over the proposal samples instead of sigma-weights."}
    )
    separate_reweighting_beta: float | None = field(
        default=None,
        metadata={"help": "If set, the sigma-weights use log phi = b * raw reward (the proposal keeps beta)."},
    )
    indicator_mask: bool = field(
        default=False,
        metadata={"help": "Multiply the sigma-weights by 1[exp(log phi) > 2e-16] (the original's indicator)."},
    )
    negative_sampler: Literal["proposal", "smc"] = field(
        default="proposal",
        metadata={
            "help": "Negatives of the sigma-weighted term: 'proposal' (its samples, self-normalised weights) or "
            "'smc' (twisted SMC particles towards sigma with the proposal as twist, the sampler's weights)."
        },
    )
    smc_resampling: Literal["multinomial", "systematic", "none"] = field(
        default="multinomial", metadata={"help": "negative_sampler='smc': the resampling scheme."}
    )
    smc_ess_threshold: float = field(
        default=0.5,
        metadata={"help": "negative_sampler='smc': resample below this ESS fraction of the particles (0 to 1)."},
    )

    # -------------------------------------------------------------------------------------- target, rewards
    anneal_target_dist_beta: float | None = field(
        default=None,
        metadata={"help": "Start value of a log-spaced beta schedule ending at target_dist_beta (None: constant)."},
    )
    reward_transform: str | None = field(
        default=None,
        metadata={
            "help": "Policy-side reward transform: 'minus_alpha_exp_beta_r' (r - a·exp(b·r)) or "
            "'minus_alpha_indicator' (r - a·1[r < threshold]); None: off."
        },
    )
    reward_transform_alpha: float | None = field(
        default=None, metadata={"help": "alpha of the reward transform (default: `alpha`)."}
    )
    reward_transform_beta: float | None = field(
        default=None, metadata={"help": "beta of the reward transform (default: `target_dist_beta`)."}
    )
    reward_transform_threshold: float = field(
        default=-5.0, metadata={"help": "Threshold of reward_transform='minus_alpha_indicator'."}
    )
    transform_both_sides: bool = field(
        default=False,
        metadata={"help": "Also transform the proposal side's reward before its rm_type map (the original did not)."},
    )
    normalize_reward: bool = field(
        default=False,
        metadata={
            "help": "Normalise the policy's REINFORCE reward r' (raw score unless reward_cap / reward_transform) at "
            "run time: (r' - mean) / max(std, 1e-8) with the running mean and unbiased std of every policy sample's "
            "r' so far (all processes, this step's included). The target side (rm_type, reward_threshold, log phi, "
            "sigma-weights), p_bad and save_negdata stay on raw rewards. Saved in checkpoints."
        },
    )
    kl_coef: float = kl_coef_field(0.2)  # (the policy's return r' - kl_coef * KL; PPO's default is 0.05)
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        default="k1", metadata={"help": "Per-token KL estimator: 'k1' (the original's), 'k2' or 'k3'."}
    )

    # -------------------------------------------------------------------------------------- schedule, models
    order: Literal["q_then_p", "p_then_q"] = field(
        default="q_then_p",
        metadata={
            "help": "'q_then_p': the proposal step targets the policy before its update (the original's default); "
            "'p_then_q': the policy is updated first."
        },
    )
    q_steps_per_p_step: int = field(
        default=1, metadata={"help": "Proposal updates per policy update (extra ones use fresh proposal samples)."}
    )
    proposal_samples_per_prompt: int | None = field(
        default=None,
        metadata={
            "help": "Responses the proposal samples per prompt (>= 2; default num_samples_per_prompt). Fewer cut "
            "the proposal's rollout, its step and the negative term in proportion; the sigma-weights are normalised "
            "over these samples and alpha keeps its meaning (see docs/repulse.md)."
        },
    )
    proposal_reuse_steps: int = field(
        default=1,
        metadata={
            "help": "Policy steps one proposal rollout serves (1: fresh proposal samples every step); the others "
            "re-weight its samples with the current policy and skip the proposal's sampling and step."
        },
    )
    proposal_reuse_min_ess: float = field(
        default=0.0,
        metadata={
            "help": "With proposal_reuse_steps > 1: resample when the reused samples' ESS fraction is below this."
        },
    )
    proposal_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the proposal (default: learning_rate)."}
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Turn dropout off in all models (importance weights need it)."}
    )
    push_proposal_to_hub: bool = field(
        default=False, metadata={"help": "With push_to_hub, also upload the proposal in proposal/."}
    )

    # ---------------------------------------------------------------------------------------- data, logging
    save_negdata: str | None = field(
        default=None,
        metadata={
            "help": "JSONL file collecting every sampled response whose raw reward < save_negdata_threshold. A "
            "relative path is under --output_dir (e.g. negdata.jsonl: <output_dir>/negdata.jsonl); an absolute one "
            "is kept. Its first line names the run (run id); another run's file, or a file trl_ext did not write, "
            "is refused (a resumed run continues its own)."
        },
    )
    save_negdata_threshold: float = field(
        default=-5.0, metadata={"help": "Raw-reward threshold of save_negdata and of the logged p_bad."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.save_negdata:  # relative: under output_dir (absolute, so that a second __post_init__ keeps it)
            path = os.path.expanduser(self.save_negdata)
            self.save_negdata = os.path.abspath(path if os.path.isabs(path) else os.path.join(self.output_dir, path))

    # ------------------------------------------------------------------------------------------- derived
    @property
    def proposal_num_samples(self) -> int:
        """Samples per prompt of the proposal: ``proposal_samples_per_prompt``, else ``num_samples_per_prompt``."""
        if self.proposal_samples_per_prompt is None:
            return self.num_samples_per_prompt
        return self.proposal_samples_per_prompt

    @property
    def negative_samples_per_prompt(self) -> int:
        """Negative samples per prompt of the policy's loss: the proposal's count when its samples are the
        negatives, else ``num_samples_per_prompt`` (the policy's own samples, or the SMC particles)."""
        if self.uses_proposal_model and self.negative_sampler == "proposal":
            return self.proposal_num_samples
        return self.num_samples_per_prompt

    @property
    def uses_proposal_model(self) -> bool:
        """Whether a proposal model is sampled from and trained."""
        return self.uses_negative_samples and not self.use_base_as_proposal

    @property
    def uses_negative_samples(self) -> bool:
        """Whether the policy loss has a term on σ-weighted (proposal) samples."""
        return self.loss_type != "reinforce" and get_loss_spec(self.loss_type).kind == "harmlessness"

    def _twist_uses_logprobs_only(self, loss: str) -> bool:
        from ..twist.twist_step import twist_uses_logprobs_only  # not imported with the config

        return twist_uses_logprobs_only(self.parameterization, loss)

    def _twist_loss_type(self) -> str | None:
        try:
            return self.proposal_loss_type if self.uses_proposal_model else None
        except KeyError:  # an unknown loss_type: reported by `_validate_losses`
            return None

    @property
    def effective_proposal_learning_rate(self) -> float:
        return self.learning_rate if self.proposal_learning_rate is None else self.proposal_learning_rate

    # ------------------------------------------------------------------------------------------- checks
    def _validate(self) -> None:
        super()._validate()
        fail = self._fail
        self._validate_generation(fail)
        self._validate_losses(fail)
        check_target(self, fail)
        check_negative_sampler(self, fail)
        self._validate_schedule(fail)

    def _validate_generation(self, fail) -> None:
        if self.q_steps_per_p_step < 1:
            fail(f"q_steps_per_p_step={self.q_steps_per_p_step}: set it to at least 1.")
        if self.fp16:
            fail(
                "fp16 is not supported: the proposal and the policy are stepped separately and a loss scaler shared "
                "by both steps would mis-scale one of them. Use bf16=True (or full precision)."
            )

    def _validate_losses(self, fail) -> None:
        try:
            spec = get_loss_spec(self.loss_type)
        except KeyError:
            names = sorted({"reinforce", *available_losses("harmlessness")})
            fail(f"unknown loss_type {self.loss_type!r}; choose one of {', '.join(names)}.")
        if spec.kind not in ("harmlessness", "reinforce"):
            fail(
                f"loss_type={self.loss_type!r} is a {spec.kind!r} loss; the policy needs 'reinforce' or a "
                f"'harmlessness' loss ({', '.join(available_losses('harmlessness'))})."
            )
        if self.reinforce_baseline not in BASELINES:
            fail(f"unknown reinforce_baseline {self.reinforce_baseline!r}; choose 'rloo', 'none' or 'hardcoded'.")
        if self.reinforce_baseline in ("rloo", "expectation") and self.num_samples_per_prompt < 2:
            fail(
                "reinforce_baseline='rloo' needs at least 2 samples per prompt; set num_samples_per_prompt >= 2 or "
                "reinforce_baseline='none'."
            )
        if self.alpha_convention not in ALPHA_CONVENTIONS:
            fail(f"unknown alpha_convention {self.alpha_convention!r}; choose 'reference' or 'expectation'.")
        if not self.alpha >= 0 or (self.start_alpha is not None and not self.start_alpha > 0):
            fail(f"alpha={self.alpha}, start_alpha={self.start_alpha}: alpha must be >= 0 and start_alpha > 0.")
        if self.start_alpha is not None and not self.alpha > 0:
            fail("start_alpha is set but alpha is 0: a log-spaced schedule needs alpha > 0.")
        self._check_choice("kl_estimator", KL_ESTIMATORS)
        self.check_kl_control(fail)
        negative = spec.kind == "harmlessness"
        if negative and not self.use_base_as_proposal and self.proposal_loss_type is None:
            fail(
                f"loss_type={self.loss_type!r} needs negative samples, but there is no proposal "
                "(proposal_loss_type=None) and use_base_as_proposal=False. Set proposal_loss_type='ctl' to learn a "
                "proposal, or use_base_as_proposal=True to use the policy's own samples."
            )
        if not negative and self.use_base_as_proposal:
            fail(
                f"use_base_as_proposal=True but loss_type={self.loss_type!r} uses no proposal samples; set "
                "loss_type='neg_training' (the p_θ-proposal ablation) or use_base_as_proposal=False."
            )
        check_proposal_parameterization(self, PROPOSAL_LOSS_TYPES, fail)
        if self.proposal_learning_rate is not None and self.proposal_learning_rate < 0:
            fail(f"proposal_learning_rate={self.proposal_learning_rate} must be >= 0.")

    def _validate_schedule(self, fail) -> None:
        extra_steps = self.order == "p_then_q" or self.q_steps_per_p_step > 1
        if extra_steps and self.uses_proposal_model and self.gradient_accumulation_steps != 1:
            fail(
                f"order={self.order!r} with q_steps_per_p_step={self.q_steps_per_p_step} makes extra optimizer steps "
                f"inside one training step, which cannot be combined with gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}; set gradient_accumulation_steps=1 (raise "
                "per_device_train_batch_size instead) or use order='q_then_p' with q_steps_per_p_step=1."
            )
        if self.q_steps_per_p_step > 1 and not self.uses_proposal_model:
            fail(
                f"q_steps_per_p_step={self.q_steps_per_p_step} but no proposal model is trained (loss_type="
                f"{self.loss_type!r}, use_base_as_proposal={self.use_base_as_proposal}); set q_steps_per_p_step=1."
            )
        check_proposal_samples(self, fail)
        check_proposal_reuse(self, fail)
        if self.load_best_model_at_end:
            fail("load_best_model_at_end is not supported (there is no eval loss); set it to False.")
