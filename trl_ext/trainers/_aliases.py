"""Old flat module paths of `trl_ext.trainers` (before 0.2's layout), kept importable for one release.

``import trl_ext.trainers.ppo_config`` (and ``from trl_ext.trainers.rollout import ...``) give the module at its new
path, the very same module object, with a `DeprecationWarning` naming the new path. Pickles that name an old path,
such as a `training_args.bin` saved by an earlier trl_ext (``trl_ext.trainers.ppo_config.PPOConfig``), load through
the same mechanism. The shared rollout moved below the trainers, to `trl_ext.rollout`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED_MODULES", "install"]

REMOVAL = "trl_ext 0.3"
MOVED_MODULES: dict[str, str] = {
    "trl_ext.trainers.rollout": "trl_ext.rollout.generator",
    "trl_ext.trainers.sampling": "trl_ext.rollout.sampling",
    "trl_ext.trainers.reference": "trl_ext.rollout.reference",
    "trl_ext.trainers.data": "trl_ext.rollout.data",
    "trl_ext.trainers.negdata": "trl_ext.rollout.negdata",
    "trl_ext.trainers.multimodal": "trl_ext.rollout.vision",
    "trl_ext.trainers.online": "trl_ext.trainers.common.online",
    "trl_ext.trainers.online_config": "trl_ext.trainers.common.online_config",
    "trl_ext.trainers.checkpoint": "trl_ext.trainers.common.checkpoint",
    "trl_ext.trainers.model_parts": "trl_ext.trainers.common.model_parts",
    "trl_ext.trainers.ppo_metrics": "trl_ext.trainers.common.metrics",
    "trl_ext.trainers.ppo_config": "trl_ext.trainers.ppo.ppo_config",
    "trl_ext.trainers.ppo_trainer": "trl_ext.trainers.ppo.ppo_trainer",
    "trl_ext.trainers.policy_value": "trl_ext.trainers.ppo.policy_value",
    "trl_ext.trainers.experience": "trl_ext.trainers.ppo.experience",
    "trl_ext.trainers.proposal_config": "trl_ext.trainers.proposal.proposal_config",
    "trl_ext.trainers.proposal_trainer": "trl_ext.trainers.proposal.proposal_trainer",
    "trl_ext.trainers.proposal_metrics": "trl_ext.trainers.proposal.metrics",
    "trl_ext.trainers.twist_step": "trl_ext.trainers.twist.twist_step",
    "trl_ext.trainers.harmlessness_config": "trl_ext.trainers.harmlessness.harmlessness_config",
    "trl_ext.trainers.harmlessness_trainer": "trl_ext.trainers.harmlessness.harmlessness_trainer",
    "trl_ext.trainers.harmlessness_io": "trl_ext.trainers.harmlessness.io",
    "trl_ext.trainers.harmlessness_models": "trl_ext.trainers.harmlessness.models",
    "trl_ext.trainers.harmlessness_steps": "trl_ext.trainers.harmlessness.steps",
    "trl_ext.trainers.dpo": "trl_ext.trainers.preference.dpo",
    "trl_ext.trainers.kto": "trl_ext.trainers.preference.kto",
    "trl_ext.trainers.preference_common": "trl_ext.trainers.preference.common",
    "trl_ext.trainers.preference_data": "trl_ext.trainers.preference.data",
    # 0.3's layout (issue 37): the algorithm pieces left trainers/common for trl_ext.ops
    "trl_ext.trainers.common.kl_control": "trl_ext.ops.kl_control",
    "trl_ext.trainers.common.reward_norm": "trl_ext.ops.reward_norm",
    "trl_ext.trainers.common.resume_config": "trl_ext.trainers.common.resume",
    "trl_ext.trainers.proposal.twist_step": "trl_ext.trainers.twist.twist_step",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only the old names of :data:`MOVED_MODULES`; the module it 'creates' is the new module itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path works until {REMOVAL}.", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the new module is already imported."""


def install() -> None:
    """Put the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
