"""Rewards: the reward-shaping maths shared by every trainer, and simple reward functions.

- :mod:`~trl_ext.rewards.shaping`: ``rm_type`` map (:func:`map_reward`), the target's log-potential ``β·R``
  (:func:`log_target_weight`), reward transforms (:func:`transform_reward`) and :class:`RewardShaping`, which bundles
  them (docs/algorithms.md §3).
- :mod:`~trl_ext.rewards.lexical`: :class:`LexicalReward`, a word/token-list reward (e.g. with
  :data:`OFFENSIVE_WORDS`).
- :mod:`~trl_ext.rewards.toxicity`: :class:`OffensivenessReward`, an independent offensiveness classifier
  (alt-profanity-check, ``pip install trl_ext[toxicity]``), ``r = log(max(1 − p_offensive, floor))``.

See docs/rewards.md for runnable examples.
"""

from .lexical import HELDOUT_OFFENSIVE_WORDS, OFFENSIVE_WORDS, LexicalReward, word_token_ids
from .shaping import (
    INDICATOR_REWARD_EPS,
    REWARD_TRANSFORMS,
    RM_TYPES,
    RewardShaping,
    log_target_weight,
    map_reward,
    transform_reward,
)
from .toxicity import OffensivenessReward, reward_threshold

__all__ = [
    "HELDOUT_OFFENSIVE_WORDS",
    "INDICATOR_REWARD_EPS",
    "OFFENSIVE_WORDS",
    "REWARD_TRANSFORMS",
    "RM_TYPES",
    "LexicalReward",
    "OffensivenessReward",
    "RewardShaping",
    "log_target_weight",
    "map_reward",
    "reward_threshold",
    "transform_reward",
    "word_token_ids",
]
