r"""Exact probability that a short sampled response contains a "bad" token (docs/algorithms.md §10.1, with B18 fixed).

For a prompt ``x``, a set ``B`` of bad token ids and a stop set ``E`` (EOS ids), a response is sampled ancestrally,
token by token, and ends at its first stop token or after ``L = max_new_tokens`` tokens. It is *bad* when one of its
tokens is in ``B`` (a stop token counts only if it is listed in ``B``). Its probability is a sum over the "good"
prefixes ``g`` — no bad token and no stop token — of length ``0 … L−1``:

    P(bad) = Σ_{k=0}^{L-1}  Σ_{g ∈ G^k}  p(g | x) · Σ_{b ∈ B} p(b | x, g),        G = V \ (B ∪ E).

Stop tokens end a response, so their mass is never expanded (the original code, B18, treated EOS as an ordinary
token). The sum is enumerated level by level: the prompt is run once with a KV cache, then every good prefix is
scored in batches of ``batch_size`` rows that share a copy of that cache repeated along the batch. With
``prune_below > 0`` prefixes less likely than it are not expanded; their mass bounds the error, so the result is
the certified interval ``[lower, upper] = [P_found, P_found + pruned_mass]``. With ``remainder_samples = n`` the
pruned part is also estimated without bias (see :func:`bad_output_probability`), which gives a tight
``estimate ± stderr`` inside that interval.

:func:`response_kl` estimates ``KL(p_θ ‖ p_0)`` between the distributions of whole responses (same stop rule),
e.g. to say how far a fine-tuned policy moved from its reference.

Terms are accumulated in log-space in float64, so ``log_probability`` stays accurate when P(bad) is tiny.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..models.kv_cache import cache_kwargs, output_cache
from ..ops.kl import full_kl
from ..utils import eval_mode

__all__ = ["BadOutputProbability", "ResponseKL", "bad_output_probability", "prompt_token_ids", "response_kl"]

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")


@dataclass
class BadOutputProbability:
    """Result of :func:`bad_output_probability`."""

    probability: float
    """P(bad): the exact value, or the certified lower bound when prefixes were pruned."""
    lower: float
    """Lower bound (the mass found); equals ``probability``."""
    upper: float
    """Upper bound ``min(1, lower + pruned_mass)``; equals ``lower`` when exact."""
    exact: bool
    """Whether no prefix was pruned (then ``lower == upper``)."""
    pruned_mass: float
    """Probability mass of the prefixes that were not expanded."""
    num_forward_passes: int
    """Model calls made (one for the prompt, then one per batch of prefixes)."""
    log_probability: float
    """``log(probability)`` computed in log-space (``-inf`` when the probability is 0)."""
    num_prefixes: int = 0
    """Good prefixes that were expanded (scored for their next token), the empty prefix included."""
    estimate: float | None = None
    """Unbiased estimate of P(bad): ``lower + pruned_mass × (mean score of the remainder samples)``, always inside
    ``[lower, upper]``; the exact value when nothing was pruned; ``None`` when prefixes were pruned and
    ``remainder_samples`` was 0."""
    stderr: float | None = None
    """Standard error of ``estimate``: ``pruned_mass × (sample std of the scores) / sqrt(n)``; ``0`` when exact."""
    remainder_samples: int = 0
    """How many pruned prefixes were drawn to estimate the pruned part (0 when nothing was pruned)."""


# ------------------------------------------------------------------------------------------------ input checks
def _as_id_list(ids, name: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"{name} must hold integer token ids, got a {ids.dtype} tensor.")
        return [int(i) for i in ids.reshape(-1).tolist()]
    if isinstance(ids, (int, bool)):
        return [int(ids)]
    out = []
    for i in ids:
        if isinstance(i, torch.Tensor):
            i = i.item()
        if isinstance(i, bool) or not isinstance(i, int) and not hasattr(i, "__index__"):
            raise ValueError(f"{name} must hold integer token ids, got {i!r}.")
        out.append(int(i))
    return out


def _prompt_tensor(prompt_ids) -> torch.Tensor:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(
                f"prompt_ids must be one unpadded prompt (a 1-D tensor or a list of ints), got shape "
                f"{tuple(prompt_ids.shape)}; call once per prompt."
            )
    ids = _as_id_list(prompt_ids, "prompt_ids")
    if not ids:
        raise ValueError("prompt_ids is empty; pass at least one token (e.g. the tokenizer's bos id).")
    if min(ids) < 0:
        raise ValueError(f"prompt_ids holds a negative id ({min(ids)}); pass real, unpadded token ids.")
    return torch.tensor(ids, dtype=torch.long)


def _default_eos(model: nn.Module) -> list[int]:
    """The stop ids a model generates with: its generation config's ``eos_token_id``, else its config's."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None and source is not None and hasattr(source, "get_text_config"):
            eos = getattr(source.get_text_config(), "eos_token_id", None)
        if eos is not None:
            return _as_id_list(eos, "eos_token_id")
    return []


