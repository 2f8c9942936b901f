"""Negative data: the sampled responses whose raw reward falls below a threshold, collected in a JSON-lines file.

RePULSe runs keep every bad sample they meet (``--save_negdata`` in the original, which pickled a set after each
fit step). Here each such sample is appended as one JSON object per line, as soon as it is sampled, after a first
line that says which run wrote the file::

    {"trl_ext_negdata": {"format": "trl_ext.negdata", "version": 1, "run_id": "…", "output_dir": "…",
                         "created": "2025-…", "config": {"save_negdata_threshold": -5.0, "model": "…", …}}}
    {"prompt": "...", "response": "...", "reward": -7.1, "step": 12, "source": "proposal"}

``source`` says which model sampled it (``"policy"`` or ``"proposal"``) and ``step`` is the number of optimizer
steps done when it was sampled. Texts are decoded with special tokens kept (an end-of-turn token in a response is
part of what was sampled). The file is plain text, no pickle.

**Header and run id.** The first line (:func:`negdata_header`) names the format, the run id (a fresh UUID per run),
the run's ``output_dir``, when it started and the settings that decide what was kept. A run appends only to its own
file: an existing file without that header (an older trl_ext file, or anyone else's) or with another run's id is
refused, with the file left untouched — choose another ``save_negdata`` path or delete the file. A resumed run
continues its file: the trainer records the run id in every checkpoint (``negdata_run.json``) and, on resume,
accepts the file whose header has that id (or, for a checkpoint saved before run ids, the same ``output_dir``).

**Reading.** :func:`read_negative_data` returns the rows without the header (and also reads files written before
headers existed), as the DPO/KTO ``negative_data_path`` and `trl_ext.eval.eval_negative_data` do. With
``datasets.load_dataset("json", ...)`` the header is one more row (its ``prompt`` is ``None``): drop it with
``dataset.filter(lambda row: row["prompt"] is not None)``, or build the dataset from :func:`read_negative_data`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable

import torch

from ..data.files import read_jsonl

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HEADER_KEY",
    "NegativeDataWriter",
    "negative_rows",
    "negdata_header",
    "read_negative_data",
    "read_negative_data_header",
]

SOURCES: tuple[str, ...] = ("policy", "proposal")
FORMAT, FORMAT_VERSION = "trl_ext.negdata", 1
HEADER_KEY = "trl_ext_negdata"  # the only key of the header line
_CHOOSE = "Set save_negdata to another path, or delete (or move) this file"


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


def negdata_header(run_id: str, output_dir: str | None = None, config: dict | None = None) -> dict:
    """The first line of a negative-data file: ``{"trl_ext_negdata": {format, version, run_id, output_dir, created,
    config}}``."""
    return {
        HEADER_KEY: {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "run_id": run_id,
            "output_dir": os.path.abspath(output_dir) if output_dir else None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config or {},
        }
    }


def _is_header(row) -> bool:
    return isinstance(row, dict) and isinstance(row.get(HEADER_KEY), dict)


def _first_line(path: str) -> str | None:
    """The first non-blank line of ``path`` (``None``: missing or empty), read as bytes so that any file can be
    looked at."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                return raw.decode("utf-8", errors="replace")
    return None


