"""Dataset preparation shared by every recipe: mixtures, row caps, input templates, chat format, CSFT prefixes.

Pure functions over `datasets.Dataset` (and, where noted, `datasets.IterableDataset`); the recipes call them through
:func:`trl_ext.cli.train_and_eval_splits`, in this order:

1. :func:`mix_datasets`: several datasets → one, each row drawn from dataset ``i`` with probability ``probs[i]``
   (`datasets.interleave_datasets`), then the first ``max_samples`` rows;
2. :func:`apply_input_template`: ``template.format(text)`` on a text column (e.g. ``"User: {}\\nAssistant: "``);
3. :func:`to_conversational`: plain-text rows → TRL's conversational format (the prompt becomes one user turn, the
   completions one assistant turn each), which every trainer renders with the tokenizer's chat template;
4. :func:`prefix_inputs`: the conditional-SFT prefix (``--csft_prompt`` of ``recipes/sft.py``) on every input.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

__all__ = [
    "COMPLETION_COLUMNS",
    "STOPPING_STRATEGIES",
    "apply_input_template",
    "check_input_template",
    "mix_datasets",
    "normalize_probs",
    "prefix_inputs",
    "select_first",
    "to_conversational",
]

STOPPING_STRATEGIES = ("first_exhausted", "all_exhausted")
COMPLETION_COLUMNS = ("completion", "chosen", "rejected")


def _columns(dataset) -> list[str] | None:
    """Column names of a dataset (``None`` for an iterable dataset whose features are unknown)."""
    names = getattr(dataset, "column_names", None)
    return list(names) if names is not None else None


def _require_column(dataset, column: str, option: str) -> None:
    columns = _columns(dataset)
    if columns is not None and column not in columns:
        raise ValueError(
            f"{option} applies to the column {column!r}, but the dataset has the columns {columns}; pick one of "
            "them with --input_key."
        )


def normalize_probs(probs, num_datasets: int) -> list[float]:
    """``probs`` checked and scaled to sum to 1 (``None``: uniform over ``num_datasets``).

    Raises:
        ValueError: the length differs from ``num_datasets``, a value is negative or not finite, or all are zero.
    """
    if probs is None:
        return [1.0 / num_datasets] * num_datasets
    probs = [float(p) for p in probs]
    if len(probs) != num_datasets:
        raise ValueError(
            f"--dataset_probs has {len(probs)} values for {num_datasets} datasets; give one probability per dataset."
        )
    if any(not math.isfinite(p) or p < 0 for p in probs):
        raise ValueError(f"--dataset_probs must be finite and non-negative, got {probs}.")
    total = sum(probs)
    if total <= 0:
        raise ValueError(f"--dataset_probs are all zero ({probs}); at least one dataset needs a positive probability.")
    if not math.isclose(total, 1.0, rel_tol=1e-6):
        logger.warning(f"--dataset_probs {probs} sum to {total:g}, not 1; normalised to {[p / total for p in probs]}.")
    return [p / total for p in probs]


def select_first(dataset, max_samples: int | None):
    """The first ``max_samples`` rows (all of them when ``None`` or when the dataset is shorter)."""
    if max_samples is None:
        return dataset
    if max_samples < 1:
        raise ValueError(f"--max_samples must be at least 1, got {max_samples}.")
    if not hasattr(dataset, "select"):  # IterableDataset
        return dataset.take(max_samples)
    return dataset.select(range(min(max_samples, len(dataset))))


def mix_datasets(
    datasets: list,
    probs: list[float] | None = None,
    seed: int = 0,
    max_samples: int | None = None,
    stopping_strategy: str = "first_exhausted",
):
    """One dataset whose rows are sampled from ``datasets`` with probabilities ``probs``.

    Each row of the result comes from dataset ``i`` with probability ``probs[i]``, independently of the other rows
    (a seeded draw; within a dataset the rows keep their order), so among ``N`` rows the count from dataset ``i`` is
    Binomial(``N``, ``probs[i]``) until a dataset runs out. ``stopping_strategy`` says when the mixture ends:
    ``"first_exhausted"`` when one dataset has no rows left (no row repeats), ``"all_exhausted"`` once every dataset
    was used up at least once (shorter ones restart: oversampling). Probabilities are normalised when they do not sum
    to 1 (with a logged note); datasets with probability 0 are left out. ``max_samples`` then keeps the first rows.

    Args:
        datasets: `datasets.Dataset`s (or `IterableDataset`s) with the same columns.
        probs: one non-negative weight per dataset; ``None`` = uniform.
        seed: seed of the draw.
        max_samples: keep at most this many rows of the mixture (its first ones).
        stopping_strategy: ``"first_exhausted"`` or ``"all_exhausted"``.

    Returns:
        The mixed dataset (a single dataset is returned as it is, cut to ``max_samples``).

    Raises:
        ValueError: no datasets, bad probabilities (see :func:`normalize_probs`), an unknown stopping strategy, or
            datasets whose columns differ.
    """
    from datasets import interleave_datasets

    if not datasets:
        raise ValueError("mix_datasets needs at least one dataset.")
    if stopping_strategy not in STOPPING_STRATEGIES:
        raise ValueError(f"stopping_strategy must be one of {STOPPING_STRATEGIES}, got {stopping_strategy!r}.")
    probs = normalize_probs(probs, len(datasets))
    columns = [_columns(d) for d in datasets]
    known = [c for c in columns if c is not None]
    if any(sorted(c) != sorted(known[0]) for c in known[1:]):
        listing = "; ".join(f"dataset {i}: {c}" for i, c in enumerate(columns))
        raise ValueError(
            f"The datasets of a mixture must have the same columns, got {listing}. Rename or drop columns so that "
            "they match (e.g. `dataset.rename_column(...)`, `dataset.select_columns(...)`)."
        )
    kept = [(d, p) for d, p in zip(datasets, probs) if p > 0]
    if len(kept) == 1:
        return select_first(kept[0][0], max_samples)
    if known:  # the same column order everywhere (interleave_datasets requires aligned features)
        kept = [(d.select_columns(known[0]) if _columns(d) is not None else d, p) for d, p in kept]
    mixed = interleave_datasets(
        [d for d, _ in kept], probabilities=[p for _, p in kept], seed=seed, stopping_strategy=stopping_strategy
    )
    return select_first(mixed, max_samples)


def check_input_template(template: str) -> str:
    """``template`` if it holds exactly one ``{}`` placeholder (the text goes there), else a ``ValueError``."""
    import string

    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"--input_template {template!r} is not a valid format string: {exc}.") from exc
    if fields != [""]:
        raise ValueError(
            f"--input_template must contain exactly one '{{}}' placeholder (where the text goes) and no other braces, "
            f"got {template!r} (write a literal brace as '{{{{' or '}}}}')."
        )
    return template


def apply_input_template(dataset, template: str, column: str = "prompt"):
    """``template.format(text)`` on the text column ``column`` (e.g. ``"User: {}\\nAssistant: "``).

    Raises:
        ValueError: the template has no or several ``{}``, the column is missing (the columns found are named), or
            it holds chat messages rather than text.
    """
    check_input_template(template)
    _require_column(dataset, column, "--input_template")

    def format_row(row):
        value = row[column]
        if not isinstance(value, str):
            raise ValueError(
                f"--input_template formats text, but the column {column!r} holds {type(value).__name__} values (chat "
                "messages?); format those with the tokenizer's chat template instead."
            )
        return {column: template.format(value)}

    return dataset.map(format_row)


def to_conversational(dataset, column: str = "prompt", completion_columns=COMPLETION_COLUMNS):
    """Plain-text rows → TRL's conversational format: ``column`` becomes one user turn and each of the
    ``completion_columns`` present one assistant turn. Rows already conversational are kept. The trainers then apply
    the tokenizer's chat template (with the generation prompt after a prompt-only row).

    Raises:
        ValueError: ``column`` is missing (e.g. a ``text`` dataset: language-modelling rows have no turns).
    """
    _require_column(dataset, column, "--apply_chat_template")
    columns = _columns(dataset)
    targets = [c for c in completion_columns if c != column and (columns is None or c in columns)]

    def wrap(row):
        out = {}
        if isinstance(row[column], str):
            out[column] = [{"role": "user", "content": row[column]}]
        for name in targets:
            if isinstance(row.get(name), str):
                out[name] = [{"role": "assistant", "content": row[name]}]
        return out

    return dataset.map(wrap)


def _prefix_messages(messages: list, prefix: str, where: str) -> list:
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            content = message["content"]
            if not isinstance(content, str):
                raise ValueError(f"Cannot prefix the first user message of {where}: its content is not text.")
            return [*messages[:i], {**message, "content": prefix + content}, *messages[i + 1 :]]
    raise ValueError(f"Cannot prefix {where}: a conversation has no user message.")


def prefix_inputs(dataset, prefix: str):
    """``prefix`` in front of every input: the ``prompt`` (its first user message if conversational), else the
    ``text``, else the first user message of ``messages``. Conditional SFT puts a reward-class marker there (e.g.
    ``"<rm_score>: 5.00 "``) so that the model learns to condition on it.

    Raises:
        ValueError: none of those columns exists (the columns found are named).
    """
    columns = _columns(dataset) or []
    column = next((c for c in ("prompt", "text", "messages") if c in columns), None)
    if column is None:
        raise ValueError(
            f"The prefix goes in front of the 'prompt', 'text' or 'messages' column; the dataset has {columns}."
        )

    def add(row):
        value = row[column]
        if isinstance(value, str):
            return {column: prefix + value}
        return {column: _prefix_messages(value, prefix, f"the column {column!r}")}

    return dataset.map(add)
