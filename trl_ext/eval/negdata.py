r"""Negative-data evaluation: how much probability does a policy still put on known-bad responses?

Input: the bad samples a harmlessness run collected (the JSONL of
:class:`~trl_ext.rollout.negdata.NegativeDataWriter`, rows ``{"prompt", "response", "reward", "step", "source"}``),
or any list / JSONL of ``{"prompt", "response"}``.
For each (prompt, response) pair :func:`eval_negative_data` computes

    log p(response | prompt) = Σ_t log p(y_t | prompt, y_<t)            (the response's tokens only)

and, grouping the rows by prompt, each prompt's mean log-prob and ``logsumexp`` — the log of the total probability
mass on the known-bad answers of that prompt — then the overall mean, the mean of the per-prompt means and the mean
of the per-prompt ``logsumexp`` (docs/algorithms.md §10.3).

Done properly, unlike the original:

- prompt and response are tokenised **separately** and concatenated as token ids, so the response boundary is exact
  (the original re-tokenised the joined text and assumed the last ``generate_max_len`` tokens were the response);
- rows are padded on either side (``padding_side``); positions come from the attention mask, so both sides give
  the same log-probs (to float round-off);
- identical (prompt, response) pairs are counted once (the original kept a set), so a bad answer sampled twice does
  not double its mass in the ``logsumexp``; ``num_duplicates_dropped`` says how many were dropped.

Texts are tokenised without adding special tokens by default: the trainer's JSONL keeps the special tokens in the
decoded texts (chat-template markers, an end-of-turn token ending the response), so they are already there.
Conversational prompts (message lists) get the tokenizer's chat template with the generation prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from ..ops.logprobs import logprobs_from_logits
from ..rollout import causal_lm_outputs
from ..rollout.negdata import read_negative_data
from ..utils import eval_mode
from .metrics import group_logprob_summary
from .report import write_json_report

__all__ = ["eval_negative_data", "load_negative_rows", "sequence_logprobs"]

PADDING_SIDES = ("left", "right")
REQUIRED_KEYS = ("prompt", "response")


# ------------------------------------------------------------------------------------------------ inputs
def load_negative_rows(rows_or_path) -> list[dict]:
    """The rows to evaluate: from a JSONL path (the trainer's negative-data file or any file of JSON objects), or
    from an iterable of mappings (a list of dicts, a `datasets.Dataset`). Every row needs ``prompt`` and
    ``response``."""
    if isinstance(rows_or_path, (str, os.PathLike)):
        path = os.fspath(rows_or_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No negative-data file at {path!r}; pass a JSONL path or a list of rows.")
        rows = read_negative_data(path)
    elif isinstance(rows_or_path, Mapping):
        raise ValueError("Pass a list of rows ({'prompt', 'response'} dicts) or a JSONL path, not a single dict.")
    elif isinstance(rows_or_path, Iterable):
        rows = [dict(row) if isinstance(row, Mapping) else row for row in rows_or_path]
    else:
        raise ValueError(f"rows_or_path must be a JSONL path or a list of rows; got {type(rows_or_path).__name__}.")
    if not rows:
        raise ValueError("No rows to evaluate: the file or list is empty.")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(
                f"Row {i} is a {type(row).__name__}; every row must be a dict with 'prompt' and 'response'."
            )
        missing = [key for key in REQUIRED_KEYS if key not in row]
        if missing:
            raise ValueError(
                f"Row {i} lacks {missing} (it has {sorted(row)}); every row needs 'prompt' and 'response'. Rename "
                "the columns of your data to these names."
            )
        if not isinstance(row["response"], str):
            raise ValueError(f"Row {i}: 'response' must be a string; got {type(row['response']).__name__}.")
    return rows


def _prompt_key(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def _prompt_text(prompt, tokenizer, chat_template: bool | None, index: int) -> tuple[str, bool]:
    """``(text, templated)``: the prompt as the model reads it."""
    conversational = isinstance(prompt, list)
    if not conversational and not isinstance(prompt, str):
        raise ValueError(f"Row {index}: 'prompt' must be a string or a list of chat messages; got {type(prompt)}.")
    if conversational and chat_template is False:
        raise ValueError(f"Row {index} has a conversational prompt but chat_template=False; use None or True.")
    if not (conversational or chat_template):
        return prompt, False
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("The tokenizer has no chat template; set `tokenizer.chat_template` or pass text prompts.")
    messages = prompt if conversational else [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True


# ------------------------------------------------------------------------------------------------ log-probs
def _batch(pairs: list[tuple[list[int], list[int]]], pad_id: int, padding_side: str):
    """``(input_ids, attention_mask, labels)`` of ``prompt + response`` rows; labels are the response ids at their
    positions and -100 elsewhere."""
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (p, r) in enumerate(pairs):
        n = len(p) + len(r)
        start = width - n if padding_side == "left" else 0
        ids[i, start : start + n] = torch.tensor(p + r, dtype=torch.long)
        mask[i, start : start + n] = 1
        labels[i, start + len(p) : start + n] = torch.tensor(r, dtype=torch.long)
    return ids, mask, labels


@torch.no_grad()
def sequence_logprobs(
    model: nn.Module,
    pairs: list[tuple[list[int], list[int]]],
    *,
    pad_token_id: int,
    padding_side: str = "left",
) -> torch.Tensor:
    """``(B,)`` fp32 ``Σ_t log p(y_t | prompt, y_<t)`` of each ``(prompt_ids, response_ids)`` pair, in one padded
    forward pass. Only the logits from the first response position on are computed when the model supports
    ``logits_to_keep`` (left padding keeps just ``max response length + 1`` positions)."""
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}; got {padding_side!r}.")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ids, mask, labels = _batch(pairs, pad_token_id, padding_side)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    width = ids.shape[1]
    first = int((labels != -100).float().argmax(-1).min())  # earliest response token of the batch
    keep = width - first + 1  # logits at positions first-1 … width-1 predict tokens first … width
    logits = causal_lm_outputs(model, ids, mask, keep).logits[:, -keep:]
    shifted = torch.cat([labels[:, width - keep + 1 :], torch.full_like(labels[:, :1], -100)], dim=1)
    return logprobs_from_logits(logits, shifted).sum(-1).float().cpu()


# ------------------------------------------------------------------------------------------------ the evaluation
def eval_negative_data(
    model: nn.Module,
    tokenizer,
    rows_or_path,
    *,
    batch_size: int = 16,
    padding_side: str = "left",
    chat_template: bool | None = None,
    add_special_tokens: bool = False,
    output_path: str | None = None,
    show_progress: bool = True,
    model_name: str | None = None,
) -> dict:
    """Log-probabilities of known-bad responses under ``model``, per response, per prompt and overall.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer (needs a pad token).
        rows_or_path: a JSONL path (e.g. the harmlessness trainer's ``save_negdata`` file) or a list of dicts with
            ``prompt`` (text or chat messages) and ``response`` (text); other keys (``reward``, ``step``,
            ``source``, ...) are copied into the per-row entries.
        batch_size: rows per forward pass.
        padding_side: ``"left"`` (default, computes fewer logits) or ``"right"``; both give the same values.
        chat_template: ``None``: chat-message prompts get the chat template, text prompts are used as they are;
            ``True``: text prompts are wrapped as one user turn too; ``False``: never (chat prompts then raise).
        add_special_tokens: let the tokenizer add its special tokens (e.g. BOS) to text prompts that are not
            templated; off by default because the trainer's texts already hold them.
        output_path: where to write the JSON report (``None``: not written).
        show_progress: a progress bar over the batches.
        model_name: the model's name in the report (default: its ``config._name_or_path``).

    Returns:
        The report: ``tool``, ``config``, ``num_rows_read``, ``num_duplicates_dropped``, ``summary`` (overall
        values), ``prompts`` (per prompt: ``num_responses``, ``mean_logprob``, ``logsumexp_logprob``) and ``rows``
        (per unique row: ``index`` in the input, ``logprob``, ``num_tokens``, ``mean_token_logprob``, and its
        fields).
    """
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}; got {padding_side!r}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer has no pad token; set one, e.g. `tokenizer.pad_token = tokenizer.eos_token`.")
    source = os.fspath(rows_or_path) if isinstance(rows_or_path, (str, os.PathLike)) else None
    rows = load_negative_rows(rows_or_path)

    unique, seen = [], set()
    for i, row in enumerate(rows):
        key = (_prompt_key(row["prompt"]), row["response"])
        if key not in seen:
            seen.add(key)
            unique.append((i, row))

    pairs = []
    for i, row in unique:
        text, templated = _prompt_text(row["prompt"], tokenizer, chat_template, i)
        prompt_ids = tokenizer(text, add_special_tokens=add_special_tokens and not templated)["input_ids"]
        response_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
        if not prompt_ids or not response_ids:
            raise ValueError(f"Row {i} has an empty {'prompt' if not prompt_ids else 'response'} after tokenisation.")
        pairs.append((list(prompt_ids), list(response_ids)))

    # Longest rows first, so that each batch holds rows of similar length (less padding); results keep input order.
    order = sorted(range(len(pairs)), key=lambda j: -(len(pairs[j][0]) + len(pairs[j][1])))
    logprobs = torch.zeros(len(pairs), dtype=torch.float32)
    starts = range(0, len(order), batch_size)
    with eval_mode(model):
        for s in tqdm(starts, desc="eval_negative_data", unit="batch", disable=not show_progress):
            chunk = order[s : s + batch_size]
            logprobs[chunk] = sequence_logprobs(
                model, [pairs[j] for j in chunk], pad_token_id=tokenizer.pad_token_id, padding_side=padding_side
            )

    keys = [_prompt_key(row["prompt"]) for _, row in unique]
    per_prompt, overall = group_logprob_summary(keys, logprobs.double().numpy())
    first_prompt = {}
    for _, row in unique:
        first_prompt.setdefault(_prompt_key(row["prompt"]), row["prompt"])
    entries = []
    for (i, row), (_, response_ids), value in zip(unique, pairs, logprobs.tolist()):
        extra = {k: v for k, v in row.items() if k not in REQUIRED_KEYS}
        entries.append(
            {
                "index": i,
                "prompt": row["prompt"],
                "response": row["response"],
                "logprob": value,
                "num_tokens": len(response_ids),
                "mean_token_logprob": value / len(response_ids),
                **extra,
            }
        )
    config = getattr(model, "config", None)
    report = {
        "tool": "eval_negative_data",
        "config": {
            "model": model_name or getattr(config, "_name_or_path", None) or type(model).__name__,
            "data": source,
            "batch_size": int(batch_size),
            "padding_side": padding_side,
            "chat_template": chat_template,
            "add_special_tokens": bool(add_special_tokens),
        },
        "num_rows_read": len(rows),
        "num_duplicates_dropped": len(rows) - len(unique),
        "summary": {
            "mean_logprob": overall["mean_logprob"],
            "mean_of_prompt_means": overall["mean_of_group_means"],
            "mean_of_prompt_logsumexp": overall["mean_of_group_logsumexp"],
            "num_responses": overall["num_values"],
            "num_prompts": overall["num_groups"],
        },
        "prompts": [
            {
                "prompt": first_prompt[p["group"]],
                "num_responses": p["count"],
                "mean_logprob": p["mean_logprob"],
                "logsumexp_logprob": p["logsumexp_logprob"],
            }
            for p in per_prompt
        ],
        "rows": entries,
        "notes": [
            "logprob = sum of log p over the response tokens (prompt and response tokenised separately).",
            "identical (prompt, response) pairs are counted once; logsumexp_logprob = log of the total probability "
            "of a prompt's known-bad responses.",
        ],
    }
    if output_path is not None:
        write_json_report(output_path, report)
    return report
