r"""Where the SMC sampler gets its next-token distributions and twists from: *twist sources*.

At every step a source gives, for every particle (row) and every candidate next token ``y``,

- ``log p(y | s_{<t})``: the target's base model ``p`` (the policy whose outputs are studied),
- ``log q(y | s_{<t})``: the proposal particles are extended with,
- ``log ψ_t(s_{<t}, y)``: the twist of the intermediate target ``π_t ∝ p(s_{1:t})·ψ_t(s_{1:t})``,

as ``(B, V)`` tensors (:class:`StepScores`), and keeps whatever state it needs (KV caches, running sums) in particle
order: :meth:`TwistSource.reorder` applies a resampling step to it.

Sources:

- :class:`LMTwist`: a twist learned by :class:`~trl_ext.trainers.ProposalTrainer`, for every parameterisation it
  supports (docs/algorithms.md §6; ``v_t = log ψ_t`` as in :mod:`trl_ext.models.twist`):

  ==============================  ==================================================  ==========================
  parameterisation                ``log ψ_t(s_{<t}, y)``                                models run per step
  ==============================  ==================================================  ==========================
  ``policy_psi_q_p_s_t``          ``log q(y|s_{<t}) − log p(y|s_{<t})``                q and p
  ``policy_psi_q_p_s_1_to_t``     ``Σ_{k<t}(log q − log p)(s_k) + log q(y) − log p(y)``  q and p
  ``policy_psi_unnorm``           ``ℓ^q_t[y] − log p(y|s_{<t})`` (raw q logit)          q and p
  ``modulation_*``                ``m_t[y]`` (the modulation logits)                    the modulated model (its
                                                                                       base is p) [+ p if given]
  ==============================  ==================================================  ==========================

  In every case the proposal is the model ``q`` itself, which is the twist-induced proposal
  ``q_t(y) ∝ p(y|s_{<t})·ψ_t(s_{<t}, y)`` of that twist (so each incremental weight does not depend on the token
  drawn). ``policy_psi_q_p_s_1_to_t`` is the *implied twist of a proposal*: ``π_t ∝ q(s_{1:t})`` — use
  :func:`proposal_twist` for any proposal ``q`` and target ``p``.
- :class:`FunctionTwist`: ``log ψ_t`` from a function of the prefix (e.g. the exact optimal twist of an enumerated
  toy), with the twist-induced proposal, the target itself, or another LM as proposal. :func:`constant_twist`
  (``ψ ≡ 1``) turns SMC into importance sampling with proposal ``q`` (plain sampling from ``p`` when ``q = p``).

Cost: :attr:`TwistSource.row_forwards` sums the row-forwards of the models the source runs (:class:`CachedLM`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..models.modulated import ModulatedCausalLM
from ..models.twist import MODULATION_PARAMETERIZATIONS, POLICY_PARAMETERIZATIONS, modulation_kind_of
from ..utils import unwrap_model
from .cached_lm import CachedLM

__all__ = [
    "FunctionTwist",
    "LMTwist",
    "StepScores",
    "TwistSource",
    "constant_twist",
    "proposal_twist",
]


@dataclass
class StepScores:
    """Next-token scores of every particle, all ``(B, V)`` float32 (see the module doc)."""

    log_p: torch.Tensor
    log_q: torch.Tensor
    log_psi: torch.Tensor


class TwistSource(ABC):
    """Base class of twist sources: :meth:`start` on the prompts, :meth:`advance` by one token, :meth:`reorder`.

    Subclasses list their :class:`CachedLM` s in ``self.models`` (for :attr:`row_forwards`) and implement
    :meth:`_start`, :meth:`_advance` and :meth:`_reorder` (for the state they keep besides the caches).
    """

    models: list[CachedLM]

    @property
    def row_forwards(self) -> int:
        """Rows forwarded by every model of the source so far (one per row per model call)."""
        return sum(m.row_forwards for m in self.models)

    @property
    def device(self) -> torch.device:
        return self.models[0].device

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> StepScores:
        """Scores of the first response token for ``(B, P)`` left-padded prompts (one row per particle)."""
        return self._start(prompt_ids, prompt_mask)

    def advance(self, tokens: torch.Tensor) -> StepScores:
        """Append one token per row (``(B,)``) and return the scores of the next one."""
        return self._advance(tokens)

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes a copy of row ``index[i]`` (resampling), in every cache and running state."""
        for model in self.models:
            model.reorder(index)
        self._reorder(index)

    @abstractmethod
    def _start(self, prompt_ids, prompt_mask) -> StepScores: ...

    @abstractmethod
    def _advance(self, tokens) -> StepScores: ...

    @abstractmethod
    def _reorder(self, index: torch.Tensor) -> None: ...


def _last_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, -1].float(), dim=-1)


def _check_vocab(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{name}: the proposal scores {a.shape[-1]} tokens but the target {b.shape[-1]}; the twist, proposal and "
            "target must share one vocabulary (the same tokenizer and output size)."
        )