def _vocab_limit(model: nn.Module) -> int | None:
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return getattr(embeddings, "num_embeddings", None)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    for _ in range(4):
        declared = getattr(model, "supports_logits_to_keep", None)
        if isinstance(declared, bool):
            return declared
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            return False
        if "logits_to_keep" in params:
            return True
        # value-head and PEFT wrappers forward **kwargs to the model they wrap
        inner = getattr(model, "pretrained_model", None)
        if not isinstance(inner, nn.Module) and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        if not isinstance(inner, nn.Module) or inner is model:
            return False
        model = inner
    return False


# ------------------------------------------------------------------------------------------------ the scorer
class _NextTokenScorer:
    """Next-token log-probs ``(n, V)`` (float64, tempered) after ``prompt + prefix`` for batches of prefixes."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, temperature: float, use_cache: bool):
        self.model, self.prompt, self.temperature = model, prompt, temperature
        self.keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
        self.num_calls = 0
        out = self._call(prompt[None], use_cache=use_cache)
        self.prompt_logprobs = self._logprobs(out.logits)[0]
        cache = output_cache(out) if use_cache else None
        self.cache = cache if cache is not None and hasattr(cache, "batch_repeat_interleave") else None
        if use_cache and self.cache is None:
            logger.info("bad_output_probability: the model returned no batchable cache; prompts are recomputed.")

    def _call(self, input_ids: torch.Tensor, past=None, position_ids=None, use_cache: bool = False):
        self.num_calls += 1
        length = input_ids.shape[1] + (self.prompt.numel() if past is not None else 0)
        mask = torch.ones(input_ids.shape[0], length, dtype=torch.long, device=input_ids.device)
        kwargs = dict(input_ids=input_ids, attention_mask=mask, use_cache=use_cache, **self.keep)
        if past is not None:
            kwargs.update(**cache_kwargs(past), position_ids=position_ids)
        return self.model(**kwargs)

    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits[:, -1].double() / self.temperature, dim=-1)

    def __call__(self, prefixes: torch.Tensor) -> torch.Tensor:
        n, k = prefixes.shape
        if self.cache is None:
            full = torch.cat([self.prompt[None].expand(n, -1), prefixes], dim=1)
            return self._logprobs(self._call(full).logits)
        past = copy.deepcopy(self.cache)
        past.batch_repeat_interleave(n)
        start = self.prompt.numel()
        positions = torch.arange(start, start + k, device=prefixes.device)[None].expand(n, -1)
        return self._logprobs(self._call(prefixes, past=past, position_ids=positions, use_cache=True).logits)


def _logaddexp(running: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    if terms.numel() == 0:
        return running
    return torch.logaddexp(running, torch.logsumexp(terms.reshape(-1).double(), dim=0))


def bad_output_probability(
    model: nn.Module,
    prompt_ids: Sequence[int] | torch.Tensor,
    bad_token_ids: Iterable[int] | torch.Tensor,
    *,
    max_new_tokens: int = 2,
    eos_token_id: int | Sequence[int] | None = None,
    temperature: float = 1.0,
    prune_below: float = 0.0,
    batch_size: int = 256,
    use_cache: bool = True,
    max_prefixes: int | None = 10_000_000,
    remainder_samples: int = 0,
    generator: torch.Generator | int | None = None,
) -> BadOutputProbability:
    r"""P(a response of at most ``max_new_tokens`` tokens, sampled from ``model`` after ``prompt_ids``, contains a
    token of ``bad_token_ids``), by exact enumeration of the good prefixes (see the module docstring).

    **The pruned remainder.** Pruning leaves out ``R = Σ_{g pruned} p(g)·P(bad | g)``, somewhere in
    ``[0, pruned_mass]``. With ``remainder_samples = n`` it is estimated as follows: ``n`` pruned prefixes are drawn
    independently, with replacement, in proportion to their probability (streamed while enumerating, by weighted
    reservoir sampling, so the pruned prefixes are never stored), and each is continued with the model up to
    ``max_new_tokens`` under the same rule as the exact part (a stop token ends the response, it is bad when a bad
    token appears). A draw's score ``Y`` is its chance of turning bad: at each continuation step the exact mass of
    the bad next tokens, times the chance of having stayed good and unstopped so far, is added, and the next token
    is drawn among the good ones. ``E[Y | g] = P(bad | g)`` by induction over the steps — it is the expectation of
    the 0/1 "a sampled continuation is bad" score, with the last draw of each step averaged out exactly
    (Rao–Blackwellisation: same mean, less variance; for ``max_new_tokens = 2`` it has no sampling noise at all,
    only the choice of ``g`` does). Since ``g`` is drawn with probability ``p(g) / pruned_mass``,
    ``E[pruned_mass · Y] = Σ_g p(g)·P(bad | g) = R``: ``estimate = lower + pruned_mass · mean(Y)`` is unbiased,
    its standard error is ``pruned_mass · std(Y) / sqrt(n)`` (sample std), and as ``0 ≤ Y ≤ 1`` it always lies in
    the certified interval. Only ``generator`` is used for the draws (the global RNG is left alone), so a seed
    reproduces the estimate.

    Args:
        model: a causal LM whose output has ``logits`` ``(B, T, V)``: a `transformers` model,
            `trl_ext.models.ModulatedCausalLM` (its ``logits`` are already log-probs; ``log_softmax`` leaves them
            unchanged) or `trl_ext.models.AutoModelForCausalLMWithValueHead`. Run in eval mode under ``no_grad``;
            its previous mode is restored.
        prompt_ids: one unpadded prompt: a list of ints or a 1-D ``LongTensor`` (see :func:`prompt_token_ids`).
        bad_token_ids: the bad ids (a list, a tensor, or an object with a ``bad_token_ids`` attribute such as
            `trl_ext.rewards.LexicalReward`). An empty set gives probability 0 without running the model.
        max_new_tokens: the longest response ``L`` (≥ 1). The work grows like ``|G|^{L-1}`` without pruning.
        eos_token_id: stop id(s) that end a response. ``None`` takes the model's (generation) config
            ``eos_token_id``; pass ``[]`` for responses that never stop early. A stop id is bad only if listed.
        temperature: the sampling temperature ``T > 0``: next-token log-probs are ``log_softmax(logits / T)``.
        prune_below: do not expand prefixes whose probability is below this (``0``: exact result).
        batch_size: prefixes per forward pass.
        use_cache: run the prompt once and reuse its KV cache for every batch (``False``: recompute it per batch;
            also the automatic fallback when the model returns no batchable cache).
        max_prefixes: refuse (``ValueError``) to hold more good prefixes than this at one level; raise
            ``prune_below`` or lower ``max_new_tokens`` instead. ``None``: no limit.
        remainder_samples: pruned prefixes drawn to estimate the pruned part (``0``: none, ``estimate`` is then
            ``None`` when something was pruned; else at least 2, for a standard error). Unused when nothing is pruned.
        generator: a ``torch.Generator`` for those draws (on the model's device, or on the CPU), or an int seed;
            ``None`` seeds a fresh generator with 0, so results are reproducible by default.

    Returns:
        :class:`BadOutputProbability`.
    """
    if hasattr(bad_token_ids, "bad_token_ids") and not isinstance(bad_token_ids, torch.Tensor):
        bad_token_ids = bad_token_ids.bad_token_ids
    prompt = _prompt_tensor(prompt_ids)
    bad = sorted(set(_as_id_list(bad_token_ids, "bad_token_ids")))
    stops = sorted(set(_default_eos(model) if eos_token_id is None else _as_id_list(eos_token_id, "eos_token_id")))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}.")
    prune_below = float(prune_below)
    if not 0.0 <= prune_below < 1.0:
        raise ValueError(f"prune_below must be in [0, 1), got {prune_below} (0 gives the exact value).")
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    batch_size = int(batch_size)
    if isinstance(remainder_samples, bool) or not isinstance(remainder_samples, int) or remainder_samples < 0:
        raise ValueError(f"remainder_samples must be an integer >= 0, got {remainder_samples!r}.")
    if remainder_samples == 1:
        raise ValueError("remainder_samples must be 0 or >= 2 (one draw has no standard error).")
    for name, ids in (("bad_token_ids", bad), ("eos_token_id", stops)):
        if ids and ids[0] < 0:
            raise ValueError(f"{name} holds a negative id ({ids[0]}); token ids are >= 0.")
    limit = _vocab_limit(model)
    if limit is not None and int(prompt.max()) >= limit:
        raise ValueError(f"prompt_ids holds id {int(prompt.max())}, outside the model's vocabulary of {limit} ids.")
    if not bad:
        logger.warning("bad_output_probability: bad_token_ids is empty, so P(bad) = 0.")
        return BadOutputProbability(0.0, 0.0, 0.0, True, 0.0, 0, _NEG_INF, 0, estimate=0.0, stderr=0.0)

    device = next(model.parameters()).device
    with eval_mode(model):
        with torch.no_grad():
            scorer = _NextTokenScorer(model, prompt.to(device), temperature, use_cache)
            vocab = scorer.prompt_logprobs.shape[-1]
            for name, ids in (("bad_token_ids", bad), ("eos_token_id", stops)):
                if ids and ids[-1] >= vocab:
                    raise ValueError(f"{name} holds id {ids[-1]}, outside the model's {vocab} output logits.")
            bad_mask, good_ids = _token_sets(bad, stops, vocab, device)
            reservoir = None
            if remainder_samples and prune_below > 0:
                reservoir = _PrunedReservoir(remainder_samples, _as_generator(generator, device))
            result = _enumerate(
                scorer, bad_mask, good_ids, max_new_tokens, prune_below, batch_size, max_prefixes, reservoir
            )
            if reservoir is not None and reservoir.tokens is not None:
                scores = _remainder_scores(scorer, reservoir, bad_mask, good_ids, max_new_tokens, batch_size)
                mean, std = float(scores.mean()), float(scores.std())  # unbiased sample std (n >= 2)
                estimate = result.lower + result.pruned_mass * mean
                result.estimate = min(max(estimate, result.lower), result.upper)  # only rounding can leave it
                result.stderr = result.pruned_mass * std / math.sqrt(scores.numel())
                result.remainder_samples = scores.numel()
                result.num_forward_passes = scorer.num_calls
    return result


def _token_sets(bad: list[int], stops: list[int], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bad_mask (V,), good_ids)``: good = neither bad nor a stop token."""
    bad_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    bad_mask[bad] = True
    good_mask = ~bad_mask
    if stops:
        good_mask[stops] = False
    return bad_mask, torch.nonzero(good_mask).reshape(-1)


def _as_generator(generator: torch.Generator | int | None, device) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        return generator
    if generator is not None and (isinstance(generator, bool) or not isinstance(generator, int)):
        raise ValueError(f"generator must be a torch.Generator, an int seed or None, got {generator!r}.")
    return torch.Generator(device=device).manual_seed(0 if generator is None else generator)


def _draw(probs: torch.Tensor, generator: torch.Generator, num: int = 1) -> torch.Tensor:
    """``torch.multinomial`` with replacement on the generator's device; the ids come back on ``probs``' device."""
    return torch.multinomial(probs.to(generator.device), num, True, generator=generator).to(probs.device)


class _PrunedReservoir:
    """``n`` independent draws, with replacement, from the pruned prefixes in proportion to their probability,
    collected while the enumeration streams past them chunk by chunk. Each slot is overwritten by a draw from the
    new chunk with probability (chunk mass) / (pruned mass seen so far); a slot then ends up holding a draw from
    chunk ``c`` with probability ``m_c / W_c · Π_{c' > c} W_{c'-1} / W_{c'} = m_c / W_total``, as required."""

    def __init__(self, n: int, generator: torch.Generator):
        self.n, self.generator = n, generator
        self.log_seen = _NEG_INF
        self.tokens: torch.Tensor | None = None  # (n, longest) prefix ids, right-padded with -1
        self.lengths: torch.Tensor | None = None

    def offer(self, rows: torch.Tensor, good_ids: torch.Tensor, log_pruned: torch.Tensor) -> None:
        """``rows (r, k)`` expanded prefixes, ``log_pruned (r, |G|)`` the log-probability of each pruned extension
        ``row + good_ids[j]`` (``-inf`` where kept)."""
        row_mass = torch.logsumexp(log_pruned, dim=-1)
        log_chunk = float(torch.logsumexp(row_mass, dim=0))
        if log_chunk == _NEG_INF:
            return
        hi, lo = max(self.log_seen, log_chunk), min(self.log_seen, log_chunk)
        self.log_seen = hi if lo == _NEG_INF else hi + math.log1p(math.exp(lo - hi))
        replace = math.exp(log_chunk - self.log_seen)
        uniforms = torch.rand(self.n, generator=self.generator, device=self.generator.device, dtype=torch.float64)
        slots = torch.nonzero(uniforms < replace).reshape(-1).to(rows.device)
        if slots.numel() == 0:
            return
        which = _draw((row_mass - log_chunk).exp(), self.generator, slots.numel())
        cols = torch.cat([
            _draw((log_pruned[part] - row_mass[part, None]).exp().float(), self.generator)[:, 0]
            for part in which.split(64)
        ])  # fmt: skip
        drawn = torch.cat([rows[which], good_ids[cols][:, None]], dim=1)
        k = drawn.shape[1]
        if self.tokens is None:
            self.tokens = torch.full((self.n, k), -1, dtype=torch.long, device=rows.device)
            self.lengths = torch.zeros(self.n, dtype=torch.long, device=rows.device)
        if self.tokens.shape[1] < k:
            pad = self.tokens.new_full((self.n, k - self.tokens.shape[1]), -1)
            self.tokens = torch.cat([self.tokens, pad], dim=1)
        self.tokens[slots] = -1
        self.tokens[slots, :k] = drawn
        self.lengths[slots] = k


def _remainder_scores(scorer, reservoir, bad_mask, good_ids, max_new_tokens, batch_size) -> torch.Tensor:
    """The score ``Y`` of each drawn pruned prefix (see :func:`bad_output_probability`), ``(n,)`` float64."""
    scores = torch.zeros(reservoir.n, dtype=torch.float64, device=reservoir.tokens.device)
    for k in reservoir.lengths.unique().tolist():
        index = torch.nonzero(reservoir.lengths == k).reshape(-1)
        for part in index.split(batch_size):
            rows = reservoir.tokens[part, :k]
            score = torch.zeros(part.numel(), dtype=torch.float64, device=rows.device)
            alive = torch.ones_like(score)  # P(no bad and no stop token since the prefix | the tokens drawn)
            for step in range(max_new_tokens - k):
                logprobs = scorer(rows)
                score += alive * torch.logsumexp(logprobs[:, bad_mask], dim=-1).exp()
                if step == max_new_tokens - k - 1:
                    break
                good = logprobs[:, good_ids]
                log_good = torch.logsumexp(good, dim=-1, keepdim=True)
                alive = alive * log_good[:, 0].exp()
                probs = torch.where(log_good > _NEG_INF, (good - log_good).exp(), torch.ones_like(good))
                rows = torch.cat([rows, good_ids[_draw(probs, reservoir.generator)]], dim=1)
            scores[part] = score
    return scores


def _enumerate(scorer, bad_mask, good_ids, max_new_tokens, prune_below, batch_size, max_prefixes, reservoir=None):
    """The level-by-level enumeration (see the module docstring); pruned extensions go to ``reservoir``."""
    device = scorer.prompt_logprobs.device
    log_prune = math.log(prune_below) if prune_below > 0 else _NEG_INF

    zero = torch.tensor(_NEG_INF, dtype=torch.float64, device=device)
    found, pruned = zero.clone(), zero.clone()
    prefixes = torch.zeros(1, 0, dtype=torch.long, device=device)  # the empty prefix
    prefix_logp = torch.zeros(1, dtype=torch.float64, device=device)
    num_prefixes = 0
    for level in range(1, max_new_tokens + 1):
        last = level == max_new_tokens
        next_prefixes, next_logp = [], []
        for start in range(0, prefixes.shape[0], batch_size):
            rows, row_logp = prefixes[start : start + batch_size], prefix_logp[start : start + batch_size]
            step = scorer.prompt_logprobs[None] if level == 1 else scorer(rows)
            num_prefixes += rows.shape[0]
            found = _logaddexp(found, row_logp + torch.logsumexp(step[:, bad_mask].double(), dim=-1))
            if last:
                continue
            cand = row_logp[:, None] + step[:, good_ids].double()  # (n, |G|)
            keep = cand >= log_prune
            pruned = _logaddexp(pruned, cand[~keep])
            if reservoir is not None and not bool(keep.all()):
                reservoir.offer(rows, good_ids, cand.masked_fill(keep, _NEG_INF))
            row_idx, col_idx = torch.nonzero(keep, as_tuple=True)
            next_prefixes.append(torch.cat([rows[row_idx], good_ids[col_idx][:, None]], dim=1))
            next_logp.append(cand[row_idx, col_idx])
            held = sum(p.shape[0] for p in next_prefixes)
            if max_prefixes is not None and held > max_prefixes:
                raise ValueError(
                    f"More than {max_prefixes} good prefixes of length {level} to expand; raise prune_below (e.g. "
                    "1e-6), lower max_new_tokens, or raise max_prefixes."
                )
        if last or not next_prefixes:
            break
        prefixes, prefix_logp = torch.cat(next_prefixes), torch.cat(next_logp)
        if prefixes.shape[0] == 0:
            break

    log_found, log_pruned = float(found), float(pruned)
    lower, pruned_mass = math.exp(log_found), math.exp(log_pruned)
    exact = log_pruned == _NEG_INF
    upper = lower if exact else min(1.0, lower + pruned_mass)
    return BadOutputProbability(
        probability=lower,
        lower=lower,
        upper=upper,
        exact=exact,
        pruned_mass=pruned_mass,
        num_forward_passes=scorer.num_calls,
        log_probability=log_found,
        num_prefixes=num_prefixes,
        estimate=lower if exact else None,
        stderr=0.0 if exact else None,
    )


@dataclass
class ResponseKL:
    """Result of :func:`response_kl`."""

    value: float
    """Unbiased estimate of ``KL(p_θ ‖ p_0)`` between the two distributions of whole responses (nats)."""
    stderr: float
    """Its standard error (``0`` when ``max_new_tokens == 1``: then the value is exact)."""
    first_token: float
    """The exact KL of the first response token, ``KL(p_θ(y_1) ‖ p_0(y_1))`` (a part of ``value``)."""
    num_samples: int
    """Responses sampled from ``p_θ``."""


def response_kl(
    model: nn.Module,
    ref_model: nn.Module,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int = 2,
    eos_token_id: int | Sequence[int] | None = None,
    temperature: float = 1.0,
    num_samples: int = 256,
    generator: torch.Generator | int | None = None,
    batch_size: int = 256,
    use_cache: bool = True,
) -> ResponseKL:
    r"""``KL(p_θ ‖ p_0)`` of whole responses (at most ``max_new_tokens`` tokens, ended by the first stop token as in
    :func:`bad_output_probability`), between ``model`` (``p_θ``) and ``ref_model`` (``p_0``) after ``prompt_ids``.

    By the chain rule the response KL is the sum over positions ``t`` of ``E_{y<t ∼ p_θ}[1[y<t has not ended] ·
    KL(p_θ(· | y<t) ‖ p_0(· | y<t))]``, with each inner KL exact over the vocabulary (a stop token's own log-ratio
    is counted at its position; nothing after it). ``num_samples`` responses are drawn from ``p_θ`` and each one
    scores the sum of those exact per-position KLs along its path: an unbiased estimate, never negative, whose
    first term (the first token's KL) is exact and shared by every draw, so only the later positions add noise.
    Tokens are drawn with ``generator`` only (an int seed, or ``None`` for seed 0; the global RNG is untouched).
    Both models run in eval mode under ``no_grad`` and must share the tokenizer.
    """
    prompt = _prompt_tensor(prompt_ids)
    stops = sorted(set(_default_eos(model) if eos_token_id is None else _as_id_list(eos_token_id, "eos_token_id")))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
        raise ValueError(f"num_samples must be an integer >= 2 (for a standard error), got {num_samples!r}.")
    if not math.isfinite(float(temperature)) or float(temperature) <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}.")
    device = next(model.parameters()).device
    with eval_mode(model, ref_model), torch.no_grad():
        policy = _NextTokenScorer(model, prompt.to(device), float(temperature), use_cache)
        ref = _NextTokenScorer(
            ref_model, prompt.to(next(ref_model.parameters()).device), float(temperature), use_cache
        )
        first, vocab = policy.prompt_logprobs, policy.prompt_logprobs.shape[-1]
        if ref.prompt_logprobs.shape[-1] != vocab:
            raise ValueError(f"model has {vocab} output logits but ref_model {ref.prompt_logprobs.shape[-1]}.")
        if stops and (stops[0] < 0 or stops[-1] >= vocab):
            raise ValueError(f"eos_token_id holds id {stops[-1] if stops[0] >= 0 else stops[0]}, not a token id.")
        first_kl = float(full_kl(first, ref.prompt_logprobs.to(device)))
        gen = _as_generator(generator, device)
        stop_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        stop_mask[stops] = True
        totals = torch.full((num_samples,), first_kl, dtype=torch.float64, device=device)
        for part in torch.arange(num_samples, device=device).split(int(batch_size)):
            rows = _draw(first.exp(), gen, part.numel())[:, None]
            alive = ~stop_mask[rows[:, 0]]
            for position in range(1, max_new_tokens):
                if not bool(alive.any()):
                    break
                live = torch.nonzero(alive).reshape(-1)  # only responses that have not ended are run
                logprobs = policy(rows[live])
                kl = full_kl(logprobs, ref(rows[live].to(ref.prompt.device)).to(device))
                totals[part[live]] += kl
                if position == max_new_tokens - 1:
                    break
                nxt = torch.zeros_like(rows[:, :1])
                nxt[live] = _draw(logprobs.exp(), gen)
                rows = torch.cat([rows, nxt], dim=1)
                alive = alive.clone()
                alive[live] = ~stop_mask[nxt[live, 0]]
    return ResponseKL(float(totals.mean()), float(totals.std()) / math.sqrt(num_samples), first_kl, num_samples)


def prompt_token_ids(tokenizer, prompt, *, chat_template: bool = False) -> list[int]:
    """The token ids of a text prompt, as the trainers feed it to the policy.

    ``chat_template=False``: ``tokenizer(prompt, add_special_tokens=False)``. ``chat_template=True``: the prompt as
    one user turn (or a given list of ``{"role", "content"}`` messages) rendered with the tokenizer's chat template
    and its generation prompt, then tokenised without extra special tokens (the template holds them).
    """
    if chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat_template=True but the tokenizer has no chat template; set one or pass False.")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif not isinstance(prompt, str):
        raise ValueError(
            f"prompt must be a string (or messages with chat_template=True), got {type(prompt).__name__}."
        )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("The prompt tokenises to no tokens; pass a non-empty prompt.")
    return list(ids)
