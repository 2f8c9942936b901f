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

    {"key": "3", "index": 3, "digest": "…", "run_id": "…", "prompt": …, "completion": "…", "score": 0.41,
     "completions": ["…", …], "scores": [0.41, …], "best_index": 0}

``completions``/``scores`` hold every sample (when ``num_samples > 1``), ``completion``/``score``/``best_index`` the
chosen one (``completion`` is the only sample when ``num_samples == 1``; with several samples and no reward model
there is no choice, so only ``completions`` is written). Scoring mode writes ``prompt``, ``response`` and ``score``.

Context: in generation mode, every prompt plus ``max_new_tokens`` must fit the policy's positions
(``max_position_embeddings``), as in the trainers; otherwise nothing is generated or written and the error says how
long the prompts may be.

Metadata: before the first row, ``<output_file>.meta.json`` is written (atomically) with the format version, a run id
and every setting that changes the rows (mode, model, backend, samples, sampling settings, seed, reward, chat
template, id column); the JSONL itself stays a plain file of rows. Each row carries the ``run_id``.

Resuming: ``key`` is the value of ``id_column`` (when given) or the row index. Running the same command again after an
interruption finishes the job (a finished job generates nothing), and refuses rather than guesses:

- an existing output file without our metadata (not written by batch inference) is refused and left untouched;
- a setting that changes the rows differs from the metadata's: refused, naming the settings;
- a row with another run id, or a row whose ``digest`` (a hash of the prompt, and of the response in scoring mode)
  does not match the dataset row with the same key: refused (another run's or another dataset's file);
- only then, a last line cut off by a kill mid-write (no final newline, or not valid JSON) is removed.

``--overwrite`` starts afresh (and is the way to reuse a file batch inference did not write).

Reproducibility: the prompts are processed in fixed chunks of ``batch_size`` consecutive rows, and each chunk's
sampling is seeded from ``(seed, first row of the chunk)`` (vLLM: each prompt from ``(seed, row)``). A resumed run
regenerates a chunk that was cut short and appends only its missing rows, so with the same settings (and
``batch_size``) the finished file is byte for byte the file of an uninterrupted run. Changing ``batch_size`` on
resume is allowed (e.g. after running out of memory): the new rows are drawn with the same settings, but not with the
random numbers an uninterrupted run would have used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..rollout.context import check_prompts_fit_context
from .generation import BACKENDS, VLLMGenerator, generate_texts, resolve_backend, sampling_settings, stop_token_ids
from .output_file import (
    FORMAT,
    FORMAT_VERSION,
    JsonlWriter,
    check_settings,
    derived_seed,
    load_finished_rows,
    metadata_path,
    read_metadata,
    row_digest,
    scan_rows,
    write_metadata,
)

__all__ = [
    "BatchInferenceArguments",
    "JsonlWriter",
    "check_settings",
    "derived_seed",
    "load_finished_rows",
    "load_reward_function",
    "metadata_path",
    "read_metadata",
    "row_digest",
    "row_keys",
    "run_batch_inference",
    "run_settings",
    "write_metadata",
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

    url_options: ClassVar[tuple[str, ...]] = ("reward_model_path",)  # may be a reward server's URL

    output_file: str = field(
        default="outputs/batch_inference.jsonl",
        metadata={"help": "JSONL file to write (appended to; prompts already in it are skipped). Its settings and run "
                  "id go to <output_file>.meta.json; a file batch inference did not write is refused."},
    )  # fmt: skip
    overwrite: bool = field(
        default=False,
        metadata={"help": "Start the output file afresh instead of resuming (also replaces a file batch inference "
                  "did not write, or one written with other settings)."},
    )  # fmt: skip
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
        default=8,
        metadata={"help": "Prompts per chunk; each chunk is generated, scored and written together, its sampling "
                  "seeded from (--seed, its first row). Resume with the same value for a byte-identical file."},
    )  # fmt: skip
    use_chat_template: bool = field(
        default=False,
        metadata={"help": "Render plain-text prompts as a user message with the chat template (conversational "
                  "prompts always use it)."},
    )  # fmt: skip
    stop_tokens: list[str] | None = field(
        default=None, metadata={"help": "Extra tokens that end a response (the eos and end-of-turn tokens always do)."}
    )
    seed: int = field(
        default=0, metadata={"help": "Random seed of the sampling (each chunk is seeded from it and its first row)."}
    )
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


def _local_path(path: str | None) -> str | None:
    """An existing local path made absolute (so relative and absolute spellings match); anything else as is."""
    return os.path.abspath(path) if path and os.path.exists(path) else path


