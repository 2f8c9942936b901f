"""Offline preference training: `DPOTrainer` / `KTOTrainer` (subclasses of TRL's with extra losses), their shared
code, and pairs / unpaired rows built from negative data."""

from .data import pairs_from_negative_data, unpaired_from_negative_data
from .dpo import DPOConfig, DPOTrainer
from .kto import KTOConfig, KTOTrainer

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "pairs_from_negative_data",
    "unpaired_from_negative_data",
]
