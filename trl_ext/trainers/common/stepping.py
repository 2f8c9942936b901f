"""How the online trainers step their models: the one place where a trainer back-propagates or steps outside
`transformers.Trainer`.

Every online trainer's loss of a micro-step goes through ``compute_loss`` and `Trainer.training_step`'s backward,
and every accumulation ends in `Trainer`'s clip-and-step of the whole trained module:

- **PPO** (`trainers/ppo`): one module (policy, and the critic when there is one) and one optimizer;
  ``compute_loss`` returns policy loss + ``vf_coef`` × value loss, so the two are clipped together. During the
  critic warm-up the policy term is left out and its gradients stay ``None`` (the optimizer skips them).
- **Proposal / twist learning** (`trainers/proposal`): one model, the twist loss through ``compute_loss``.
- **RePULSe** (`trainers/harmlessness`): the policy and the proposal, one optimizer with a parameter group each,
  each clipped on its own. A micro-step has a *leading* model, whose loss is back-propagated and which is clipped
  and stepped alone here (:meth:`ModelStepping.step_model`), and a *closing* model, whose loss goes through
  ``compute_loss`` and `Trainer`'s optimizer step (its clipping then sees only that model's gradients, the leading
  model's having been cleared). ``order="q_then_p"``: the proposal leads (stepped at the accumulation's last
  micro-step); ``order="p_then_q"``: the policy leads and the proposal, trained towards the updated policy,
  closes. Extra proposal steps (``q_steps_per_p_step > 1``) are leading steps of their own. Under DeepSpeed the
  engine owns the step: both losses close together (one backward, joint clipping).
- **RePULSe on GRPO** (`trainers/repulse_grpo`): GRPO's policy steps as `GRPOTrainer` does; the proposal lives
  outside the prepared model with an optimizer of its own, so its leading step is :func:`step_own_optimizer`
  (gradients averaged over the processes by hand, clipped and stepped at the accumulation's end).

A trainer using :meth:`ModelStepping.step_model` names its models in :meth:`ModelStepping.stepped_models`.
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["ModelStepping", "step_own_optimizer"]


class ModelStepping:
    """Backward passes outside `Trainer.training_step` and the clip-and-step of one model of several sharing the
    optimizer. A mixin: it reads the trainer's ``args``, ``accelerator``, ``optimizer`` and ``_metrics``."""

    def stepped_models(self) -> dict[str, nn.Module]:
        """``{name: module}``: the models that share the optimizer and can be stepped alone, as the trained module
        holds them now (FSDP2 swaps parameters for sharded ones when the model is prepared). Default: the model."""
        return {"model": self.model}

    def _trained_params(self) -> dict[str, list[nn.Parameter]]:
        """The trainable parameters of each of :meth:`stepped_models`, looked up now (never cached)."""
        return {name: [p for p in m.parameters() if p.requires_grad] for name, m in self.stepped_models().items()}

    def backward_scaled(self, loss: torch.Tensor) -> None:
        """Back-propagate a loss already divided by the gradient-accumulation steps (DeepSpeed must not divide
        again), as `Trainer.training_step` does with ``loss_is_scaled_for_ga = True``."""
        kwargs = {"scale_wrt_gas": False} if self.is_deepspeed_enabled else {}
        self.accelerator.backward(loss, **kwargs)

    def step_model(self, name: str) -> float:
        """Clip (``max_grad_norm``; the norm is logged as ``grad_norm/<name>``) and step the parameters of model
        ``name`` only: the other models' gradients are set aside meanwhile and restored afterwards, and this
        model's are cleared. Returns the seconds it took."""
        start = time.perf_counter()
        trained = self._trained_params()
        params = trained[name]
        others = [p for other, ps in trained.items() if other != name for p in ps]
        stashed = [(p, p.grad) for p in others if p.grad is not None]
        for p, _ in stashed:
            p.grad = None
        try:
            max_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
            norm = self.accelerator.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
            if norm is not None:
                self._metrics.add(f"grad_norm/{name}", norm)
            self.optimizer.step()
        finally:
            for p in params:
                p.grad = None
            for p, grad in stashed:
                p.grad = grad
        return time.perf_counter() - start


def step_own_optimizer(accelerator, params: list[nn.Parameter], optimizer, max_grad_norm: float | None):
    """Step a model that is not part of the prepared module and has its own ``optimizer``: average the gradients of
    ``params`` over the processes (several processes), clip them to ``max_grad_norm`` (``None`` or ``<= 0``: no
    clipping), step and clear them. Returns the gradient norm before clipping."""
    if accelerator.num_processes > 1:
        for p in params:
            if p.grad is not None:
                p.grad = accelerator.reduce(p.grad, reduction="mean")
    max_norm = max_grad_norm if max_grad_norm and max_grad_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
