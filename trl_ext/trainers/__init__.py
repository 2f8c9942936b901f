"""Trainers, one sub-package per algorithm: `ppo` (TRL 1.12's API), `proposal` (twist learning), `harmlessness`
(RePULSe), `preference` (DPO/KTO with extra losses, subclasses of TRL's), plus `kd.py` (knowledge distillation) and
`prm.py` (process reward models); `common` holds what the online trainers share. The rollout they share lives below
them, in `trl_ext.rollout` (re-exported here). The flat paths of earlier releases (`trl_ext.trainers.ppo_config`, ...)
still import, with a DeprecationWarning (`_aliases.py`).
"""

from ..rollout import (
    PolicyOutput,
    ReferencePolicy,
    Rollout,
    RolloutGenerator,
    RolloutReward,
    SamplingSettings,
    forward_response,
    generate_responses,
)
from ..rollout.data import PromptCollator, RolloutSampler, prepare_prompt_dataset
from . import _aliases
from .harmlessness.harmlessness_config import HarmlessnessConfig
from .harmlessness.harmlessness_trainer import HarmlessnessTrainer
from .kd import KDConfig, KDTrainer
from .ppo.compat import CountUpdates
from .ppo.policy_value import PolicyAndValueModel
from .ppo.ppo_config import PPOConfig
from .ppo.ppo_trainer import PPORewards, PPOTrainer
from .preference.data import pairs_from_negative_data, unpaired_from_negative_data
from .preference.dpo import DPOConfig, DPOTrainer
from .preference.kto import KTOConfig, KTOTrainer
from .prm import PRMConfig, PRMDataCollator, PRMTrainer, prepare_prm_dataset, tokenize_prm_example
from .proposal.proposal_config import ProposalConfig
from .proposal.proposal_trainer import ProposalRewards, ProposalTrainer
from .repulse_grpo.repulse_grpo_config import RePULSeGRPOConfig
from .repulse_grpo.repulse_grpo_trainer import RePULSeGRPOTrainer

_aliases.install()

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "HarmlessnessConfig",
    "HarmlessnessTrainer",
    "KDConfig",
    "KDTrainer",
    "KTOConfig",
    "KTOTrainer",
    "CountUpdates",
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
    "RePULSeGRPOConfig",
    "RePULSeGRPOTrainer",
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
