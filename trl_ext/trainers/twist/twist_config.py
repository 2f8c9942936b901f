"""`TwistTargetConfig`: the options of a proposal trained towards a twisted target ``σ ∝ p·exp(β·R)`` (the target's
``target_dist_beta``, ``rm_type``, ``reward_cap``, ``reward_threshold``; how the twist is read off the proposal,
``parameterization``; the loss reduction), the base of `ProposalConfig` and `HarmlessnessConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...losses import AGGREGATIONS
from ...rewards import RM_TYPES
from ..common.online_config import OnlineConfig

__all__ = ["TwistTargetConfig"]


@dataclass
class TwistTargetConfig(OnlineConfig):
    r"""
    [`OnlineConfig`] plus the options of a proposal trained towards a twisted target ``σ ∝ p·exp(β·R)``, shared by
    [`~trl_ext.ProposalConfig`] (``p`` is the frozen reference) and [`~trl_ext.HarmlessnessConfig`] (``p`` is the
    policy being trained); see each of them for what the fields mean there.

    Parameters:
        parameterization (`str`, *optional*, defaults to `"policy_psi_q_p_s_t"`):
            How the twist ``log ψ_t`` is read off the proposal ``q``.
        loss_aggregation (`str`, *optional*, defaults to `"seq-mean-token-mean"`):
            Reduction of per-token losses: `"seq-mean-token-mean"` (the original code's), `"seq-mean-token-sum"` or
            `"token-mean"`.
        target_dist_beta (`float`, *optional*, defaults to `-10.0`):
            β of the target. With `rm_type="rlhf"` (higher reward = better), β < 0 puts it on low-reward outputs.
        rm_type (`str`, *optional*, defaults to `"rlhf"`):
            Raw score ``r`` → ``R``: `"rlhf"` (``min(r, reward_cap)``), `"indicator_below_threshold"` or
            `"toxicity_class_logprob"`.
        reward_cap (`float`, *optional*):
            Upper cap of `"rlhf"` rewards (`None`: none).
        reward_threshold (`float`, *optional*):
            Threshold of `"indicator_below_threshold"`.
        modulation_init_scale_divider (`float`, *optional*, defaults to `1.0`):
            When the trainer builds a modulation (`modulation_*` parameterizations): its last layer starts as
            ``xavier_normal / divider``.
        modulation_init_head_from_base (`bool`, *optional*, defaults to `False`):
            When the trainer builds a `model`/`linear_head` modulation: start its output layer from the base's LM
            head (divided by the divider).
    """

    parameterization: str = field(
        default="policy_psi_q_p_s_t",
        metadata={
            "help": "Twist parameterisation of the proposal: 'policy_psi_q_p_s_t' (log q - log p per token), "
            "'policy_psi_q_p_s_1_to_t', 'policy_psi_unnorm', or a modulation: 'modulation_linear_head', "
            "'modulation_nn_head' / 'modulation_mlp_head' (q ∝ p·exp(m), a head on p's final hidden state; in "
            "HarmlessnessConfig p is the live policy, whose trunk forward q then shares) and, for ProposalTrainer "
            "only, 'modulation_model'."
        },
    )
    loss_aggregation: Literal["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"] = field(
        default="seq-mean-token-mean",
        metadata={
            "help": "Reduction of per-token losses: 'seq-mean-token-mean' (the original's), 'seq-mean-token-sum' or "
            "'token-mean' (within each micro-step's rollout)."
        },
    )
    target_dist_beta: float = field(
        default=-10.0,
        metadata={
            "help": "beta of the target sigma ∝ p·exp(beta·R). With rm_type='rlhf' (higher = better), beta < 0 "
            "targets low-reward (bad) outputs (RePULSe; the paper uses -1 ... -30), beta > 0 the high-reward ones, "
            "beta = 0 gives sigma = p."
        },
    )
    rm_type: str = field(
        default="rlhf",
        metadata={
            "help": "Raw score -> R for the target: 'rlhf' (min(r, reward_cap)), 'indicator_below_threshold' "
            "(log(1[r < reward_threshold] + 1e-16); needs beta > 0) or 'toxicity_class_logprob' (-softplus(r)). "
            "HarmlessnessConfig maps only the proposal side with it; the policy's reward always uses 'rlhf'."
        },
    )
    reward_cap: float | None = field(
        default=None, metadata={"help": "Upper cap of R for rm_type='rlhf' (None: none)."}
    )
    reward_threshold: float | None = field(
        default=None, metadata={"help": "Threshold of rm_type='indicator_below_threshold'."}
    )
    modulation_init_scale_divider: float = field(
        default=1.0,
        metadata={"help": "When the trainer builds the modulation: last layer starts as xavier_normal / divider."},
    )
    modulation_init_head_from_base: bool = field(
        default=False,
        metadata={"help": "When the trainer builds a model/linear_head modulation: start it from the base LM head."},
    )

    def _twist_loss_type(self) -> str | None:
        """The name of the proposal's twist loss (``None``: no proposal is trained); subclasses say which field."""
        return None

    def _twist_uses_logprobs_only(self, loss: str) -> bool:
        """Whether the twist loss ``loss`` with this ``parameterization`` reads only ``q``'s token log-probs (so it
        may run padding-free); the subclasses that train a twist answer from the proposal trainer's twist step."""
        return True

    def _validate(self) -> None:
        super()._validate()
        self._check_choice("loss_aggregation", AGGREGATIONS)
        self._check_choice("rm_type", RM_TYPES)
        if not self.modulation_init_scale_divider > 0:
            self._fail(f"modulation_init_scale_divider={self.modulation_init_scale_divider}: set a positive divider.")
        if self.modulation_init_head_from_base and self.parameterization not in (
            "modulation_model",
            "modulation_linear_head",
        ):
            self._fail(
                "modulation_init_head_from_base=True starts a Linear head on the base's final hidden state from the "
                "base LM head, which only 'modulation_model' and 'modulation_linear_head' have; turn it off for "
                f"parameterization={self.parameterization!r}."
            )
        from ...losses import available_losses

        loss = self._twist_loss_type()
        if self.padding_free and loss in available_losses("twist"):
            if not self._twist_uses_logprobs_only(loss):
                self._fail(
                    f"padding_free=True needs a twist read from token log-probs alone; parameterization="
                    f"{self.parameterization!r} with the twist loss {loss!r} needs the proposal's logits. Use "
                    "parameterization='policy_psi_q_p_s_t' or 'policy_psi_q_p_s_1_to_t' (not with 'dpg'), or "
                    "padding_free=False."
                )
        self._refuse_dropping_rewards(
            "the twist losses weigh the samples of a prompt against each other (importance weights normalised over "
            "its samples), so one sample cannot be taken out without changing the weights of the others"
        )
