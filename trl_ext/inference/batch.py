"""Batch inference over a prompt dataset: generation, best-of-N with a reward model, or reward scoring, written to
a resumable JSONL file.

Modes (:class:`BatchInferenceArguments`):

- ``generate``: sample ``num_samples`` responses per prompt (HF ``generate`` through the trainers' sampler; vLLM when
  it is installed and a GPU is present). With a reward model every sample is scored and the best one is kept
  (best-of-N); without one the samples are written as they are.
- ``score``: no generation; score the ``prompt`` / ``response`` pairs of the dataset with the reward model.

Prompts are plain strings or chat conversations (lists of ``{"role", "content"}`` messages); conversations, and plain
prompts with ``use_chat_template``, get the tokenizer's chat template with the generation prompt, tokenised as the
trainers tokenise prompts (:func:`trl_ext.rollout.data.prepare_prompt_dataset`).

Output: one JSON object per line and per prompt, written and flushed after every chunk of ``batch_size`` prompts::

    {"key": "3", "index": 3, "digest": "…", "prompt": …, "completion": "…", "score": 0.41,
     "completions": ["…", …], "scores": [0.41, …], "best_index": 0}

``completions``/``scores`` hold every sample (when ``num_samples > 1``), ``completion``/``score``/``best_index`` the
chosen one (``completion`` is the only sample when ``num_samples == 1``; with several samples and no reward model
there is no choice, so only ``completions`` is written). Scoring mode writes ``prompt``, ``response`` and ``score``.

Resuming: ``key`` is the value of ``id_column`` (when given) or the row index. Rows whose key is already in the output
file are skipped, so running the same command again after an interruption finishes the job and a finished job
generates nothing. ``digest`` (a hash of the prompt, and of the response in scoring mode) must match the dataset
row with the same key, otherwise the file belongs to another dataset and the run stops with an error. A last line
cut off by a kill mid-write (no final newline, or not valid JSON) is removed before appending.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .generation import BACKENDS, VLLMGenerator, generate_texts, resolve_backend, sampling_settings, stop_token_ids

__all__ = [
    "BatchInferenceArguments",
    "JsonlWriter",
    "load_finished_rows",
    "load_reward_function",
    "row_digest",
    "row_keys",
    "run_batch_inference",
]

logger = logging.getLogger(__name__)

MODES = ("generate", "score")


@dataclass
class BatchInferenceArguments:
    """Options of batch inference (`recipes/batch_inference.py`). The dataset comes from TRL's `ScriptArguments`
    (``--dataset_name``, ``--dataset_train_split``) and the policy from TRL's `ModelConfig` (``--model_name_or_path``,
    ``--dtype``).

    Parameters:
        > Output

        output_file, overwrite, progress

        > Mode

        mode, backend

        > Generation

        num_samples, max_new_tokens, temperature, top_k, top_p, batch_size, use_chat_template, stop_tokens, seed

        > Reward model (best-of-N, scoring mode)

        reward_model_path, reward_batch_size, reward_max_length, reward_use_chat_template

        > Data

        response_column, id_column, max_prompts
    """

    output_file: str = field(
        default="outputs/batch_inference.jsonl",
        metadata={"help": "JSONL file to write (appended to; prompts already in it are skipped)."},
    )
    overwrite: bool = field(default=False, metadata={"help": "Start the output file afresh instead of resuming."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    mode: str = field(
        default="generate",
        metadata={"help": "'generate' (sample responses, best-of-N with a reward model) or 'score' (score the "
                  "dataset's prompt/response pairs with the reward model)."},
    )  # fmt: skip
    backend: str = field(
        default="auto",
        metadata={"help": "'hf' (transformers generate), 'vllm' (needs vLLM and a GPU; falls back to 'hf' with a "
                  "message) or 'auto' (vLLM when usable)."},
    )  # fmt: skip
    num_samples: int = field(
        default=1, metadata={"help": "Samples per prompt; with a reward model the best one is kept (best-of-N)."}
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Most tokens per response."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0: greedy)."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (None: off)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (1.0: off)."})
    batch_size: int = field(
        default=8, metadata={"help": "Prompts per chunk; each chunk is generated, scored and written together."}
    )
    use_chat_template: bool = field(
        default=False,
        metadata={"help": "Render plain-text prompts as a user message with the chat template (conversational "
                  "prompts always use it)."},
    )  # fmt: skip
    stop_tokens: list[str] | None = field(
        default=None, metadata={"help": "Extra tokens that end a response (the eos and end-of-turn tokens always do)."}
    )
    seed: int = field(default=0, metadata={"help": "Random seed of the sampling."})
    reward_model_path: str | None = field(
        default=None,
        metadata={
            "help": "Reward model folder / Hub id, or the URL of a reward server (http://host:port/get_reward)."
        },
    )
    reward_batch_size: int = field(default=16, metadata={"help": "Texts per reward forward pass (or request)."})
    reward_max_length: int | None = field(
        default=None, metadata={"help": "Truncate reward inputs to this many tokens (None: no truncation)."}
    )
    reward_use_chat_template: bool = field(
        default=False, metadata={"help": "Render prompt + response with the reward tokenizer's chat template."}
    )
    response_column: str = field(default="response", metadata={"help": "Response column of scoring mode."})
    id_column: str | None = field(
        default=None, metadata={"help": "Column with a unique id per prompt, used as the resume key (default: index)."}
    )
    max_prompts: int | None = field(default=None, metadata={"help": "Only the first N rows of the dataset."})

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}; got {self.mode!r}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}; got {self.backend!r}.")
        if self.mode == "score" and self.reward_model_path is None:
            raise ValueError("--mode score needs --reward_model_path (a reward model or a reward server URL).")
        for name in ("num_samples", "batch_size", "max_new_tokens", "reward_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1; got {getattr(self, name)}.")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"--max_prompts must be >= 1 (or unset); got {self.max_prompts}.")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("Need --temperature >= 0 and 0 < --top_p <= 1.")


# --------------------------------------------------------------------------------------------------- the JSONL file
def row_digest(*values: Any) -> str:
    """A short stable hash of JSON-serialisable values (the prompt, and the response in scoring mode)."""
    text = json.dumps(values, sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def load_finished_rows(path: str | os.PathLike) -> dict[str, dict]:
    """The rows already in the output file, by key; a torn last line is cut off the file (with a warning).

    Raises:
        ValueError: a line other than the last is not a JSON object with a ``key``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    pieces = data.split(b"\n")  # a complete file ends with "\n", so its last piece is b""
    rows: dict[str, dict] = {}
    offset = 0
    for number, piece in enumerate(pieces, start=1):
        is_unterminated = number == len(pieces)
        is_last_line = number == len(pieces) - 1 and pieces[-1] == b""
        row = None
        if not is_unterminated and piece.strip():
            try:
                row = json.loads(piece)
            except (json.JSONDecodeError, UnicodeDecodeError):
                row = None
            if not isinstance(row, dict) or "key" not in row:
                if not is_last_line:
                    raise ValueError(
                        f"{path}: line {number} is not a row written by batch inference. Fix or delete the file, or "
                        "pass --overwrite to start again."
                    )
                row = None
        if row is None and piece.strip():  # torn: unterminated, or the last line does not parse
            logger.warning("%s: removing a torn last line (%d bytes) left by an interrupted run.", path, len(piece))
            with open(path, "r+b") as f:
                f.truncate(offset)
            break
        if row is not None:
            rows[str(row["key"])] = row
        offset += len(piece) + 1
    return rows


