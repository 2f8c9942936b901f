"""What the trainers' checkpoints are made of, shared by every trl_ext trainer that saves models.

- :func:`save_model_pair`: a trainer's policy at the root of a folder `from_pretrained` can read and its second model
  (a critic, a proposal) in a sub-folder, written through a hidden staging folder and moved into place with atomic
  renames (:func:`move_into`), so a kill mid-write never leaves a half-written model; :func:`load_model_weights`
  restores one of them (the LoRA adapter under PEFT, else the full weights);
- the online trainers' small state files: ``kl_controller.json`` (the current KL coefficient,
  :func:`save_kl_controller`) and, with ``normalize_reward``, ``reward_normalizer.json`` (the running score
  statistics, :func:`save_reward_normalizer`), each written atomically.

Each trainer's own layout lives with it: PPO's policy + critic (``value_model/``) and the rollout in progress in
`trl_ext.trainers.ppo.checkpoint`, RePULSe's policy + proposal (``proposal/``) in
`trl_ext.trainers.harmlessness.checkpoint`. Finding and verifying the checkpoint to resume from (complete folders,
``trl_ext_manifest.json``) is `trl_ext.trainers.common.resume`'s job. In checkpoints `transformers.Trainer` adds the
optimizer, scheduler, RNG states and ``trainer_state.json`` (written last: a folder without it is incomplete), and with
``ema_beta`` the trainers add ``ema.safetensors`` (`trl_ext.trainers.common.ema`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import torch
from torch import nn

from ..._deprecation import moved_names
from ...models.lora import is_peft_model
from ...models.modulated_utils import load_modulation_state_dict
from .manifest import naming_file
from .run_folder import explain_disk_full, remove_stale_stages

__all__ = [
    "KL_CONTROLLER_NAME",
    "REWARD_NORMALIZER_NAME",
    "load_kl_controller",
    "load_model_weights",
    "load_reward_normalizer",
    "move_into",
    "save_kl_controller",
    "save_model_pair",
    "save_reward_normalizer",
    "weight_files",
]

logger = logging.getLogger(__name__)

KL_CONTROLLER_NAME = "kl_controller.json"
REWARD_NORMALIZER_NAME = "reward_normalizer.json"


def _split_state_dict(state_dict: dict | None, prefix: str) -> dict | None:
    if state_dict is None:
        return None
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


def move_into(stage: str, target: str) -> None:
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


def save_model_pair(
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
    """Write a trainer's two models in one staged save: the policy (root), ``second`` (``second_dir/``, with the
    tokenizer when ``tokenizer_with_second``), the tokenizer and ``extra_files`` in a hidden folder of ``output_dir``,
    then rename them into place. A ``state_dict`` of the wrapper (keys ``policy.*`` / ``<second_dir>.*``) replaces the
    models' own weights. With ``second=None`` only the policy (and the tokenizer and extra files) is written. Each
    trainer's own pair (PPO's policy + critic, RePULSe's policy + proposal) is in its package's ``checkpoint.py``."""
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
            move_into(stage, output_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


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


def load_model_weights(model: nn.Module, path: str) -> None:
    """Restore ``model`` from the folder ``path`` in place: the active LoRA adapter under PEFT, else the full weights
    (through the class's own `from_pretrained`, so transformers' key conversions apply)."""
    if is_peft_model(model):
        adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
        with naming_file(weight_files(path), "the LoRA adapter"):
            model.load_adapter(path, adapter_name=adapter, is_trainable=True)
        model.set_adapter(adapter)
    else:
        _copy_weights_from_pretrained(model, path)


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
    """Write the running score statistics (``normalize_reward``, `trl_ext.ops.reward_norm.RunningMoments`) to
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


# Names that moved to the module of the trainer (or the job) they belong to, importable from here until trl_ext 0.3.
__getattr__ = moved_names(
    __name__,
    {
        "VALUE_MODEL_DIR": "trl_ext.trainers.ppo.checkpoint",
        "ROLLOUT_STATE_PATTERN": "trl_ext.trainers.ppo.checkpoint",
        "save_policy_and_value": "trl_ext.trainers.ppo.checkpoint",
        "load_policy_and_value": "trl_ext.trainers.ppo.checkpoint",
        "PROPOSAL_DIR": "trl_ext.trainers.harmlessness.checkpoint",
        "save_policy_and_proposal": "trl_ext.trainers.harmlessness.checkpoint",
        "load_policy_and_proposal": "trl_ext.trainers.harmlessness.checkpoint",
        "TRAINER_STATE_NAME": "trl_ext.trainers.common.resume",
        "is_complete_checkpoint": "trl_ext.trainers.common.resume",
        "last_complete_checkpoint": "trl_ext.trainers.common.resume",
        "list_checkpoints": "trl_ext.trainers.common.resume",
        "resolve_resume_checkpoint": "trl_ext.trainers.common.resume",
        "verify_checkpoint": "trl_ext.trainers.common.resume",
    },
)
