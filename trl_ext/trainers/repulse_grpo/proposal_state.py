"""The proposal's part of a `RePULSeGRPOTrainer` checkpoint: its weights and its optimizer, beside the policy's.

`transformers.Trainer` writes ``checkpoint-N/`` (the policy, its optimizer and scheduler, RNG states,
``trainer_state.json``); :class:`ProposalCheckpointCallback` then adds ``checkpoint-N/proposal/`` in its ``on_save``
hook (a public `TrainerCallback` hook, called right after each checkpoint is written):

- the proposal as ``save_pretrained`` writes it (full weights, a LoRA adapter, or a modulation head), with the
  tokenizer;
- ``proposal_optimizer.pt``: the proposal optimizer's state dict;
- ``proposal_state.json``: the negative-data run id.

The folder is written under a hidden temporary name and renamed into place (an atomic rename), so a kill mid-write
leaves either no ``proposal/`` or a whole one. :func:`resume_checkpoint` picks, for ``resume_from_checkpoint=True``,
the newest checkpoint whose ``proposal/`` is complete, and :func:`load_proposal_state` restores it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import torch
from torch import nn
from transformers import TrainerCallback

from ..common.checkpoint import load_model_weights, move_into
from ..common.resume import list_checkpoints
from ..harmlessness.checkpoint import PROPOSAL_DIR

__all__ = [
    "OPTIMIZER_NAME",
    "STATE_NAME",
    "ProposalCheckpointCallback",
    "has_proposal_state",
    "load_proposal_state",
    "resume_checkpoint",
    "save_proposal_state",
]

OPTIMIZER_NAME = "proposal_optimizer.pt"
STATE_NAME = "proposal_state.json"


def save_proposal_state(
    proposal: nn.Module, optimizer: torch.optim.Optimizer | None, checkpoint_dir: str, *, processing_class=None,
    extra: dict | None = None,
) -> str:  # fmt: skip
    """Write ``checkpoint_dir/proposal/`` (weights, tokenizer, optimizer, ``extra`` as JSON) atomically; returns it."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    target = os.path.join(checkpoint_dir, PROPOSAL_DIR)
    root = tempfile.mkdtemp(prefix=".proposal-stage-", dir=checkpoint_dir)
    stage = os.path.join(root, PROPOSAL_DIR)
    try:
        proposal.save_pretrained(stage)
        if processing_class is not None:
            processing_class.save_pretrained(stage)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), os.path.join(stage, OPTIMIZER_NAME))
        with open(os.path.join(stage, STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(dict(extra or {}), f)
        move_into(root, checkpoint_dir)  # one rename puts the whole folder in place (an old one is replaced whole)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return target


def has_proposal_state(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a complete ``proposal/`` (its last file, the JSON state, is there)."""
    return os.path.isfile(os.path.join(checkpoint_dir, PROPOSAL_DIR, STATE_NAME))


def load_proposal_state(proposal: nn.Module, optimizer: torch.optim.Optimizer | None, checkpoint_dir: str) -> dict:
    """Restore the proposal's weights and its optimizer from ``checkpoint_dir/proposal/``; returns the saved JSON
    state. A checkpoint without it (e.g. one of plain `GRPOTrainer`) is refused with a clear error."""
    path = os.path.join(checkpoint_dir, PROPOSAL_DIR)
    if not has_proposal_state(checkpoint_dir):
        raise FileNotFoundError(
            f"{checkpoint_dir} has no complete {PROPOSAL_DIR}/ folder: it was not written by RePULSeGRPOTrainer (or "
            "the run was killed while saving it), so the proposal cannot be restored. Resume from an earlier "
            "checkpoint, or start the proposal afresh by loading the policy as the model of a new run."
        )
    load_model_weights(proposal, path)
    opt_path = os.path.join(path, OPTIMIZER_NAME)
    if optimizer is not None and os.path.isfile(opt_path):
        optimizer.load_state_dict(torch.load(opt_path, map_location="cpu", weights_only=True))
    with open(os.path.join(path, STATE_NAME), encoding="utf-8") as f:
        state = json.load(f)
    logging.getLogger(__name__).info("Restored the proposal and its optimizer from %s.", path)
    return state


def resume_checkpoint(resume_from_checkpoint, output_dir: str) -> str | None:
    """The checkpoint folder to resume: a given path, or for ``True`` the newest ``checkpoint-N`` of ``output_dir``
    with a complete ``proposal/`` (``None`` for ``None``/``False``)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is not True:
        return os.fspath(resume_from_checkpoint)
    for path in reversed(list_checkpoints(output_dir)):
        if has_proposal_state(path) and os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
    raise ValueError(f"resume_from_checkpoint=True, but {output_dir} holds no complete RePULSeGRPOTrainer checkpoint.")


class ProposalCheckpointCallback(TrainerCallback):
    """Adds the proposal's state to each checkpoint ``Trainer`` has just written (``on_save``)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer.accelerator.is_main_process:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            trainer.save_proposal_checkpoint(folder)
        trainer.accelerator.wait_for_everyone()
        return control
