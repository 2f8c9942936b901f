r"""The exact target ``σ(s) ∝ p(s|x)·φ(s)`` over responses of one or two tokens, by enumeration.

For a prompt ``x``, a set ``B`` of bad tokens, stop tokens ``E`` and a potential that depends only on whether the
response holds a bad token (:class:`~trl_ext.sampling.TokenSetPotential`: ``φ_bad`` / ``φ_good``; the indicator
``1[bad]`` gives ``Z = P(bad)``), every first token ``s_1`` carries the mass

    m(s_1) = p(s_1) · φ_bad                                              s_1 ∈ B
           = p(s_1) · φ_good                                             s_1 ∈ E \ B, or T = 1
           = p(s_1) · [φ_bad·P(B | s_1) + φ_good·(1 − P(B | s_1))]       otherwise (T = 2),

with ``P(B | s_1) = Σ_{b∈B} p(b | x, s_1)``, and ``Z = Σ_{s_1} m(s_1)``. This needs one forward pass for the prompt
and one row per "good" first token (the prompt's KV cache is shared). From the same numbers:

- the optimal twist ``ψ*_1(s_1) = m(s_1)/p(s_1) = E_p[φ | s_1]`` (:meth:`ShortResponseTarget.log_twist`, usable as
  a :class:`~trl_ext.sampling.FunctionTwist`; with it and its twist-induced proposal every SMC particle has weight
  ``Z``);
- exact samples of ``σ`` (:meth:`ShortResponseTarget.sample`): ``s_1 ∝ m``, then ``s_2 ∝ p(·|s_1)·φ(s_1, ·)``;
- :meth:`ShortResponseTarget.bad_given_first`: ``P(bad | s_1)`` (1 on ``B``, 0 on ``E \ B``), the quantity the
  input-distribution estimators average in :mod:`.responses`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...models.kv_cache import cache_kwargs, output_cache
from ...sampling import TokenSetPotential
from ...sampling.cached_lm import model_device
from ...utils import eval_mode
from ._common import progress

__all__ = ["ShortResponseTarget", "short_response_target"]


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(a, b)


@dataclass
class ShortResponseTarget:
    """Exact ``σ`` for responses of ``T ∈ {1, 2}`` tokens (module doc). Tensors are float64 on the CPU, ``(V,)``."""

    model: nn.Module
    prompt_ids: torch.Tensor
    """``(P,)`` the prompt."""
    potential: TokenSetPotential
    stop_token_ids: list[int]
    max_new_tokens: int
    log_p_first: torch.Tensor
    """``log p(s_1 | x)``."""
    log_bad_second: torch.Tensor
    """``log P(s_2 ∈ B | x, s_1)`` for good first tokens (``nan`` elsewhere; all ``nan`` when ``T = 1``)."""
    log_mass: torch.Tensor
    """``log m(s_1)``."""
    row_forwards: int
    """Rows forwarded to build the table (1 for the prompt + one per good first token)."""

    @property
    def log_z(self) -> float:
        """``log Z = log Σ_s p(s)·φ(s)``."""
        return float(torch.logsumexp(self.log_mass, 0))

    @property
    def z(self) -> float:
        return math.exp(self.log_z)

    def _first_classes(self) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = self.log_p_first.shape[0]
        bad = torch.zeros(vocab, dtype=torch.bool)
        bad[self.potential.token_ids] = True
        stop = torch.zeros(vocab, dtype=torch.bool)
        stop[self.stop_token_ids] = True
        return bad, stop & ~bad

    def bad_given_first(self) -> torch.Tensor:
        """``(V,)`` ``P(bad | s_1)`` (indicator view: 1 on bad tokens, 0 on stop tokens, ``P(B|s_1)`` otherwise)."""
        bad, stop = self._first_classes()
        if self.max_new_tokens == 1:
            return bad.double()
        out = self.log_bad_second.exp()
        return torch.where(bad, torch.ones_like(out), torch.where(stop, torch.zeros_like(out), out))

    def log_twist(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor):
        """The optimal twist for :class:`~trl_ext.sampling.FunctionTwist`: ``log ψ*_1(y) = log m(y) − log p(y)``
        for an empty response, and ``log φ(s_1, y)`` (the final potential, ``ψ*_2 = φ``) after one token."""
        rows, t = response_ids.shape
        device = response_ids.device
        if t == 0:
            twist = (self.log_mass - self.log_p_first).float()
            return twist.to(device).expand(rows, -1)
        if t >= 2:
            raise ValueError(f"The exact short-response twist covers responses of at most 2 tokens, got {t + 1}.")
        vocab = self.log_p_first.shape[0]
        bad, _ = self._first_classes()
        bad = bad.to(device)
        first_bad = bad[response_ids[:, 0]]
        phi_bad, phi_good = self.potential.log_phi_bad, self.potential.log_phi_good
        by_token = torch.where(bad, torch.tensor(phi_bad, device=device), torch.tensor(phi_good, device=device))
        out = by_token[None].expand(rows, vocab).clone()
        out[first_bad] = phi_bad
        return out.float()

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` exact draws from ``σ``: ``(n, T)`` ids (``pad = 0`` after a stop) and their ``(n, T)`` mask."""
        T = self.max_new_tokens
        probs = (self.log_mass - self.log_z).exp()
        first = torch.multinomial(probs.float(), n, replacement=True, generator=generator)
        ids = torch.zeros(n, T, dtype=torch.long)
        mask = torch.zeros(n, T, dtype=torch.long)
        ids[:, 0], mask[:, 0] = first, 1
        if T == 1:
            return ids, mask
        bad, stop = self._first_classes()
        go_on = ~stop[first]
        if go_on.any():
            rows = first[go_on]
            phi = torch.where(
                bad,
                torch.tensor(self.potential.log_phi_bad, dtype=torch.float64),
                torch.tensor(self.potential.log_phi_good, dtype=torch.float64),
            )
            seconds, start = [], 0
            for log_p2 in _next_token_logprobs(self.model, self.prompt_ids, rows):
                first_bad = bad[rows[start : start + log_p2.shape[0]]][:, None]
                weights = log_p2 + torch.where(first_bad, torch.zeros_like(log_p2), phi[None])
                seconds.append(torch.multinomial(torch.softmax(weights, -1).float(), 1, generator=generator)[:, 0])
                start += log_p2.shape[0]
            ids[go_on, 1], mask[go_on, 1] = torch.cat(seconds), 1
        return ids, mask


