"""Saving and loading PPO's policy and critic in a folder `from_pretrained` can read.

Layout of a saved folder (the final `save_model` output and every `checkpoint-N`):

- the root holds the policy exactly as ``policy.save_pretrained`` writes it — full weights (loadable with
  ``AutoModelForCausalLM.from_pretrained``; a shared actor-critic policy includes its value head), or the LoRA
  adapter under PEFT — plus the tokenizer;
- ``value_model/`` holds the separate critic, when there is one (``save_pretrained`` of the value model);
- in checkpoints, `transformers.Trainer` adds the optimizer, scheduler, RNG states and ``trainer_state.json``, and
  PPO adds ``ppo_rollout_state-rank<i>.pt`` when the checkpoint falls in the middle of a rollout, and the online
  trainers add ``kl_controller.json`` (the current KL coefficient, :func:`save_kl_controller`) and, with
  ``normalize_reward``, ``reward_normalizer.json`` (the running score statistics, :func:`save_reward_normalizer`),
  and with ``ema_beta``, ``ema.safetensors`` (the EMA of the trained weights, `trl_ext.trainers.common.ema`); with
  ``save_ema_model`` the final save holds the EMA weights at the root, checkpoints always the live ones.

Writes are staged: everything is written to a hidden temporary folder next to the target, then moved into place
entry by entry with atomic renames. `transformers.Trainer` (5.23) writes ``checkpoint-N`` in place, not through a
temporary folder, so an interrupted save leaves a partial ``checkpoint-N``; `Trainer` writes
``trainer_state.json`` last, and :func:`last_complete_checkpoint` only picks checkpoints that have it. After it, the
trainers add ``trl_ext_manifest.json`` (every file's size and SHA-256, `trl_ext.trainers.common.manifest`), which
:func:`resolve_resume_checkpoint` checks before anything is loaded; the loaders here name the file they fail on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile

import torch
from torch import nn

from ...models.lora import is_peft_model
from ...models.modulated_utils import load_modulation_state_dict
from .manifest import MANIFEST_NAME, CheckpointIntegrityError, naming_file, verify_manifest
from .run_folder import explain_disk_full, remove_stale_stages, stage_prefix

__all__ = [
    "KL_CONTROLLER_NAME",
    "REWARD_NORMALIZER_NAME",
    "PROPOSAL_DIR",
    "ROLLOUT_STATE_PATTERN",
    "VALUE_MODEL_DIR",
    "is_complete_checkpoint",
    "last_complete_checkpoint",
    "list_checkpoints",
    "load_kl_controller",
    "load_policy_and_proposal",
    "load_policy_and_value",
    "load_reward_normalizer",
    "resolve_resume_checkpoint",
    "save_kl_controller",
    "save_policy_and_proposal",
    "save_policy_and_value",
    "save_reward_normalizer",
    "verify_checkpoint",
    "weight_files",
]

logger = logging.getLogger(__name__)

VALUE_MODEL_DIR = "value_model"
PROPOSAL_DIR = "proposal"
TRAINER_STATE_NAME = "trainer_state.json"
ROLLOUT_STATE_PATTERN = "ppo_rollout_state-rank{rank}.pt"
KL_CONTROLLER_NAME = "kl_controller.json"
REWARD_NORMALIZER_NAME = "reward_normalizer.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def _split_state_dict(state_dict: dict | None, prefix: str) -> dict | None:
    if state_dict is None:
        return None
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


def _move_into(stage: str, target: str) -> None:
    """Move every entry of ``stage`` into ``target`` with renames (an existing entry is replaced)."""
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(stage):
        src, dst = os.path.join(stage, name), os.path.join(target, name)
        if os.path.isdir(src) and os.path.exists(dst):
            old = f"{dst}.trl-ext-old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(src, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(src, dst)


def _save_pretrained(model: nn.Module, path: str, state_dict: dict | None) -> None:
    model.save_pretrained(path, **({"state_dict": state_dict} if state_dict else {}))


def _save_two_models(
    policy: nn.Module,
    second: nn.Module | None,
    second_dir: str,
    output_dir: str,
    *,
    state_dict: dict | None,
    processing_class,
    extra_files: dict[str, object] | None,
    tokenizer_with_second: bool,
    stage_prefix: str,
) -> None:
    """Stage the policy (root), ``second`` (``second_dir/``, with the tokenizer when ``tokenizer_with_second``), the
    tokenizer and ``extra_files`` in a hidden folder of ``output_dir``, then rename them into place. A
    ``state_dict`` of the wrapper (keys ``policy.*`` / ``<second_dir>.*``) replaces the models' own weights."""
    os.makedirs(output_dir, exist_ok=True)
    remove_stale_stages(output_dir)
    stage = tempfile.mkdtemp(prefix=stage_prefix, dir=output_dir)
    try:
        with explain_disk_full(output_dir):
            _save_pretrained(policy, stage, _split_state_dict(state_dict, "policy."))
            if second is not None:
                path = os.path.join(stage, second_dir)
                _save_pretrained(second, path, _split_state_dict(state_dict, f"{second_dir}."))
                if processing_class is not None and tokenizer_with_second:
                    processing_class.save_pretrained(path)
            if processing_class is not None:
                processing_class.save_pretrained(stage)
            for name, obj in (extra_files or {}).items():
                torch.save(obj, os.path.join(stage, name))
            _move_into(stage, output_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def save_policy_and_value(
    policy: nn.Module,
    value_model: nn.Module | None,
    output_dir: str,
    *,
    state_dict: dict | None = None,
    processing_class=None,
    extra_files: dict[str, object] | None = None,
) -> None:
    """Write the policy to ``output_dir`` and the critic to ``output_dir/value_model`` (see the module docs).

    Args:
        policy: the policy (a `PreTrainedModel` or a `PeftModel`, which saves its adapter).
        value_model: the separate critic or ``None``.
        output_dir: target folder (created if needed).
        state_dict: optional full state dict of the `PolicyAndValueModel` (keys ``policy.*`` / ``value_model.*``),
            e.g. gathered from DeepSpeed or FSDP; otherwise each model's own weights are saved.
        processing_class: tokenizer / processor saved next to the policy.
        extra_files: ``{file name: object}`` saved with ``torch.save`` in the root (e.g. the training arguments).
    """
    _save_two_models(
        policy, value_model, VALUE_MODEL_DIR, output_dir, state_dict=state_dict, processing_class=processing_class,
        extra_files=extra_files, tokenizer_with_second=False, stage_prefix=stage_prefix("ppo"),
    )  # fmt: skip
    logger.info(
        "Saved the policy to %s%s.", output_dir, f" and the value model to {VALUE_MODEL_DIR}/" if value_model else ""
    )


def weight_files(path: str) -> str:
    """``path`` with the weight files it holds, for error messages (``ckpt/model.safetensors``)."""
    names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".bin"))) if os.path.isdir(path) else []
    if not names:
        return path
    return os.path.join(path, names[0]) if len(names) == 1 else f"{path} ({', '.join(names)})"


