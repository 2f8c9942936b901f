"""Which trainer and which settings wrote a checkpoint, checked before a run resumes from it.

Every ``checkpoint-N`` a trl_ext trainer saves holds ``trl_ext_run.json`` (written before the manifest, so the
manifest covers it)::

    {"format": "trl_ext-run-record", "version": 1, "trainer": "PPOTrainer", "config_class": "PPOConfig",
     "config_hash": "<sha256 of the compared settings>", "config": {<the compared settings>}}

On resume (:func:`check_run_record`):

- a checkpoint written by another trainer (a PPO checkpoint given to DPO, a RePULSe one to the proposal trainer) is
  refused with both names — it used to fail later, while loading, with "the file may be damaged";
- a checkpoint whose settings differ from this run's is refused with the settings that differ (old → new), unless
  ``allow_config_change=True`` (then a warning lists them).

Compared settings are the config's fields except those that say where to write, what to report, how often to save or
log, how processes are laid out and how long to train (:data:`IGNORED_FIELDS`, :data:`IGNORED_PREFIXES`): changing
those is how a run is resumed on another machine, or extended. A checkpoint without the record (older trl_ext, plain
TRL) resumes unchecked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

__all__ = [
    "RUN_RECORD_NAME",
    "check_run_record",
    "compared_settings",
    "trainer_family",
    "warn_if_run_finished",
    "write_run_record",
]

logger = logging.getLogger(__name__)

RUN_RECORD_NAME = "trl_ext_run.json"
RUN_RECORD_FORMAT = "trl_ext-run-record"

IGNORED_FIELDS = frozenset({
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "allow_rng_reset", "allow_config_change",
    "run_name", "report_to", "project", "trackio_space_id", "disable_tqdm", "local_rank", "num_train_epochs",
    "max_steps", "total_episodes", "num_sample_generations", "print_run_summary", "plot", "save_negdata",
    "use_cpu", "no_cuda", "deepspeed", "fsdp", "fsdp_config", "accelerator_config", "torch_compile",
})  # fmt: skip
IGNORED_PREFIXES = (
    "logging_", "save_", "eval_", "hub_", "push_to_hub", "dataloader_", "ddp_", "log_", "gradient_checkpointing_",
)  # fmt: skip


def trainer_family(trainer: object) -> str:
    """The name of the first trl_ext class in ``trainer``'s MRO: a user's subclass of `PPOTrainer` is a PPOTrainer."""
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl_ext."):
            return cls.__name__
    return type(trainer).__name__


def _jsonable(value):
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def compared_settings(args) -> dict:
    """The settings of ``args`` (a `TrainingArguments`) that a resumed run must share with its checkpoint."""
    settings = args.to_dict() if hasattr(args, "to_dict") else dict(vars(args))
    return _jsonable({
        k: v for k, v in settings.items()
        if k not in IGNORED_FIELDS and not k.startswith(IGNORED_PREFIXES) and not k.startswith("_")
    })  # fmt: skip


def _hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def write_run_record(checkpoint_dir: str, trainer: object, args) -> None:
    """Write ``trl_ext_run.json`` into ``checkpoint_dir`` (atomically)."""
    settings = compared_settings(args)
    record = {
        "format": RUN_RECORD_FORMAT, "version": 1, "trainer": trainer_family(trainer),
        "config_class": type(args).__name__, "config_hash": _hash(settings), "config": settings,
    }  # fmt: skip
    path = os.path.join(checkpoint_dir, RUN_RECORD_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def check_run_record(checkpoint_dir: str, trainer: object, args, allow_config_change: bool = False) -> None:
    """Check that ``checkpoint_dir`` was written by this kind of trainer with this run's settings (module docs).

    Raises:
        ValueError: another trainer wrote it; or settings differ and not ``allow_config_change``.
    """
    path = os.path.join(checkpoint_dir, RUN_RECORD_NAME)
    if not os.path.isfile(path):
        logger.info("%s has no %s (older trl_ext or plain TRL): its trainer and settings are not checked.",
                    checkpoint_dir, RUN_RECORD_NAME)  # fmt: skip
        return
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    family = trainer_family(trainer)
    if record.get("trainer") != family:
        raise ValueError(
            f"{checkpoint_dir} was written by {record.get('trainer')} ({record.get('config_class')}), not by a "
            f"{family}: its files are intact but hold another trainer's models and state. Resume from a checkpoint "
            f"of a {family} run, or start this run fresh (initialise the model from that checkpoint's weights with "
            "--model_name_or_path <checkpoint folder> if that is what you meant)."
        )
    settings = compared_settings(args)
    if record.get("config_hash") == _hash(settings):
        return
    old = record.get("config", {})
    changed = sorted(k for k in old.keys() | settings.keys() if old.get(k, "<absent>") != settings.get(k, "<absent>"))
    if not changed:  # hashed differently by another version, same values
        return
    absent = "<absent>"
    listed = "; ".join(f"{k}: {_short(old.get(k, absent))} -> {_short(settings.get(k, absent))}" for k in changed[:12])
    more = f" and {len(changed) - 12} more" if len(changed) > 12 else ""
    message = f"{checkpoint_dir} was saved with other settings than this run's: {listed}{more}."
    if allow_config_change:
        logger.warning("%s Resuming anyway (allow_config_change=True).", message)
        return
    raise ValueError(
        f"{message} A resumed run must continue the run it belongs to: use that run's settings, start fresh in "
        "another --output_dir, or pass --allow_config_change true to resume with the new settings on purpose."
    )


def warn_if_run_finished(checkpoint_dir: str) -> None:
    """Warn when ``checkpoint_dir`` is the last step of the run that saved it (its ``trainer_state.json`` has
    ``global_step >= max_steps``): resuming it trains nothing unless this run is longer."""
    try:
        with open(os.path.join(checkpoint_dir, "trainer_state.json"), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return
    step, last = state.get("global_step"), state.get("max_steps")
    if isinstance(step, int) and isinstance(last, int) and 0 < last <= step:
        logger.warning(
            "%s is the last step of the run that saved it (step %d of %d): resuming it trains nothing unless this run "
            "is longer (raise max_steps, num_train_epochs or total_episodes).", checkpoint_dir, step, last,
        )  # fmt: skip