class LMTwist(TwistSource):
    """The twist of a proposal model trained by `ProposalTrainer` (module doc table), sampled with that model.

    Args:
        model: the trained proposal / twist model ``q``: a causal LM for ``policy_psi_*``, a `ModulatedCausalLM` of
            the matching kind for ``modulation_*``.
        parameterization: the parameterisation it was trained with (`trl_ext.models.twist.TWIST_PARAMETERIZATIONS`).
        reference_model: the target's base ``p``. Required for ``policy_psi_*``; for ``modulation_*`` it defaults to
            the modulated model's own frozen base (what `ProposalTrainer` uses when ``ref_model=None``).
        any_proposal: skip the check that a ``policy_psi_*`` model is a plain LM (:func:`proposal_twist` reads a
            modulated model's ``log q`` output as a plain proposal's log-probs).
    """

    def __init__(
        self,
        model: nn.Module,
        parameterization: str,
        reference_model: nn.Module | None = None,
        *,
        any_proposal: bool = False,
    ):
        inner = unwrap_model(model)
        modulated = isinstance(inner, ModulatedCausalLM) and not any_proposal
        if parameterization in MODULATION_PARAMETERIZATIONS:
            kind = modulation_kind_of(parameterization)
            if not modulated:
                raise ValueError(
                    f"parameterization={parameterization!r} reads the modulation logits of a ModulatedCausalLM, but "
                    f"the model is a {type(inner).__name__}; pass the trained ModulatedCausalLM or pick a "
                    "policy_psi_* parameterisation."
                )
            if inner.config.modulation_kind != kind:
                raise ValueError(
                    f"parameterization={parameterization!r} needs a {kind!r} modulation, but the model's "
                    f"modulation_kind is {inner.config.modulation_kind!r}; pass the matching parameterisation."
                )
        elif parameterization in POLICY_PARAMETERIZATIONS:
            if modulated:
                raise ValueError(
                    f"parameterization={parameterization!r} treats q as a plain causal LM, but the model is a "
                    f"ModulatedCausalLM (kind {inner.config.modulation_kind!r}); use its modulation_* "
                    "parameterisation."
                )
            if reference_model is None:
                raise ValueError(
                    f"parameterization={parameterization!r} defines ψ relative to the target's base p: pass "
                    "reference_model (the frozen p of the target, e.g. the policy whose P(bad) is estimated)."
                )
        elif parameterization == "policy":
            raise ValueError(
                "parameterization='policy' has no twist; pass the parameterisation the proposal was trained with, "
                "or use proposal_twist(q, p) for a plain proposal with its implied twist."
            )
        else:
            raise ValueError(
                f"Unknown parameterization {parameterization!r}; choose one of "
                f"{POLICY_PARAMETERIZATIONS + MODULATION_PARAMETERIZATIONS}."
            )
        self.parameterization = parameterization
        self.q = CachedLM(model)
        self.p = CachedLM(reference_model) if reference_model is not None else None
        self.models = [self.q] + ([self.p] if self.p is not None else [])
        self._prefix: torch.Tensor | None = None  # Σ_{k<t} (log q − log p)(s_k), for policy_psi_q_p_s_1_to_t
        self._last_step: torch.Tensor | None = None  # (B, V) log q − log p of the current step

    def _scores(self, q_out, p_out) -> StepScores:
        if self.parameterization in MODULATION_PARAMETERIZATIONS:
            log_q = q_out.logits[:, -1].float()  # a ModulatedCausalLM returns log q itself
            log_p = _last_log_softmax(p_out.logits if p_out is not None else q_out.base_logits)
            _check_vocab(self.parameterization, log_q, log_p)
            return StepScores(log_p, log_q, q_out.modulation_logits[:, -1].float().to(log_q.device))
        raw = q_out.logits[:, -1].float()
        log_q = torch.log_softmax(raw, dim=-1)
        log_p = _last_log_softmax(p_out.logits).to(log_q.device)
        _check_vocab(self.parameterization, log_q, log_p)
        if self.parameterization == "policy_psi_unnorm":
            return StepScores(log_p, log_q, raw - log_p)
        step = log_q - log_p
        if self.parameterization == "policy_psi_q_p_s_t":
            return StepScores(log_p, log_q, step)
        self._last_step = step
        return StepScores(log_p, log_q, self._prefix[:, None] + step)

    def _start(self, prompt_ids, prompt_mask) -> StepScores:
        q_out = self.q.start(prompt_ids, prompt_mask)
        p_out = self.p.start(prompt_ids, prompt_mask) if self.p is not None else None
        self._prefix = torch.zeros(prompt_ids.shape[0], device=self.q.device)
        return self._scores(q_out, p_out)

    def _advance(self, tokens) -> StepScores:
        if self.parameterization == "policy_psi_q_p_s_1_to_t":
            tokens_here = tokens.to(self._last_step.device)
            self._prefix = self._prefix + self._last_step.gather(1, tokens_here[:, None])[:, 0]
        q_out = self.q.advance(tokens)
        p_out = self.p.advance(tokens) if self.p is not None else None
        return self._scores(q_out, p_out)

    def _reorder(self, index: torch.Tensor) -> None:
        if self._prefix is not None:
            self._prefix = self._prefix.index_select(0, index.to(self._prefix.device))
        if self._last_step is not None:
            self._last_step = self._last_step.index_select(0, index.to(self._last_step.device))


