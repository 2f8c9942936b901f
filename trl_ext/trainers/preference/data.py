"""Preference datasets from the bad samples a harmlessness run collected (its negative-data JSON-lines file).

The harmlessness trainer (``negdata_path``, see :mod:`trl_ext.rollout.negdata`) writes one row per bad sample::

    {"prompt": "...", "response": "...", "reward": -7.1, "step": 12, "source": "proposal"}

- :func:`pairs_from_negative_data` turns them into DPO rows (``prompt``, ``chosen``, ``rejected``) with the bad
  response as ``rejected``; the chosen completion comes from a column of the rows, a ``{prompt: chosen}`` mapping,
  or a sample of a policy; or is left out for negative-only training (``prompt``, ``rejected``), which trl_ext's
  `DPOTrainer` trains with ``extra_loss="negative_dpo"`` or ``"unlikelihood"``.
- :func:`unpaired_from_negative_data` turns them into KTO rows (``prompt``, ``completion``, ``label=False``), with
  optional desirable rows (``label=True``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ...rollout.negdata import read_negative_data

__all__ = ["pairs_from_negative_data", "unpaired_from_negative_data"]

_REQUIRED = ("prompt", "response")


def _load_rows(rows_or_path, what: str = "negative data") -> list[dict]:
    """Rows from a JSONL path, a list of dicts or a `datasets.Dataset`; a clear error for anything else."""
    if isinstance(rows_or_path, (str, os.PathLike)):
        path = os.fspath(rows_or_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"No {what} file at {path!r}: pass the JSONL file a harmlessness run wrote (its `negdata_path`)."
            )
        rows = read_negative_data(path)
    elif isinstance(rows_or_path, Iterable) and not isinstance(rows_or_path, (Mapping, bytes)):
        rows = list(rows_or_path)
    else:
        raise TypeError(
            f"Expected a JSONL path, a list of dicts or a datasets.Dataset of {what}, got "
            f"{type(rows_or_path).__name__}."
        )
    if not rows:
        raise ValueError(f"The {what} is empty: there are no rows to build a dataset from.")
    return rows


def _check_keys(rows: list[dict], required: Iterable[str], what: str) -> None:
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"{what} row {i} is a {type(row).__name__}, not a dict.")
        missing = [key for key in required if key not in row or row[key] is None]
        if missing:
            raise ValueError(
                f"{what} row {i} has no {', '.join(repr(k) for k in missing)} (its keys: {sorted(row)}); every row "
                f"needs {', '.join(repr(k) for k in required)}."
            )


def _strip_added_bos(text: str, tokenizer) -> str:
    """Drop a leading BOS string that the tokenizer would add again when TRL tokenises the prompt.

    The negative-data writer decodes prompts with their special tokens, so a prompt tokenised with a BOS starts with
    the BOS text; TRL's DPO/KTO tokenise prompts with ``add_special_tokens=True`` and would then see two BOS tokens.
    """
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not text.startswith(bos):
        return text
    ids = tokenizer("x")["input_ids"]
    return text[len(bos) :] if ids and ids[0] == tokenizer.bos_token_id else text


def _sample_chosen(
    prompts: list[str], policy, tokenizer, *, max_new_tokens: int, temperature: float, batch_size: int, seed: int
) -> list[str]:
    """One sampled completion per prompt (decoded with special tokens, like the negative data's responses)."""
    from ...rollout import SamplingSettings, generate_responses

    if tokenizer is None:
        raise ValueError("Sampling chosen completions from `policy` needs its `tokenizer`; pass tokenizer=...")
    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer has no pad token; set `tokenizer.pad_token = tokenizer.eos_token` first.")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and batch_size={batch_size} must both be >= 1.")
    eos = tokenizer.eos_token_id
    settings = SamplingSettings(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        temperature=temperature,
        stop_token_ids=(eos,) if eos is not None else None,
        eos_token_id=eos,
    )
    device = next(policy.parameters()).device
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]  # the text holds its specials
    width = max(len(ids) for ids in encoded)
    prompt_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, ids in enumerate(encoded):  # left padding, as generation needs
        if ids:
            prompt_ids[i, width - len(ids) :] = torch.tensor(ids)
            prompt_mask[i, width - len(ids) :] = 1
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        responses, mask, _ = generate_responses(
            policy, prompt_ids.to(device), prompt_mask.to(device), settings, batch_size
        )
    return [tokenizer.decode(r[m != 0].tolist(), skip_special_tokens=False) for r, m in zip(responses, mask)]