def _copy_weights_from_pretrained(model: nn.Module, path: str) -> None:
    """Load the weights saved in ``path`` into ``model`` in place, through the class's own `from_pretrained`
    (which applies transformers' checkpoint key conversions, e.g. GPT-NeoX ``embed_out`` → ``lm_head``)."""
    param = next(model.parameters())
    if getattr(model, "live_base", False):  # a modulation of a model restored on its own: its weights only
        with naming_file(weight_files(path), "the modulation weights"):
            result = model.load_state_dict(load_modulation_state_dict(path, {}), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise RuntimeError(
                f"The modulation in {path} does not match this {model.config.modulation_kind!r} head: missing "
                f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}."
            )
        return
    with naming_file(weight_files(path), f"the weights of {type(model).__name__}"):
        if hasattr(type(model), "from_pretrained"):
            loaded = type(model).from_pretrained(path, dtype=param.dtype)
        else:  # e.g. an OpenRLHF-style ValueHeadRewardModel critic
            from ...models.critic import load_critic

            loaded = load_critic(path, dtype=param.dtype)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(
            f"The weights in {path} do not match {type(model).__name__}: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}."
        )
    del loaded


def load_policy_and_value(policy: nn.Module, value_model: nn.Module | None, checkpoint_dir: str) -> None:
    """Restore the policy (full weights, or the LoRA adapter under PEFT) and the critic saved in ``checkpoint_dir``."""
    if is_peft_model(policy):
        adapter = policy.active_adapter if isinstance(policy.active_adapter, str) else policy.active_adapters[0]
        with naming_file(weight_files(checkpoint_dir), "the LoRA adapter"):
            policy.load_adapter(checkpoint_dir, adapter_name=adapter, is_trainable=True)
        policy.set_adapter(adapter)
    else:
        _copy_weights_from_pretrained(policy, checkpoint_dir)
    if value_model is not None:
        path = os.path.join(checkpoint_dir, VALUE_MODEL_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{checkpoint_dir} has no {VALUE_MODEL_DIR}/ folder: it was not written by trl_ext's PPOTrainer with "
                "a separate value model (TRL 1.12 checkpoints hold only the policy and cannot restore the critic)."
            )
        _copy_weights_from_pretrained(value_model, path)
    what = " and the value model" if value_model is not None else ""
    logger.info("Restored the policy%s from %s.", what, checkpoint_dir)


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


