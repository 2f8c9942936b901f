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
- The output folder (`run_folder`): the main process locks ``output_dir`` for the trainer's lifetime (a second
  process fails at once, naming the holder's PID), removes the temporary folders of killed saves, and refuses a fresh
  run over another run's ``checkpoint-N`` folders unless ``overwrite_output_dir``. A checkpoint to resume from must
  come from the same kind of trainer with the same settings (`run_record`, ``allow_config_change``); one without a
  manifest gets its weights checked for NaN / inf before it is loaded.
- Saving: a full disk gives an error that names the folder and the free space, and the partial checkpoint is removed.

Put the mixin before TRL's trainer in the bases (``class KDTrainer(CompleteModelCard, VerifiedResumeMixin,
SFTTrainer)``); `OnlineTrainerMixin` includes it.
"""

from __future__ import annotations

import os
import zipfile

from . import checkpoint as ckpt
from .manifest import MANIFEST_NAME, ManifestCallback, check_finite_weight_files, check_rng_states, naming_file
from .run_folder import check_fresh_output_dir, explain_disk_full, lock_output_dir, remove_stale_stages
from .run_record import check_run_record, warn_if_run_finished, write_run_record

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
                path = self._check_output_dir_and_resume(resume_from_checkpoint)
            except Exception as err:  # noqa: BLE001 - passed to every process, so that none waits in the broadcast
                error = err
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            path, error = broadcast_object_list([path, error])
        if error is not None:
            raise error
        self._verified_resume = path
        return path

    def _check_output_dir_and_resume(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """On the main process: lock the output folder, clean it, and resolve and check the checkpoint."""
        args = self.args
        lock_output_dir(args.output_dir, owner=self)
        remove_stale_stages(args.output_dir, checkpoints=True)
        path = ckpt.resolve_resume_checkpoint(resume_from_checkpoint, args.output_dir)
        if path is None:
            check_fresh_output_dir(args.output_dir, getattr(args, "overwrite_output_dir", False))
            return None
        check_run_record(path, self, args, getattr(args, "allow_config_change", False))
        check_rng_states(path, args.world_size, getattr(args, "allow_rng_reset", False))
        if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            check_finite_weight_files(path)
        warn_if_run_finished(path)
        return path

    def _save_checkpoint(self, model, trial):
        """`Trainer._save_checkpoint`, plus ``trl_ext_run.json`` (before `ManifestCallback` writes the manifest); a
        full disk is reported with the folder and the free space, and the partial checkpoint removed."""
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        partial = None if os.path.exists(folder) else folder
        if self.args.should_save:
            remove_stale_stages(self.args.output_dir)
        with explain_disk_full(self.args.output_dir, partial if self.args.should_save else None):
            result = super()._save_checkpoint(model, trial)
            if self.args.should_save and os.path.isdir(folder):
                write_run_record(folder, self, self.args)
        return result

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