class JsonlWriter:
    """Append rows to a JSONL file, one line each, flushed at once (a kill loses at most the line being written)."""

    def __init__(self, path: str | os.PathLike, overwrite: bool = False):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "w" if overwrite else "a", encoding="utf-8")

    def write(self, rows: list[dict]) -> None:
        self._file.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def row_keys(dataset, id_column: str | None) -> list[str]:
    """The resume key of every row: its ``id_column`` value, or its index."""
    if id_column is None:
        return [str(i) for i in range(len(dataset))]
    if id_column not in dataset.column_names:
        raise ValueError(f"--id_column {id_column!r} is not a column of the dataset ({dataset.column_names}).")
    keys = [str(v) for v in dataset[id_column]]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--id_column {id_column!r} has duplicate values; it must identify each row uniquely.")
    return keys


# ------------------------------------------------------------------------------------------------------- rewards
def load_reward_function(args: BatchInferenceArguments, tokenizer=None):
    """The reward of ``args.reward_model_path``: a `RemoteReward` for a URL, else a `ModelReward` of the loaded model
    (``None`` when no reward is configured)."""
    from ..models.reward_functions import RemoteReward, as_reward_function

    path = args.reward_model_path
    if path is None:
        return None
    if path.startswith(("http://", "https://")):
        return RemoteReward(path, batch_size=args.reward_batch_size)
    return as_reward_function(
        path,
        tokenizer=tokenizer,
        batch_size=args.reward_batch_size,
        max_length=args.reward_max_length,
        use_chat_template=args.reward_use_chat_template,
    )


