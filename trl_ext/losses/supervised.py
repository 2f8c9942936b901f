"""Supervised losses on logits: next-token cross-entropy (SFT), knowledge distillation and process reward models.

Logits are ``(B, T, V)``; labels or masks are ``(B, T)``. Positions that do not count (label ``ignore_index``, mask
0, no step marker) are never read: their logits may hold garbage (``inf``/``nan``) without affecting the loss, the
metrics or the gradients. Losses are computed in (at least) float32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.stats import masked_mean
from .base import LossOutput, aggregate
from .registry import register_loss

__all__ = ["gpt_lm_loss", "kd_loss", "prm_loss"]


def _check_logits_labels(logits: torch.Tensor, labels: torch.Tensor, what: str = "labels") -> None:
    if logits.dim() < 2 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"`logits` must have shape (*{what}.shape, V); got logits {tuple(logits.shape)} and {what} "
            f"{tuple(labels.shape)}."
        )


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _zero_invalid_rows(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Logits in at least float32, with the rows of invalid positions replaced by zeros (garbage is never read)."""
    logits = _upcast(logits)
    return torch.where(valid.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))


@register_loss("gpt_lm", kind="supervised", aliases=("sft",))
def gpt_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = True,
    aggregation: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """Next-token cross-entropy (the causal-LM / SFT loss).

    With ``shift=True`` (labels are the input ids, as in ``transformers``), the logits at position ``t`` predict the
    label at ``t + 1``: ``ℓ_t = −log softmax(logits[:, t])[labels[:, t + 1]]``. With ``shift=False`` the caller has
    aligned them already. Tokens whose label is ``ignore_index`` do not count.

    The default ``aggregation="token-mean"`` is the average over all non-ignored tokens of the batch (the convention
    of ``transformers``/TRL SFT); the ``seq-*`` modes and ``normalizer`` work as in :func:`aggregate` (pass the
    global number of non-ignored tokens as ``normalizer`` to make gradient-accumulation micro-batches sum to the
    full-batch loss). A batch with no counted token gives a loss of ``0`` that still back-propagates (zero gradients).

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)`` integer token ids, ``ignore_index`` where the loss is not taken.

    Metrics: ``num_tokens`` (counted tokens), ``token_accuracy`` (fraction of counted tokens whose arg-max logit is
    the label).
    """
    _check_logits_labels(logits, labels)
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    valid = labels != ignore_index
    safe_logits = _zero_invalid_rows(logits, valid)
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    nll = F.cross_entropy(safe_logits.flatten(0, -2), safe_labels.flatten(), reduction="none").view_as(labels)
    loss = aggregate(nll, valid, aggregation, normalizer)
    with torch.no_grad():
        metrics = {
            "num_tokens": valid.sum().float(),
            "token_accuracy": masked_mean((safe_logits.argmax(-1) == safe_labels).float(), valid),
        }
    return LossOutput(loss, metrics)


