"""Prompt datasets for online trainers: validation, tokenisation, left-padded batches and the rollout sampler.

Written once for every online trainer (PPO, the proposal and the harmlessness trainers):

- :func:`prepare_prompt_dataset` accepts a ``prompt`` column (plain strings, or conversational message lists that
  get the tokenizer's chat template with the generation prompt) or a pre-tokenised ``input_ids`` column (TRL 1.12's
  PPO format), and returns a dataset with a single ``input_ids`` column (the online trainers keep the other columns
  for their reward functions, :mod:`.columns`).
- :class:`PromptCollator` left-pads prompts (generation appends to the right end).
- :func:`left_padded` turns any padded batch into a left-padded one using its attention mask.
- :class:`RolloutSampler` yields the prompts of each rollout, repeated once per optimisation micro-step, in an order
  fixed by the seed and the epoch (so a resumed run sees the same prompts as an uninterrupted one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler
from trl import is_conversational, maybe_apply_chat_template
from trl.trainer.utils import pad

from .columns import reward_columns

__all__ = [
    "PromptCollator",
    "RolloutSampler",
    "check_chat_template",
    "check_pad_token",
    "left_padded",
    "prepare_prompt_dataset",
    "tokenizer_name",
    "tokenizer_of",
]

logger = logging.getLogger(__name__)

PROMPT_COLUMNS = ("prompt", "input_ids")


def tokenizer_of(processing_class):
    """The tokenizer of a tokenizer or of a processor (``processor.tokenizer``)."""
    tokenizer = getattr(processing_class, "tokenizer", None)
    return tokenizer if tokenizer is not None else processing_class


def tokenizer_name(tokenizer) -> str:
    """``ClassName('name_or_path')`` of a tokenizer, for error messages."""
    path = getattr(tokenizer, "name_or_path", "") or ""
    return f"{type(tokenizer).__name__}({path!r})" if path else type(tokenizer).__name__


def check_chat_template(dataset, tokenizer, name: str = "train_dataset", processor=None) -> None:
    """Raise a clear error when ``dataset``'s first ``prompt`` is a list of chat messages and neither ``tokenizer``
    nor ``processor`` has a chat template to turn it into text. Cheap (reads one row): trainers call it before
    building their models. Datasets without rows or without a ``prompt`` column pass."""
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return
    columns = list(getattr(dataset, "column_names", None) or dataset[0].keys())
    if "prompt" not in columns or "input_ids" in columns:
        return
    if not is_conversational({"prompt": dataset[0]["prompt"]}):
        return
    if getattr(tokenizer, "chat_template", None) is None and getattr(processor, "chat_template", None) is None:
        raise ValueError(
            f"{name} holds conversational prompts (lists of chat messages) but the tokenizer "
            f"{tokenizer_name(tokenizer)} has no chat template to turn them into text. Set one "
            "(`tokenizer.chat_template = other_tokenizer.chat_template`, e.g. from the instruct version of the "
            "model), or pass plain-text prompts."
        )


def check_pad_token(tokenizer) -> None:
    """Raise a clear error when the tokenizer cannot pad (batches of prompts and responses need a pad token)."""
    if tokenizer is None:
        raise ValueError("A tokenizer is required: pass processing_class=<the policy's tokenizer>.")
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) has no pad token. Set one before building the trainer, e.g. "
            "`tokenizer.pad_token = tokenizer.eos_token` (rewards and masks are read from attention masks, so pad "
            "== eos is safe) or add a dedicated one with `tokenizer.add_special_tokens({'pad_token': '[PAD]'})`."
        )


def prepare_prompt_dataset(
    dataset, tokenizer, *, num_proc: int | None = None, name: str = "train_dataset", keep_columns: bool = False
):
    """Validate a prompt dataset and tokenise it to a single ``input_ids`` column (plus, with ``keep_columns``, its
    reward columns, :func:`~trl_ext.rollout.columns.reward_columns`).

    Args:
        dataset: a `datasets.Dataset` with a ``prompt`` column (strings, or lists of ``{"role", "content"}``
            messages) or an ``input_ids`` column (lists of token ids, TRL 1.12 style; used as they are).
        tokenizer: the policy's tokenizer. Conversational prompts get its chat template with the generation prompt
            (`trl.maybe_apply_chat_template`) and are tokenised without extra special tokens (the template has
            them); plain strings are tokenised with the tokenizer's defaults, as TRL 1.12's PPO example did.
        num_proc: processes for `Dataset.map`.
        name: the argument name, for error messages.
        keep_columns: keep the columns other than the prompt (the online trainers pass them to reward functions).

    Returns:
        A dataset with the column ``input_ids`` (and the reward columns with ``keep_columns``).

    Raises:
        ValueError: the dataset is empty, neither column is present, conversational prompts without a chat template,
            or a prompt is empty.
    """
    if not hasattr(dataset, "__len__"):
        raise ValueError(
            f"{name} has no length (an IterableDataset?): online trainers sample prompt batches by index; pass a "
            "map-style `datasets.Dataset` (e.g. `Dataset.from_list(list(iterable_dataset.take(n)))`)."
        )
    if len(dataset) == 0:
        raise ValueError(
            f"{name} is empty (0 rows): it must hold prompts, in a 'prompt' or an 'input_ids' column. Check the split "
            "you loaded and any filtering done before."
        )
    columns = list(getattr(dataset, "column_names", None) or [])
    if not columns:
        columns = list(dataset[0].keys())
    kept = reward_columns(dataset) if keep_columns else []
    if "input_ids" in columns:
        dropped = [c for c in columns if c != "input_ids" and c not in kept]
        prepared = dataset.remove_columns(dropped) if dropped else dataset
    elif "prompt" in columns:
        first = dataset[0]
        conversational = is_conversational({"prompt": first["prompt"]})
        if not conversational and not isinstance(first["prompt"], str):
            raise ValueError(
                f"{name}: the 'prompt' column must hold strings or lists of chat messages "
                f"({{'role': ..., 'content': ...}}); found {type(first['prompt']).__name__}."
            )
        if conversational:
            check_chat_template(dataset, tokenizer, name)

        def tokenize(example):
            if conversational:
                text = maybe_apply_chat_template({"prompt": example["prompt"]}, tokenizer)["prompt"]
                return {"input_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}
            return {"input_ids": tokenizer(example["prompt"])["input_ids"]}

        dropped = [c for c in columns if c not in kept]
        prepared = dataset.map(tokenize, remove_columns=dropped, num_proc=num_proc, desc=f"Tokenizing {name}")
    else:
        raise ValueError(
            f"{name} has columns {columns}, but a prompt dataset needs a 'prompt' column (text or chat messages) or "
            f"an 'input_ids' column (token ids). Rename the prompt column with "
            f"`dataset.rename_column('<yours>', 'prompt')`."
        )
    empty = [i for i, ids in enumerate(prepared["input_ids"]) if len(ids) == 0]
    if empty:
        raise ValueError(f"{name}: prompts {empty[:5]} are empty after tokenisation; remove them from the dataset.")
    return prepared


class PromptCollator:
    """Collate ``{"input_ids": [...]}`` rows into left-padded ``input_ids`` and ``attention_mask`` tensors."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = int(pad_token_id)

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        masks = [torch.ones_like(x) for x in ids]
        return {
            "input_ids": pad(ids, padding_value=self.pad_token_id, padding_side="left"),
            "attention_mask": pad(masks, padding_value=0, padding_side="left"),
        }


