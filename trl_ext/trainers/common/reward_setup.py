"""The reward argument of the online trainers, checked and turned into the rollout's reward.

- :func:`resolve_reward_argument`: ``reward_model=`` or its GRPO spelling ``reward_funcs=`` (one reward, or a list);
- :func:`check_reward_arguments`: every reward callable's required parameters are provided by the prompt datasets'
  columns (`trl_ext.rollout.columns`), checked when the trainer is built;
- :func:`build_reward`: the :class:`~trl_ext.rollout.reward.RolloutReward` of one reward, or the
  :class:`~trl_ext.rollout.reward_list.WeightedRewards` of a list with ``reward_weights``;
"""

from __future__ import annotations

from ..._deprecation import moved_names
from ...rollout.columns import check_reward_columns, reward_columns
from ...rollout.reward_list import build_rollout_reward, reward_members, reward_names

__all__ = ["build_reward", "check_reward_arguments", "resolve_reward_argument"]

_SMC_NOTE = (
    "negative_sampler='smc' scores partial particles without the dataset's columns: with it, reward functions may "
    "not require a column; use negative_sampler='proposal'."
)


def resolve_reward_argument(reward_model, reward_funcs, trainer: str):
    """The reward of a trainer: ``reward_model`` or ``reward_funcs`` (exactly one of them; a list holds several
    rewards, summed with ``reward_weights``)."""
    if reward_model is not None and reward_funcs is not None:
        raise ValueError(
            f"{trainer}: pass the reward as reward_model= or as reward_funcs= (its name in TRL's GRPOTrainer), not "
            "both; a list of rewards goes in either."
        )
    reward = reward_model if reward_model is not None else reward_funcs
    if reward is None:
        raise ValueError(
            "`reward_model` (or `reward_funcs`) is required: a reward model, a reward function, a callable, a URL, "
            "or a list of them."
        )
    if isinstance(reward, list):
        if not reward or any(r is None for r in reward):
            raise ValueError(f"{trainer}: the list of rewards is empty or holds None: {reward!r}.")
        return list(reward)  # a copy: placing its reward models replaces them in the list
    return reward


def check_reward_arguments(trainer: str, reward, args, train_dataset, eval_dataset, image_column=None) -> None:
    """Refuse reward callables with a required parameter that no reward column of ``train_dataset`` (or of
    ``eval_dataset``, each of a dict) provides (:func:`~trl_ext.rollout.columns.check_reward_columns`). With
    ``negative_sampler="smc"`` (RePULSe) no column reaches the rewards of the SMC negatives."""
    members = reward_members(reward)
    functions = dict(zip(reward_names(members), members))
    exclude = (image_column,) if image_column else ()
    datasets = {"train_dataset": reward_columns(train_dataset, exclude)}
    evals = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
    for key, dataset in evals.items():
        if dataset is not None:
            datasets["eval_dataset" if key is None else f"eval_dataset[{key!r}]"] = reward_columns(dataset, exclude)
    provided = ["images"] if args.reward_uses_images else []
    check_reward_columns(functions, datasets, trainer, provided)
    if getattr(args, "negative_sampler", None) == "smc":
        check_reward_columns(functions, {"the SMC negatives": []}, trainer, provided, note=_SMC_NOTE)


def build_reward(reward, tokenizer, args):
    """The rollout's reward of the trainer's ``reward`` argument (``reward_uses_images``, ``reward_weights``)."""
    weights = getattr(args, "reward_weights", None)
    return build_rollout_reward(reward, tokenizer, uses_images=args.reward_uses_images, weights=weights)


__getattr__ = moved_names(__name__, {"log_reward_components": "trl_ext.trainers.common.metrics"})
