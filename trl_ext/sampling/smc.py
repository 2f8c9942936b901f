r"""Batched twisted sequential Monte Carlo over token sequences.

:func:`twisted_smc` runs ``K`` particles for each of ``G`` prompts (groups; the same prompt repeated ``G`` times
gives ``G`` independent runs) towards ``σ(s) ∝ p(s|x)·φ(s)``:

1. every alive particle is extended by one token ``s_t ~ q(·|s_{<t})`` from its :class:`~.twists.TwistSource`
   (or from the defensive mixture ``(1 − ε)·q + ε·p`` with ``SMCConfig.proposal_mix = ε``, which then stands for
   ``q`` below);
2. it gets the incremental log-weight ``log p(s_t) + log ψ_t(s_{1:t}) − log q(s_t) − log ψ_{t−1}(s_{1:t−1})``
   (:func:`~.smc_math.incremental_log_weight`), with ``log φ(s_{1:t})`` in place of ``log ψ_t`` when the response is
   complete (a stop token of ``stop_token_ids`` was drawn, or ``t = max_new_tokens``); a complete particle keeps
   its weight and receives padding from then on;
3. before the last step, every group whose effective sample size is below ``ess_threshold·K`` (every group when
   ``ess_threshold = 1``) is resampled
   (multinomial or systematic): the mean of its weights enters its evidence estimate, its particles are replaced by
   copies of the drawn ancestors — responses, running twist values and the twist source's KV caches alike — and its
   weights are reset to 1.

At the end the mean of the remaining weights completes ``Ẑ`` (:mod:`.smc_math`): ``E[Ẑ] = Z_σ = Σ_s p(s)φ(s)``
and ``E[log Ẑ] ≤ log Z_σ``. The particles with their normalised final weights approximate ``σ``
(:meth:`SMCResult.normalized_weights`, :meth:`SMCResult.resample`).

**Conditional SMC** (``reference_ids``): particle 0 of each group is forced to follow a given response, and
resampling never replaces it (:func:`~.smc_math.conditional_multinomial_resample`). When that response is an exact
sample of ``σ``, ``E[log Ẑ] ≥ log Z_σ``: the upper half of the bidirectional bound of Zhao et al. (2024).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .potentials import Potential
from .smc_math import (
    RESAMPLING_SCHEMES,
    effective_sample_size,
    incremental_log_weight,
    log_mean_exp,
    normalized_weights,
    resample,
)
from .twists import TwistSource

__all__ = ["SMCConfig", "SMCResult", "twisted_smc"]


@dataclass
class SMCConfig:
    """Settings of :func:`twisted_smc`.

    Parameters:
        num_particles: ``K``, particles per group.
        max_new_tokens: ``T``, the longest response.
        resampling: ``"multinomial"``, ``"systematic"`` or ``"none"`` (sequential importance sampling).
        ess_threshold: resample a group when its effective sample size falls below ``ess_threshold·K``; ``1``
            resamples at every step (before the last), ``0`` never.
        stop_token_ids: tokens that end a response (kept as its last token); empty: every response has ``T`` tokens.
        pad_token_id: the id written after a response's end.
        proposal_mix: ``ε``, draw tokens from the defensive mixture ``(1 − ε)·q + ε·p`` instead of ``q`` (the
            weights use the mixture's probability, so every estimate stays exact); ``0`` (default) is plain ``q``.
    """

    num_particles: int = field(default=16, metadata={"help": "K: particles per prompt (per independent run)."})
    max_new_tokens: int = field(default=2, metadata={"help": "T: the longest response, in tokens."})
    resampling: str = field(
        default="multinomial",
        metadata={"help": "Resampling scheme: 'multinomial', 'systematic' or 'none'.", "choices": RESAMPLING_SCHEMES},
    )
    ess_threshold: float = field(
        default=0.5,
        metadata={
            "help": "Resample a group when its effective sample size is below ess_threshold × K (0 to 1; 1: at every "
            "step, 0: never)."
        },
    )
    stop_token_ids: list[int] = field(
        default_factory=list,
        metadata={"help": "Token ids that end a response (e.g. the EOS id); empty: all responses have T tokens."},
    )
    pad_token_id: int = field(default=0, metadata={"help": "Id written after a response's end."})
    proposal_mix: float = field(
        default=0.0,
        metadata={
            "help": "ε in [0, 1]: sample each token from (1 − ε)·q + ε·p, a defensive mixture with the target that "
            "bounds every incremental weight's p/q factor by 1/ε (a twist that collapsed onto a few tokens can no "
            "longer miss the rest); 0: q alone."
        },
    )

    def __post_init__(self):
        if not isinstance(self.num_particles, int) or self.num_particles < 1:
            raise ValueError(f"num_particles must be a positive int, got {self.num_particles!r}.")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}.")
        if self.resampling not in RESAMPLING_SCHEMES:
            raise ValueError(f"resampling must be one of {RESAMPLING_SCHEMES}, got {self.resampling!r}.")
        if not 0.0 <= self.ess_threshold <= 1.0:
            raise ValueError(f"ess_threshold must be in [0, 1], got {self.ess_threshold}.")
        if not 0.0 <= self.proposal_mix <= 1.0:
            raise ValueError(f"proposal_mix must be in [0, 1], got {self.proposal_mix}.")
        self.stop_token_ids = [int(i) for i in self.stop_token_ids]


@dataclass
class SMCResult:
    """The particles of :func:`twisted_smc` and its estimates. ``G`` groups of ``K`` particles, ``B = G·K`` rows
    (group by group), ``T`` response tokens. Per-token records follow each particle's ancestral line."""

    prompt_ids: torch.Tensor
    """``(B, P)`` left-padded prompts (each group's prompt repeated ``K`` times)."""
    prompt_mask: torch.Tensor
    """``(B, P)``."""
    response_ids: torch.Tensor
    """``(B, T)`` responses; ``pad_token_id`` after each one's end."""
    response_mask: torch.Tensor
    """``(B, T)`` 1 up to and including the stop token (or the ``T``-th token)."""
    log_weights: torch.Tensor
    """``(G, K)`` float64 log-weights accumulated since each group's last resampling."""
    log_z: torch.Tensor
    """``(G,)`` float64 ``log Ẑ`` per group."""
    ess: torch.Tensor
    """``(steps, G)`` float64 effective sample size after each step's weighting, before resampling."""
    num_resampling: torch.Tensor
    """``(G,)`` how many times each group was resampled."""
    log_phi: torch.Tensor
    """``(B,)`` float64 ``log φ`` of the final responses."""
    token_log_p: torch.Tensor
    """``(B, T)`` float32 ``log p`` of the response tokens (0 on padding)."""
    token_log_q: torch.Tensor
    """``(B, T)`` float32 ``log q`` of the response tokens (of the mixture when ``proposal_mix > 0``)."""
    token_log_psi: torch.Tensor
    """``(B, T)`` float32 ``log ψ_t`` of the response prefixes (the last token's entry is the twist, not ``φ``)."""
    row_forwards: int
    """Rows forwarded through the source's models (one per row per model call)."""

    @property
    def num_groups(self) -> int:
        return self.log_weights.shape[0]

    @property
    def num_particles(self) -> int:
        return self.log_weights.shape[1]

    @property
    def z(self) -> torch.Tensor:
        """``(G,)`` float64 ``Ẑ`` (may underflow to 0; :attr:`log_z` does not)."""
        return self.log_z.exp()

    def normalized_weights(self) -> torch.Tensor:
        """``(G, K)`` normalised final weights (zeros for a group whose weights are all zero)."""
        return normalized_weights(self.log_weights)

    def final_ess(self) -> torch.Tensor:
        """``(G,)`` effective sample size of the final weights."""
        return effective_sample_size(self.log_weights)

    def resample(self, generator: torch.Generator | None = None, scheme: str = "multinomial") -> torch.Tensor:
        """``(B,)`` row indices of ``K`` equally weighted draws per group from the final weighted particles (an
        approximate sample of ``σ``). Groups whose weights are all zero keep their own rows."""
        G, K = self.log_weights.shape
        rows = torch.arange(G * K, device=self.log_weights.device).view(G, K)
        alive = torch.isfinite(self.log_weights).any(dim=-1)
        if alive.any():
            picked = resample(self.log_weights[alive], scheme, generator)
            rows[alive] = rows[alive].gather(1, picked.to(rows.device))
        return rows.reshape(-1)


def _check_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be (G, P) left-padded prompts, got shape {tuple(prompt_ids.shape)}.")
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids)
    elif prompt_mask.dim() == 1:
        prompt_mask = prompt_mask[None]
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} must match prompt_ids {tuple(prompt_ids.shape)}.")
    return prompt_ids.long(), prompt_mask.long()


