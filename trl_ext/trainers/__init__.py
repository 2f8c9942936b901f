"""Trainers: PPO on `transformers.Trainer` (TRL 1.12's API) and the rollout every online trainer shares."""

from .data import PromptCollator, RolloutSampler, prepare_prompt_dataset
from .policy_value import PolicyAndValueModel
from .ppo_config import PPOConfig
from .ppo_trainer import PPORewards, PPOTrainer
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
    "PPOConfig",
    "PPORewards",
    "PPOTrainer",
    "PolicyAndValueModel",
    "PolicyOutput",
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
