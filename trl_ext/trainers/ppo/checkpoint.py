"""PPO's checkpoint layout: the policy at the root of the folder (``policy.save_pretrained``: full weights, loadable
with ``AutoModelForCausalLM.from_pretrained`` — a shared actor-critic policy includes its value head — or the LoRA
adapter under PEFT) plus the tokenizer; the separate critic, when there is one, in ``value_model/``; and, in a
checkpoint taken in the middle of a rollout, that rollout (``ppo_rollout_state-rank<i>.pt``), so that resuming
continues it exactly. The staged writes and the other state files are `trl_ext.trainers.common.checkpoint`'s.
"""

from __future__ import annotations

import logging
import os

from torch import nn

from ..common.checkpoint import load_model_weights, save_model_pair
from ..common.run_folder import stage_prefix

__all__ = ["ROLLOUT_STATE_PATTERN", "VALUE_MODEL_DIR", "load_policy_and_value", "save_policy_and_value"]

logger = logging.getLogger(__name__)

VALUE_MODEL_DIR = "value_model"
ROLLOUT_STATE_PATTERN = "ppo_rollout_state-rank{rank}.pt"


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
    save_model_pair(
        policy, value_model, VALUE_MODEL_DIR, output_dir, state_dict=state_dict, processing_class=processing_class,
        extra_files=extra_files, tokenizer_with_second=False, stage_prefix=stage_prefix("ppo"),
    )  # fmt: skip
    logger.info(
        "Saved the policy to %s%s.", output_dir, f" and the value model to {VALUE_MODEL_DIR}/" if value_model else ""
    )


def load_policy_and_value(policy: nn.Module, value_model: nn.Module | None, checkpoint_dir: str) -> None:
    """Restore the policy (full weights, or the LoRA adapter under PEFT) and the critic saved in ``checkpoint_dir``."""
    load_model_weights(policy, checkpoint_dir)
    if value_model is not None:
        path = os.path.join(checkpoint_dir, VALUE_MODEL_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{checkpoint_dir} has no {VALUE_MODEL_DIR}/ folder: it was not written by trl_ext's PPOTrainer with "
                "a separate value model (TRL 1.12 checkpoints hold only the policy and cannot restore the critic)."
            )
        load_model_weights(value_model, path)
    what = " and the value model" if value_model is not None else ""
    logger.info("Restored the policy%s from %s.", what, checkpoint_dir)