# ------------------------------------------------------------------------------------------------------- the run
def _prompt_token_ids(prompts: list, tokenizer, use_chat_template: bool, progress: bool = True) -> list[list[int]]:
    from datasets import Dataset
    from datasets.utils import logging as datasets_logging

    from ..rollout.data import prepare_prompt_dataset

    if use_chat_template:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    bars_were_on = datasets_logging.is_progress_bar_enabled()
    if not progress:
        datasets_logging.disable_progress_bar()
    try:
        prepared = prepare_prompt_dataset(Dataset.from_dict({"prompt": prompts}), tokenizer, name="prompts")
    finally:
        if bars_were_on and not progress:
            datasets_logging.enable_progress_bar()
    return prepared["input_ids"]


class _Generator:
    """``n`` responses per prompt from HF ``generate`` or vLLM."""

    def __init__(self, args: BatchInferenceArguments, model, tokenizer, model_path: str | None, chat: bool):
        self.args, self.model, self.tokenizer = args, model, tokenizer
        stops = stop_token_ids(tokenizer, model, args.stop_tokens or (), chat=chat)
        self.settings = sampling_settings(
            tokenizer,
            stops,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
        )
        self.backend = resolve_backend(args.backend)
        if self.backend == "vllm":
            if model_path is None:
                raise ValueError("The vLLM backend needs the model's path (model_path=).")
            self._vllm = VLLMGenerator(model_path, seed=args.seed)
        elif model is None:
            raise ValueError("Generation with HF generate needs the policy model (model=).")

    def __call__(self, prompt_ids: list[list[int]]) -> list[list[str]]:
        n = self.args.num_samples
        if self.backend == "vllm":
            return self._vllm(prompt_ids, self.settings, n=n)
        repeated = [ids for ids in prompt_ids for _ in range(n)]  # rows grouped prompt by prompt
        texts = generate_texts(self.model, self.tokenizer, repeated, self.settings, batch_size=len(repeated))
        return [texts[i * n : (i + 1) * n] for i in range(len(prompt_ids))]


def _generation_rows(chunk: list[dict], prompt_ids: list[list[int]], generator: _Generator, reward_fn) -> list[dict]:
    prompts = [row["prompt"] for row in chunk]
    samples = generator(prompt_ids)
    n = generator.args.num_samples
    scores = None
    if reward_fn is not None:
        flat = reward_fn([p for p in prompts for _ in range(n)], [c for group in samples for c in group])
        scores = flat.view(len(prompts), n)
    out = []
    for i, row in enumerate(chunk):
        row = dict(row)
        if n > 1:
            row["completions"] = samples[i]
        if scores is not None:
            best = int(torch.argmax(scores[i]))
            if n > 1:
                row["scores"] = scores[i].tolist()
            row.update(completion=samples[i][best], score=float(scores[i, best]), best_index=best)
        elif n == 1:
            row["completion"] = samples[i][0]
        out.append(row)
    return out


