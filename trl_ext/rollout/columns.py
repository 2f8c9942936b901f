"""Dataset columns that reach reward functions, as TRL's GRPO passes them.

Every column of a prompt dataset other than the prompt itself (``prompt``, a pre-tokenised ``input_ids`` /
``attention_mask``, and a vision dataset's image column) and the names the trainers pass themselves
(:data:`RESERVED_COLUMNS`) is a *reward column*: a reward callable receives it as a
keyword list with one value per completion, each prompt's value repeated for its ``num_samples_per_prompt``
samples (``accuracy_reward(completions, solution=[...])``).

- :func:`reward_columns`: the reward columns of a dataset;
- :class:`ColumnCollator`: wraps the prompt collator; the reward columns go around it, into the batch under
  :data:`COLUMNS_KEY` as plain lists (so the collator itself sees only the prompt, as before);
- :func:`repeat_columns` / :func:`select_columns`: the rows of a rollout (``N`` samples per prompt, any subset);
- :func:`missing_arguments` / :func:`check_reward_columns`: a reward callable's required parameters that nothing
  provides, refused with a clear error when the trainer is built (and when a batch lacks them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

__all__ = [
    "COLUMNS_KEY",
    "PROMPT_COLUMNS",
    "RESERVED_COLUMNS",
    "TRAINER_ARGUMENTS",
    "ColumnCollator",
    "check_reward_columns",
    "missing_arguments",
    "repeat_columns",
    "reward_columns",
    "rollout_inputs",
    "select_columns",
]

COLUMNS_KEY = "reward_columns"
"""The key of a collated batch that holds its reward columns (``{name: [value per prompt]}``)."""

PROMPT_COLUMNS = ("prompt", "input_ids", "attention_mask")
"""The columns that hold the prompt: never passed to reward functions as columns (they get ``prompts``)."""

TRAINER_ARGUMENTS = ("prompts", "completions", "completion_ids")
"""The keywords every trainer gives reward callables besides the columns (``images`` too with
``reward_uses_images``)."""

RESERVED_COLUMNS = (
    *TRAINER_ARGUMENTS, "completion", "images", "prompt_ids", "prompt_mask", "completion_mask", "tokenizer",
    "skip_special_tokens",
)  # fmt: skip
"""Column names never passed as reward columns: the keywords the trainers pass themselves (and, as in TRL, the
completion)."""


def reward_columns(dataset, exclude: Iterable[str] = ()) -> list[str]:
    """The reward columns of ``dataset`` (a `datasets.Dataset`, or anything whose rows are dicts): every column but
    :data:`PROMPT_COLUMNS`, :data:`RESERVED_COLUMNS` and ``exclude`` (e.g. the image column). ``[]`` for ``None`` or
    an empty dataset."""
    if dataset is None:
        return []
    columns = list(getattr(dataset, "column_names", None) or [])
    if not columns and hasattr(dataset, "__len__") and len(dataset):
        columns = list(dataset[0].keys())
    skip = {*PROMPT_COLUMNS, *RESERVED_COLUMNS, *exclude}
    return [c for c in columns if c not in skip]


class ColumnCollator:
    """Collate prompt rows with ``collator`` after taking their reward columns out, then add those columns to the
    batch under :data:`COLUMNS_KEY` (lists, one value per row, any type). Batches of rows without reward columns are
    exactly ``collator``'s."""

    def __init__(self, collator: Callable, exclude: Iterable[str] = ()):
        self.collator = collator
        self.keep = {*PROMPT_COLUMNS, *RESERVED_COLUMNS, *exclude}

    def __call__(self, features: Sequence[Mapping]) -> dict:
        names = [k for k in (features[0] if features else {}) if k not in self.keep]
        if not names:
            return self.collator(features)
        batch = self.collator([{k: v for k, v in f.items() if k not in names} for f in features])
        batch[COLUMNS_KEY] = {name: [f[name] for f in features] for name in names}
        return batch


