"""Twist learning, shared by the proposal trainer (a proposal towards ``σ ∝ p_ref·exp(β·R)``) and RePULSe (a proposal
towards the policy's own ``σ ∝ p_θ·exp(β·R)``):

- `twist_config`: :class:`TwistTargetConfig`, the options of the target and of the twist;
- `twist_step`: :func:`twist_loss` (the twist loss of sampled responses, CTL / SIXO / DPG / mixed, under any
  parameterization of the twist) and its checks.
"""

from .twist_config import TwistTargetConfig
from .twist_step import TwistLossOutput, twist_loss, twist_uses_logprobs_only, validate_twist_setup

__all__ = ["TwistLossOutput", "TwistTargetConfig", "twist_loss", "twist_uses_logprobs_only", "validate_twist_setup"]
