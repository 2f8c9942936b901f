"""The probability ``P(y | x)`` that a causal LM continues an input ``x`` with a fixed target ``y``, and the
gradient signal the importance samplers are guided by.

``log P(y | x) = Σ_j log p(y_j | prefix, x, y_<j)`` is read from one forward pass over ``[prefix; x; y_<m]`` with an
all-ones attention mask (no padding: every input of a distribution has the same length), in fp32 log-softmax
(:func:`trl_ext.ops.logprobs_from_logits`).

The samplers' *score* ``s(x)`` of an input is either

- ``"logit"`` (the original ARC/RePULSe choice): the logit of the first target token at the last input position, or
- ``"logprob"``: ``log P(y | x)`` itself.

:func:`evaluate_inputs` also returns ``∂s/∂e_k`` for every input embedding ``e_k`` of ``x``. The first-order change
of ``s`` when token ``x_k`` is replaced by ``v`` is ``(W_E[v] − e_k)·∂s/∂e_k``, so ``G[k, v] = ∂s/∂e_k · W_E[v]``
(:func:`token_scores`) ranks the replacements of position ``k`` (the ``−e_k`` term is the same for every ``v``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...ops import logprobs_from_logits
from ...utils import eval_mode

__all__ = [
    "SCORES",
    "InputEvaluation",
    "check_model_inputs",
    "eval_mode",
    "evaluate_inputs",
    "target_logprob",
    "target_token_ids",
    "token_scores",
]

SCORES = ("logit", "logprob")


def target_token_ids(tokenizer, target_word: str, leading_space: bool = False) -> list[int]:
    """Token ids of ``target_word`` (``" " + target_word`` with ``leading_space``), without special tokens."""
    if not target_word:
        raise ValueError("target_word is empty; give the word (or text) whose probability to estimate.")
    text = (" " + target_word) if leading_space else target_word
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise ValueError(f"The tokenizer encodes {text!r} as no token; choose another target word.")
    return ids


def _embeddings(model: nn.Module) -> nn.Module:
    embeddings = model.get_input_embeddings()
    if embeddings is None or not hasattr(embeddings, "weight"):
        raise ValueError("The model has no input embedding matrix (get_input_embeddings()); use a causal LM.")
    return embeddings


def check_model_inputs(model: nn.Module, vocab_size: int, target_ids: Sequence[int], prefix_ids=()) -> None:
    """Raise a ``ValueError`` when token ids of the distribution, the target or the prefix do not fit the model."""
    rows = _embeddings(model).weight.shape[0]
    if vocab_size > rows:
        raise ValueError(
            f"The input distribution covers {vocab_size} token ids but the model embeds only {rows}; build the "
            "distribution with the model's vocabulary size."
        )
    if not len(target_ids):
        raise ValueError("target_ids is empty; give at least one target token id.")
    bad = [int(i) for i in list(target_ids) + list(prefix_ids) if not 0 <= int(i) < rows]
    if bad:
        raise ValueError(f"Token ids {bad} (target or prefix) are outside the model's vocabulary [0, {rows}).")


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _build_input_ids(x: torch.Tensor, target_ids: Sequence[int], prefix_ids: Sequence[int]) -> torch.Tensor:
    """``[prefix; x; y_<m]`` for every row of ``x``: the last ``m`` positions predict ``y``."""
    n = x.shape[0]
    prefix = torch.tensor(list(prefix_ids), dtype=torch.long, device=x.device).expand(n, -1)
    head = torch.tensor(list(target_ids)[:-1], dtype=torch.long, device=x.device).expand(n, -1)
    return torch.cat([prefix, x.long(), head], dim=1)


def _target_logits(model: nn.Module, num_targets: int, **inputs) -> torch.Tensor:
    """``(n, m, V)`` logits at the ``m`` positions that predict the target tokens."""
    rows, width = next(iter(inputs.values())).shape[:2]
    kwargs = {"logits_to_keep": num_targets} if _accepts_logits_to_keep(model) else {}
    mask = torch.ones(rows, width, dtype=torch.long, device=next(iter(inputs.values())).device)
    logits = model(**inputs, attention_mask=mask, use_cache=False, **kwargs).logits
    return logits[:, -num_targets:]


def _target_logprob_from_logits(logits: torch.Tensor, target_ids: Sequence[int]) -> torch.Tensor:
    labels = torch.tensor(list(target_ids), dtype=torch.long, device=logits.device).expand(logits.shape[0], -1)
    return logprobs_from_logits(logits.float(), labels).sum(-1)


def target_logprob(
    model: nn.Module,
    x: torch.Tensor,
    target_ids: Sequence[int],
    batch_size: int = 256,
    prefix_ids: Sequence[int] = (),
) -> torch.Tensor:
    """``(n,)`` float64 (on CPU) ``log P(y | prefix, x)`` for the ``(n, L)`` inputs ``x``, in eval mode, no grad.

    Args:
        model: a causal LM (``model(input_ids=..., attention_mask=...)`` returns ``logits``).
        x: ``(n, L)`` token ids.
        target_ids: the target's ``m ≥ 1`` token ids ``y``.
        batch_size: rows per forward pass.
        prefix_ids: fixed ids read before ``x`` (e.g. a BOS token).
    """
    _check_batch(x, batch_size)
    check_model_inputs(model, 0, target_ids, prefix_ids)
    device = _embeddings(model).weight.device
    out = []
    with eval_mode(model), torch.no_grad():
        for chunk in x.split(batch_size):
            ids = _build_input_ids(chunk.to(device), target_ids, prefix_ids)
            logits = _target_logits(model, len(target_ids), input_ids=ids)
            out.append(_target_logprob_from_logits(logits, target_ids).double().cpu())
    return torch.cat(out)


@dataclass
class InputEvaluation:
    """What :func:`evaluate_inputs` returns for ``n`` inputs of length ``L``."""

    target_logprob: torch.Tensor
    """``(n,)`` float64 (CPU) ``log P(y | x)``."""
    score: torch.Tensor
    """``(n,)`` float64 (CPU) score ``s(x)``."""
    embedding_grad: torch.Tensor | None
    """``(n, L, H)`` float32 (model device) ``∂s/∂e_k`` at the ``L`` input positions, or ``None`` without grads."""


def evaluate_inputs(
    model: nn.Module,
    x: torch.Tensor,
    target_ids: Sequence[int],
    score: str = "logit",
    prefix_ids: Sequence[int] = (),
    with_grad: bool = True,
    batch_size: int | None = None,
) -> InputEvaluation:
    """``log P(y|x)``, the score ``s(x)`` and (``with_grad``) ``∂s/∂e`` of ``(n, L)`` inputs in one pass per batch.

    The model runs in eval mode on ``inputs_embeds`` that require grad; only those embeddings get a gradient
    (``torch.autograd.grad``: no parameter ``.grad`` is written and no ``requires_grad`` flag is changed).
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}.")
    batch_size = batch_size or x.shape[0]
    _check_batch(x, batch_size)
    embeddings = _embeddings(model)
    device, start, length = embeddings.weight.device, len(prefix_ids), x.shape[1]
    logprobs, scores, grads = [], [], []
    with eval_mode(model), torch.set_grad_enabled(with_grad):
        for chunk in x.split(batch_size):
            ids = _build_input_ids(chunk.to(device), target_ids, prefix_ids)
            embeds = embeddings(ids).detach().requires_grad_(with_grad)
            logits = _target_logits(model, len(target_ids), inputs_embeds=embeds)
            logprob = _target_logprob_from_logits(logits, target_ids)
            value = logits[:, 0, int(target_ids[0])].float() if score == "logit" else logprob
            if with_grad:
                (grad,) = torch.autograd.grad(value.sum(), embeds)
                grads.append(grad[:, start : start + length].float())
            logprobs.append(logprob.detach().double().cpu())
            scores.append(value.detach().double().cpu())
    return InputEvaluation(torch.cat(logprobs), torch.cat(scores), torch.cat(grads) if with_grad else None)


def token_scores(embedding_grad: torch.Tensor, embedding_weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``G = embedding_grad @ W_E[:vocab_size]ᵀ`` in float32: ``(..., H) → (..., vocab_size)``.

    ``G[..., v]`` is the first-order gain of the score from putting token ``v`` at that position (up to a constant
    per position). It is linear in ``embedding_grad``, so a mean of ``G`` over a batch equals ``token_scores`` of
    the mean gradient, which the samplers use to avoid a ``(B, L, V)`` tensor.
    """
    return embedding_grad.float() @ embedding_weight[:vocab_size].detach().float().T


def _check_batch(x: torch.Tensor, batch_size: int) -> None:
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"x must be a non-empty (n, length) tensor of token ids, got shape {tuple(x.shape)}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
