"""How `HarmlessnessTrainer` steps its two models and when one policy forward serves both steps. The policy and the
proposal share one optimizer; which model leads a micro-step (back-propagated and stepped alone) and which closes it
through `Trainer` is written in `trainers/common/stepping.py`, whose :class:`ModelStepping` this extends. A mixin: it
reads the trainer's ``args``, ``accelerator``, ``optimizer``, ``proposal``, ``_wrapper`` (`HarmlessnessModels`),
``_metrics`` and ``_timings``, and calls its public hooks (``compute_policy_loss``, ``compute_proposal_loss``,
``compute_ptx_loss``)."""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ...models.lm_head import split_lm_head
from ...models.modulated import ModulatedCausalLM
from ...rollout import Rollout, forward_response
from ...rollout.vision import concat_vision
from ..common.stepping import ModelStepping
from .steps import HarmlessnessRollouts, HarmlessnessStep, stack_rollouts

__all__ = ["TwoModelStepping"]


class TwoModelStepping(ModelStepping):
    """The policy and the proposal as the stepped models, the leading step of a micro-step, the policy's forward and
    loss, the step's timings, and whether a step's policy forward also scores the proposal's samples."""

    #: One policy forward serves the policy step and the proposal rollout's log p_θ where that is exact
    #: (:meth:`_fuses_negative_forward`); False: a separate no-grad pass, as before (same results up to rounding).
    fuse_negative_forward = True

    def stepped_models(self) -> dict[str, nn.Module]:
        """``{"policy": ..., "proposal": ...}`` (no proposal: the policy alone), from the trained wrapper now."""
        wrapper = self._wrapper
        modules = (("policy", wrapper.policy), ("proposal", wrapper.proposal))
        return {name: module for name, module in modules if module is not None}

    def _step_alone(self, part: str) -> None:
        """:meth:`step_model` of ``part``; the proposal's optimizer time counts as ``timing/proposal_optimizer``."""
        seconds = self.step_model(part)
        if part == "proposal":
            self._timings["proposal_optimizer"] = self._timings.get("proposal_optimizer", 0.0) + seconds

    @contextlib.contextmanager
    def _timed(self, key: str):
        """Add the block's seconds to ``timing/<key>`` of this step, less those of timed blocks nested in it."""
        stack = self.__dict__.setdefault("_timing_stack", [])
        stack.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = stack.pop()
            self._timings[key] = self._timings.get(key, 0.0) + elapsed - inner
            if stack:
                stack[-1] += elapsed

    def _leading_step(self, model: nn.Module, step: HarmlessnessStep) -> str:
        """The micro-step's leading model (`trainers/common/stepping.py`): its loss and backward, and its own
        clip-and-step. Returns the model whose loss closes the step through :meth:`compute_loss`: ``"policy"``
        (no proposal step, or ``q_then_p`` after the proposal's), ``"proposal"`` (``p_then_q``, after the policy's
        step and with its reference log-probs recomputed under the updated policy) or ``"both"`` (DeepSpeed)."""
        rollouts = step.rollouts
        if rollouts.proposal is None or rollouts.proposal_reused:  # no proposal step
            return "policy"
        if self.is_deepspeed_enabled:  # one backward: the engine steps both models and clips their joint norm
            return "both"
        if self.args.order == "q_then_p":
            step.proposal_out = self._proposal_backward(
                model, rollouts.proposal, step.rewards.proposal_log_phi, step.scale
            )
            if self.accelerator.sync_gradients:
                self._step_alone("proposal")
            return "policy"
        with self._timed("policy_step"):  # p_then_q: update p, then train q towards the updated p
            loss = self._policy_loss(model, step)
            self.note_loss(loss, "policy loss")
            self.backward_scaled(loss)
        self._step_alone("policy")
        rollouts.proposal.ref_logprobs = self._policy_logprobs(rollouts.proposal)
        return "proposal"

    def _proposal_backward(self, model: nn.Module, rollout: Rollout, log_phi: torch.Tensor, scale: float):
        """A leading proposal step's twist loss (:meth:`compute_proposal_loss`) and its backward, ``× scale``."""
        with self._timed("proposal_step"):
            out = self.compute_proposal_loss(model, rollout, log_phi)
            self.note_loss(out.loss.loss, "proposal loss")
            self.backward_scaled(out.loss.loss * scale)
        return out

    def _policy_forward(self, model: nn.Module, rollouts: HarmlessnessRollouts, share_trunk: bool = False):
        """``(policy_lp, neg_lp, negatives)``: ``p_θ``'s log-probs, with gradient, on its samples and on the
        negatives (the proposal's samples or the SMC particles; ``policy_lp`` again without negatives), from one
        forward pass over both."""
        parts = [rollouts.policy]
        if rollouts.proposal is not None and self.args.uses_negative_samples:
            parts.append(rollouts.negatives if rollouts.negatives is not None else rollouts.proposal)
        ids, mask, T = stack_rollouts(parts)
        vision = concat_vision([part.vision for part in parts])
        B, T_p = rollouts.policy.batch_size, rollouts.policy.response_length
        # a head proposal's step reads the hidden states of its samples from here instead of running the trunk again
        with self._wrapper.acting_as("policy"), self._hidden_for_proposal(share_trunk and len(parts) > 1, parts, B):
            logprobs = forward_response(
                model, ids, mask, T, temperature=self.args.temperature, vision=vision,
                padding_free=self.args.padding_free,
            ).logprobs  # fmt: skip
        policy_lp = logprobs[:B, :T_p]
        neg_lp = logprobs[B:, : parts[-1].response_length] if len(parts) > 1 else policy_lp
        return policy_lp, neg_lp, parts[-1]

    def _policy_loss(self, model: nn.Module, step: HarmlessnessStep, extra_loss: torch.Tensor | None = None):
        """The step's policy loss ``× scale`` (plus ``extra_loss``), from the policy forward (:meth:`_policy_forward`,
        unless the step holds it already); sets ``step.policy_out`` and ``step.policy_logprobs``."""
        rollouts = step.rollouts
        policy_lp, neg_lp, negatives = self._policy_forward(model, rollouts) if step.forward is None else step.forward
        weight_lp = None
        if self.args.uses_negative_samples:
            weight_lp = neg_lp.detach() if self.args.disable_dropout else self._policy_logprobs(negatives)
        out = self.compute_policy_loss(
            policy_lp, rollouts, step.rewards, neg_logprobs=neg_lp, weight_logprobs=weight_lp
        )
        loss = out.loss if self._ptx is None else out.loss + self.compute_ptx_loss()
        step.policy_out, step.policy_logprobs = out, policy_lp.detach()
        return loss * step.scale + (extra_loss if extra_loss is not None else 0.0)

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