def read_negative_data_header(path: str) -> dict | None:
    """The header of a negative-data file (the dict under ``"trl_ext_negdata"``), or ``None`` when the file is
    missing, empty, or does not start with one."""
    line = _first_line(path)
    if line is None:
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row[HEADER_KEY] if _is_header(row) else None


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
    """Appends the bad samples of each rollout to ``path`` (one JSON object per line) after the run's header.

    Args:
        path: the JSONL file (created with its folder).
        threshold: raw-reward threshold.
        decode: token ids → text.
        gather: optional function collecting a list of rows from every process (e.g. `accelerate.utils.gather_object`);
            only ``is_main_process`` writes.
        is_main_process: whether this process writes.
        output_dir: the run's output folder, recorded in the header.
        config: the settings recorded in the header (JSON-ready).

    Call :meth:`start` before the first rollout (the trainer does, with the resumed checkpoint's run id);
    :meth:`add` starts a fresh file itself otherwise. :attr:`run_id` is the run id in use once started.
    """

    def __init__(
        self,
        path: str,
        threshold: float,
        decode: Callable[[list[int]], str],
        gather: Callable[[list], list] | None = None,
        is_main_process: bool = True,
        output_dir: str | None = None,
        config: dict | None = None,
    ):
        self.path, self.threshold, self.decode = os.fspath(path), float(threshold), decode
        self.gather, self.is_main_process = gather, is_main_process
        self.output_dir, self.config = output_dir, dict(config or {})
        self.num_written = 0
        self.run_id: str | None = None

    def check_not_foreign(self) -> None:
        """Raise a ``ValueError`` when ``path`` exists, is not empty and does not start with a negdata header (a file
        no trl_ext run with a run id wrote): it is never appended to."""
        line = _first_line(self.path)
        if line is None or read_negative_data_header(self.path) is not None:
            return
        excerpt = line.strip()[:80]
        raise ValueError(
            f"save_negdata={self.path!r} exists and was not written by a trl_ext run (its first line is not a "
            f"'{HEADER_KEY}' header: {excerpt!r}; files from before run ids have none either). A run only appends to "
            f"its own negative-data file. {_CHOOSE}."
        )

    def start(self, resume_run_id: str | None = None, resuming: bool = False, overwrite: bool = False) -> str:
        """Decide where this run's rows go and return the run id (main process; see the module docs).

        A missing or empty file gets a fresh header. An existing one is continued when its header's run id is this
        writer's (a second ``train()``) or ``resume_run_id`` (the resumed checkpoint's), or, when ``resuming`` a
        checkpoint that recorded no run id, when its ``output_dir`` is this run's. With ``overwrite`` a file of this
        ``output_dir`` is started afresh. Anything else is a ``ValueError`` and the file is left untouched."""
        self.check_not_foreign()
        header = read_negative_data_header(self.path)
        if header is None:
            return self._write_header()
        theirs = header.get("run_id")
        mine = os.path.abspath(self.output_dir) if self.output_dir else None
        same_dir = mine is not None and header.get("output_dir") == mine
        if theirs is not None and theirs in (self.run_id, resume_run_id):
            self.run_id = theirs
            return theirs
        if resuming and resume_run_id is None and same_dir:
            self.run_id = theirs
            return theirs
        if overwrite and same_dir:
            os.remove(self.path)
            return self._write_header()
        if resuming:
            why = (
                f"this run resumes a checkpoint of run {resume_run_id}"
                if resume_run_id
                else f"this run resumes a checkpoint of output_dir {mine!r}"
            )
        else:
            why = "this run is a new run (it resumes no checkpoint)"
        raise ValueError(
            f"save_negdata={self.path!r} holds the negative samples of another run (run id {theirs}, output_dir "
            f"{header.get('output_dir')!r}, started {header.get('created')}), and {why}. A run only appends to its "
            f"own file, so that no file mixes runs. {_CHOOSE}; to continue that run instead, resume it from its "
            "checkpoint (resume_from_checkpoint)."
        )

    def _write_header(self) -> str:
        self.run_id = uuid.uuid4().hex
        _append_jsonl(self.path, [negdata_header(self.run_id, self.output_dir, self.config)])
        return self.run_id

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
        if self.run_id is None:
            self.start()
        written = _append_jsonl(self.path, rows)
        self.num_written += written
        return written


def read_negative_data(path: str) -> list[dict]:
    """The rows of a negative-data JSONL file, without its header line(s) (an empty list if it does not exist).
    Files written before headers existed read the same. A line that is not UTF-8 or not a JSON object is a
    ``ValueError`` naming the file and the line."""
    if not os.path.isfile(path):
        return []
    return [row for row in read_jsonl(path) if not _is_header(row)]
