"""`RePULSeGRPOConfig`: TRL's `GRPOConfig` plus the options of RePULSe's learned proposal and push-down term."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trl import GRPOConfig

from ...losses.reinforce import ALPHA_CONVENTIONS
from ..harmlessness.config_checks import check_proposal_parameterization
from ..harmlessness.harmlessness_config import PROPOSAL_LOSS_TYPES

__all__ = ["PROPOSAL_GENERATION_MODES", "RePULSeGRPOConfig"]

#: How the proposal samples. Only HF generation is offered (see docs/grpo_repulse.md for why not a vLLM swap).
PROPOSAL_GENERATION_MODES: tuple[str, ...] = ("hf",)


@dataclass
class RePULSeGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`~trl_ext.RePULSeGRPOTrainer`]: every option of TRL's [`~trl.GRPOConfig`] (reward
    functions, `num_generations`, `loss_type`, `beta` and the reference model, vLLM, logging), plus a learned proposal
    `q_ξ` trained towards `σ_θ(s) ∝ p_θ(s)·exp(β·r(s))` (β < 0: the policy's own low-reward outputs) and a term
    `α × Σ w̃·log p_θ(s̃)` on `q_ξ`'s σ-weighted samples that pushes their probability down. The names and defaults
    are `HarmlessnessConfig`'s.

    Parameters:
        > Parameters of the push-down term

        alpha (`float`, *optional*, defaults to `0.1`):
            Weight `α ≥ 0` of the push-down term. `0` trains the policy exactly as `GRPOTrainer` (the term is
            skipped; the proposal is still trained, on its own random stream, unless
            `train_proposal_at_zero_alpha=False`).
        alpha_convention (`str`, *optional*, defaults to `"reference"`):
            Scale of the term: `"reference"` (alias `"code"`: `α·mean` over the negatives of `w̃·log p_θ`, the
            original's α/N convention, scaled by `proposal_samples_per_prompt / num_generations`) or
            `"expectation"` (`α` times the σ-expectation per prompt).
        indicator_mask (`bool`, *optional*, defaults to `False`):
            Multiply the σ-weights by `1[exp(β·r) > 2e-16]` (the original's indicator; no renormalisation).
        loss_aggregation (`str`, *optional*, defaults to `"seq-mean-token-mean"`):
            Reduction of the push-down term's and the proposal loss's per-token values (GRPO's own loss keeps
            `loss_type`).

        > Parameters of the proposal

        target_dist_beta (`float`, *optional*, defaults to `-10.0`):
            `β` of the target `σ ∝ p_θ·exp(β·r)`, `r` the weighted sum of the reward functions.
        proposal_loss_type (`str`, *optional*, defaults to `"ctl"`):
            Twist loss of the proposal: `"ctl"`, `"ctl_no_second_term"` or `"dpg"`.
        parameterization (`str`, *optional*, defaults to `"policy_psi_q_p_s_t"`):
            `"policy_psi_*"`: the proposal is a full model (a copy of the initial policy, or one with a LoRA adapter);
            `"modulation_linear_head"` / `"modulation_mlp_head"`: a head on the live policy's trunk.
        modulation_init_scale_divider (`float`, *optional*, defaults to `1.0`):
            A head proposal's last layer starts as `xavier_normal / divider`.
        modulation_init_head_from_base (`bool`, *optional*, defaults to `False`):
            A linear head proposal starts from the policy's LM head (divided by the divider).
        proposal_learning_rate (`float`, *optional*):
            Learning rate of the proposal's own AdamW (default: `learning_rate`).
        q_steps_per_p_step (`int`, *optional*, defaults to `1`):
            Proposal updates per policy micro-step (the extra ones use fresh proposal samples).
        proposal_samples_per_prompt (`int`, *optional*):
            Responses the proposal samples per prompt (≥ 2; default `num_generations`).
        proposal_generation (`str`, *optional*, defaults to `"hf"`):
            How the proposal samples: `"hf"` (`generate` on the training device; with `use_vllm` the policy still
            samples with TRL's engine).
        train_proposal_at_zero_alpha (`bool`, *optional*, defaults to `True`):
            With `alpha=0`, still sample and train the proposal (it has no effect on the policy then).

        > Parameters of saving and logging

        push_proposal_to_hub (`bool`, *optional*, defaults to `False`):
            Also write the proposal to `<output_dir>/proposal` in `save_model`, so that `push_to_hub` uploads it
            beside the policy.
        save_negdata (`str`, *optional*):
            JSONL file collecting every proposal sample whose reward < `save_negdata_threshold` (relative paths are
            under `output_dir`).
        save_negdata_threshold (`float`, *optional*, defaults to `-5.0`):
            Reward threshold of `save_negdata` and of the logged `proposal/p_bad`.
    """

    alpha: float = field(default=0.1, metadata={"help": "Weight alpha >= 0 of the push-down term (0: plain GRPO)."})
    alpha_convention: Literal["reference", "code", "expectation"] = field(
        default="reference",
        metadata={
            "help": "Scale of the push-down term: 'reference' (alias 'code'; the original's alpha/N convention, which "
            "the paper's alpha values assume) or 'expectation' (alpha times the sigma-expectation)."
        },
    )
    indicator_mask: bool = field(
        default=False,
        metadata={"help": "Multiply the sigma-weights by 1[exp(log phi) > 2e-16] (the original's indicator)."},
    )
    loss_aggregation: Literal["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"] = field(
        default="seq-mean-token-mean",
        metadata={"help": "Reduction of the push-down term and of the proposal loss (GRPO's loss keeps loss_type)."},
    )
    target_dist_beta: float = field(
        default=-10.0,
        metadata={"help": "beta of the proposal's target sigma ∝ p·exp(beta·r); beta < 0 targets low rewards."},
    )
    proposal_loss_type: str = field(
        default="ctl",
        metadata={"help": "Twist loss of the learned proposal: 'ctl', 'ctl_no_second_term' or 'dpg'."},
    )
    parameterization: str = field(
        default="policy_psi_q_p_s_t",
        metadata={
            "help": "Twist parameterisation of the proposal: 'policy_psi_q_p_s_t', 'policy_psi_q_p_s_1_to_t', "
            "'policy_psi_unnorm' (a full proposal model) or 'modulation_linear_head' / 'modulation_mlp_head' (a "
            "head on the live policy's trunk)."
        },
    )
    modulation_init_scale_divider: float = field(
        default=1.0, metadata={"help": "A head proposal's last layer starts as xavier_normal / divider."}
    )
    modulation_init_head_from_base: bool = field(
        default=False, metadata={"help": "A linear head proposal starts from the policy's LM head / divider."}
    )
    proposal_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the proposal (default: learning_rate)."}
    )
    q_steps_per_p_step: int = field(
        default=1, metadata={"help": "Proposal updates per policy micro-step (extra ones use fresh proposal samples)."}
    )
    proposal_samples_per_prompt: int | None = field(
        default=None,
        metadata={"help": "Responses the proposal samples per prompt (>= 2; default num_generations)."},
    )
    proposal_generation: str = field(
        default="hf",
        metadata={"help": "How the proposal samples: 'hf' (generate on the training device, also with use_vllm)."},
    )
    train_proposal_at_zero_alpha: bool = field(
        default=True, metadata={"help": "With alpha=0, still sample and train the proposal (no effect on the policy)."}
    )
    push_proposal_to_hub: bool = field(
        default=False,
        metadata={"help": "Also write the proposal to <output_dir>/proposal in save_model (push_to_hub uploads it)."},
    )
    save_negdata: str | None = field(
        default=None,
        metadata={
            "help": "JSONL file of the proposal samples with reward < save_negdata_threshold (relative: under "
            "output_dir)."
        },
    )
    save_negdata_threshold: float = field(
        default=-5.0, metadata={"help": "Reward threshold of save_negdata and of the logged proposal/p_bad."}
    )

    def __post_init__(self):
        super().__post_init__()

        def fail(message: str) -> None:
            raise ValueError(f"RePULSeGRPOConfig: {message}")

        if not self.alpha >= 0:
            fail(f"alpha must be >= 0; got {self.alpha}.")
        if self.alpha_convention not in ALPHA_CONVENTIONS:
            fail(f"alpha_convention={self.alpha_convention!r}; choose one of {', '.join(ALPHA_CONVENTIONS)}.")
        if self.q_steps_per_p_step < 1:
            fail(f"q_steps_per_p_step must be >= 1; got {self.q_steps_per_p_step}.")
        if self.proposal_samples_per_prompt is not None and self.proposal_samples_per_prompt < 2:
            fail(
                f"proposal_samples_per_prompt={self.proposal_samples_per_prompt}: the sigma-weights are normalised "
                "over a prompt's proposal samples, so it needs at least 2 (or None: num_generations)."
            )
        if self.proposal_loss_type is None:
            fail("proposal_loss_type=None trains no proposal; use TRL's GRPOConfig/GRPOTrainer for plain GRPO.")
        if self.proposal_generation not in PROPOSAL_GENERATION_MODES:
            fail(
                f"proposal_generation={self.proposal_generation!r} is not supported: only 'hf' (the proposal samples "
                "with generate on the training device; the policy keeps TRL's vLLM engine with use_vllm). Sampling "
                "the proposal through TRL's engine by swapping weights is not offered (docs/grpo_repulse.md)."
            )
        if self.steps_per_generation != 1:
            fail(
                f"steps_per_generation={self.steps_per_generation}: the proposal samples for the prompts of each "
                "micro-step, which GRPO only hands to training_step when it generates every micro-step; set "
                "steps_per_generation=1 (with gradient_accumulation_steps > 1 it defaults to that value)."
            )
        check_proposal_parameterization(self, PROPOSAL_LOSS_TYPES, fail)

    @property
    def effective_proposal_learning_rate(self) -> float:
        return self.learning_rate if self.proposal_learning_rate is None else self.proposal_learning_rate

    @property
    def num_samples_per_prompt(self) -> int:
        """``num_generations`` under trl_ext's name (the policy's samples per prompt)."""
        return self.num_generations

    @property
    def proposal_num_samples(self) -> int:
        """The proposal's samples per prompt (``proposal_samples_per_prompt``, default ``num_generations``)."""
        return self.proposal_samples_per_prompt or self.num_generations

    @property
    def negative_samples_per_prompt(self) -> int:
        """Negatives per prompt of the push-down term: the proposal's samples."""
        return self.proposal_num_samples