def rollout_inputs(inputs: Mapping, device) -> dict:
    """The optional inputs of a rollout in a collated batch: ``vision`` (moved to ``device``) and ``columns``,
    each only when the batch has it (so that a trainer's ``rollout`` hook without them still works)."""
    out = {}
    if inputs.get("vision") is not None:
        out["vision"] = inputs["vision"].to(device)
    if inputs.get(COLUMNS_KEY):
        out["columns"] = inputs[COLUMNS_KEY]
    return out


def repeat_columns(columns: Mapping[str, Sequence] | None, n: int) -> dict[str, list] | None:
    """Each prompt's value ``n`` times in a row (the rows of a rollout with ``n`` samples per prompt)."""
    if not columns:
        return None
    return {name: [v for v in values for _ in range(n)] for name, values in columns.items()}


def select_columns(columns: Mapping[str, Sequence] | None, index) -> dict[str, list] | None:
    """The rows ``index`` (a slice, an index tensor or a bool mask) of every column."""
    if not columns:
        return None
    if isinstance(index, slice):
        return {name: list(values[index]) for name, values in columns.items()}
    index = torch.as_tensor(index).cpu()
    rows = index.nonzero().flatten().tolist() if index.dtype == torch.bool else index.flatten().tolist()
    return {name: [values[i] for i in rows] for name, values in columns.items()}


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and C callables: nothing to check
        return None


def missing_arguments(function, provided: Iterable[str]) -> list[str]:
    """The parameters a reward callable requires (no default) that ``provided`` does not name.

    ``function``: a `CallableReward` (its wrapped callable is read), another `RewardFunction` (its ``compute``) or a
    plain callable; anything else (a reward model, a URL) requires nothing. A callable that takes ``(prompts,
    completions)`` positionally gets them as its first two parameters; the others come by keyword."""
    from ..models.reward_functions import CallableReward, RewardFunction

    if isinstance(function, CallableReward):
        function, by_keyword = function.fn, function.by_keyword
    elif isinstance(function, RewardFunction):
        function, by_keyword = function.compute, False
    elif callable(function) and not isinstance(function, torch.nn.Module):
        by_keyword = None
    else:
        return []
    parameters = _parameters(function)
    if parameters is None:
        return []
    if by_keyword is None:
        by_keyword = any(p.name in ("completions", "completion_ids") for p in parameters)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not by_keyword:
        parameters = [p for i, p in enumerate(parameters) if not (i < 2 and p.kind in positional)]
    provided = {*TRAINER_ARGUMENTS, *provided}
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and p.name not in provided
    ]


def check_reward_columns(
    functions: Mapping[str, object],
    datasets: Mapping[str, Sequence[str] | None],
    trainer: str,
    provided: Iterable[str] = (),
    note: str = "",
) -> None:
    """Refuse reward callables that require a parameter none of the datasets' reward columns provides.

    ``functions``: ``{name: reward}`` (each checked with :func:`missing_arguments`); ``datasets``: ``{argument
    name: its reward columns}`` (``None``: no such dataset, not checked); ``provided``: other keywords the trainer
    passes (e.g. ``images``); ``note``: a sentence added to the error (why a column is not passed)."""
    provided = set(provided)
    for label, columns in datasets.items():
        if columns is None:
            continue
        for name, function in functions.items():
            missing = missing_arguments(function, {*columns, *provided})
            if not missing:
                continue
            needs = ", ".join(repr(m) for m in missing)
            raise ValueError(
                f"{trainer}: the reward function {name!r} requires {needs}, which no column of {label} provides "
                f"(its columns other than the prompt: {list(columns) or 'none'}; trainers also pass "
                f"{', '.join(TRAINER_ARGUMENTS)}). Add a column named {missing[0]!r} to {label} (one value per "
                f"prompt; each completion gets its prompt's value), rename the column that holds it, or give the "
                f"parameter a default.{(' ' + note) if note else ''}"
            )
