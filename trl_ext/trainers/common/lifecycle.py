"""The one `train` and the one `save_model` of trl_ext's trainers, and the hooks the mixins plug into them.

A trainer is built from small mixins (resume verification, non-finite steps, the run summary, CPU FSDP, the online
trainers' state) that each need a word before training starts, after it ends, or after a save. Instead of each one
overriding `Trainer.train` / `Trainer.save_model` and calling ``super()`` — a chain a reader has to follow through
the MRO — they define hooks, and :class:`TrainLifecycle` calls them, in one place:

- ``train``: every ``_before_train(resume_from_checkpoint) -> resume_from_checkpoint`` of the MRO, most derived class
  first (each may resolve or check the checkpoint to resume from), then `Trainer.train`, then every
  ``_after_train()``, base classes first;
- ``save_model``: :meth:`TrainLifecycle._write_saved_model` (what is written: `Trainer.save_model` by default, the
  online trainers' own writing in `trl_ext.trainers.common.online`), then every ``_after_save(folder,
  is_checkpoint)``, base classes first (a checkpoint's extra files: PPO's rollout in progress, RePULSe's negative-data
  run id).

Hooks are looked up on the classes themselves (``cls.__dict__``), so a hook runs once per class that defines it,
without ``super()`` calls.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["TrainLifecycle"]


def _hooks(obj, name: str) -> list[Callable]:
    """The ``name`` methods that the classes of ``obj``'s MRO define themselves, most derived first."""
    return [cls.__dict__[name] for cls in type(obj).__mro__ if name in cls.__dict__]


class TrainLifecycle:
    """`train` and `save_model`, calling the mixins' hooks (see the module docs). Every trl_ext trainer mixin that
    needs them derives from this class, so it sits after all of them in the MRO, right before TRL's trainer."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, after every ``_before_train`` hook (which may resolve ``resume_from_checkpoint``) and
        before every ``_after_train`` hook."""
        for hook in _hooks(self, "_before_train"):
            resume_from_checkpoint = hook(self, resume_from_checkpoint)
        output = super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        for hook in reversed(_hooks(self, "_after_train")):
            hook(self)
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model(s) (:meth:`_write_saved_model`), then the ``_after_save`` hooks' files. ``output_dir``
        defaults to ``args.output_dir``; a save inside another folder during training is a checkpoint."""
        self._write_saved_model(output_dir, _internal_call)
        folder = os.path.normpath(output_dir if output_dir is not None else self.args.output_dir)
        is_checkpoint = _internal_call and folder != os.path.normpath(self.args.output_dir)
        for hook in reversed(_hooks(self, "_after_save")):
            hook(self, folder, is_checkpoint)

    def _write_saved_model(self, output_dir: str | None, _internal_call: bool) -> None:
        """What :meth:`save_model` writes: `Trainer.save_model`'s files, unless a mixin writes its own."""
        super().save_model(output_dir, _internal_call)
