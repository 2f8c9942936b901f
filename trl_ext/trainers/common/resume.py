"""Resuming, in one place: finding the checkpoint to resume from, verifying it, and the options that govern it.

- :class:`ResumeConfigMixin`: the output-folder and resume options every trl_ext config shares (``allow_rng_reset``,
  ``allow_config_change``, ``overwrite_output_dir``). Put it before TRL's config in the bases (``class
  KDConfig(ResumeConfigMixin, SFTConfig)``); the recipes get the options through the config dataclass.
- Discovery: :func:`list_checkpoints`, :func:`last_complete_checkpoint` (complete = holds ``trainer_state.json``,
  the last file `Trainer` writes) and :func:`resolve_resume_checkpoint` / :func:`verify_checkpoint` (the files
  against ``trl_ext_manifest.json``, `trl_ext.trainers.common.manifest`).
- :class:`VerifiedResumeMixin`: every trl_ext trainer's checkpoints verify themselves:

- Saving: `train()` adds a :class:`~trl_ext.trainers.common.manifest.ManifestCallback`, which writes
  ``trl_ext_manifest.json`` (every file's size and SHA-256) into each ``checkpoint-N`` after `Trainer` has written the
  rest.
- Resuming: before `Trainer.train` loads anything, the main process resolves ``resume_from_checkpoint``
  (:func:`resolve_resume_checkpoint`: ``True`` picks the newest checkpoint that
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

import logging
import os
import re
import zipfile
from dataclasses import dataclass, field

from .checkpoint import weight_files
from .lifecycle import TrainLifecycle
from .manifest import (
    MANIFEST_NAME,
    CheckpointIntegrityError,
    ManifestCallback,
    check_finite_weight_files,
    check_rng_states,
    naming_file,
    verify_manifest,
)
from .run_folder import check_fresh_output_dir, explain_disk_full, lock_output_dir, remove_stale_stages
from .run_record import check_run_record, warn_if_run_finished, write_run_record

__all__ = [
    "TRAINER_STATE_NAME",
    "ResumeConfigMixin",
    "VerifiedResumeMixin",
    "is_complete_checkpoint",
    "last_complete_checkpoint",
    "list_checkpoints",
    "resolve_resume_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


# ------------------------------------------------------------------------------------------------ the options
@dataclass
class ResumeConfigMixin:
    """The output-folder and resume options (documented in the docstrings of the configs that use them)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a fresh run in an output_dir that holds another run's checkpoint-N folders by deleting "
            "them first. False (default): such an output_dir is refused (resume that run, or choose another "
            "output_dir), so that two runs' checkpoints are never mixed."
        },
    )
    allow_config_change: bool = field(
        default=False,
        metadata={
            "help": "Resume from a checkpoint saved with other settings than this run's (its trl_ext_run.json lists "
            "them), with a warning naming each one. False (default): refused, naming the settings that differ. "
            "Where to write, logging, saving, hub and length options (max_steps, num_train_epochs, total_episodes) "
            "may always change."
        },
    )

    allow_rng_reset: bool = field(
        default=False,
        metadata={
            "help": "Resume from a checkpoint that has no RNG state files (rng_state.pth, or rng_state_<rank>.pth "
            "for each process) with fresh random-number generators, with a warning: the run then differs from an "
            "uninterrupted one. False (default): such a checkpoint is refused."
        },
    )


# ------------------------------------------------------------------------------ finding and verifying checkpoints
def is_complete_checkpoint(path: str) -> bool:
    """True when ``path`` holds ``trainer_state.json``, the last file `Trainer` writes into a checkpoint."""
    return os.path.isfile(os.path.join(path, TRAINER_STATE_NAME))


def _checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``output_dir``, newest (largest ``N``, as a number) first."""
    if not os.path.isdir(output_dir):
        return []
    steps = sorted(
        ((int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT_RE.match(name))),
        reverse=True,
    )
    return [p for _, name in steps if os.path.isdir(p := os.path.join(output_dir, name))]


def list_checkpoints(output_dir: str) -> list[str]:
    """The complete ``checkpoint-N`` folders of ``output_dir`` (with ``trainer_state.json``), oldest first."""
    return [path for path in reversed(_checkpoint_folders(output_dir)) if is_complete_checkpoint(path)]


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The ``checkpoint-N`` folder of ``output_dir`` with the largest ``N`` that is complete, or ``None``.

    Newer incomplete checkpoints (an interrupted save) are skipped with a warning. Files are not checked against the
    manifest: :func:`resolve_resume_checkpoint` does that.
    """
    for path in _checkpoint_folders(output_dir):
        if is_complete_checkpoint(path):
            return path
        logger.warning("Skipping %s: it has no %s (an interrupted save).", path, TRAINER_STATE_NAME)
    return None


def _other_checkpoints(path: str) -> str:
    """A sentence naming the other complete checkpoints next to ``path``, for error messages."""
    parent = os.path.dirname(os.path.normpath(path))
    others = [os.path.basename(p) for p in list_checkpoints(parent) if os.path.normpath(p) != os.path.normpath(path)]
    if not others:
        return f" There is no other complete checkpoint in {parent}."
    return f" Complete checkpoints in {parent}: {', '.join(others)}."


