"""How `HarmlessnessTrainer` steps two models with one optimizer: backward passes (already scaled for gradient
accumulation), the clip-and-step of one model while the other's gradients wait (module docs of
`harmlessness_trainer`), and when one policy forward can serve the proposal step too. A mixin: it reads the
trainer's ``args``, ``accelerator``, ``optimizer``, ``proposal``, ``_wrapper`` (`HarmlessnessModels`), ``_metrics``
and ``_timings``."""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ...models.lm_head import split_lm_head
from ...models.modulated import ModulatedCausalLM

__all__ = ["TwoModelStepping"]


class TwoModelStepping:
    """Backward passes and per-model optimizer steps of the policy and the proposal, and whether a step's policy
    forward also scores the proposal's samples."""

    #: One policy forward serves the policy step and the proposal rollout's log p_θ where that is exact
    #: (:meth:`_fuses_negative_forward`); False: a separate no-grad pass, as before (same results up to rounding).
    fuse_negative_forward = True

    def _fuses_negative_forward(self) -> bool:
        """Whether this step's policy forward (with gradient, over its own and the proposal's samples) also gives
        the proposal rollout's ``log p_θ`` (the q-step's reference log-probs and the σ-weights), in place of a
        separate no-grad pass over q's samples: with ``order="q_then_p"`` (the policy is the same in both),
        dropout off (train and eval forwards agree), the proposal's samples as the negatives, one process (DDP,
        FSDP and DeepSpeed expect each forward of the trained module to be followed by its backward, and here the
        proposal's forward and backward come between), and :attr:`fuse_negative_forward` (on)."""
        args = self.args
        return bool(
            self.fuse_negative_forward and self.proposal is not None and args.order == "q_then_p"
            and args.disable_dropout and args.negative_sampler == "proposal" and args.uses_negative_samples
            and self.accelerator.num_processes == 1 and not self.is_deepspeed_enabled
        )  # fmt: skip

    def _is_head_proposal(self) -> bool:
        """Whether the proposal is a head on the live policy (``modulation_*_head``): then a fused step's policy
        forward also gives its inputs, since its twist-loss step needs only the policy's final hidden states on q's
        samples, which that forward computes anyway (no separate trunk pass for the q-step)."""
        proposal = self.proposal
        return isinstance(proposal, ModulatedCausalLM) and proposal.live_base

    @contextlib.contextmanager
    def _hidden_for_proposal(self, enabled: bool, parts: list, first_row: int):
        """Around the policy forward over ``parts`` (the policy's rollout, then the proposal's from row
        ``first_row``): with ``enabled``, keep the hidden states of the proposal's rows at the positions predicting its
        response tokens for its proposal step (:meth:`_head_outputs`). None are kept when that forward scored through
        the logits (e.g. a trained LM head); the proposal step then runs its own trunk pass."""
        wrapper = self._wrapper
        wrapper.keep_hidden, wrapper.last_hidden, self._negative_hidden = enabled, None, None
        try:
            yield
        finally:
            hidden, wrapper.keep_hidden, wrapper.last_hidden = wrapper.last_hidden, False, None
        if enabled and hidden is not None:
            rollout = parts[-1]
            self._negative_hidden = (rollout, hidden[first_row:, : rollout.response_length])

    def _head_outputs(self, rollout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(log q, m)`` of a head proposal at ``rollout``'s response positions from the hidden states the policy
        forward kept for it (see :meth:`_hidden_for_proposal`), or ``None`` (the twist loss then runs q itself)."""
        kept, self._negative_hidden = getattr(self, "_negative_hidden", None), None
        if kept is None or kept[0] is not rollout:
            return None
        split = split_lm_head(self.policy)
        return None if split is None else self.proposal.outputs_from_hidden(kept[1], split.head)

    def _backward(self, loss: torch.Tensor) -> None:
        # Losses are already divided by the accumulation steps here; DeepSpeed must not divide again.
        kwargs = {"scale_wrt_gas": False} if self.is_deepspeed_enabled else {}
        self.accelerator.backward(loss, **kwargs)

    def _trained_params(self) -> dict[str, list[nn.Parameter]]:
        """``{"policy": [...], "proposal": [...]}``: the trainable parameters of each model as the trained module
        holds them *now* (FSDP2 replaces the parameters by sharded ones when the model is prepared, so a list taken
        at construction would name stale tensors)."""
        wrapper = self._wrapper
        modules = (("policy", wrapper.policy), ("proposal", wrapper.proposal))
        return {name: [p for p in m.parameters() if p.requires_grad] for name, m in modules if m is not None}

    def _step_only(self, part: str) -> None:
        """Clip (``max_grad_norm``) and step the parameters of one model; the other model's gradients are set
        aside meanwhile and this model's are cleared afterwards."""
        start = time.perf_counter()
        trained = self._trained_params()
        params = trained[part]
        others = [p for name, ps in trained.items() if name != part for p in ps]
        stashed = [(p, p.grad) for p in others if p.grad is not None]
        for p, _ in stashed:
            p.grad = None
        try:
            max_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
            norm = self.accelerator.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
            if norm is not None:
                self._metrics.add(f"grad_norm/{part}", norm)
            self.optimizer.step()
        finally:
            for p in params:
                p.grad = None
            for p, grad in stashed:
                p.grad = grad
            if part == "proposal":
                elapsed = time.perf_counter() - start
                self._timings["proposal_optimizer"] = self._timings.get("proposal_optimizer", 0.0) + elapsed
