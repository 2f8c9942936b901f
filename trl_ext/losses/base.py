"""Shared pieces of the loss library: the output type and the loss aggregation over tokens.

Conventions used by every loss in :mod:`trl_ext.losses`:

* Per-token tensors are ``(..., T)`` with a mask of the same shape (1 = real action token, 0 = padding). Losses that
  work per prompt take ``(P, N, T)`` (P prompts, N samples each) and normalise importance weights over the N axis.
* Losses never modify their inputs in place and never read masked-out values (they may hold garbage).
* Every loss returns a :class:`LossOutput`: the scalar ``loss`` to back-propagate and a dict of detached metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ..ops.stats import masked_mean, masked_sum

__all__ = ["LossOutput", "Aggregation", "AGGREGATIONS", "aggregate", "check_same_shape", "second_normalizer"]

Aggregation = Literal["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"]
AGGREGATIONS: tuple[str, ...] = ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean")


@dataclass
class LossOutput:
    """Result of a loss function.

    Attributes:
        loss: scalar tensor to call ``backward()`` on.
        metrics: detached scalar tensors for logging (e.g. ``clipfrac``, ``approxkl``); keys are metric names without
            a prefix, the trainer adds one (``policy/``, ``val/``, ...).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self.metrics = {
            k: v.detach() if torch.is_tensor(v) else torch.tensor(float(v)) for k, v in self.metrics.items()
        }


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "seq-mean-token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``(..., T)`` to a scalar.

    Modes (``m`` the mask, ``S`` the number of sequences = product of the leading dims):

    * ``"seq-mean-token-mean"`` — ``(1/S) Σ_s [Σ_t ℓ_{s,t} m_{s,t} / Σ_t m_{s,t}]``: each sequence's token mean, then
      the mean over sequences. This is the convention of the original RePULSe/OpenRLHF code (length-normalised per
      sequence, so every sequence counts equally whatever its length).
    * ``"seq-mean-token-sum"`` — ``(1/S) Σ_s Σ_t ℓ_{s,t} m_{s,t}``: the summed loss of each sequence, averaged over
      sequences (no length normalisation; longer sequences weigh more).
    * ``"token-mean"`` — ``Σ_{s,t} ℓ m / Σ_{s,t} m``: the global token mean (every token counts equally).

    ``normalizer`` replaces the denominator of the outer mean: the number of sequences (``seq-*`` modes) or of
    tokens (``token-mean``) of the *whole* optimisation batch. A trainer that splits one batch into
    gradient-accumulation micro-batches passes the global count so that the summed micro-batch losses equal the loss
    of the full batch, whatever the split.
    """
    if per_token.shape != mask.shape:
        raise ValueError(f"per-token loss shape {tuple(per_token.shape)} != mask shape {tuple(mask.shape)}")
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(per_token, mask, dim=-1)
        return per_seq.sum() / normalizer if normalizer is not None else per_seq.mean()
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(per_token, mask, dim=-1)
        return per_seq.sum() / normalizer if normalizer is not None else per_seq.mean()
    if mode == "token-mean":
        total = masked_sum(per_token, mask)
        if normalizer is not None:
            return total / normalizer
        return total / mask.sum().clamp_min(1)
    raise ValueError(f"Unknown aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}.")


def second_normalizer(aggregation: str, normalizer, second, what: str):
    """The normalizer of a loss's second sample set (RePULSe's q-samples, SIXO's base samples): ``second`` when
    given, else ``normalizer``. With ``token-mean`` and a ``normalizer`` the second set's own token count is
    required: the two sets have different token counts, so sharing the first one's would mis-scale the term."""
    if second is not None:
        return second
    if aggregation == "token-mean" and normalizer is not None:
        raise ValueError(
            f"With aggregation='token-mean' and a `normalizer`, also pass `{what}` (the global token count of the "
            "second sample set): the two sample sets have different token counts."
        )
    return normalizer


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise a ``ValueError`` naming the offending argument when tensors that must share a shape do not."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.shape != ref.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(t.shape)} but `{ref_name}` has shape {tuple(ref.shape)}; they must match."
            )


# ----------------------------------------------------------------------------------------------------------------
# Layout and shape helpers shared by the loss modules (weights, reinforce, twist); not part of the public API.
# ----------------------------------------------------------------------------------------------------------------
def is_flat_batch(mask: torch.Tensor, name: str = "mask") -> bool:
    """True for a flat ``(B, T)`` batch, False for a grouped ``(P, N, T)`` one; anything else is an error."""
    if mask.dim() == 3:
        return False
    if mask.dim() == 2:
        return True
    raise ValueError(f"`{name}` must be (P, N, T) or (B, T); got shape {tuple(mask.shape)}.")


def as_grouped(x: torch.Tensor, name: str, grouped_dim: int, flat: bool) -> torch.Tensor:
    """Return ``x`` in the grouped layout, adding a leading P = 1 axis to a flat tensor."""
    want = grouped_dim - 1 if flat else grouped_dim
    if x.dim() != want:
        layout = "flat (B, ...)" if flat else "grouped (P, N, ...)"
        raise ValueError(f"`{name}` must have {want} dims for a {layout} batch; got shape {tuple(x.shape)}.")
    return x.unsqueeze(0) if flat else x


def check_sequence_shape(x: torch.Tensor, name: str, mask: torch.Tensor) -> None:
    if x.shape != mask.shape[:-1]:
        raise ValueError(f"`{name}` has shape {tuple(x.shape)}; expected {tuple(mask.shape[:-1])} (mask minus T).")


def check_token_shape(x: torch.Tensor, name: str, mask: torch.Tensor) -> None:
    if x.shape != mask.shape:
        raise ValueError(f"`{name}` has shape {tuple(x.shape)}; expected the mask's shape {tuple(mask.shape)}.")


def zero_masked(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` with masked-out entries replaced by 0 (out of place; gradients flow through the kept entries)."""
    if valid.dim() < x.dim():
        valid = valid.reshape(*valid.shape, *([1] * (x.dim() - valid.dim())))
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
