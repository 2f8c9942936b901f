"""Trainers: PPO on `transformers.Trainer` (TRL 1.12's API) and the rollout every online trainer shares; the RePULSe
and twist-learning trainers; DPO/KTO with extra losses (subclasses of TRL's); knowledge distillation; process reward
models."""

from .data import PromptCollator, RolloutSampler, prepare_prompt_dataset
from .dpo import DPOConfig, DPOTrainer
from .harmlessness_config import HarmlessnessConfig
from .harmlessness_trainer import HarmlessnessTrainer
from .kd import KDConfig, KDTrainer
from .kto import KTOConfig, KTOTrainer
from .policy_value import PolicyAndValueModel
from .ppo_config import PPOConfig
from .ppo_trainer import PPORewards, PPOTrainer
from .preference_data import pairs_from_negative_data, unpaired_from_negative_data
from .prm import PRMConfig, PRMDataCollator, PRMTrainer, prepare_prm_dataset, tokenize_prm_example
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
    "DPOConfig",
    "DPOTrainer",
    "HarmlessnessConfig",
    "HarmlessnessTrainer",
    "KDConfig",
    "KDTrainer",
    "KTOConfig",
    "KTOTrainer",
    "PPOConfig",
    "PPORewards",
    "PPOTrainer",
    "PRMConfig",
    "PRMDataCollator",
    "PRMTrainer",
    "PolicyAndValueModel",
    "PolicyOutput",
    "PromptCollator",
    "ProposalConfig",
    "ProposalRewards",
    "ProposalTrainer",
    "ReferencePolicy",
    "Rollout",
    "RolloutGenerator",
    "RolloutReward",
    "RolloutSampler",
    "SamplingSettings",
    "forward_response",
    "generate_responses",
    "pairs_from_negative_data",
    "prepare_prm_dataset",
    "prepare_prompt_dataset",
    "tokenize_prm_example",
    "unpaired_from_negative_data",
]
