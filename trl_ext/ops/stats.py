"""Masked statistics over padded tensors.

Every function takes a value tensor ``x`` and a mask of the same shape (or broadcastable to it) whose non-zero
entries mark real elements. Masked-out entries never influence the result, whatever they contain (including
``inf``/``nan``), because they are replaced by zero before any arithmetic.
"""

from __future__ import annotations

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_std",
    "masked_whiten",
    "masked_normalize",
]


def _zeroed(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = mask.to(dtype=x.dtype if x.is_floating_point() else torch.float32)
    mask = mask.expand_as(x) if mask.shape != x.shape else mask
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)), mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """``Σ_i x_i·m_i`` over ``dim`` (all elements when ``dim`` is None)."""
    xz, mask = _zeroed(x, mask)
    prod = xz * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, eps: float = 0.0
) -> torch.Tensor:
    """Masked mean ``Σ x·m / Σ m`` over ``dim`` (all elements when ``dim`` is None).

    Rows whose mask is entirely zero give ``0`` rather than ``nan``: a zero denominator is replaced by 1 (the
    numerator is zero there too). With ``eps > 0`` the denominator is ``Σ m + eps`` instead.
    """
    xz, mask = _zeroed(x, mask)
    if dim is None:
        num, den = (xz * mask).sum(), mask.sum()
    else:
        num, den = (xz * mask).sum(dim=dim), mask.sum(dim=dim)
    if eps > 0:
        return num / (den + eps)
    return num / torch.where(den == 0, torch.ones_like(den), den)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Masked variance ``Σ m (x − μ)² / (Σ m − 1)`` (``Σ m`` when ``unbiased=False``), with ``μ`` the masked mean.

    With ``unbiased=True`` and a single real element the variance is undefined; ``0`` is returned for it.
    """
    mean = masked_mean(x, mask, dim=dim)
    if dim is not None:
        mean = mean.reshape(_keepdim_shape(x.shape, (dim,) if isinstance(dim, int) else dim))
    xz, m = _zeroed(x, mask)
    sq = (xz - mean) ** 2 * m
    count = m.sum() if dim is None else m.sum(dim=dim)
    total = sq.sum() if dim is None else sq.sum(dim=dim)
    den = count - 1 if unbiased else count
    return total / torch.where(den <= 0, torch.ones_like(den), den) * (den > 0)


def _keepdim_shape(shape: torch.Size, dims: tuple[int, ...]) -> tuple[int, ...]:
    dims = {d % len(shape) for d in dims}
    return tuple(1 if i in dims else s for i, s in enumerate(shape))


def masked_std(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Square root of :func:`masked_var`."""
    return masked_var(x, mask, dim=dim, unbiased=unbiased).sqrt()


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    dim: int | tuple[int, ...] | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x``: ``(x − μ)/sqrt(σ² + eps)`` with masked statistics (global when ``dim`` is None).

    With ``shift_mean=False`` the mean is added back, ``x ↦ (x − μ)/σ + μ`` (the convention TRL uses when whitening
    rewards). Masked-out entries of the output are set to zero.
    """
    mean = masked_mean(x, mask, dim=dim)
    var = masked_var(x, mask, dim=dim, unbiased=True)
    if dim is not None:
        shape = _keepdim_shape(x.shape, (dim,) if isinstance(dim, int) else dim)
        mean, var = mean.reshape(shape), var.reshape(shape)
    xz, m = _zeroed(x, mask)
    out = (xz - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


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
    mean = masked_mean(x, mask, dim=dim)
    std = masked_std(x, mask, dim=dim, unbiased=True)
    if dim is not None:
        shape = _keepdim_shape(x.shape, (dim,) if isinstance(dim, int) else dim)
        mean, std = mean.reshape(shape), std.reshape(shape)
    xz, m = _zeroed(x, mask)
    return (xz - mean) / std.clamp_min(std_floor) * m