def proposal_twist(proposal: nn.Module, target: nn.Module) -> LMTwist:
    """A proposal ``q`` with its implied twist ``ψ_t = q(s_{1:t})/p(s_{1:t})`` (intermediate targets
    ``π_t ∝ q(s_{1:t})``): every incremental weight is 1 until the sequence is complete, where it is
    ``p(s)·φ(s)/q(s)`` — importance sampling with ``q``, which resampling then never touches."""
    return LMTwist(proposal, "policy_psi_q_p_s_1_to_t", reference_model=target, any_proposal=True)


LogPsiFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FunctionTwist(TwistSource):
    """A twist given by a function of the prefix, with the target ``p`` (and optionally a proposal) run as LMs.

    Args:
        target: the target's base ``p`` (a causal LM).
        log_psi: ``(prompt_ids (B, P), prompt_mask (B, P), response_ids (B, t)) -> (B, V)`` values
            ``log ψ_{t+1}(s_{1:t}, y)`` for every candidate next token ``y`` (``-inf`` allowed: ``ψ = 0``), or
            ``None`` for the constant twist ``ψ ≡ 1``.
        proposal: ``"twist_induced"`` (default): ``q(y) ∝ p(y|s_{<t})·ψ_t(s_{<t}, y)``, the locally optimal
            proposal of the twist; ``"target"``: ``q = p``; or a causal LM sharing ``p``'s vocabulary.
    """

    def __init__(self, target: nn.Module, log_psi: LogPsiFn | None, proposal: str | nn.Module = "twist_induced"):
        self.p = CachedLM(target)
        self.log_psi_fn = log_psi
        if isinstance(proposal, str):
            if proposal not in ("twist_induced", "target"):
                raise ValueError(f"proposal must be 'twist_induced', 'target' or a causal LM, got {proposal!r}.")
            self.q = None
        else:
            self.q = CachedLM(proposal)
        self.proposal = proposal
        self.models = [self.p] + ([self.q] if self.q is not None else [])
        self._prompt_ids = self._prompt_mask = self._response = None

    def _scores(self, p_out, q_out) -> StepScores:
        log_p = _last_log_softmax(p_out.logits)
        if self.log_psi_fn is None:
            log_psi = torch.zeros_like(log_p)
        else:
            log_psi = self.log_psi_fn(self._prompt_ids, self._prompt_mask, self._response)
            log_psi = torch.as_tensor(log_psi, device=log_p.device).float()
        if log_psi.shape != log_p.shape:
            raise ValueError(
                f"log_psi returned shape {tuple(log_psi.shape)}; expected (rows, vocabulary) = {tuple(log_p.shape)}."
            )
        if q_out is not None:
            log_q = _last_log_softmax(q_out.logits).to(log_p.device)
            _check_vocab("FunctionTwist", log_q, log_p)
        elif self.proposal == "target":
            log_q = log_p
        else:
            log_q = torch.log_softmax(log_p + log_psi, dim=-1)
            if torch.isnan(log_q).any():
                raise ValueError(
                    "log_psi is -inf for every token of some row; the twist-induced proposal is undefined."
                )
        return StepScores(log_p, log_q, log_psi)

    def _start(self, prompt_ids, prompt_mask) -> StepScores:
        self._prompt_ids, self._prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        self._response = prompt_ids.new_zeros(prompt_ids.shape[0], 0).to(self.device)
        p_out = self.p.start(prompt_ids, prompt_mask)
        q_out = self.q.start(prompt_ids, prompt_mask) if self.q is not None else None
        return self._scores(p_out, q_out)

    def _advance(self, tokens) -> StepScores:
        self._response = torch.cat([self._response, tokens.to(self.device)[:, None]], dim=1)
        p_out = self.p.advance(tokens)
        q_out = self.q.advance(tokens) if self.q is not None else None
        return self._scores(p_out, q_out)

    def _reorder(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        self._prompt_ids = self._prompt_ids.index_select(0, index)
        self._prompt_mask = self._prompt_mask.index_select(0, index)
        self._response = self._response.index_select(0, index)


def constant_twist(target: nn.Module, proposal: nn.Module | None = None) -> FunctionTwist:
    """``ψ_t ≡ 1``: SMC with proposal ``q`` (default ``p`` itself) and no twist — importance sampling of
    ``p·φ`` when nothing is resampled, plain Monte Carlo when ``q = p``."""
    return FunctionTwist(target, None, proposal=proposal if proposal is not None else "target")
