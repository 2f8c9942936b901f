"""Twist / proposal learning: `ProposalConfig`, `ProposalTrainer` (CTL, SIXO, DPG) and the twist step that the
RePULSe trainer (`trl_ext.trainers.harmlessness`) reuses for its proposal."""

from .proposal_config import ProposalConfig
from .proposal_trainer import ProposalRewards, ProposalTrainer

__all__ = ["ProposalConfig", "ProposalRewards", "ProposalTrainer"]