def _check_reference(reference_ids, reference_mask, G: int, config: SMCConfig) -> tuple[torch.Tensor, torch.Tensor]:
    T = config.max_new_tokens
    if reference_ids.dim() != 2 or reference_ids.shape[0] != G or reference_ids.shape[1] > T:
        raise ValueError(
            f"reference_ids must be (groups={G}, ≤ max_new_tokens={T}) responses, got {tuple(reference_ids.shape)}."
        )
    if reference_mask is None:
        reference_mask = torch.ones_like(reference_ids)
    if reference_mask.shape != reference_ids.shape:
        raise ValueError("reference_mask must have the shape of reference_ids.")
    width = reference_ids.shape[1]
    ids = torch.full((G, T), config.pad_token_id, dtype=torch.long)
    mask = torch.zeros(G, T, dtype=torch.long)
    ids[:, :width], mask[:, :width] = reference_ids.long().cpu(), reference_mask.long().cpu()
    lengths = mask.sum(-1)
    if not bool((mask == (torch.arange(T)[None] < lengths[:, None]).long()).all()) or bool((lengths == 0).any()):
        raise ValueError("Each reference response must have a mask of ones then zeros, with at least one token.")
    stops = torch.tensor(config.stop_token_ids, dtype=torch.long)
    for g in range(G):
        n = int(lengths[g])
        body = ids[g, : n - 1]
        if torch.isin(body, stops).any() or (n < T and not bool(torch.isin(ids[g, n - 1], stops))):
            raise ValueError(
                f"Reference response {g} ({ids[g, :n].tolist()}) is not one the sampler can produce: it must end at "
                f"its first stop token {config.stop_token_ids} or after max_new_tokens={T} tokens."
            )
    return ids, mask


