"""`VerifiedResumeMixin`: every trl_ext trainer's checkpoints verify themselves.

- Saving: `train()` adds a :class:`~trl_ext.trainers.common.manifest.ManifestCallback`, which writes
  ``trl_ext_manifest.json`` (every file's size and SHA-256) into each ``checkpoint-N`` after `Trainer` has written the
  rest.
- Resuming: before `Trainer.train` loads anything, the main process resolves ``resume_from_checkpoint``
  (:func:`~trl_ext.trainers.common.checkpoint.resolve_resume_checkpoint`: ``True`` picks the newest checkpoint that
  verifies, a path must verify), then checks the RNG states
  (:func:`~trl_ext.trainers.common.manifest.check_rng_states`, ``allow_rng_reset``); the result (or the error) is
  broadcast, so every process resumes from the same folder or stops with the same message.
- Loading: an error while `Trainer` loads the weights, the optimizer / scheduler or the RNG states names the folder
  and the files.

Put the mixin before TRL's trainer in the bases (``class KDTrainer(CompleteModelCard, VerifiedResumeMixin,
SFTTrainer)``); `OnlineTrainerMixin` includes it.
"""

from __future__ import annotations

import os
import zipfile

from . import checkpoint as ckpt
from .manifest import ManifestCallback, check_rng_states, naming_file

__all__ = ["VerifiedResumeMixin"]


class VerifiedResumeMixin:
    """Manifests on save, verification before resume (see the module docs)."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, resuming only from a checkpoint that verifies (:meth:`verified_resume_checkpoint`)."""
        verified = self.__dict__.pop("_verified_resume", None)
        if not (resume_from_checkpoint and resume_from_checkpoint == verified):  # not already checked by a subclass
            resume_from_checkpoint = self.verified_resume_checkpoint(resume_from_checkpoint)
            self.__dict__.pop("_verified_resume", None)
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def verified_resume_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint to resume from (``None``: a fresh run), after checking its files against its manifest and
        its RNG states; also makes sure the checkpoints this run saves get a manifest.

        Raises:
            ValueError: no checkpoint qualifies (``True``), or the one given is incomplete; a
                `CheckpointIntegrityError` (a ``ValueError``) names the files that are missing or differ, or the
                missing RNG states (unless ``allow_rng_reset``).
        """
        if not any(isinstance(c, ManifestCallback) for c in self.callback_handler.callbacks):
            self.add_callback(ManifestCallback())
        path, error = None, None
        if self.accelerator.is_main_process:
            try:
                path = ckpt.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
                if path is not None:
                    check_rng_states(path, self.args.world_size, getattr(self.args, "allow_rng_reset", False))
            except Exception as err:  # noqa: BLE001 - passed to every process, so that none waits in the broadcast
                error = err
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            path, error = broadcast_object_list([path, error])
        if error is not None:
            raise error
        self._verified_resume = path
        return path

    # --------------------------------------------------------------- `Trainer`'s loaders, with the files named
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with naming_file(ckpt.weight_files(resume_from_checkpoint), "the model weights"):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        except Exception as err:  # noqa: BLE001 - re-raised with the file's name
            names = ("optimizer.pt", "scheduler.pt")
            # torch.save writes zip archives: a truncated one has lost its central directory (cheap to check)
            bad = [n for n in names if os.path.isfile(p := os.path.join(checkpoint, n)) and not zipfile.is_zipfile(p)]
            where = os.path.join(checkpoint, bad[0]) if len(bad) == 1 else f"{checkpoint} ({', '.join(bad or names)})"
            with naming_file(where, "the optimizer / scheduler state"):
                raise err

    def _load_rng_state(self, checkpoint):
        if checkpoint is None:
            return super()._load_rng_state(checkpoint)
        name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
        with naming_file(os.path.join(checkpoint, name), "the RNG states"):
            return super()._load_rng_state(checkpoint)