# ------------------------------------------------------------------------------------ RePULSe: policy + proposal
def save_policy_and_proposal(
    policy: nn.Module,
    proposal: nn.Module | None,
    output_dir: str,
    *,
    state_dict: dict | None = None,
    processing_class=None,
    extra_files: dict[str, object] | None = None,
) -> None:
    """Write the policy to ``output_dir`` and the proposal to ``output_dir/proposal`` (the harmlessness trainer's
    layout; the same staged, rename-into-place writes as :func:`save_policy_and_value`).

    Args:
        policy: the policy (a `PreTrainedModel`, or a `PeftModel`, which saves its adapter).
        proposal: the proposal or ``None``.
        output_dir: target folder (created if needed).
        state_dict: optional full state dict of the `HarmlessnessModels` wrapper (keys ``policy.*`` /
            ``proposal.*``), e.g. gathered from DeepSpeed or FSDP.
        processing_class: tokenizer / processor saved next to the policy (and the proposal).
        extra_files: ``{file name: object}`` saved with ``torch.save`` in the root.
    """
    _save_two_models(
        policy, proposal, PROPOSAL_DIR, output_dir, state_dict=state_dict, processing_class=processing_class,
        extra_files=extra_files, tokenizer_with_second=True, stage_prefix=stage_prefix("repulse"),
    )  # fmt: skip
    logger.info("Saved the policy to %s%s.", output_dir, f" and the proposal to {PROPOSAL_DIR}/" if proposal else "")


def load_policy_and_proposal(policy: nn.Module, proposal: nn.Module | None, checkpoint_dir: str) -> None:
    """Restore the policy and the proposal (full weights, or LoRA adapters under PEFT) saved by
    :func:`save_policy_and_proposal` in ``checkpoint_dir``."""
    load_policy_and_value(policy, None, checkpoint_dir)
    if proposal is None:
        return
    path = os.path.join(checkpoint_dir, PROPOSAL_DIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {PROPOSAL_DIR}/ folder: it was not written by trl_ext's HarmlessnessTrainer "
            "with a proposal model, so the proposal cannot be restored."
        )
    load_policy_and_value(proposal, None, path)
    logger.info("Restored the proposal from %s.", path)


def save_kl_controller(controller, checkpoint_dir: str) -> None:
    """Write the KL controller's state (its current coefficient) to ``checkpoint_dir/kl_controller.json``."""
    _write_json_atomically(controller.state_dict(), checkpoint_dir, KL_CONTROLLER_NAME)


def _write_json_atomically(state: dict, checkpoint_dir: str, name: str) -> None:
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, name)
    tmp = f"{path}.tmp-{os.getpid()}"  # atomic: a kill mid-write never leaves half a file
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def load_kl_controller(controller, checkpoint_dir: str) -> None:
    """Restore the KL controller's coefficient from ``checkpoint_dir/kl_controller.json``. A checkpoint without
    the file (written before the adaptive controller existed) keeps the controller's start value (``kl_coef``),
    with a warning when the controller is adaptive."""
    path = os.path.join(checkpoint_dir, KL_CONTROLLER_NAME)
    if not os.path.isfile(path):
        if hasattr(controller, "target"):
            logger.warning("%s has no %s: the adaptive KL coefficient restarts from kl_coef.", checkpoint_dir,
                           KL_CONTROLLER_NAME)  # fmt: skip
        return
    with naming_file(path, "the KL controller"), open(path, encoding="utf-8") as f:
        controller.load_state_dict(json.load(f))
    logger.info("Restored the KL coefficient %.6g from %s.", controller.value, path)


def save_reward_normalizer(normalizer, checkpoint_dir: str) -> None:
    """Write the running score statistics (``normalize_reward``, `reward_norm.RunningMoments`) to
    ``checkpoint_dir/reward_normalizer.json`` (atomically; floats round-trip exactly through JSON)."""
    _write_json_atomically(normalizer.state_dict(), checkpoint_dir, REWARD_NORMALIZER_NAME)


def load_reward_normalizer(normalizer, checkpoint_dir: str) -> None:
    """Restore the running score statistics from ``checkpoint_dir/reward_normalizer.json``. A checkpoint without the
    file (written with ``normalize_reward=False``) leaves them empty, with a warning: the statistics restart from the
    next rollout's scores."""
    path = os.path.join(checkpoint_dir, REWARD_NORMALIZER_NAME)
    if not os.path.isfile(path):
        logger.warning("%s has no %s: the running reward statistics (normalize_reward) restart from the next "
                       "rollout.", checkpoint_dir, REWARD_NORMALIZER_NAME)  # fmt: skip
        return
    with naming_file(path, "the running reward statistics"), open(path, encoding="utf-8") as f:
        normalizer.load_state_dict(json.load(f))
    logger.info("Restored the running reward statistics (%r) from %s.", normalizer, path)