def run_settings(
    args: BatchInferenceArguments,
    *,
    backend: str | None = None,
    model=None,
    model_path: str | None = None,
    model_revision: str | None = None,
    reward_fn=None,
) -> dict[str, Any]:
    """The settings that change the rows of a run, as recorded in the metadata and compared on resume.

    The batch sizes and the progress bar are not among them (a resumed run may change them); neither is the prompt
    set, which is checked row by row (a run may be extended to more prompts)."""
    reward = None
    if reward_fn is not None:
        reward = args.reward_model_path
        if reward is None or not reward.startswith(("http://", "https://")):
            reward = _local_path(reward) or getattr(reward_fn, "name", type(reward_fn).__name__)
    common = {
        "mode": args.mode,
        "id_column": args.id_column,
        "reward": reward,
        "reward_max_length": args.reward_max_length,
        "reward_use_chat_template": args.reward_use_chat_template,
    }
    if args.mode == "score":
        return {**common, "response_column": args.response_column}
    if model_path is None and model is not None:
        model_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    param = next(model.parameters(), None) if model is not None else None
    sampling = args.temperature > 0
    return {
        **common,
        "model": _local_path(model_path),
        "model_revision": model_revision,
        "model_dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
        "backend": backend,
        "num_samples": args.num_samples,
        "max_new_tokens": args.max_new_tokens,
        "temperature": float(args.temperature),
        "top_k": (args.top_k or None) if sampling else None,  # sampling-only settings do not matter when greedy
        "top_p": float(args.top_p) if sampling else None,
        "seed": args.seed if sampling else None,
        "stop_tokens": sorted(args.stop_tokens or []),
        "use_chat_template": args.use_chat_template,
    }


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


def _model_config(model_path: str | None, revision: str | None = None):
    """An object whose ``config`` is the policy's config, read from ``model_path`` (the vLLM backend loads no
    model here); ``None`` when it cannot be read (vLLM then applies its own limit)."""
    if model_path is None:
        return None
    from types import SimpleNamespace

    from transformers import AutoConfig

    try:
        return SimpleNamespace(config=AutoConfig.from_pretrained(model_path, revision=revision))
    except (OSError, ValueError):
        return None


class _Generator:
    """``n`` responses per prompt from HF ``generate`` or vLLM."""

    def __init__(self, args: BatchInferenceArguments, model, tokenizer, model_path: str | None, chat: bool, backend):
        self.args, self.model, self.tokenizer, self.backend = args, model, tokenizer, backend
        stops = stop_token_ids(tokenizer, model, args.stop_tokens or (), chat=chat)
        self.settings = sampling_settings(
            tokenizer,
            stops,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
        )
        if backend == "vllm":
            if model_path is None:
                raise ValueError("The vLLM backend needs the model's path (model_path=).")
            self._vllm = VLLMGenerator(model_path, seed=args.seed)
        elif model is None:
            raise ValueError("Generation with HF generate needs the policy model (model=).")

    def __call__(self, prompt_ids: list[list[int]], index: list[int]) -> list[list[str]]:
        """The samples of the prompts at dataset rows ``index``. HF: run under the chunk's seed (set by the caller);
        vLLM: each prompt seeded from ``(seed, row)``."""
        n = self.args.num_samples
        if self.backend == "vllm":
            seeds = [derived_seed(self.args.seed, i) for i in index]
            return self._vllm(prompt_ids, self.settings, n=n, seeds=seeds)
        repeated = [ids for ids in prompt_ids for _ in range(n)]  # rows grouped prompt by prompt
        texts = generate_texts(self.model, self.tokenizer, repeated, self.settings, batch_size=len(repeated))
        return [texts[i * n : (i + 1) * n] for i in range(len(prompt_ids))]


def _generation_rows(chunk: list[dict], prompt_ids: list[list[int]], generator: _Generator, reward_fn) -> list[dict]:
    prompts = [row["prompt"] for row in chunk]
    samples = generator(prompt_ids, [row["index"] for row in chunk])
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


@contextlib.contextmanager
def _seeded(seed: int, model=None):
    """Run the block from torch seed ``seed`` and restore the caller's random state afterwards."""
    param = next(model.parameters(), None) if model is not None else None
    devices = [param.device] if param is not None and param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _open_output(args: BatchInferenceArguments, settings: dict, digests: list[str], keys: list[str]):
    """``(run_id, finished rows by key, resuming)`` of the output file, after every check, so that nothing is
    modified unless the file is ours and matches this run; a torn last line of our own file is removed. A fresh run
    writes the metadata."""
    path, meta_file = os.fspath(args.output_file), metadata_path(args.output_file)
    exists = os.path.exists(path)
    fresh = args.overwrite or not exists or (os.path.getsize(path) == 0 and not os.path.exists(meta_file))
    if fresh:
        run_id = uuid.uuid4().hex
        write_metadata(
            path,
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "run_id": run_id,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "settings": settings,
                "batch_size": args.batch_size,  # not binding: a resumed run may change it (see the module notes)
                "prompts": {"rows": len(keys), "fingerprint": row_digest(digests)},
            },
        )
        return run_id, {}, False
    meta = read_metadata(path)
    check_settings(path, meta["settings"], settings)
    run_id = meta["run_id"]
    done, complete_bytes, torn_bytes = scan_rows(path, run_id)
    by_key = {k: i for i, k in enumerate(keys)}
    for key, row in done.items():
        i = by_key.get(key)
        if i is not None and row.get("digest") != digests[i]:
            raise ValueError(
                f"{path} holds a row with key {key} for another prompt than row {i} of this dataset: it was written "
                "for a different dataset or --id_column. The file is left untouched; use another --output_file, or "
                "--overwrite."
            )
    if meta.get("batch_size") != args.batch_size:
        logger.warning(
            "%s was started with --batch_size %s, resumed with %s: the new rows are drawn with the same settings but "
            "will not be byte-identical to those of an uninterrupted run.",
            path,
            meta.get("batch_size"),
            args.batch_size,
        )
    if torn_bytes:
        logger.warning("%s: removing a torn last line (%d bytes) left by an interrupted run.", path, torn_bytes)
        with open(path, "r+b") as f:
            f.truncate(complete_bytes)
    return run_id, done, True


