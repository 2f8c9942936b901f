"""Token sampling for rollouts: draw the next token inside ``generate`` and record its log-probability.

`transformers`' sampling mode draws each token with ``torch.multinomial``, which on CPU costs ~7 ms per step for a
``32 × 8k`` batch — more than the forward pass of a small model. :class:`SampleAndRecord` is a logits processor that
draws the token itself by inverse-CDF sampling (``searchsorted`` on the cumulative probabilities, ~0.2 ms), and
returns scores that are ``-inf`` everywhere except at the drawn token, so ``generate`` runs in *greedy* mode and
simply picks it. The distribution sampled from is exactly ``softmax(warp(logits / T))`` (``warp`` = top-k/top-p, if
any), the same as `transformers`' sampling mode.

On the way it records ``log_softmax(logits / T)`` at the drawn token — the tempered, *unfiltered* log-probability,
which is what the trainers' loss forward pass computes (:func:`~trl_ext.rollout.generator.forward_response`) — so a
rollout can skip a separate policy forward pass for its sampling-time log-probs.

By default the uniform of each draw comes from torch's global RNG (each process its own stream). With ``row_keys``
(one integer per row, :func:`row_keys`) it comes instead from a counter-based hash of ``(row key, token position)``
(:func:`keyed_uniform`): a row's tokens then depend only on its key and its logits, not on which process samples it,
how many rows share its batch, or what was drawn before. Trainers key rows by ``(seed, stream, rollout, global row)``
(``seed_per_row``), so N processes sample exactly what one process with an N× larger batch samples.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["SampleAndRecord", "keyed_uniform", "row_keys"]

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2³²`` for int64 tensors ``x < 2³²`` and ``c < 2³²``, without signed 64-bit overflow (the product
    is split at 16 bits: each partial product stays below 2⁴⁸)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (C. Wellons' "lowbias32") of int64 tensors holding values in ``[0, 2³²)``."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: int, stream: int, rollout: int, rows: torch.Tensor) -> torch.Tensor:
    """``(B,)`` int64 keys of the rows ``rows`` (their global indices in rollout number ``rollout`` of sample stream
    ``stream``, e.g. 0 for the policy and 1 for a proposal) of a run seeded with ``seed``: a hash chain, so nearby
    seeds, rollouts and rows give unrelated keys. Exact integer arithmetic: the same keys on every device."""
    rows = torch.as_tensor(rows, dtype=torch.int64)
    key = torch.full_like(rows, 0x9E3779B9)
    for value in (seed, stream, rollout):
        key = _hash32(key ^ (int(value) & _MASK32))
    return _hash32(key ^ (rows & _MASK32))


def keyed_uniform(keys: torch.Tensor, step: int) -> torch.Tensor:
    """``(B, 1)`` float64 uniforms in ``[0, 1)`` for draw number ``step`` of the rows with ``keys``: 53 random bits
    from two hashes of ``(key, step)`` (:func:`row_keys`); the same on every device and in any batch of rows."""
    base = _hash32(keys ^ _hash32(torch.full_like(keys, int(step) & _MASK32)))
    high, low = _hash32(base ^ 0x68E31DA4) >> 5, _hash32(base ^ 0x1B56C4E9) >> 6  # 27 + 26 bits
    return ((high << 26) | low).to(torch.float64).unsqueeze(-1) / float(2**53)


class SampleAndRecord(LogitsProcessor):
    """Draw the next token by inverse-CDF sampling and record its tempered log-probability.

    Use with ``generate(..., do_sample=False, logits_processor=[sampler])`` and no temperature/top-k/top-p in the
    generation config (they are applied here). After ``generate``, :meth:`logprobs` gives the ``(B, steps)`` fp32
    log-probs, one column per generated token (columns after a row's end are meaningless and must be masked).

    Args:
        temperature: sampling temperature (> 0).
        top_k: keep the ``top_k`` most likely tokens (``None``/0: off).
        top_p: nucleus sampling threshold (1.0: off).
        row_keys: ``(B,)`` int64 keys of the rows (:func:`row_keys`): draw number ``t`` of row ``i`` is then
            :func:`keyed_uniform` of ``(row_keys[i], t)`` instead of the next number of torch's global RNG.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        row_keys: torch.Tensor | None = None,
    ):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 to sample; got {temperature}.")
        self.temperature = float(temperature)
        warpers = []
        if top_k:
            warpers.append(TopKLogitsWarper(top_k=int(top_k)))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(top_p)))
        self.warpers = LogitsProcessorList(warpers)
        self._steps: list[torch.Tensor] = []
        self.row_keys = row_keys

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tempered = scores.float() / self.temperature
        logprobs = torch.log_softmax(tempered, dim=-1)
        warped = self.warpers(input_ids, tempered) if len(self.warpers) else tempered
        probs = logprobs.exp() if warped is tempered else torch.softmax(warped, dim=-1)
        # fp64 cumulative sums: no rounding gap between the last entry and the drawn uniform.
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        if self.row_keys is None:
            uniform = torch.rand((cdf.shape[0], 1), dtype=torch.float64, device=cdf.device)
        else:
            uniform = keyed_uniform(self.row_keys.to(cdf.device), len(self._steps))
        draw = uniform * cdf[:, -1:]
        # right=True: the first index whose cumulative mass exceeds the draw, never a zero-probability token.
        tokens = torch.searchsorted(cdf, draw, right=True).clamp_(max=cdf.shape[-1] - 1)
        self._steps.append(logprobs.gather(-1, tokens).squeeze(-1))
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens, 0.0)

    def logprobs(self) -> torch.Tensor:
        """``(B, steps)`` fp32 log-probs of the drawn tokens (``(B, 0)``-shaped never: at least one step ran)."""
        return torch.stack(self._steps, dim=1)
