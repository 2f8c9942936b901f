"""Masked statistics over padded tensors.

Every function takes a value tensor ``x`` and a mask of the same shape (or broadcastable to it) whose non-zero
entries mark real elements. Masked-out entries never influence the result, whatever they contain (including
``inf``/``nan``), because they are replaced by zero before any arithmetic.

Half-precision inputs (fp16, bf16) are reduced in fp32 and the result is cast back to their dtype: in fp16 the
squares of values of 1e3 already overflow (``masked_whiten`` of them gave 0 everywhere) and a bf16 sum of a few hundred
tokens loses most of its digits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_std",
    "masked_whiten",
    "masked_normalize",
]


def _upcast(x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    """``(x in at least fp32, the dtype to cast the result back to or None)``."""
    if x.is_floating_point() and torch.finfo(x.dtype).bits < 32:
        return x.float(), x.dtype
    return x, None


def _back(out: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return out if dtype is None else out.to(dtype)


def _zeroed(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = mask.to(dtype=x.dtype if x.is_floating_point() else torch.float32)
    mask = mask.expand_as(x) if mask.shape != x.shape else mask
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)), mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """``Σ_i x_i·m_i`` over ``dim`` (all elements when ``dim`` is None)."""
    x, dtype = _upcast(x)
    xz, mask = _zeroed(x, mask)
    prod = xz * mask
    return _back(prod.sum() if dim is None else prod.sum(dim=dim), dtype)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, eps: float = 0.0
) -> torch.Tensor:
    """Masked mean ``Σ x·m / Σ m`` over ``dim`` (all elements when ``dim`` is None).

    Rows whose mask is entirely zero give ``0`` rather than ``nan``: a zero denominator is replaced by 1 (the
    numerator is zero there too). With ``eps > 0`` the denominator is ``Σ m + eps`` instead.
    """
    x, dtype = _upcast(x)
    xz, mask = _zeroed(x, mask)
    if dim is None:
        num, den = (xz * mask).sum(), mask.sum()
    else:
        num, den = (xz * mask).sum(dim=dim), mask.sum(dim=dim)
    if eps > 0:
        return _back(num / (den + eps), dtype)
    return _back(num / torch.where(den == 0, torch.ones_like(den), den), dtype)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Masked variance ``Σ m (x − μ)² / (Σ m − 1)`` (``Σ m`` when ``unbiased=False``), with ``μ`` the masked mean.

    With ``unbiased=True`` and a single real element the variance is undefined; ``0`` is returned for it.
    """
    x, dtype = _upcast(x)
    mean = masked_mean(x, mask, dim=dim)
    if dim is not None:
        mean = mean.reshape(_keepdim_shape(x.shape, (dim,) if isinstance(dim, int) else dim))
    xz, m = _zeroed(x, mask)
    sq = (xz - mean) ** 2 * m
    count = m.sum() if dim is None else m.sum(dim=dim)
    total = sq.sum() if dim is None else sq.sum(dim=dim)
    den = count - 1 if unbiased else count
    return _back(total / torch.where(den <= 0, torch.ones_like(den), den) * (den > 0), dtype)


def _keepdim_shape(shape: torch.Size, dims: tuple[int, ...]) -> tuple[int, ...]:
    dims = {d % len(shape) for d in dims}
    return tuple(1 if i in dims else s for i, s in enumerate(shape))


def masked_std(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Square root of :func:`masked_var`."""
    x, dtype = _upcast(x)
    return _back(masked_var(x, mask, dim=dim, unbiased=unbiased).sqrt(), dtype)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    dim: int | tuple[int, ...] | None = None,
    eps: float = 1e-8,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Whiten ``x``: ``(x − μ)/sqrt(σ² + eps)`` with masked statistics (global when ``dim`` is None).

    With ``shift_mean=False`` the mean is added back, ``x ↦ (x − μ)/σ + μ`` (the convention TRL uses when whitening
    rewards). Masked-out entries of the output are set to zero.

    ``reduce``: a function that sums a tensor over processes (e.g. ``lambda t: accelerator.reduce(t, "sum")``); μ and
    the unbiased σ² are then those of the elements of *every* process, so that N processes whiten as one process
    holding all their rows does (only with ``dim=None``).
    """
    x, dtype = _upcast(x)
    if reduce is not None:
        if dim is not None:
            raise ValueError("masked_whiten: reduce (statistics over processes) needs dim=None.")
        mean, var = _reduced_mean_var(x, mask, reduce)
    else:
        mean = masked_mean(x, mask, dim=dim)
        var = masked_var(x, mask, dim=dim, unbiased=True)
    if dim is not None:
        shape = _keepdim_shape(x.shape, (dim,) if isinstance(dim, int) else dim)
        mean, var = mean.reshape(shape), var.reshape(shape)
    xz, m = _zeroed(x, mask)
    out = (xz - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _back(out * m, dtype)


def _reduced_mean_var(x: torch.Tensor, mask: torch.Tensor, reduce) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and unbiased variance of the elements of every process (``reduce`` sums over processes)."""
    xz, m = _zeroed(x, mask)
    totals = reduce(torch.stack([(xz * m).sum(), m.sum()]))
    total, count = totals[0], totals[1]
    mean = total / torch.where(count == 0, torch.ones_like(count), count)
    squares = reduce(((xz - mean) ** 2 * m).sum())
    den = count - 1
    return mean, squares / torch.where(den <= 0, torch.ones_like(den), den) * (den > 0)


def masked_normalize(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int | tuple[int, ...] | None = None,
    std_floor: float = 1e-8,
) -> torch.Tensor:
    """Standardise ``x`` to zero masked mean and unit masked std: ``(x − μ)/max(σ, std_floor)``.

    Unlike :func:`masked_whiten`, the standard deviation is floored (not ``eps``-regularised), which is the
    convention of advantage normalisation over a rollout buffer (std ≥ 1e-8). Masked-out entries become zero.
    """
    x, dtype = _upcast(x)
    mean = masked_mean(x, mask, dim=dim)
    std = masked_std(x, mask, dim=dim, unbiased=True)
    if dim is not None:
        shape = _keepdim_shape(x.shape, (dim,) if isinstance(dim, int) else dim)
        mean, std = mean.reshape(shape), std.reshape(shape)
    xz, m = _zeroed(x, mask)
    return _back((xz - mean) / std.clamp_min(std_floor) * m, dtype)
