"""RePULSe's checkpoint layout: the policy at the root of the folder (full weights or its LoRA adapter, with the
tokenizer) and the proposal ``q`` in ``proposal/`` (with the tokenizer too, so it loads on its own). Shared by
`HarmlessnessTrainer` and `RePULSeGRPOTrainer`; the staged writes are `trl_ext.trainers.common.checkpoint`'s.
"""

from __future__ import annotations

import logging
import os

from torch import nn

from ..common.checkpoint import load_model_weights, save_model_pair
from ..common.run_folder import stage_prefix

__all__ = ["PROPOSAL_DIR", "load_policy_and_proposal", "save_policy_and_proposal"]

logger = logging.getLogger(__name__)

PROPOSAL_DIR = "proposal"


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
    layout; the staged, rename-into-place writes of
    :func:`~trl_ext.trainers.common.checkpoint.save_model_pair`).

    Args:
        policy: the policy (a `PreTrainedModel`, or a `PeftModel`, which saves its adapter).
        proposal: the proposal or ``None``.
        output_dir: target folder (created if needed).
        state_dict: optional full state dict of the `HarmlessnessModels` wrapper (keys ``policy.*`` /
            ``proposal.*``), e.g. gathered from DeepSpeed or FSDP.
        processing_class: tokenizer / processor saved next to the policy (and the proposal).
        extra_files: ``{file name: object}`` saved with ``torch.save`` in the root.
    """
    save_model_pair(
        policy, proposal, PROPOSAL_DIR, output_dir, state_dict=state_dict, processing_class=processing_class,
        extra_files=extra_files, tokenizer_with_second=True, stage_prefix=stage_prefix("repulse"),
    )  # fmt: skip
    logger.info("Saved the policy to %s%s.", output_dir, f" and the proposal to {PROPOSAL_DIR}/" if proposal else "")


def load_policy_and_proposal(policy: nn.Module, proposal: nn.Module | None, checkpoint_dir: str) -> None:
    """Restore the policy and the proposal (full weights, or LoRA adapters under PEFT) saved by
    :func:`save_policy_and_proposal` in ``checkpoint_dir``."""
    load_model_weights(policy, checkpoint_dir)
    if proposal is None:
        return
    path = os.path.join(checkpoint_dir, PROPOSAL_DIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {PROPOSAL_DIR}/ folder: it was not written by trl_ext's HarmlessnessTrainer "
            "with a proposal model, so the proposal cannot be restored."
        )
    load_model_weights(proposal, path)
    logger.info("Restored the proposal from %s.", path)
