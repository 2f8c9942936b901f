"""Helpers for packed ("padding-free") batches: several sequences concatenated along one token dimension.

A packed batch of ``B`` sequences with lengths ``L_1..L_B`` is a tensor of ``total = Σ L_b`` tokens, described by
either the lengths or the cumulative offsets ``cu_seqlens = [0, L_1, L_1+L_2, ..., total]`` (``int32``, the format
flash-attention's varlen kernels take). Position ids restart at 0 for every sequence, which is how
``transformers`` detects packed inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "cu_seqlens_from_lengths",
    "lengths_from_cu_seqlens",
    "packed_position_ids",
    "pack_sequences",
    "pack_padded",
    "unpack_values",
]


def _as_lengths(seq_lengths: torch.Tensor | Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    lengths = torch.as_tensor(seq_lengths, dtype=torch.long, device=device)
    if lengths.dim() != 1:
        raise ValueError(f"seq_lengths must be 1-D, got shape {tuple(lengths.shape)}.")
    if bool((lengths < 0).any()):
        raise ValueError("seq_lengths must be non-negative.")
    return lengths


def cu_seqlens_from_lengths(seq_lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``cu_seqlens = [0, L_1, L_1 + L_2, ..., Σ L]`` as ``int32`` of shape ``(B + 1,)``."""
    lengths = _as_lengths(seq_lengths)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`cu_seqlens_from_lengths`: ``L_b = cu[b+1] − cu[b]`` as ``int64`` ``(B,)``."""
    cu = torch.as_tensor(cu_seqlens).long()
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError("cu_seqlens must be a 1-D non-decreasing tensor starting at 0.")
    return cu.diff()


def packed_position_ids(
    seq_lengths: torch.Tensor | Sequence[int] | None = None, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Position ids of a packed batch: ``[0..L_1−1, 0..L_2−1, ...]``, shape ``(total,)`` ``int64``.

    Give exactly one of ``seq_lengths`` (``(B,)``) or ``cu_seqlens`` (``(B + 1,)``). Add a leading batch dimension
    with ``.unsqueeze(0)`` for a model forward.
    """
    if (seq_lengths is None) == (cu_seqlens is None):
        raise ValueError("Pass exactly one of seq_lengths or cu_seqlens.")
    lengths = _as_lengths(seq_lengths) if seq_lengths is not None else lengths_from_cu_seqlens(cu_seqlens)
    starts = lengths.cumsum(0) - lengths
    total = int(lengths.sum())
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths)


def pack_sequences(sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate ``B`` tensors of shapes ``(L_b, ...)`` into ``(Σ L_b, ...)``; return ``(packed, cu_seqlens)``."""
    if len(sequences) == 0:
        raise ValueError("pack_sequences needs at least one sequence.")
    lengths = [int(s.shape[0]) for s in sequences]
    return torch.cat(list(sequences), dim=0), cu_seqlens_from_lengths(lengths).to(sequences[0].device)


def pack_padded(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the real tokens of a padded batch: ``(B, T, ...)`` values with a ``(B, T)`` mask → ``(Σ m, ...)``.

    Tokens keep their order within each row and rows follow each other; works for any padding side.

    Returns:
        ``(packed, cu_seqlens)`` with ``cu_seqlens`` ``int32`` ``(B + 1,)``.
    """
    if mask.dim() != 2 or values.shape[:2] != mask.shape:
        raise ValueError(
            f"values must be (B, T, ...) with mask (B, T); got {tuple(values.shape)}, {tuple(mask.shape)}."
        )
    keep = mask != 0
    return values[keep], cu_seqlens_from_lengths(keep.sum(dim=1))


def unpack_values(
    packed: torch.Tensor,
    seq_lengths: torch.Tensor | Sequence[int],
    padding_value: float = 0,
    padding_side: str = "right",
    as_list: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | list[torch.Tensor]:
    """Split a packed ``(total,)`` / ``(1, total)`` / ``(total, ...)`` tensor back into sequences.

    Args:
        packed: packed values; a leading batch dimension of size 1 (``(1, total, ...)``) is removed first.
        seq_lengths: ``(B,)`` lengths with ``Σ L_b = total``.
        padding_value: value written at padded positions.
        padding_side: ``"right"`` (real tokens first) or ``"left"``.
        as_list: return a list of ``B`` tensors ``(L_b, ...)`` instead.

    Returns:
        ``(padded, mask)`` with ``padded`` of shape ``(B, max L, ...)`` and ``mask`` ``(B, max L)`` ``int64``
        (``1`` on real tokens); or the list when ``as_list=True``.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    lengths = _as_lengths(seq_lengths, device=packed.device)
    if packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[1] == int(lengths.sum()):
        packed = packed[0]
    total = int(lengths.sum())
    if packed.shape[0] != total:
        raise ValueError(f"packed has {packed.shape[0]} tokens but the lengths sum to {total}.")
    if as_list:
        return list(packed.split(lengths.tolist(), dim=0))
    B = lengths.numel()
    max_len = int(lengths.max()) if B else 0
    rows = torch.repeat_interleave(torch.arange(B, device=packed.device), lengths)
    cols = packed_position_ids(lengths)
    if padding_side == "left":
        cols = cols + torch.repeat_interleave(max_len - lengths, lengths)
    padded = packed.new_full((B, max_len, *packed.shape[1:]), padding_value)
    padded = padded.index_put((rows, cols), packed)
    mask = torch.zeros((B, max_len), dtype=torch.long, device=packed.device).index_put(
        (rows, cols), torch.ones_like(rows)
    )
    return padded, mask
