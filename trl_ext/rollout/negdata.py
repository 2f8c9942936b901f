"""Negative data: the sampled responses whose raw reward falls below a threshold, collected in a JSON-lines file.

RePULSe runs keep every bad sample they meet (``--save_negdata`` in the original, which pickled a set after each
fit step). Here each such sample is appended as one JSON object per line, as soon as it is sampled::

    {"prompt": "...", "response": "...", "reward": -7.1, "step": 12, "source": "proposal"}

``source`` says which model sampled it (``"policy"`` or ``"proposal"``) and ``step`` is the number of optimizer
steps done when it was sampled. Texts are decoded with special tokens kept (an end-of-turn token in a response is
part of what was sampled). The file is plain text: no pickle, readable with ``datasets.load_dataset("json", ...)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import torch

__all__ = ["NegativeDataWriter", "negative_rows", "read_negative_data"]

SOURCES: tuple[str, ...] = ("policy", "proposal")


def negative_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    *,
    threshold: float,
    step: int,
    source: str,
    decode: Callable[[list[int]], str],
) -> list[dict]:
    """The rows of one rollout whose raw ``rewards`` are below ``threshold``, as JSON-ready dicts.

    Args:
        prompt_ids, prompt_mask: ``(B, P)`` prompts (any padding side; the mask selects the real tokens).
        response_ids, response_mask: ``(B, T)`` responses.
        rewards: ``(B,)`` raw rewards.
        threshold: a row is kept when its reward is strictly below it.
        step: the optimizer step recorded with each row.
        source: ``"policy"`` or ``"proposal"``.
        decode: maps a list of token ids to text (e.g. ``tokenizer.decode``).
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}.")
    keep = (rewards.detach().float().cpu() < float(threshold)).nonzero().flatten().tolist()
    rows = []
    for i in keep:
        prompt = prompt_ids[i][prompt_mask[i] != 0].tolist()
        response = response_ids[i][response_mask[i] != 0].tolist()
        rows.append(
            {
                "prompt": decode(prompt),
                "response": decode(response),
                "reward": float(rewards[i]),
                "step": int(step),
                "source": source,
            }
        )
    return rows


def _append_jsonl(path: str, rows: Iterable[dict]) -> int:
    rows = list(rows)
    if not rows:
        return 0
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return len(rows)


class NegativeDataWriter:
    """Appends the bad samples of each rollout to ``path`` (one JSON object per line).

    Args:
        path: the JSONL file (created with its folder on the first write; an existing file is appended to, so a
            resumed run continues it).
        threshold: raw-reward threshold.
        decode: token ids → text.
        gather: optional function collecting a list of rows from every process (e.g. `accelerate.utils.gather_object`);
            only ``is_main_process`` writes.
        is_main_process: whether this process writes.
    """

    def __init__(
        self,
        path: str,
        threshold: float,
        decode: Callable[[list[int]], str],
        gather: Callable[[list], list] | None = None,
        is_main_process: bool = True,
    ):
        self.path, self.threshold, self.decode = os.fspath(path), float(threshold), decode
        self.gather, self.is_main_process = gather, is_main_process
        self.num_written = 0

    def add(self, rollout, rewards: torch.Tensor, *, step: int, source: str) -> int:
        """Write the rows of ``rollout`` (a :class:`~trl_ext.rollout.generator.Rollout`) whose raw ``rewards`` are
        below the threshold; returns how many this process wrote (0 on the other processes)."""
        rows = negative_rows(
            rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask, rewards,
            threshold=self.threshold, step=step, source=source, decode=self.decode,
        )  # fmt: skip
        if self.gather is not None:
            rows = self.gather(rows)
        if not self.is_main_process:
            return 0
        written = _append_jsonl(self.path, rows)
        self.num_written += written
        return written


def read_negative_data(path: str) -> list[dict]:
    """The rows of a negative-data JSONL file (an empty list if it does not exist)."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
