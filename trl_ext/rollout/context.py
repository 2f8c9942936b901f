"""The context-length check shared by the online trainers and batch inference: a prompt plus the new tokens to
generate must fit the positions the policy was built for (``max_position_embeddings``). Past them, generation goes on
without an error and the rows are longer than the model can attend to.

- :func:`context_length`: the number of positions of a model, read from its config;
- :func:`check_prompts_fit_context`: a ``ValueError`` naming the longest prompt, how many do not fit and what to
  change (the trainers' ``response_length``, batch inference's ``--max_new_tokens``).
"""

from __future__ import annotations

__all__ = ["check_prompts_fit_context", "context_length"]


def _prefix(trainer: str) -> str:
    return f"{trainer}: " if trainer else ""


_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(model) -> int | None:
    """The number of positions ``model`` was built for (``config.max_position_embeddings`` or its GPT-2 /
    other-architecture names, read from the text config), or ``None`` when its config does not say."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in _CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_prompts_fit_context(
    dataset,
    model,
    response_length: int,
    name: str = "train_dataset",
    *,
    trainer: str = "",
    option: str = "response_length",
):
    """Raise ``ValueError`` when the longest tokenised prompt of ``dataset`` plus ``response_length`` new tokens needs
    more positions than the policy ``model`` has (:func:`context_length`).

    ``dataset`` is a dataset with an ``input_ids`` column, or the token-id lists themselves (batch inference).
    ``option`` is the name of the setting that holds ``response_length`` (``"max_new_tokens"`` for batch inference),
    so that the message names what to lower. Nothing is checked when the model's config gives no context length or
    the dataset has no ``input_ids``."""
    limit = context_length(model)
    if dataset is None or limit is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:  # token ids per prompt (a list, or a dataset column)
        ids_per_prompt = dataset
    elif "input_ids" in columns:
        ids_per_prompt = dataset["input_ids"]
    else:
        return
    lengths = [len(ids) for ids in ids_per_prompt]
    longest = max(lengths, default=0)
    if longest + response_length <= limit:
        return
    too_long = sum(n + response_length > limit for n in lengths)
    room = limit - response_length
    fix = (
        f"Truncate or filter the prompts to at most {room} tokens (e.g. `dataset.filter(lambda row: "
        f"len(tokenizer(row['prompt']).input_ids) <= {room})`), or lower {option}"
        if room > 0
        else f"Lower {option} below {limit}"
    )
    raise ValueError(
        f"{_prefix(trainer)}{name}: the longest prompt has {longest} tokens; with {option}={response_length} "
        f"new tokens a sequence needs {longest + response_length} positions, but the policy's context is {limit} "
        f"(its config's max_position_embeddings). {too_long} of {len(lengths)} prompts do not fit. {fix}."
    )