def verify_checkpoint(path: str) -> bool:
    """Check ``path`` against its ``trl_ext_manifest.json`` (`manifest.verify_manifest`).

    Returns:
        ``True`` when every listed file matches; ``False``, with a warning, when the checkpoint has no manifest
        (written by an older trl_ext or by plain TRL / transformers, or interrupted just before the manifest): its
        files cannot be checked.

    Raises:
        CheckpointIntegrityError: naming the files that are missing or differ, and the other checkpoints to resume
            from.
    """
    try:
        verified = verify_manifest(path)
    except CheckpointIntegrityError as err:
        raise CheckpointIntegrityError(
            f"{err} Resume from an earlier checkpoint (resume_from_checkpoint=<folder>, or True for the newest one "
            f"that verifies).{_other_checkpoints(path)}"
        ) from None
    _log_verified(path, verified)
    return verified


def _log_verified(path: str, verified: bool) -> None:
    if verified:
        logger.info("Checked every file of %s against its %s.", path, MANIFEST_NAME)
        return
    logger.warning(
        "%s has no %s (written by an older trl_ext or by plain TRL / transformers, or interrupted just before the "
        "manifest): its files cannot be checked before they are loaded.", path, MANIFEST_NAME,
    )  # fmt: skip


def _has_manifest(path: str) -> bool:
    """Whether the checkpoint folder ``path`` has a ``trl_ext_manifest.json``."""
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def _newest_verified_checkpoint(output_dir: str) -> str:
    """The newest complete checkpoint of ``output_dir`` whose files match its manifest; see
    :func:`resolve_resume_checkpoint`."""
    folders = _checkpoint_folders(output_dir)
    any_manifest = any(_has_manifest(path) for path in folders)
    skipped = []
    for path in folders:
        if not is_complete_checkpoint(path):
            reason = f"it has no {TRAINER_STATE_NAME} (an interrupted save)"
        elif any_manifest and not _has_manifest(path):
            reason = (
                f"it has no {MANIFEST_NAME} while other checkpoints here have one (the save was interrupted before "
                "the manifest was written)"
            )
        else:
            try:
                verified = verify_manifest(path)
            except CheckpointIntegrityError as err:
                reason = str(err)
            else:
                _log_verified(path, verified)
                if skipped:
                    logger.warning("Resuming from %s, the newest checkpoint that verifies.", path)
                return path
        logger.warning("Skipping %s: %s", path, reason)
        skipped.append(f"{os.path.basename(path)} ({reason})")
    raise ValueError(
        f"No complete checkpoint (with {TRAINER_STATE_NAME} and files that match {MANIFEST_NAME}) in {output_dir}"
        + (f"; skipped: {'; '.join(skipped)}." if skipped else ".")
    )


def resolve_resume_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder `Trainer.train` should resume from, or ``None`` for a fresh run.

    ``True`` picks the newest *complete* checkpoint of ``output_dir`` whose files match its manifest; older ones are
    tried in turn, and each one skipped is named in a warning (no ``trainer_state.json``: an interrupted save; files
    that differ from the manifest; no manifest while other checkpoints of the folder have one: interrupted before
    the manifest was written). A path must be a complete checkpoint whose files match its manifest. A checkpoint
    without any manifest (older trl_ext, plain TRL) is used with a warning. Anything false (``None``, ``False``,
    ``""``) means no resume. The RNG states are checked apart
    (:func:`~trl_ext.trainers.common.manifest.check_rng_states`).

    Raises:
        ValueError: ``True`` and no checkpoint qualifies, or the path is not a complete checkpoint.
        CheckpointIntegrityError: (a ``ValueError``) the path's files do not match its manifest; the message names
            them.
    """
    if resume_from_checkpoint is True:
        return _newest_verified_checkpoint(output_dir)
    if not resume_from_checkpoint:
        return None
    if not is_complete_checkpoint(resume_from_checkpoint):
        raise ValueError(
            f"{resume_from_checkpoint} is not a complete checkpoint (no {TRAINER_STATE_NAME}; probably interrupted "
            "while saving). Resume from an earlier one, or pass resume_from_checkpoint=True."
            + _other_checkpoints(resume_from_checkpoint)
        )
    verify_checkpoint(resume_from_checkpoint)
    return resume_from_checkpoint


# ------------------------------------------------------------------------------------------------ the trainer mixin


class VerifiedResumeMixin(TrainLifecycle):
    """Manifests on save, verification before resume (see the module docs)."""

    def _before_train(self, resume_from_checkpoint):
        """Resume only from a checkpoint that verifies (:meth:`verified_resume_checkpoint`; once, when a hook before
        this one has already checked it)."""
        verified = self.__dict__.pop("_verified_resume", None)
        if not (resume_from_checkpoint and resume_from_checkpoint == verified):  # not already checked by a subclass
            resume_from_checkpoint = self.verified_resume_checkpoint(resume_from_checkpoint)
            self.__dict__.pop("_verified_resume", None)
        return resume_from_checkpoint

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
        path = resolve_resume_checkpoint(resume_from_checkpoint, args.output_dir)
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
        with naming_file(weight_files(resume_from_checkpoint), "the model weights"):
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
