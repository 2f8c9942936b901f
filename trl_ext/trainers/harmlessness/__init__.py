"""RePULSe, the harmlessness outer loop: `HarmlessnessConfig`, `HarmlessnessTrainer` (a proposal q learns the
policy's low-reward outputs, the policy p is pushed down on them), its models, steps and checkpoint I/O."""

from .harmlessness_config import HarmlessnessConfig
from .harmlessness_trainer import HarmlessnessTrainer

__all__ = ["HarmlessnessConfig", "HarmlessnessTrainer"]
