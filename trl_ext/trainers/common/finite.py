"""Non-finite losses, gradients and weights: what every trl_ext trainer on `transformers.Trainer` does about them.

- A micro-step whose loss is NaN or ±inf, or an optimizer step whose gradients hold one, **skips the optimizer
  step**: the gradients are thrown away just before ``optimizer.step()`` (a step pre-hook on the torch optimizer, so
  it also covers optimizers passed in ``optimizers=(...)`` and the extra per-model steps of `HarmlessnessTrainer`),
  the weights and the optimizer state (Adam moments, step count) stay as they were, a warning is logged and
  ``nonfinite/skipped_steps`` (skipped steps so far) joins the logs. `Trainer`'s bookkeeping goes on as for any
  step: ``global_step`` advances, the learning-rate scheduler steps, callbacks (EMA, checkpoints) run.
- After more than ``max_consecutive_skipped_steps`` skipped steps in a row the run stops with a `RuntimeError`
  (``0``: the first non-finite step stops it). A step that is taken resets the count.
- A run in which *every* optimizer step was skipped (fewer steps than that limit, e.g. a reward of 1e30 whose squares
  overflow in every loss) does not return as if it trained: ``train()`` raises a `RuntimeError` saying that nothing
  was trained (the weights are the initial ones) and why the steps were skipped.
- :func:`check_finite_weights`: a model with a NaN / ±inf weight is never saved (``save_model`` raises and writes
  nothing).

Under several processes the decision to skip is made together (a flag summed over processes), so the replicas never
diverge. Under DeepSpeed the engine owns the optimizer step (and skips fp16 overflows itself): there the step guard is
not installed, the loss check only logs, and the weights are checked on what the process holds. With fp16 and a
gradient scaler, the scaler skips overflowing steps first (that is how dynamic loss scaling works; those steps are not
counted here).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import get_total_norm

from .lifecycle import TrainLifecycle
from .run_folder import explain_disk_full

__all__ = [
    "FiniteStepsArguments",
    "FiniteStepsMixin",
    "check_finite_weights",
    "check_learning_rates",
    "grads_are_finite",
]

logger = logging.getLogger(__name__)

_MAX_NAMES = 5


@dataclass
class FiniteStepsArguments:
    """Config field of the non-finite step guard (mixed into every trl_ext trainer config)."""

    max_consecutive_skipped_steps: int = field(
        default=10,
        metadata={
            "help": "An optimizer step whose loss or gradients are NaN/inf is skipped (weights and optimizer state "
            "unchanged, logged as nonfinite/skipped_steps); more than this many skipped steps in a row stop the run "
            "with an error. 0: stop at the first non-finite step."
        },
    )

    def __post_init__(self):
        check_learning_rates(self)
        value = self.max_consecutive_skipped_steps
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{type(self).__name__}: max_consecutive_skipped_steps={value!r} must be an integer >= 0 (the number "
                "of non-finite optimizer steps in a row that are skipped before the run stops; 0: stop at once)."
            )
        super().__post_init__()


def check_learning_rates(config) -> None:
    """Refuse a negative or non-finite ``learning_rate`` (and the online trainers' other learning rates) when the
    config is built, before any model loads; torch's own error would come after the models load and leave an empty
    ``output_dir``. Every trl_ext config runs it (through :class:`FiniteStepsArguments`)."""
    for key in ("learning_rate", "proposal_learning_rate"):
        value = getattr(config, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(
                f"{type(config).__name__}: {key}={value!r}; it must be a finite number >= 0 (e.g. 1e-5): a negative "
                "learning rate climbs the loss instead of descending it."
            )


def grads_are_finite(params) -> bool:
    """Whether every gradient of ``params`` that exists is finite (one device sync per device).

    Fast path: the L2 norm of all of a device's gradients (``torch.nn.utils.get_total_norm``, one vectorised pass,
    ~7x faster on CPU than an elementwise ``isfinite``) is finite only if every element is; only when it is not
    (a NaN/inf, or a sum of squares past the dtype's range) is each gradient checked element by element."""
    grads: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor (FSDP2): this process's shard
        if grad.numel():
            grads.setdefault(grad.device, []).append(grad)
    for tensors in grads.values():
        if bool(torch.isfinite(get_total_norm(tensors, 2.0, foreach=True))):
            continue
        if not bool(torch.stack([torch.isfinite(g).all() for g in tensors]).all()):
            return False
    return True


def _nonfinite_names(named_tensors) -> list[str]:
    bad = []
    for name, tensor in named_tensors:
        if torch.is_tensor(tensor) and tensor.is_floating_point() and tensor.numel():
            if not bool(torch.isfinite(tensor).all()):
                bad.append(name)
    return bad


def check_finite_weights(model: nn.Module | None = None, state_dict: dict | None = None, what: str = "model") -> None:
    """Raise a ``ValueError`` naming the weights of ``model`` (or of ``state_dict``) that hold NaN or ±inf, before
    anything is written: a NaN model is never saved."""
    named = state_dict.items() if state_dict is not None else (model.named_parameters() if model is not None else ())
    bad = _nonfinite_names(named)
    if bad:
        more = f" and {len(bad) - _MAX_NAMES} more" if len(bad) > _MAX_NAMES else ""
        raise ValueError(
            f"Refusing to save the {what}: {len(bad)} weight tensor(s) hold NaN or inf ({', '.join(bad[:_MAX_NAMES])}"
            f"{more}); nothing was written. Training diverged (a NaN reward, loss or gradient reached the optimizer): "
            "resume from the last checkpoint with a lower learning_rate, a max_grad_norm, or a fixed reward."
        )


class FiniteStepsMixin(TrainLifecycle):
    """Trainer mixin (before the `transformers.Trainer` class in the bases): skip optimizer steps with a non-finite
    loss or gradient, stop after ``max_consecutive_skipped_steps`` in a row, refuse to save a non-finite model (see the
    module docs).

    A trainer that runs its own backward passes (instead of `Trainer.training_step`) calls
    :meth:`guard_optimizer_steps` at the start of its micro-step and :meth:`note_loss` for every loss it
    backpropagates."""

    _nonfinite_hook = None  # (optimizer, handle) of the installed step pre-hook
    _nonfinite_reason: str | None = None  # why the coming optimizer step must be skipped (a loss of this step)
    _consecutive_skipped_steps: int = 0
    _skipped_steps: int = 0
    _taken_steps: int = 0
    _last_skip_reason: str | None = None

    def _before_train(self, resume_from_checkpoint):
        self._skipped_steps = self._taken_steps = 0
        return resume_from_checkpoint

    def _after_train(self) -> None:
        """A `RuntimeError` when every optimizer step of the run was skipped as non-finite
        (:meth:`check_something_trained`)."""
        self.check_something_trained()

    def check_something_trained(self) -> None:
        """Raise a `RuntimeError` when optimizer steps were skipped as non-finite and none was taken: the run would
        otherwise end normally with the weights it started from."""
        if self._skipped_steps == 0 or self._taken_steps > 0:
            return
        raise RuntimeError(
            f"{type(self).__name__}: all {self._skipped_steps} optimizer steps of this run were skipped as "
            f"non-finite (the last: {self._last_skip_reason}); nothing was trained and the weights are the ones the "
            "run started from. Look for NaN/inf or huge values in the rewards, data or loaded weights (a checkpoint "
            "with NaN weights skips every step), lower learning_rate or set max_grad_norm, then run again."
        )

    # ------------------------------------------------------------------------------------------------ loss
    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """`Trainer.training_step` (forward, backward), with the step guard installed and the loss checked."""
        self.guard_optimizer_steps()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.note_loss(loss)
        return loss

    def note_loss(self, loss: torch.Tensor, what: str = "loss") -> None:
        """Mark the coming optimizer step to be skipped when ``loss`` (of one of its micro-steps) is NaN or ±inf."""
        if self._nonfinite_reason is not None or not torch.is_tensor(loss):
            return
        if bool(torch.isfinite(loss.detach()).all()):
            return
        value = loss.detach().float().reshape(-1)[0].item() if loss.numel() else math.nan
        if self._nonfinite_hook is None:  # DeepSpeed (or no torch optimizer): the engine steps; say so at least
            logger.warning("%s: non-finite %s (%s) at step %s; this optimizer step is not guarded.",
                           type(self).__name__, what, value, getattr(self.state, "global_step", None))  # fmt: skip
            return
        self._nonfinite_reason = f"non-finite {what} ({value})"

    # ------------------------------------------------------------------------------------------------ step
    def _max_consecutive_skipped_steps(self) -> int:
        return int(getattr(self.args, "max_consecutive_skipped_steps", 10))

    def guard_optimizer_steps(self) -> None:
        """Install the step pre-hook on the torch optimizer inside ``self.optimizer`` (once per optimizer; not under
        DeepSpeed, whose engine steps itself)."""
        optimizer = getattr(self, "optimizer", None)
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):  # accelerate's wrapper
            optimizer = optimizer.optimizer
        hooked = self._nonfinite_hook
        if hooked is not None and hooked[0] is optimizer:
            return
        if hooked is not None:
            hooked[1].remove()
        self._nonfinite_hook, self._nonfinite_reason = None, None
        self._consecutive_skipped_steps = 0
        if getattr(self, "is_deepspeed_enabled", False) or not isinstance(optimizer, torch.optim.Optimizer):
            return
        self._nonfinite_hook = (optimizer, optimizer.register_step_pre_hook(self._before_optimizer_step))

    def _skip_decision(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Why this step is skipped (``None``: it is taken), agreed by every process."""
        reason = self._nonfinite_reason
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if reason is None and not grads_are_finite(params):
            reason = "non-finite gradient (NaN or inf)"
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            flag = torch.tensor([1.0 if reason else 0.0], device=accelerator.device)
            if float(accelerator.reduce(flag, reduction="sum")) > 0 and reason is None:
                reason = "non-finite loss or gradient on another process"
        return reason

    def _before_optimizer_step(self, optimizer, args, kwargs):
        reason = self._skip_decision(optimizer)
        self._nonfinite_reason = None
        if reason is None:
            self._consecutive_skipped_steps = 0
            self._taken_steps += 1
            return None
        self._last_skip_reason = reason
        for group in optimizer.param_groups:  # the optimizer skips parameters without gradient: nothing changes
            for p in group["params"]:
                p.grad = None
        self._consecutive_skipped_steps += 1
        self._skipped_steps += 1
        limit, run = self._max_consecutive_skipped_steps(), self._consecutive_skipped_steps
        step = getattr(getattr(self, "state", None), "global_step", 0) + 1  # the optimizer step being taken
        if run > limit:
            raise RuntimeError(
                f"{type(self).__name__}: {run} optimizer steps in a row had a non-finite loss or gradient (the last: "
                f"step {step}, {reason}); stopping (max_consecutive_skipped_steps={limit}). The weights are those of "
                "the last step taken (skipped steps change nothing). Look for NaN/inf in the data or rewards, "
                "lower learning_rate, set max_grad_norm, train in fp32/bf16 rather than fp16, or raise "
                "max_consecutive_skipped_steps to ride out longer bursts."
            )
        logger.warning(
            "%s: skipped the optimizer step %s: %s (%d in a row; more than %d in a row stop the run).",
            type(self).__name__, step, reason, run, limit,
        )  # fmt: skip
        return None

    # ------------------------------------------------------------------------------------------ logs, saving
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, with ``nonfinite/skipped_steps`` (optimizer steps skipped so far) once one was skipped."""
        if self._skipped_steps and not any(key.startswith("eval_") for key in logs):
            logs["nonfinite/skipped_steps"] = self._skipped_steps
        super().log(logs, start_time)

    def check_finite_weights(self, state_dict: dict | None = None) -> None:
        """:func:`check_finite_weights` on the trained model (or on the gathered ``state_dict``)."""
        model = None if state_dict is not None else self.accelerator.unwrap_model(self.model)
        check_finite_weights(model, state_dict, what=f"{type(self).__name__}'s model")

    def _write_saved_model(self, output_dir: str | None, _internal_call: bool) -> None:
        """`Trainer.save_model` after :meth:`check_finite_weights` (a model with NaN/inf weights is not saved); a full
        disk is reported with the folder and its free space."""
        self.check_finite_weights()
        with explain_disk_full(output_dir if output_dir is not None else self.args.output_dir):
            super()._write_saved_model(output_dir, _internal_call)
