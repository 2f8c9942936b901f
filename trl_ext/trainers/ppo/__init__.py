"""PPO (TRL 1.12's API): `PPOConfig`, `PPOTrainer`, the policy + value module and the experience schedule."""

from .compat import CountUpdates
from .policy_value import PolicyAndValueModel
from .ppo_config import PPOConfig
from .ppo_trainer import PPORewards, PPOTrainer

__all__ = ["CountUpdates", "PPOConfig", "PPORewards", "PPOTrainer", "PolicyAndValueModel"]
