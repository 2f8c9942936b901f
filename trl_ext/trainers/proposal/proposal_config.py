"""`ProposalConfig`: options of [`~trl_ext.ProposalTrainer`], which learns a proposal ``q`` towards
``σ(s) ∝ p_ref(s)·exp(β·R(s))`` (twist learning, docs/algorithms.md §6–§7, §9.2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...losses import available_losses
from ...models.twist import TWIST_PARAMETERIZATIONS
from ...rewards import RewardShaping
from ..common.shared_docs import document_shared_options
from ..common.vllm_config import VLLMConfigMixin, document_vllm_options
from ..twist.twist_config import TwistTargetConfig
from ..twist.twist_step import validate_twist_setup

__all__ = ["ProposalConfig"]


@document_vllm_options
@document_shared_options
@dataclass
class ProposalConfig(VLLMConfigMixin, TwistTargetConfig):
    r"""
    Configuration class for [`~trl_ext.ProposalTrainer`].

    The trainer learns a proposal ``q`` (a causal LM, or a modulation of the reference) towards the twisted target
    ``σ(s) ∝ p_ref(s)·exp(β·R(s))``, where ``p_ref`` is the frozen reference model, ``R`` the mapped reward
    (``rm_type``) and ``β = target_dist_beta``. Each `Trainer` micro-step samples `num_samples_per_prompt`
    responses from ``q`` for each of `per_device_train_batch_size` prompts and takes a twist loss (``loss_type``)
    on them; gradients accumulate over `gradient_accumulation_steps` micro-steps as usual. For the generic training
    arguments see [`~transformers.TrainingArguments`].

    Parameters:
        > Parameters that control the proposal and its loss

        parameterization (`str`, *optional*, defaults to `"policy_psi_q_p_s_t"`):
            How the twist ``log ψ_t`` is read off ``q``: `"policy_psi_q_p_s_t"` (``log q − log p_ref`` per token, all
            paper runs), `"policy_psi_q_p_s_1_to_t"` (its prefix sum), `"policy_psi_unnorm"` (raw ``q`` logit minus
            ``log p_ref``), or `"modulation_model"`, `"modulation_linear_head"`, `"modulation_nn_head"` /
            `"modulation_mlp_head"` (``q ∝ p_ref·exp(m)``; a plain model passed to the trainer is wrapped in a
            [`~trl_ext.models.ModulatedCausalLM`] of that kind).
        loss_type (`str`, *optional*, defaults to `"ctl"`):
            A twist loss of the registry: `"ctl"`, `"ctl_no_second_term"`, `"sixo"` (exact: also samples the
            reference), `"sixo_approx"`, `"dpg"`, or one registered with `trl_ext.register_loss(name, kind="twist")`.
        loss_aggregation (`str`, *optional*, defaults to `"seq-mean-token-mean"`):
            Reduction of the per-token loss: `"seq-mean-token-mean"` (the original code's), `"seq-mean-token-sum"`
            or `"token-mean"` (token mean of each micro-step's rollout).
        modulation_init_scale_divider (`float`, *optional*, defaults to `1.0`):
            When the trainer builds the modulation: its last layer starts as ``xavier_normal / divider``.
        modulation_init_head_from_base (`bool`, *optional*, defaults to `False`):
            When the trainer builds a `model`/`linear_head` modulation: start its output layer from the reference's
            LM head (divided by the divider).

        > Parameters that control the target

        target_dist_beta (`float`, *optional*, defaults to `-10.0`):
            β of ``σ ∝ p_ref·exp(β·R)``. With `rm_type="rlhf"` (higher reward = better), **β < 0** puts the target
            on the reference's low-reward (bad) outputs — the RePULSe setting (paper: −1 … −30); β > 0 on the
            high-reward ones; β = 0 gives ``σ = p_ref``.
        rm_type (`str`, *optional*, defaults to `"rlhf"`):
            Raw score ``r`` → ``R``: `"rlhf"` (``min(r, reward_cap)``), `"indicator_below_threshold"`
            (``log(1[r < reward_threshold] + 1e-16)``, needs β > 0, usually 1) or `"toxicity_class_logprob"`
            (``−softplus(r)``).
        reward_cap (`float`, *optional*):
            Cap of `"rlhf"` rewards (`None`: none).
        reward_threshold (`float`, *optional*):
            Threshold of `"indicator_below_threshold"`.
        missing_eos_penalty (`float`, *optional*):
            Subtracted from the raw score of responses without a stop token (before the map). Must be >= 0.
        reward_uses_images (`bool`, *optional*, defaults to `False`):
            Pass the prompts' images (PIL) to the reward function as `images=` (vision-language policies; the
            reward must then be a callable or a `RewardFunction`). `False`: rewards score the text only.
        nonfinite_rewards (`str`, *optional*, defaults to `"error"`):
            What a NaN or ±inf reward does: `"error"` stops the run with an error naming the prompt and the
            completion. `"drop"` is refused here (the twist losses weigh a prompt's samples against each other).
        {reward_options}

        > Parameters that control generation

        num_samples_per_prompt (`int`, *optional*, defaults to `4`):
            ``N`` responses per prompt; the σ-weights are normalised over them, so it must be at least 2.
        response_length (`int`, *optional*, defaults to `20`):
            Maximum number of new tokens per response.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature of ``q`` (log-probs use the same one). The target is defined at temperature 1, so
            keep 1.0 (pure ancestral sampling, as in the paper) unless you know why not.
        stop_token (`str`, *optional*):
            `"eos"` ends responses at the tokenizer's eos token; mutually exclusive with `stop_token_id`.
        stop_token_id (`int`, *optional*):
            Id of the stop token.
        local_rollout_forward_batch_size (`int`, *optional*, defaults to `64`):
            Rows per generation call and per no-grad scoring pass.
        ds3_gather_for_generation (`bool`, *optional*, defaults to `True`):
            Under ZeRO-3, gather the weights once per generation call.
        {rollout_options}

        > Parameters that control the data and the run length

        dataset_num_proc (`int`, *optional*):
            Processes used to tokenise the prompts.
        total_episodes (`int`, *optional*):
            Total number of sampled responses; sets `max_steps` to ``ceil(total_episodes / (per_device_train_batch_size
            × num_samples_per_prompt × gradient_accumulation_steps × world_size))`` when `max_steps` is not set.
        num_sample_generations (`int`, *optional*, defaults to `0`):
            Number of sample tables (responses of ``q`` on `eval_dataset`) printed during training (`0`: none).

        {frozen_models_options}
        {ema_options}
        {resume_options}
        > Parameters that control non-finite steps (trl_ext additions)

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step (of the proposal) whose loss or gradients hold NaN/inf is skipped (weights and
            optimizer state unchanged, logged as `nonfinite/skipped_steps`); more than this many in a row stop the
            run. `0`: stop at the first.

    > [!NOTE]
    > Defaults that differ from [`~transformers.TrainingArguments`]: `learning_rate=3e-5`, `logging_steps=10`,
    > activation checkpointing on, and `bf16` on when `fp16` is off and a GPU is present (off on a CPU-only machine).
    > `per_device_train_batch_size` counts **prompts**: a micro-step samples `per_device_train_batch_size ×
    > num_samples_per_prompt` responses.
    """

    _ema_model = "proposal"  # the averaged model, in the shared EMA docs (not a field)

    # ------------------------------------------------------------------------------------- TrainingArguments
    learning_rate: float = field(default=3e-5, metadata={"help": "Learning rate of the proposal (AdamW by default)."})

    # ------------------------------------------------------------------------------------ proposal & loss
    loss_type: str = field(
        default="ctl",
        metadata={
            "help": "Twist loss: 'ctl', 'ctl_no_second_term', 'sixo' (exact, samples the reference too), "
            "'sixo_approx', 'dpg', or a loss registered with kind 'twist'."
        },
    )

    # ---------------------------------------------------------------------------------------- data & length
    total_episodes: int | None = field(
        default=None,
        metadata={
            "help": "Total number of sampled responses; sets max_steps when max_steps is not set (None: "
            "num_train_epochs passes over the prompts)."
        },
    )
    num_sample_generations: int = field(
        default=0,
        metadata={"help": "Number of sample tables of q's responses on eval_dataset during training (0: none)."},
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Whether to push the proposal to the Hub."})

    # ------------------------------------------------------------------------------------------- checks
    def _twist_uses_logprobs_only(self, loss: str) -> bool:
        from ..twist.twist_step import twist_uses_logprobs_only  # not imported with the config

        return twist_uses_logprobs_only(self.parameterization, loss)

    def _twist_loss_type(self) -> str | None:
        return self.loss_type

    def _validate(self) -> None:
        super()._validate()
        fail = self._fail
        if self.num_samples_per_prompt < 2:
            fail(
                f"num_samples_per_prompt={self.num_samples_per_prompt}: twist losses normalise importance weights "
                "over the samples of each prompt, which carry no signal with a single sample; set it to at least 2."
            )
        self._check_choice("parameterization", TWIST_PARAMETERIZATIONS)
        if self.loss_type not in available_losses("twist"):
            fail(
                f"unknown loss_type {self.loss_type!r}: use a loss registered with kind 'twist' (registered: "
                f"{', '.join(available_losses('twist'))}). Register custom losses with "
                "trl_ext.register_loss(name, kind='twist') before building the config."
            )
        try:
            validate_twist_setup(self.parameterization, self.loss_type)
        except ValueError as err:
            fail(str(err))
        if not math.isfinite(self.target_dist_beta):
            fail(f"target_dist_beta={self.target_dist_beta} must be a finite number.")
        try:
            self.reward_shaping()
        except ValueError as err:
            fail(f"{err} (In ProposalConfig, beta is `target_dist_beta` and threshold is `reward_threshold`.)")
        if self.total_episodes is not None and self.total_episodes < 1:
            fail(f"total_episodes={self.total_episodes}: set a positive number, or None.")
        if self.num_sample_generations < 0:
            fail(f"num_sample_generations={self.num_sample_generations}: set it >= 0 (0: no sample tables).")

    # ------------------------------------------------------------------------------------------ derived
    def reward_shaping(self) -> RewardShaping:
        """The :class:`~trl_ext.rewards.RewardShaping` of the target: ``log φ = target_dist_beta · R``."""
        return RewardShaping(
            rm_type=self.rm_type,
            reward_cap=self.reward_cap,
            threshold=self.reward_threshold,
            beta=self.target_dist_beta,
        )

    @property
    def samples_per_step(self) -> int:
        """Responses sampled per optimizer step over all processes."""
        per_process = self.per_device_train_batch_size * self.num_samples_per_prompt * self.gradient_accumulation_steps
        return per_process * self.world_size

    def steps_for_episodes(self) -> int | None:
        """``max_steps`` implied by `total_episodes` (``None`` when it is unset)."""
        if self.total_episodes is None:
            return None
        return max(1, math.ceil(self.total_episodes / self.samples_per_step))