def _prompt_cache(model: nn.Module, prompt_ids: torch.Tensor):
    device = model_device(model)
    ids = prompt_ids.to(device)[None]
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    return output_cache(out), torch.log_softmax(out.logits[0, -1].double(), -1).cpu()


def _next_token_logprobs(
    model: nn.Module, prompt_ids: torch.Tensor, first: torch.Tensor, batch_size: int = 256, cache=None
) -> Iterator[torch.Tensor]:
    """Chunks of ``(≤ batch_size, V)`` float64 ``log p(· | x, s_1)`` for the first tokens ``first`` ``(n,)``, in
    order, sharing the prompt's cache (yielded chunk by chunk: all ``n`` rows at once would not fit in memory for a
    real vocabulary)."""
    device = model_device(model)
    with torch.no_grad(), eval_mode(model):
        if cache is None:
            cache, _ = _prompt_cache(model, prompt_ids)
        P = prompt_ids.shape[0]
        for chunk in first.split(batch_size):
            past = copy.deepcopy(cache)
            past.batch_repeat_interleave(chunk.shape[0])
            ids = chunk.to(device)[:, None]
            res = model(
                input_ids=ids,
                attention_mask=torch.ones(chunk.shape[0], P + 1, dtype=torch.long, device=device),
                position_ids=torch.full_like(ids, P),
                **cache_kwargs(past),
                use_cache=True,
            )
            yield torch.log_softmax(res.logits[:, -1].double(), -1).cpu()