def pairs_from_negative_data(
    rows_or_path,
    *,
    chosen_column: str | Mapping[str, Any] | None = None,
    policy=None,
    tokenizer=None,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    batch_size: int = 16,
    seed: int = 0,
    strip_bos: bool = True,
):
    """A DPO dataset whose ``rejected`` completions are the bad samples of a negative-data file.

    Args:
        rows_or_path: the negative-data JSONL path (read with `read_negative_data`), or its rows (dicts with at least
            ``prompt`` and ``response``; a `datasets.Dataset` works too).
        chosen_column: where the chosen completions come from: the name of a column of the rows (e.g. a safe answer
            stored next to each bad one), or a mapping ``{prompt: chosen}`` (every prompt must be in it).
        policy: otherwise, a causal LM to sample one chosen completion per row from (with ``tokenizer``), with
            `trl_ext.rollout.generator.generate_responses`: up to ``max_new_tokens`` tokens at ``temperature``,
            ``batch_size`` prompts at a time, torch seeded with ``seed`` (the global RNG state is restored after).
            The sample is only the policy's own behaviour: it is not checked to be good, so score it (or use a
            stronger model) if that matters.
        tokenizer: the tokenizer of the model to be trained; with ``strip_bos`` a leading BOS string is removed from
            prompts when the tokenizer adds one itself (TRL would otherwise tokenise two).
        strip_bos: see ``tokenizer``.

    With neither ``chosen_column`` nor ``policy`` the dataset has ``prompt`` and ``rejected`` only: negative-only
    training, which trl_ext's `DPOTrainer` runs with ``extra_loss="negative_dpo"`` or ``"unlikelihood"`` (and
    refuses otherwise).

    Returns:
        a `datasets.Dataset` with columns ``prompt``, ``chosen``, ``rejected`` (or ``prompt``, ``rejected``).

    Raises:
        ValueError: a row misses ``prompt``/``response`` or the chosen column, a prompt is not in the mapping, or both
            ``chosen_column`` and ``policy`` are given.
    """
    from datasets import Dataset

    rows = _load_rows(rows_or_path)
    _check_keys(rows, _REQUIRED, "Negative-data")
    if chosen_column is not None and policy is not None:
        raise ValueError("Pass either chosen_column (given chosen completions) or policy (sample them), not both.")
    prompts = [row["prompt"] for row in rows]
    rejected = [row["response"] for row in rows]
    chosen = None
    if isinstance(chosen_column, str):
        _check_keys(rows, (chosen_column,), "Negative-data")
        chosen = [row[chosen_column] for row in rows]
    elif isinstance(chosen_column, Mapping):
        missing = sorted({p for p in prompts if p not in chosen_column})
        if missing:
            raise ValueError(
                f"The chosen mapping has no completion for {len(missing)} prompt(s), e.g. {missing[0]!r}; add them "
                "or drop those rows."
            )
        chosen = [chosen_column[p] for p in prompts]
    elif chosen_column is not None:
        raise TypeError(f"chosen_column must be a column name or a {{prompt: chosen}} mapping, got {chosen_column!r}.")
    elif policy is not None:
        chosen = _sample_chosen(
            prompts,
            policy,
            tokenizer,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            batch_size=batch_size,
            seed=seed,
        )
    if strip_bos and tokenizer is not None:
        prompts = [_strip_added_bos(p, tokenizer) for p in prompts]
    columns = {"prompt": prompts}
    if chosen is not None:
        columns["chosen"] = chosen
    columns["rejected"] = rejected
    return Dataset.from_dict(columns)


def unpaired_from_negative_data(rows_or_path, desirable=None, *, tokenizer=None, strip_bos: bool = True):
    """A KTO dataset (``prompt``, ``completion``, ``label``) of the bad samples, with optional desirable rows.

    Args:
        rows_or_path: the negative-data JSONL path or its rows (``prompt`` and ``response`` each); they become
            ``label=False`` rows.
        desirable: optional ``label=True`` rows: a mapping ``{prompt: completion}``, or rows (dicts or a
            `datasets.Dataset`) with ``prompt`` and ``completion``. Without them every row is undesirable, which
            TRL's KTO loss handles (it then only pushes those completions down).
        tokenizer, strip_bos: as in :func:`pairs_from_negative_data`.

    Raises:
        ValueError: a row misses a required key.
    """
    from datasets import Dataset

    rows = _load_rows(rows_or_path)
    _check_keys(rows, _REQUIRED, "Negative-data")
    prompts = [row["prompt"] for row in rows]
    completions = [row["response"] for row in rows]
    labels = [False] * len(rows)
    if desirable is not None:
        if isinstance(desirable, Mapping):
            good = [{"prompt": p, "completion": c} for p, c in desirable.items()]
        else:
            good = _load_rows(desirable, "desirable rows")
            _check_keys(good, ("prompt", "completion"), "Desirable")
        prompts += [row["prompt"] for row in good]
        completions += [row["completion"] for row in good]
        labels += [True] * len(good)
    if strip_bos and tokenizer is not None:
        prompts = [_strip_added_bos(p, tokenizer) for p in prompts]
    return Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels})
