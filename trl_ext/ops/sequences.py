"""Index and mask helpers for padded token sequences.

Masks are integer or boolean tensors whose non-zero entries mark real tokens. Nothing here looks at pad or EOS token
ids to find where a sequence ends: positions are read from the mask, so the helpers work for left and right padding
and when ``pad_token_id == eos_token_id``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

__all__ = [
    "distinct_prompts",
    "extend_mask_past_last",
    "group_rows",
    "last_token_index",
    "first_true_index",
    "TruncatedResponses",
    "truncate_after_stop_token",
    "response_mask_from_eos",
    "position_ids_from_attention_mask",
]


def last_token_index(attention_mask: torch.Tensor, allow_empty: bool = False) -> torch.Tensor:
    """Index of the last real token of each row: ``idx_b = max{t : mask[b, t] ≠ 0}``.

    Works for any padding side (and for real tokens anywhere in the row), because it only reads the mask. For a
    right-padded row ``[a, b, eos, eos, eos]`` with mask ``[1, 1, 1, 0, 0]`` (pad == eos) it returns ``2``.

    Args:
        attention_mask: ``(B, T)`` mask (or ``(..., T)``; the last dimension is the sequence).
        allow_empty: rows without any real token raise a ``ValueError`` unless this is ``True``, in which case they
            get ``-1``.

    Returns:
        ``(B,)`` (resp. ``(...)``) ``int64`` indices.
    """
    T = attention_mask.shape[-1]
    positions = torch.arange(T, device=attention_mask.device).expand(attention_mask.shape)
    idx = torch.where(attention_mask != 0, positions, torch.full_like(positions, -1)).amax(dim=-1)
    if not allow_empty and bool((idx < 0).any()):
        rows = (idx < 0).nonzero().flatten()[:5].tolist()
        raise ValueError(f"Rows without any real token in the mask (e.g. rows {rows}); cannot locate the last token.")
    return idx


def first_true_index(bools: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Index of the first ``True`` (non-zero) entry along ``dim``, or the length of ``dim`` when there is none.

    Args:
        bools: tensor of any shape (bool or numeric; non-zero counts as ``True``).
        dim: dimension to search.

    Returns:
        ``int64`` tensor with ``dim`` removed.
    """
    n = bools.shape[dim]
    moved = bools.movedim(dim, -1) != 0
    if n == 0:
        return torch.zeros(moved.shape[:-1], dtype=torch.long, device=bools.device)
    positions = torch.arange(n, device=bools.device).expand(moved.shape)
    return torch.where(moved, positions, torch.full_like(positions, n)).amin(dim=-1)


class TruncatedResponses(NamedTuple):
    """Result of :func:`truncate_after_stop_token`."""

    responses: torch.Tensor
    """``(B, T)`` token ids with every token after the first stop token replaced by the pad id."""
    mask: torch.Tensor
    """``(B, T)`` ``int64`` mask: ``1`` up to and including the first stop token, ``0`` after it."""


def _stop_ids_tensor(stop_token_id: int | Iterable[int], device: torch.device) -> torch.Tensor:
    ids = [int(stop_token_id)] if isinstance(stop_token_id, int) else [int(i) for i in stop_token_id]
    if not ids:
        raise ValueError("stop_token_id must be an id or a non-empty collection of ids.")
    return torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)


def response_mask_from_eos(responses: torch.Tensor, eos_token_id: int | Iterable[int]) -> torch.Tensor:
    """Response mask ``m_t = 1[t ≤ first stop index]`` for right-aligned generated tokens.

    The first stop (EOS) token is part of the response (its log-prob counts, as in docs/algorithms.md §2); everything
    after it is masked. Rows without a stop token are fully unmasked (truncated at the length limit).

    Args:
        responses: ``(B, T)`` generated token ids (the prompt removed).
        eos_token_id: one id or a collection of stop ids.

    Returns:
        ``(B, T)`` ``int64`` mask.
    """
    is_stop = torch.isin(responses, _stop_ids_tensor(eos_token_id, responses.device))
    first = first_true_index(is_stop, dim=-1)
    positions = torch.arange(responses.shape[-1], device=responses.device)
    return (positions <= first.unsqueeze(-1)).long()


