"""Trainers: PPO on `transformers.Trainer` (TRL 1.12's API) and the rollout every online trainer shares."""

from .data import PromptCollator, RolloutSampler, prepare_prompt_dataset
from .harmlessness_config import HarmlessnessConfig
from .harmlessness_trainer import HarmlessnessTrainer
from .policy_value import PolicyAndValueModel
from .ppo_config import PPOConfig
from .ppo_trainer import PPORewards, PPOTrainer
from .proposal_config import ProposalConfig
from .proposal_trainer import ProposalRewards, ProposalTrainer
from .rollout import (
    PolicyOutput,
    ReferencePolicy,
    Rollout,
    RolloutGenerator,
    RolloutReward,
    SamplingSettings,
    forward_response,
    generate_responses,
)

__all__ = [
    "HarmlessnessConfig",
    "HarmlessnessTrainer",
    "PPOConfig",
    "PPORewards",
    "PPOTrainer",
    "PolicyAndValueModel",
    "PolicyOutput",
    "ProposalConfig",
    "ProposalRewards",
    "ProposalTrainer",
    "PromptCollator",
    "ReferencePolicy",
    "Rollout",
    "RolloutGenerator",
    "RolloutReward",
    "RolloutSampler",
    "SamplingSettings",
    "forward_response",
    "generate_responses",
    "prepare_prompt_dataset",
]
