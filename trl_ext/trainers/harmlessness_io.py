"""Saving, loading, resuming, pushing and evaluating for `HarmlessnessTrainer` (a mixin over `transformers.Trainer`).

Checkpoint layout (see `trl_ext.trainers.checkpoint.save_policy_and_proposal`): the policy at the root (full
weights in HF format, or the LoRA adapter under PEFT), the proposal in ``proposal/``, the tokenizer and the training
arguments; `Trainer` adds the optimizer (both parameter groups), the scheduler, the RNG states and
``trainer_state.json``.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..ops import kl_estimate, masked_sum
from . import checkpoint as ckpt
from .data import left_padded, prepare_prompt_dataset

__all__ = ["HarmlessnessTrainerIO"]

logger = logging.getLogger(__name__)


class HarmlessnessTrainerIO:
    """`Trainer` overrides of :class:`~trl_ext.trainers.harmlessness_trainer.HarmlessnessTrainer` that deal with
    placing the frozen models, checkpoints, the Hub and evaluation."""

    def _place_frozen_models(self) -> None:
        """Put the reference and the reward model where the policy is (DeepSpeed-prepared under DeepSpeed)."""
        modules = {"ref_model": self.ref_model}
        if isinstance(self.reward_model, nn.Module):
            modules["reward_model"] = self.reward_model
        for name, module in modules.items():
            if module is None:
                continue
            if self.is_deepspeed_enabled:
                from trl.models import prepare_deepspeed

                module = prepare_deepspeed(module, self.accelerator)
            else:
                module = module.to(self.accelerator.device)
            setattr(self, name, module)
        if self.ref_model is not None:
            self.reference.model = self.ref_model
        if isinstance(self.reward_model, nn.Module):
            self.reward_model.eval()

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`; ``resume_from_checkpoint=True`` picks the newest *complete* checkpoint."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = ckpt.last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint (with trainer_state.json) in {self.args.output_dir}.")
        elif resume_from_checkpoint:
            if not ckpt.is_complete_checkpoint(resume_from_checkpoint):
                raise ValueError(
                    f"{resume_from_checkpoint} is not a complete checkpoint (no trainer_state.json; probably "
                    "interrupted while saving). Resume from an earlier one, or pass resume_from_checkpoint=True."
                )
        else:
            resume_from_checkpoint = None
            # Each process samples with its own seed (the same seed would draw the same numbers everywhere).
            torch.manual_seed(self.args.seed + 100003 * self.accelerator.process_index)
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Checkpoints keep the policy in HF format at the root and the proposal in proposal/ (see checkpoint.py);
        # optimizer (both groups), scheduler, RNG and trainer state are still restored by `Trainer`.
        wrapper = self.accelerator.unwrap_model(model if model is not None else self.model)
        ckpt.load_policy_and_proposal(wrapper.policy, wrapper.proposal, resume_from_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy at ``output_dir`` (HF format, or the adapter under PEFT), the proposal in ``proposal/``,
        the tokenizer and the training arguments; outside checkpoints, also the model card (and push if asked)."""
        output_dir = os.path.normpath(output_dir if output_dir is not None else self.args.output_dir)
        state_dict = None
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            engine = self.deepspeed if self.is_deepspeed_enabled else self.model
            try:
                state_dict = self.accelerator.get_state_dict(engine)
            except ValueError:
                logger.warning(
                    "Could not gather the full weights (ZeRO-3 without stage3_gather_16bit_weights_on_model_save): "
                    "the models are not written in HF format; the DeepSpeed engine checkpoint holds them."
                )
        distributed = self.is_deepspeed_enabled or self.is_fsdp_enabled
        if self.args.should_save and not (state_dict is None and distributed):
            proposal = self.proposal if getattr(self, "_save_proposal", True) else None
            ckpt.save_policy_and_proposal(
                self.policy, proposal, output_dir, state_dict=state_dict,
                processing_class=self.processing_class, extra_files={"training_args.bin": self.args},
            )  # fmt: skip
        if not _internal_call:
            hub_id = self.args.hub_model_id
            self.create_model_card(model_name=hub_id.split("/")[-1] if hub_id else os.path.basename(output_dir))
            if self.args.push_to_hub:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """`Trainer.push_to_hub`: the policy (root of ``output_dir``) with its model card; the proposal in
        ``proposal/`` only with ``push_proposal_to_hub=True``."""
        proposal_dir = os.path.join(self.args.output_dir, ckpt.PROPOSAL_DIR)
        if self.args.push_proposal_to_hub or self.proposal is None:
            return super().push_to_hub(commit_message, blocking, **kwargs)
        # Trainer uploads the whole output folder: keep the proposal out of it meanwhile ("_*" is never uploaded).
        hidden = os.path.join(self.args.output_dir, f"_{ckpt.PROPOSAL_DIR}-not-pushed")
        if os.path.isdir(proposal_dir) and self.args.should_save:
            os.replace(proposal_dir, hidden)
        self._save_proposal = False
        try:
            return super().push_to_hub(commit_message, True, **kwargs)
        finally:
            self._save_proposal = True
            if os.path.isdir(hidden):
                os.replace(hidden, proposal_dir)

    # ---------------------------------------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample ``num_samples_per_prompt`` responses per eval prompt from the policy and log the mean raw reward
        (``{prefix}_reward``), the fraction below ``save_negdata_threshold`` (``{prefix}_p_bad``) and the KL to
        ``p_0`` (``{prefix}_kl``). Runs under a forked RNG, so it does not change the training run."""
        start = time.time()
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (prompts), passed here or to the trainer.")
        if eval_dataset is not None:
            dataset = prepare_prompt_dataset(dataset, self.tokenizer, name="eval_dataset")
        loader = self.accelerator.prepare(
            DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator)
        )
        scores, kls = [], []
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            for batch in loader:
                ids, mask = left_padded(batch["input_ids"], batch.get("attention_mask"), self.tokenizer.pad_token_id)
                rollout = self._sample("policy", self.model_wrapped, ids, mask)
                kl = kl_estimate(rollout.logprobs, rollout.ref_logprobs, self.args.kl_estimator, rollout.response_mask)
                scores.append(rollout.scores.float())
                kls.append(masked_sum(kl, rollout.response_mask, dim=-1))
        scores = self.accelerator.gather(torch.cat(scores))
        kls = self.accelerator.gather(torch.cat(kls))
        metrics = {
            f"{metric_key_prefix}_reward": float(scores.mean()),
            f"{metric_key_prefix}_p_bad": float((scores < self.args.save_negdata_threshold).float().mean()),
            f"{metric_key_prefix}_kl": float(kls.mean()),
            f"{metric_key_prefix}_runtime": time.time() - start,
        }
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
