"""Attributes of TRL ≤ 1.12's ``PPOTrainer`` that migrated scripts read, on trl_ext's `PPOTrainer`.

1.12 kept its own training loop and exposed its pieces: the prompt dataloaders, the per-process seed, the sampling
cadence, whether the policy is a PEFT model and the context that runs the policy as its reference. trl_ext's trainer
runs on `transformers.Trainer`, but the same names give the same things here.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

from torch.utils.data import DataLoader
from transformers import TrainerCallback

from ...models.lora import is_peft_model

__all__ = ["CountUpdates", "TRL112Attributes", "UpdateCadence", "update_columns"]


class TRL112Attributes:
    """Mixin of `PPOTrainer` (before `OnlineTrainerMixin` in the bases): TRL 1.12's public attributes."""

    @property
    def is_peft_model(self) -> bool:
        """Whether the policy carries PEFT adapters (1.12: ``isinstance(model, PeftModel)``)."""
        return is_peft_model(self.policy_model)

    @contextlib.contextmanager
    def null_ref_context(self) -> Iterator[None]:
        """Run the policy as its own reference for the block: with a PEFT policy and no ``ref_model``, its adapters
        are disabled (or ``ref_adapter_name`` is made active) and restored afterwards; otherwise nothing changes (the
        reference is a separate model). As in 1.12, nothing is yielded."""
        policy = self.accelerator.unwrap_model(self.model).policy
        with self.reference.module(policy):
            yield

    @property
    def dataloader(self) -> DataLoader:
        """The training prompts, one rollout's worth per process and batch (``local_batch_size /
        num_samples_per_prompt`` prompts), shuffled with ``seed``, prepared by the accelerator. `train` itself uses
        :meth:`get_train_dataloader`, which repeats each batch once per optimisation micro-step."""
        loader = self.__dict__.get("_trl112_dataloader")
        if loader is None:
            loader = self._prompt_dataloader(self._prompts_per_process)
            self.__dict__["_trl112_dataloader"] = loader
        return loader

    @property
    def eval_dataloader(self) -> DataLoader | None:
        """The evaluation prompts, ``per_device_eval_batch_size`` per batch, in order (``None`` without an eval
        dataset; 1.12 required one)."""
        dataset = self._eval_prompts()
        return None if dataset is None else self._eval_dataloader(dataset)

    @property
    def local_seed(self) -> int:
        """This process's sampling seed: ``seed + 100003 × process_index`` (as in 1.12; `train` seeds with it)."""
        return self.args.seed + 100003 * self.accelerator.process_index

    @property
    def sample_generations_freq(self) -> int:
        """Updates between two printed sample tables (``num_total_batches // num_sample_generations``, at least 1;
        ``0`` when ``num_sample_generations=0``). 1.12 stored it on ``args``; trl_ext sets it there too."""
        return self._sample_every


class UpdateCadence(TrainerCallback):
    """With ``step_unit="update"``: `logging_steps`, `save_steps` and `eval_steps` count PPO updates (TRL 1.12's
    cadence: one log row per update, checkpoints between rollouts). `Trainer` steps once per optimizer step, so the
    absolute step counts it derived from the arguments are multiplied by the optimizer steps of an update (recomputed
    from the arguments, so a resumed state is not scaled twice)."""

    def on_train_begin(self, args, state, control, **kwargs):
        factor = getattr(args, "optimizer_steps_per_unit", 1)
        for kind in ("logging", "eval", "save"):
            steps = getattr(args, f"{kind}_steps", None)
            if steps is not None and steps >= 1 and factor > 1:
                setattr(state, f"{kind}_steps", int(steps) * factor)


def update_columns(global_step: int, optimizer_steps_per_update: int) -> dict[str, float]:
    """The columns every PPO log row gets next to `Trainer`'s ``step`` (optimizer steps): ``update``, the PPO updates
    done so far (TRL 1.12's step; a fraction when a row falls inside an update), and ``optimizer_step``."""
    per = max(int(optimizer_steps_per_update), 1)
    update = global_step // per if global_step % per == 0 else global_step / per
    return {"update": update, "optimizer_step": global_step}


class CountUpdates(TrainerCallback):
    """Run a callback written for TRL ≤ 1.12's `PPOTrainer` on trl_ext's, where `Trainer` steps once per optimizer
    step: ``CountUpdates(MyCallback())``.

    The wrapped callback sees a copy of the state in which ``global_step``, ``max_steps``, ``logging_steps``,
    ``eval_steps`` and ``save_steps`` count PPO updates (a rollout and all its ``num_ppo_epochs × num_mini_batches``
    optimizer steps), as in 1.12; ``on_step_begin`` fires at the start of each update and ``on_step_end`` at its end
    (once per update, not per optimizer step); ``on_substep_end`` and ``on_optimizer_step`` are not forwarded. Every
    other event is forwarded as it comes. ``state.log_history`` is the real one (its rows carry an ``update``
    column). The control flags the callback sets (stop training, save, log) act on the real run."""

    def __init__(self, callback: TrainerCallback | type[TrainerCallback]):
        self.callback = callback() if isinstance(callback, type) else callback

    @staticmethod
    def _per_update(args) -> int:
        return max(int(getattr(args, "updates_per_rollout", 1) or 1), 1)

    def _view(self, args, state):
        per = self._per_update(args)
        view = copy.copy(state)
        view.global_step = state.global_step // per
        view.max_steps = state.max_steps // per if state.max_steps else state.max_steps
        for kind in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(state, kind, None)
            if isinstance(value, int) and value >= per:
                setattr(view, kind, value // per)
        return view

    def _forward(self, event, args, state, control, **kwargs):
        handler = getattr(self.callback, event, None)
        if handler is None:
            return None
        return handler(args, self._view(args, state), control, **kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self._per_update(args) == 0:  # the first optimizer step of an update
            return self._forward("on_step_begin", args, state, control, **kwargs)
        return None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self._per_update(args) == 0:  # the last optimizer step of an update
            return self._forward("on_step_end", args, state, control, **kwargs)
        return None

    def on_substep_end(self, args, state, control, **kwargs):
        return None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        return None

    def on_optimizer_step(self, args, state, control, **kwargs):
        return None


def _forwarder(event: str):
    def forward(self, args, state, control, **kwargs):
        return self._forward(event, args, state, control, **kwargs)

    forward.__name__ = event
    return forward


for _event in ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_evaluate",
               "on_predict", "on_save", "on_log", "on_prediction_step", "on_push_begin"):  # fmt: skip
    if hasattr(TrainerCallback, _event):
        setattr(CountUpdates, _event, _forwarder(_event))
