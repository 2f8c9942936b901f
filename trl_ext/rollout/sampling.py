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
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["SampleAndRecord"]


class SampleAndRecord(LogitsProcessor):
    """Draw the next token by inverse-CDF sampling and record its tempered log-probability.

    Use with ``generate(..., do_sample=False, logits_processor=[sampler])`` and no temperature/top-k/top-p in the
    generation config (they are applied here). After ``generate``, :meth:`logprobs` gives the ``(B, steps)`` fp32
    log-probs, one column per generated token (columns after a row's end are meaningless and must be masked).

    Args:
        temperature: sampling temperature (> 0).
        top_k: keep the ``top_k`` most likely tokens (``None``/0: off).
        top_p: nucleus sampling threshold (1.0: off).
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0):
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

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tempered = scores.float() / self.temperature
        logprobs = torch.log_softmax(tempered, dim=-1)
        warped = self.warpers(input_ids, tempered) if len(self.warpers) else tempered
        probs = logprobs.exp() if warped is tempered else torch.softmax(warped, dim=-1)
        # fp64 cumulative sums: no rounding gap between the last entry and the drawn uniform.
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        draw = torch.rand((cdf.shape[0], 1), dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
        # right=True: the first index whose cumulative mass exceeds the draw, never a zero-probability token.
        tokens = torch.searchsorted(cdf, draw, right=True).clamp_(max=cdf.shape[-1] - 1)
        self._steps.append(logprobs.gather(-1, tokens).squeeze(-1))
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens, 0.0)

    def logprobs(self) -> torch.Tensor:
        """``(B, steps)`` fp32 log-probs of the drawn tokens (``(B, 0)``-shaped never: at least one step ran)."""
        return torch.stack(self._steps, dim=1)