def run_batch_inference(
    dataset,
    args: BatchInferenceArguments,
    *,
    model=None,
    tokenizer=None,
    reward_fn=None,
    model_path: str | None = None,
) -> dict[str, Any]:
    """Generate (or score) every row of ``dataset`` not yet in ``args.output_file`` and append the rows.

    Args:
        dataset: a `datasets.Dataset` with a ``prompt`` column (and ``args.response_column`` in scoring mode).
        args: the options.
        model: the policy (HF backend of the generation mode).
        tokenizer: the policy's tokenizer (generation mode); it must have a pad token.
        reward_fn: a :class:`~trl_ext.models.RewardFunction` (best-of-N, scoring mode), e.g. from
            :func:`load_reward_function`.
        model_path: the policy's folder or Hub id (vLLM backend).

    Returns:
        ``{"total", "already_done", "written", "output_file"}``.
    """
    if "prompt" not in dataset.column_names:
        raise ValueError(f"The dataset needs a 'prompt' column; it has {dataset.column_names}.")
    if args.max_prompts is not None:
        dataset = dataset.select(range(min(args.max_prompts, len(dataset))))
    scoring = args.mode == "score"
    if scoring:
        if reward_fn is None:
            raise ValueError("Scoring mode needs a reward (reward_fn=, or --reward_model_path).")
        if args.response_column not in dataset.column_names:
            raise ValueError(
                f"Scoring mode reads responses from --response_column {args.response_column!r}, which the dataset "
                f"does not have ({dataset.column_names})."
            )
    elif tokenizer is None:
        raise ValueError("Generation needs the policy's tokenizer (tokenizer=).")

    keys = row_keys(dataset, args.id_column)
    prompts = dataset["prompt"]
    responses = dataset[args.response_column] if scoring else None
    digests = [row_digest(p, responses[i]) if scoring else row_digest(p) for i, p in enumerate(prompts)]
    done = {} if args.overwrite else load_finished_rows(args.output_file)
    by_key = {k: i for i, k in enumerate(keys)}
    for key, row in done.items():
        i = by_key.get(key)
        if i is not None and row.get("digest") != digests[i]:
            raise ValueError(
                f"{args.output_file} holds a row with key {key} for another prompt than row {i} of this dataset: it "
                "was written for a different dataset or --id_column. Use another --output_file, or --overwrite."
            )
    pending = [i for i, k in enumerate(keys) if k not in done]
    already = len(keys) - len(pending)
    if already:
        logger.info("%s: %d of %d prompts already done; resuming.", args.output_file, already, len(keys))

    generator, token_ids = None, {}
    if not scoring and pending:
        from trl import is_conversational

        torch.manual_seed(args.seed)
        chat = args.use_chat_template or is_conversational({"prompt": prompts[pending[0]]})
        generator = _Generator(args, model, tokenizer, model_path, chat)
        ids = _prompt_token_ids([prompts[i] for i in pending], tokenizer, args.use_chat_template, args.progress)
        token_ids = dict(zip(pending, ids))

    from tqdm.auto import tqdm

    written = 0
    bar = tqdm(total=len(keys), initial=already, unit="prompt", desc=args.mode, disable=not args.progress)
    with JsonlWriter(args.output_file, overwrite=args.overwrite) as writer, bar:
        for start in range(0, len(pending), args.batch_size):
            index = pending[start : start + args.batch_size]
            chunk = [{"key": keys[i], "index": i, "digest": digests[i], "prompt": prompts[i]} for i in index]
            if scoring:
                scores = reward_fn([prompts[i] for i in index], [responses[i] for i in index])
                rows = [
                    {**row, "response": responses[i], "score": float(s)} for row, i, s in zip(chunk, index, scores)
                ]
            else:
                rows = _generation_rows(chunk, [token_ids[i] for i in index], generator, reward_fn)
            writer.write(rows)
            written += len(rows)
            bar.update(len(rows))
    return {"total": len(keys), "already_done": already, "written": written, "output_file": args.output_file}