def truncate_after_stop_token(
    responses: torch.Tensor, stop_token_id: int | Iterable[int], pad_token_id: int
) -> TruncatedResponses:
    """Replace every token *after* the first stop token by ``pad_token_id``; the stop token itself is kept.

    ``out_t = responses_t`` if ``t ≤ s`` else ``pad_token_id``, with ``s`` the index of the first token in
    ``stop_token_id`` (``s = T`` when the row has none). Works when ``pad_token_id`` is itself a stop id.

    Args:
        responses: ``(B, T)`` generated token ids.
        stop_token_id: one id or a list/set of ids (e.g. EOS and an end-of-turn token).
        pad_token_id: id written after the stop token.

    Returns:
        :class:`TruncatedResponses` ``(responses, mask)``; the input is not modified.
    """
    mask = response_mask_from_eos(responses, stop_token_id)
    pad = torch.full_like(responses, int(pad_token_id))
    return TruncatedResponses(torch.where(mask.bool(), responses, pad), mask)


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a (left- or right-) padded batch: ``cumsum(mask) − 1`` on real tokens, ``1`` on pads.

    The value on pads is irrelevant to attention; ``1`` is the convention of ``transformers`` generation.

    Args:
        attention_mask: ``(B, T)``.

    Returns:
        ``(B, T)`` ``int64`` position ids.
    """
    real = attention_mask != 0
    pos = real.long().cumsum(dim=-1) - 1
    return torch.where(real, pos, torch.ones_like(pos))


def group_rows(
    x: torch.Tensor, *, samples_per_prompt: int | None = None, num_prompts: int | None = None, what: str = "tensor"
) -> torch.Tensor:
    """``(B, ...)`` rows ordered prompt by prompt (the N samples of a prompt adjacent) → ``(P, N, ...)``.

    Give exactly one of ``samples_per_prompt`` (N) and ``num_prompts`` (P); ``B`` must be a multiple of it, else a
    ``ValueError`` names ``what``. A view when ``x`` is contiguous.
    """
    if (samples_per_prompt is None) == (num_prompts is None):
        raise ValueError("group_rows: give exactly one of samples_per_prompt and num_prompts.")
    rows, size = x.shape[0], samples_per_prompt or num_prompts
    if size <= 0 or rows % size:
        unit = "samples per prompt" if samples_per_prompt else "prompts of the batch"
        raise ValueError(f"{what} has {rows} rows, not a multiple of the {size} {unit}.")
    if samples_per_prompt is not None:
        return x.reshape(rows // size, size, *x.shape[1:])
    return x.reshape(size, rows // size, *x.shape[1:])


def extend_mask_past_last(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with one more valid position right after each row's last valid one (when it is inside the row).

    TRL ≤ 1.12's PPO put the score one position after the last response token (``sequence_lengths + 1``, kept in
    range) and trained the value there too (its ``padding_mask_p1``); this is that mask. A row with no valid position
    stays empty. Only the position after the *last* valid one is added, also when the valid positions are not one
    block (e.g. ``[0, 1, 0, 1, 0] → [0, 1, 0, 1, 1]``).
    """
    keep = mask != 0
    last = last_token_index(mask, allow_empty=True)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    after = (positions == (last + 1).unsqueeze(-1)) & (last >= 0).unsqueeze(-1)
    return (keep | after).to(mask.dtype)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """``(ids, mask, inverse)`` of the distinct rows of the ``(B, P)`` prompts (``ids[inverse] == prompt_ids``), or
    ``None`` when every row is distinct (nothing to share). Rows count as equal when their ids *and* masks are."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if unique.shape[0] == rows.shape[0]:
        return None
    P = prompt_ids.shape[1]
    return unique[:, :P], unique[:, P:].to(prompt_mask.dtype), inverse