def run_batch_inference(
    dataset,
    args: BatchInferenceArguments,
    *,
    model=None,
    tokenizer=None,
    reward_fn=None,
    model_path: str | None = None,
    model_revision: str | None = None,
) -> dict[str, Any]:
    """Generate (or score) every row of ``dataset`` not yet in ``args.output_file`` and append the rows.

    Args:
        dataset: a `datasets.Dataset` with a ``prompt`` column (and ``args.response_column`` in scoring mode).
        args: the options.
        model: the policy (HF backend of the generation mode).
        tokenizer: the policy's tokenizer (generation mode); it must have a pad token.
        reward_fn: a :class:`~trl_ext.models.RewardFunction` (best-of-N, scoring mode), e.g. from
            :func:`load_reward_function`.
        model_path: the policy's folder or Hub id (vLLM backend; recorded in the metadata).
        model_revision: the policy's Hub revision (recorded in the metadata).

    Returns:
        ``{"total", "already_done", "written", "output_file"}``.

    Raises:
        ValueError: the output file exists and was not written by batch inference, was written with other settings,
            by another run or for another dataset (the file is then left untouched); or (generation) the longest
            prompt plus ``max_new_tokens`` needs more positions than the policy has, checked as the trainers check
            ``response_length`` (:func:`~trl_ext.rollout.context.check_prompts_fit_context`), before the
            output file is touched.
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
    backend = None if scoring else resolve_backend(args.backend)
    settings = run_settings(
        args, backend=backend, model=model, model_path=model_path, model_revision=model_revision, reward_fn=reward_fn
    )
    all_ids = None
    if not scoring:  # before the output file is touched: prompt + max_new_tokens must fit the policy's context
        all_ids = _prompt_token_ids(prompts, tokenizer, args.use_chat_template, args.progress)
        policy = model if model is not None else _model_config(model_path, model_revision)
        check_prompts_fit_context(all_ids, policy, args.max_new_tokens, "the prompts", option="--max_new_tokens")
    run_id, done, resuming = _open_output(args, settings, digests, keys)

    # Fixed chunks of consecutive rows: a chunk with a missing row is redone whole (same rows, same seed) and only its
    # missing rows are written, so a resumed file equals an uninterrupted run's.
    chunks = [range(s, min(s + args.batch_size, len(keys))) for s in range(0, len(keys), args.batch_size)]
    chunks = [c for c in chunks if any(keys[i] not in done for i in c)]
    already = sum(k in done for k in keys)
    if already:
        logger.info("%s: %d of %d prompts already done; resuming.", args.output_file, already, len(keys))

    generator, token_ids = None, {}
    if not scoring and chunks:
        from trl import is_conversational

        chat = args.use_chat_template or is_conversational({"prompt": prompts[0]})
        generator = _Generator(args, model, tokenizer, model_path, chat, backend)
        token_ids = {i: all_ids[i] for c in chunks for i in c}

    from tqdm.auto import tqdm

    written = 0
    bar = tqdm(total=len(keys), initial=already, unit="prompt", desc=args.mode, disable=not args.progress)
    with JsonlWriter(args.output_file, overwrite=not resuming) as writer, bar:
        for index in chunks:
            chunk = [
                {"key": keys[i], "index": i, "digest": digests[i], "run_id": run_id, "prompt": prompts[i]}
                for i in index
            ]
            with _seeded(derived_seed(args.seed, index[0]), model):
                if scoring:
                    scores = reward_fn([prompts[i] for i in index], [responses[i] for i in index])
                    rows = [
                        {**row, "response": responses[i], "score": float(s)} for row, i, s in zip(chunk, index, scores)
                    ]
                else:
                    rows = _generation_rows(chunk, [token_ids[i] for i in index], generator, reward_fn)
            rows = [row for row in rows if row["key"] not in done]
            writer.write(rows)
            written += len(rows)
            bar.update(len(rows))
    return {"total": len(keys), "already_done": already, "written": written, "output_file": args.output_file}