@register_loss("kd", kind="supervised")
def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    aggregation: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> LossOutput:
    """Knowledge-distillation loss: the forward KL ``KL(p_teacher ‖ p_student)`` per token, averaged over tokens.

    With ``p_s = softmax(student_logits/τ)`` and ``p_t = softmax(teacher_logits/τ)`` at each position::

        ℓ_t = Σ_v p_t(v)·(log p_t(v) − log p_s(v))

    (terms with ``p_t(v) = 0``, e.g. ``−inf`` teacher logits, count 0). The teacher is a constant (detached). No
    ``τ²`` factor is applied (Hinton et al. multiply by ``τ²`` to keep gradient scales; do it outside if wanted).
    Positions are not shifted: the caller aligns student logits, teacher logits and labels.

    Difference from OpenRLHF's ``KDLoss``: that loss drops the teacher entropy term and returns the cross-entropy
    ``−Σ p_t log p_s``, which has the same gradient but is not 0 when the two distributions agree. This returns the
    true KL: ``0`` for equal logits, ``> 0`` otherwise.

    Args:
        student_logits, teacher_logits: ``(B, T, V)``.
        mask: ``(B, T)``, non-zero where a position counts (bool, int or float).
        labels: ``(B, T)`` integer labels instead of a mask: positions with ``labels != ignore_index`` count.
            Give exactly one of ``mask`` and ``labels``.
        temperature: ``τ > 0``.
        aggregation, normalizer: as in :func:`aggregate`; the default ``"token-mean"`` averages over counted tokens.

    Metrics: ``num_tokens``.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"`student_logits` {tuple(student_logits.shape)} and `teacher_logits` {tuple(teacher_logits.shape)} must "
            "have the same shape (same vocabulary)."
        )
    if (mask is None) == (labels is None):
        raise ValueError("Pass exactly one of `mask` (positions that count) and `labels` (ignore_index = skip).")
    valid = mask != 0 if mask is not None else labels != ignore_index
    _check_logits_labels(student_logits, valid, "mask" if mask is not None else "labels")
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")
    log_p_s = torch.log_softmax(_zero_invalid_rows(student_logits, valid) / temperature, dim=-1)
    log_p_t = torch.log_softmax(_zero_invalid_rows(teacher_logits.detach(), valid) / temperature, dim=-1)
    p_t = log_p_t.exp()
    support = p_t > 0
    zero = torch.zeros((), dtype=log_p_s.dtype, device=log_p_s.device)
    # Outside the teacher's support the term is 0; select before subtracting so no inf − inf (nan) is formed.
    diff = torch.where(support, log_p_t, zero) - torch.where(support, log_p_s, zero)
    per_token = (p_t * diff).sum(-1)
    loss = aggregate(per_token, valid, aggregation, normalizer)
    return LossOutput(loss, {"num_tokens": valid.sum().float()})


@register_loss("prm", kind="supervised")
def prm_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    placeholder_token_id: int,
    reward_token_ids: list[int] | tuple[int, ...] | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> LossOutput:
    """Process-reward-model loss: a classification loss at every step marker (Lightman et al. 2023, Math-Shepherd).

    The steps of a solution end with a placeholder token (``input_ids == placeholder_token_id``); only those
    positions count, every other position is ignored. The loss is the mean over all step markers of the batch.

    Two heads are supported:

    * **LM head** — ``logits`` ``(B, T, V)`` and ``reward_token_ids`` (e.g. the ids of ``"+"`` and ``"-"``): the
      logits are restricted to those K ids and trained with cross-entropy.

      - *hard labels* (integer ``labels``): the label at a marker is one of ``reward_token_ids``; it is mapped to its
        index. ``ignore_index`` skips a marker; any other id is an error.
      - *soft labels* (float ``labels``, needs K = 2): the label is the probability of the first reward token, the
        target distribution is ``[p, 1 − p]`` and the loss is the soft cross-entropy ``−Σ_k q_k log softmax_k``.
        Negative labels (e.g. ``-100``) skip a marker.

    * **Scalar head** — ``logits`` ``(B, T)`` (or ``(B, T, 1)``) with ``reward_token_ids=None``: one logit per
      position, ``labels`` in ``[0, 1]`` (probability that the step is good; negative = skip) and binary
      cross-entropy with logits.

    ``reward_token_ids=None`` with vocabulary logits is an error (training the whole vocabulary is never wanted).
    A batch without any placeholder token is an error. If every marker is skipped, the loss is ``0`` (with a grad
    path).

    Metrics: ``accuracy`` (fraction of counted markers where the predicted class — arg-max reward token, or logit
    > 0 — is the labelled one; for soft labels the labelled class is the first token iff ``p ≥ 0.5``) and
    ``num_steps`` (counted markers).
    """
    if input_ids.shape != labels.shape:
        raise ValueError(f"`input_ids` {tuple(input_ids.shape)} and `labels` {tuple(labels.shape)} must match.")
    markers = input_ids == placeholder_token_id
    if not bool(markers.any()):
        raise ValueError(
            f"No placeholder token (id {placeholder_token_id}) found in `input_ids`: a PRM batch needs step markers. "
            "Check `placeholder_token_id` and that truncation did not remove them."
        )

    if reward_token_ids is None:
        if logits.dim() == labels.dim() + 1 and logits.shape[-1] == 1:
            logits = logits.squeeze(-1)
        if logits.shape != labels.shape:
            raise ValueError(
                f"`logits` {tuple(logits.shape)} look like vocabulary logits: pass `reward_token_ids` (e.g. the ids "
                "of '+'/'-'), or give a scalar head's logits of shape (B, T) with float labels in [0, 1]."
            )
        step_logits = _upcast(logits[markers])
        step_labels = labels[markers].to(step_logits.dtype)
        counted = step_labels >= 0
        if bool((step_labels[counted] > 1).any()):
            raise ValueError("Scalar-head PRM labels must be probabilities in [0, 1] (negative = ignored).")
        step_logits = torch.where(counted, step_logits, torch.zeros_like(step_logits))
        target = torch.where(counted, step_labels, torch.zeros_like(step_labels))
        per_step = F.binary_cross_entropy_with_logits(step_logits, target, reduction="none")
        correct = (step_logits > 0) == (target >= 0.5)
    else:
        _check_logits_labels(logits, labels)
        ids = torch.as_tensor(reward_token_ids, dtype=torch.long, device=logits.device).reshape(-1)
        if ids.numel() < 2:
            raise ValueError(f"`reward_token_ids` needs at least 2 ids, got {ids.tolist()}.")
        step_logits = _upcast(logits[markers][:, ids])  # (S, K)
        step_labels = labels[markers]
        if step_labels.is_floating_point():
            if ids.numel() != 2:
                raise ValueError(f"Soft (float) PRM labels need exactly 2 `reward_token_ids`, got {ids.numel()}.")
            counted = step_labels >= 0
            if bool((step_labels[counted] > 1).any()):
                raise ValueError("Soft PRM labels must be probabilities in [0, 1] (negative = ignored).")
            p = torch.where(counted, step_labels, torch.zeros_like(step_labels)).to(step_logits.dtype)
            target = torch.stack([p, 1.0 - p], dim=-1)
            step_logits = torch.where(counted.unsqueeze(-1), step_logits, torch.zeros_like(step_logits))
            per_step = -(target * torch.log_softmax(step_logits, dim=-1)).sum(-1)
            correct = (step_logits.argmax(-1) == 0) == (p >= 0.5)
        else:
            counted = step_labels != ignore_index
            match = step_labels.unsqueeze(-1) == ids  # (S, K)
            unknown = counted & ~match.any(-1)
            if bool(unknown.any()):
                raise ValueError(
                    f"PRM labels at step markers must be one of reward_token_ids {ids.tolist()} (or {ignore_index}); "
                    f"got {sorted(set(step_labels[unknown].tolist()))}."
                )
            target = match.long().argmax(-1)
            step_logits = torch.where(counted.unsqueeze(-1), step_logits, torch.zeros_like(step_logits))
            per_step = F.cross_entropy(step_logits, target, reduction="none")
            correct = step_logits.argmax(-1) == target
    loss = aggregate(per_step, counted, "token-mean")
    with torch.no_grad():
        metrics = {"accuracy": masked_mean(correct.float(), counted), "num_steps": counted.sum().float()}
    return LossOutput(loss, metrics)