def left_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` with every row's real tokens moved to the right end (left padding).

    Batches from a user's ``data_collator`` may be right-padded; generation needs left padding. Without a mask the
    real tokens are taken to be those that differ from ``pad_token_id`` (ambiguous when pad == eos: pass a mask).
    """
    if attention_mask is None:
        attention_mask = (input_ids != pad_token_id).long()
    keep = attention_mask != 0
    width = input_ids.shape[1]
    lengths = keep.sum(-1, keepdim=True)
    if bool((keep == (torch.arange(width, device=keep.device) >= width - lengths)).all()):
        return input_ids, attention_mask.long()  # already left-padded
    rows = [ids[m] for ids, m in zip(input_ids, keep)]
    ids = pad(rows, padding_value=pad_token_id, padding_side="left")
    mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left")
    return ids, mask


class RolloutSampler(Sampler[int]):
    """Dataset indices for online training: each rollout's prompts, repeated once per optimisation micro-step.

    Per epoch the dataset is shuffled with a generator seeded by ``seed + epoch`` (set by `Trainer` through
    :meth:`set_epoch`) and cut into chunks of ``prompts_per_rollout`` (all processes together); the last incomplete
    chunk is dropped. Each chunk is yielded ``repeat`` times in a row. With a DataLoader batch of
    ``prompts_per_rollout / num_processes`` and accelerate's round-robin sharding of batches, every process receives
    its own slice of the chunk ``repeat`` times: the first copy starts a rollout, the others are the micro-steps that
    train on it.

    Args:
        num_rows: dataset length.
        prompts_per_rollout: prompts per rollout over all processes.
        repeat: micro-steps per rollout (``num_ppo_epochs × num_mini_batches × gradient_accumulation_steps``).
        seed: base seed of the shuffle.
        shuffle: shuffle the dataset each epoch.
    """

    def __init__(self, num_rows: int, prompts_per_rollout: int, repeat: int, seed: int = 0, shuffle: bool = True):
        if prompts_per_rollout < 1 or repeat < 1:
            raise ValueError(f"prompts_per_rollout={prompts_per_rollout} and repeat={repeat} must be >= 1.")
        if num_rows < prompts_per_rollout:
            raise ValueError(
                f"The training dataset has {num_rows} prompts but one rollout needs {prompts_per_rollout} (over all "
                "processes); add prompts or lower per_device_train_batch_size / gradient_accumulation_steps."
            )
        self.num_rows, self.prompts_per_rollout, self.repeat = num_rows, prompts_per_rollout, repeat
        self.seed, self.shuffle, self.epoch = int(seed), shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @property
    def rollouts_per_epoch(self) -> int:
        return self.num_rows // self.prompts_per_rollout

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        size = self.prompts_per_rollout
        for start in range(0, self.rollouts_per_epoch * size, size):
            chunk = order[start : start + size]
            for _ in range(self.repeat):
                yield from chunk

    def __len__(self) -> int:
        return self.rollouts_per_epoch * self.prompts_per_rollout * self.repeat