def short_response_target(
    model: nn.Module,
    prompt_ids: Sequence[int] | torch.Tensor,
    potential: TokenSetPotential,
    *,
    max_new_tokens: int = 2,
    stop_token_ids: Sequence[int] = (),
    batch_size: int = 256,
    show_progress: bool = False,
) -> ShortResponseTarget:
    """Enumerate ``σ`` for one unpadded prompt (module doc).

    Args:
        model: the target's base ``p`` (a causal LM with a KV cache; run in eval mode, no grad).
        prompt_ids: the prompt's token ids.
        potential: a :class:`~trl_ext.sampling.TokenSetPotential` (bad tokens and ``log φ`` values).
        max_new_tokens: ``T``, 1 or 2.
        stop_token_ids: tokens that end a response.
        batch_size: first tokens scored per forward pass.
        show_progress: show a progress bar over the first tokens.
    """
    if not isinstance(potential, TokenSetPotential):
        raise ValueError(
            "Exact enumeration needs a potential that depends only on bad-token membership "
            f"(TokenSetPotential), got {type(potential).__name__}."
        )
    if max_new_tokens not in (1, 2):
        raise ValueError(f"max_new_tokens must be 1 or 2 for exact enumeration, got {max_new_tokens}.")
    prompt = torch.as_tensor(list(prompt_ids) if not torch.is_tensor(prompt_ids) else prompt_ids).long().reshape(-1)
    if prompt.numel() == 0:
        raise ValueError("prompt_ids is empty.")
    with torch.no_grad(), eval_mode(model):
        cache, log_p1 = _prompt_cache(model, prompt)
    vocab = log_p1.shape[0]
    stops = [int(i) for i in stop_token_ids]
    for name, ids in (("bad", potential.token_ids), ("stop", stops)):
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"Some {name} token ids are outside the model's vocabulary [0, {vocab}).")
    bad = torch.zeros(vocab, dtype=torch.bool)
    bad[potential.token_ids] = True
    stop = torch.zeros(vocab, dtype=torch.bool)
    stop[stops] = True
    stop &= ~bad
    phi_bad = torch.tensor(potential.log_phi_bad, dtype=torch.float64)
    phi_good = torch.tensor(potential.log_phi_good, dtype=torch.float64)
    log_bad2 = torch.full((vocab,), math.nan, dtype=torch.float64)
    rows = 1
    if max_new_tokens == 1:
        log_mass = log_p1 + torch.where(bad, phi_bad, phi_good)
    else:
        good = ~(bad | stop)
        first = good.nonzero().flatten()
        in_b, out_b = [], []
        with progress(first.numel(), "enumerating first tokens", show_progress) as bar:
            for log_p2 in _next_token_logprobs(model, prompt, first, batch_size, cache):
                in_b.append(torch.logsumexp(log_p2[:, bad], -1))
                out_b.append(torch.logsumexp(log_p2[:, ~bad], -1))
                bar.update(log_p2.shape[0])
        in_b, out_b = torch.cat(in_b), torch.cat(out_b)
        rows += first.numel()
        log_bad2[first] = in_b
        inner = torch.full((vocab,), -math.inf, dtype=torch.float64)
        inner[first] = _logaddexp(in_b + phi_bad, out_b + phi_good)
        inner = torch.where(bad, phi_bad.expand(vocab), torch.where(stop, phi_good.expand(vocab), inner))
        log_mass = log_p1 + inner
    return ShortResponseTarget(
        model=model,
        prompt_ids=prompt,
        potential=potential,
        stop_token_ids=stops,
        max_new_tokens=max_new_tokens,
        log_p_first=log_p1,
        log_bad_second=log_bad2,
        log_mass=log_mass,
        row_forwards=rows,
    )
