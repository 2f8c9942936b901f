"""Several rewards summed with weights, as TRL's GRPO takes ``reward_funcs=[...]`` and ``reward_weights``.

A trainer's ``reward_model`` (or ``reward_funcs``) may be a list: each item is anything one reward may be (a reward
model sharing the policy's tokenizer, a ``(model, tokenizer)`` pair, a `RewardFunction`, a callable, a URL, a
checkpoint path). Each is scored as a single reward is (:class:`~.reward.RolloutReward`, with the dataset's reward
columns) and the rollout's score is ``Σ_i w_i · r_i`` (``reward_weights``, default all 1). The unweighted values of
each function are kept on the rollout (``Rollout.reward_components``) and logged as ``rewards/<name>/mean`` and
``rewards/<name>/std`` (:func:`reward_component_metrics`); names come from the functions (:func:`reward_names`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..models.reward_functions import CallableReward, RewardFunction
from .reward import RolloutReward

__all__ = [
    "WeightedRewards",
    "build_rollout_reward",
    "reward_component_metrics",
    "reward_members",
    "reward_names",
]


def reward_members(reward) -> list:
    """The rewards of a trainer's ``reward_model`` argument: the items of a list, else ``[reward]``."""
    return list(reward) if isinstance(reward, list) else [reward]


def _name_of(reward) -> str:
    if isinstance(reward, tuple) and len(reward) == 2 and isinstance(reward[0], nn.Module):
        reward = reward[0]
    if isinstance(reward, CallableReward):
        return reward.name
    if isinstance(reward, (str, os.PathLike)):
        text = str(reward)
        return "RemoteReward" if text.startswith(("http://", "https://")) else os.path.basename(os.path.normpath(text))
    if isinstance(reward, (nn.Module, RewardFunction)):
        return type(reward).__name__
    name = getattr(reward, "__name__", None) or getattr(getattr(reward, "func", None), "__name__", None)
    return (name if name != "<lambda>" else "lambda") or type(reward).__name__


def reward_names(rewards: Sequence) -> list[str]:
    """One name per reward: a function's ``__name__`` (``lambda`` for a lambda), a model's or `RewardFunction`'s class
    name (a `CallableReward`'s ``name``), a path's last part; repeated names get ``_2``, ``_3``, ..."""
    names, seen = [], {}
    for reward in rewards:
        base = _name_of(reward)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


class WeightedRewards:
    """Scores ``prompt + response`` rows with several rewards: ``(B,)`` fp32 ``Σ_i weights[i] · r_i``.

    The same call as :class:`~.reward.RolloutReward`; with ``return_components=True`` it returns ``(scores,
    {name: (B,) unweighted r_i})``. Each item is scored by its own `RolloutReward` (reward models on the token ids,
    functions on the decoded text with the rows' ``columns``), outside the shared-prompt path of a single reward
    model."""

    model = None  # no single reward model: the rollout's shared-prompt and offload paths of one model do not apply

    def __init__(
        self, rewards: Sequence, tokenizer, uses_images: bool = False, weights: Sequence[float] | None = None
    ):
        rewards = list(rewards)
        if not rewards:
            raise ValueError("The list of reward functions is empty: pass at least one reward.")
        self.names = reward_names(rewards)
        weights = [1.0] * len(rewards) if weights is None else [float(w) for w in weights]
        if len(weights) != len(rewards):
            raise ValueError(
                f"reward_weights has {len(weights)} value(s) but there are {len(rewards)} reward functions "
                f"({', '.join(self.names)}): give one weight per reward function, in the same order, or leave "
                "reward_weights unset (every weight 1)."
            )
        self.weights, self.tokenizer, self.uses_images = weights, tokenizer, uses_images
        self.parts = [RolloutReward(reward, tokenizer, uses_images=uses_images) for reward in rewards]

    def placed(self):
        """Context in which every offloaded reward model of the list is on its accelerator."""
        stack = contextlib.ExitStack()
        for part in self.parts:
            stack.enter_context(part.placed())
        return stack

    @torch.no_grad()
    def __call__(
        self, prompt_ids, prompt_mask, response_ids, response_mask, vision=None, share_prompts: bool = False,
        columns: dict[str, list] | None = None, return_components: bool = False,
    ):  # fmt: skip
        rows = (prompt_ids, prompt_mask, response_ids, response_mask, vision)
        components = {name: part(*rows, columns=columns) for name, part in zip(self.names, self.parts)}
        scores = sum(w * c for w, c in zip(self.weights, components.values()))
        return (scores, components) if return_components else scores


def build_rollout_reward(reward, tokenizer, uses_images: bool = False, weights: Sequence[float] | None = None):
    """A :class:`~.reward.RolloutReward` for one reward; a :class:`WeightedRewards` for a list (or for one reward
    with ``weights``, a list of one)."""
    if isinstance(reward, list) or weights is not None:
        return WeightedRewards(reward_members(reward), tokenizer, uses_images=uses_images, weights=weights)
    return RolloutReward(reward, tokenizer, uses_images=uses_images)


def reward_component_metrics(
    components: dict[str, torch.Tensor] | None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    prefix: str = "rewards/",
) -> dict[str, float]:
    """``{prefix}<name>/mean`` and ``{prefix}<name>/std`` of each reward function's unweighted values over the rows
    of every process (``gather``: e.g. ``accelerator.gather``); NaN values are left out, the standard deviation is
    the unbiased one (``0.0`` for a single value). ``{}`` without components."""
    if not components:
        return {}
    stacked = torch.stack([v.detach().float() for v in components.values()], dim=1)
    if gather is not None:
        stacked = gather(stacked.contiguous())
    out = {}
    for name, column in zip(components, stacked.T):
        values = column[~torch.isnan(column)].double()
        mean = float(values.mean()) if values.numel() else math.nan
        std = float(values.std()) if values.numel() > 1 else 0.0
        out[f"{prefix}{name}/mean"], out[f"{prefix}{name}/std"] = mean, std
    return out