def _sample(log_q: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    probs = log_q.float().exp()
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(log_q.device)


def _mixed_log_q(log_q: torch.Tensor, log_p: torch.Tensor, mix: float) -> torch.Tensor:
    """``log((1 − ε)·q + ε·p)`` per token (``ε = mix``): ``log_q`` at ``ε = 0``, ``log_p`` at ``ε = 1``."""
    if mix <= 0.0:
        return log_q
    if mix >= 1.0:
        return log_p
    return torch.logaddexp(log_q + math.log1p(-mix), log_p + math.log(mix))


def _gather(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return values.gather(1, tokens[:, None])[:, 0]


def twisted_smc(
    source: TwistSource,
    prompt_ids: torch.Tensor,
    log_phi: Potential,
    config: SMCConfig,
    *,
    prompt_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    reference_ids: torch.Tensor | None = None,
    reference_mask: torch.Tensor | None = None,
) -> SMCResult:
    """Run twisted SMC (module doc) for ``G`` left-padded prompts ``(G, P)`` (or one ``(P,)`` prompt).

    Args:
        source: the twist source (:mod:`.twists`): target ``p``, proposal ``q`` and twist ``ψ``.
        prompt_ids: ``(G, P)`` prompt ids; repeat a prompt to get independent runs on it.
        log_phi: the final potential (:mod:`.potentials`).
        config: :class:`SMCConfig`.
        prompt_mask: ``(G, P)``; default all ones.
        generator: generator of the token draws and of resampling (CPU or the model's device).
        reference_ids: ``(G, ≤T)`` responses forced on particle 0 of each group (conditional SMC; multinomial
            resampling only); ``reference_mask`` marks their tokens (default all ones).

    Returns:
        An :class:`SMCResult`.
    """
    prompt_ids, prompt_mask = _check_prompts(prompt_ids, prompt_mask)
    G, K, T = prompt_ids.shape[0], config.num_particles, config.max_new_tokens
    B = G * K
    conditional = reference_ids is not None
    if conditional:
        if config.resampling == "systematic":
            raise ValueError(
                "Conditional SMC (reference_ids) resamples multinomially; set resampling='multinomial' or 'none'."
            )
        ref_ids, ref_mask = _check_reference(reference_ids, reference_mask, G, config)
    ids = prompt_ids.repeat_interleave(K, dim=0)
    mask = prompt_mask.repeat_interleave(K, dim=0)
    start_forwards = source.row_forwards
    scores = source.start(ids, mask)
    device = scores.log_p.device
    ids, mask = ids.to(device), mask.to(device)
    stops = torch.tensor(config.stop_token_ids, dtype=torch.long, device=device)
    response = torch.full((B, T), config.pad_token_id, dtype=torch.long, device=device)
    response_mask = torch.zeros(B, T, dtype=torch.long, device=device)
    records = {name: torch.zeros(B, T, device=device) for name in ("log_p", "log_q", "log_psi")}
    log_w = torch.zeros(B, dtype=torch.float64, device=device)
    prev_psi = torch.zeros(B, dtype=torch.float64, device=device)
    final_phi = torch.full((B,), -math.inf, dtype=torch.float64, device=device)
    log_z = torch.zeros(G, dtype=torch.float64, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    num_resampling = torch.zeros(G, dtype=torch.long, device=device)
    ess_steps = []
    ref_rows = torch.arange(G, device=device) * K
    tokens = torch.full((B,), config.pad_token_id, dtype=torch.long, device=device)
    for t in range(T):
        if t > 0:
            if not alive.any():
                break
            scores = source.advance(tokens)
        log_q_step = _mixed_log_q(scores.log_q, scores.log_p, config.proposal_mix)
        tokens = _sample(log_q_step, generator)
        if conditional:
            tokens[ref_rows] = ref_ids[:, t].to(device)
        tokens = torch.where(alive, tokens, torch.full_like(tokens, config.pad_token_id))
        lp, lq, lpsi = (_gather(v, tokens).double() for v in (scores.log_p, log_q_step, scores.log_psi))
        response[:, t] = tokens
        response_mask[:, t] = alive.long()
        for name, value in (("log_p", lp), ("log_q", lq), ("log_psi", lpsi)):
            records[name][:, t] = torch.where(alive, value, torch.zeros_like(value)).float()
        ends = alive & (torch.isin(tokens, stops) if t < T - 1 else torch.ones_like(alive))
        step_psi = lpsi.clone()
        if ends.any():
            phi = torch.as_tensor(
                log_phi(ids[ends], mask[ends], response[ends, : t + 1], response_mask[ends, : t + 1]),
                dtype=torch.float64,
            ).to(device)
            step_psi[ends] = phi
            final_phi[ends] = phi
        increment = incremental_log_weight(lp, lq, step_psi, prev_psi)
        log_w = log_w + torch.where(alive, increment, torch.zeros_like(increment))
        prev_psi = torch.where(alive & ~ends, lpsi, prev_psi)
        alive = alive & ~ends
        grouped = log_w.view(G, K)
        ess = effective_sample_size(grouped)
        ess_steps.append(ess)
        if t == T - 1 or not alive.any() or config.resampling == "none":
            continue
        need = (ess < config.ess_threshold * K) | (config.ess_threshold >= 1.0)
        need &= torch.isfinite(grouped).any(dim=-1)
        if not need.any():
            continue
        log_z[need] += log_mean_exp(grouped[need])
        picked = resample(grouped[need], config.resampling, generator, conditional=conditional).to(device)
        rows = torch.arange(B, device=device).view(G, K)
        rows[need] = rows[need].gather(1, picked)
        index = rows.reshape(-1)
        response, response_mask = response.index_select(0, index), response_mask.index_select(0, index)
        records = {name: value.index_select(0, index) for name, value in records.items()}
        prev_psi, final_phi = prev_psi.index_select(0, index), final_phi.index_select(0, index)
        alive, tokens = alive.index_select(0, index), tokens.index_select(0, index)
        log_w = log_w.index_select(0, index).view(G, K)
        log_w[need] = 0.0
        log_w = log_w.reshape(-1)
        num_resampling[need] += 1
        source.reorder(index)
    grouped = log_w.view(G, K)
    log_z = log_z + log_mean_exp(grouped)
    return SMCResult(
        prompt_ids=ids,
        prompt_mask=mask,
        response_ids=response,
        response_mask=response_mask,
        log_weights=grouped,
        log_z=log_z,
        ess=torch.stack(ess_steps),
        num_resampling=num_resampling,
        log_phi=final_phi,
        token_log_p=records["log_p"],
        token_log_q=records["log_q"],
        token_log_psi=records["log_psi"],
        row_forwards=source.row_forwards - start_forwards,
    )
