"""Saving, loading, resuming, pushing, evaluating and logging for `HarmlessnessTrainer` (a mixin over
`transformers.Trainer`).

Checkpoint layout (see `trl_ext.trainers.common.checkpoint.save_policy_and_proposal`): the policy at the root (full
weights in HF format, or the LoRA adapter under PEFT), the proposal in ``proposal/``, the tokenizer and the training
arguments, and with ``save_negdata`` the run id of the negative-data file (``negdata_run.json``, read back on resume:
see `trl_ext.rollout.negdata`); `Trainer` adds the optimizer (both parameter groups), the scheduler, the RNG states
and ``trainer_state.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from ...losses import LossOutput
from ...ops import kl_estimate, masked_sum
from ...rollout.columns import COLUMNS_KEY
from ...rollout.data import left_padded
from ...rollout.negdata import NegativeDataWriter
from ..common.online import evaluates_with_ema, forked_rng
from . import checkpoint as ckpt
from .steps import HarmlessnessRollouts, step_metrics

__all__ = ["HarmlessnessTrainerIO"]

logger = logging.getLogger(__name__)

NEGDATA_RUN_NAME = "negdata_run.json"
"""The file of a checkpoint that records the run id of its run's ``save_negdata`` file."""


class HarmlessnessTrainerIO:
    """`Trainer` overrides of :class:`~trl_ext.trainers.harmlessness.harmlessness_trainer.HarmlessnessTrainer` that
    deal with checkpoints, the Hub, evaluation and the step metrics (the plumbing shared with the other online
    trainers is in :class:`~trl_ext.trainers.common.online.OnlineTrainerMixin`)."""

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Checkpoints keep the policy in HF format at the root and the proposal in proposal/ (see checkpoint.py);
        # optimizer (both groups), scheduler, RNG and trainer state are still restored by `Trainer`.
        if self.is_fsdp_enabled:  # FSDP2's sharded weights: `Trainer` reloads its own full copy of the trained module
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        wrapper = self.accelerator.unwrap_model(model if model is not None else self.model)
        ckpt.load_policy_and_proposal(wrapper.policy, wrapper.proposal, resume_from_checkpoint)

    def _write_models(self, output_dir: str, state_dict: dict | None) -> None:
        """The policy at ``output_dir`` (HF format, or the adapter under PEFT) and the proposal in ``proposal/``
        (left out while :meth:`push_to_hub` uploads without it)."""
        proposal = self.proposal if getattr(self, "_save_proposal", True) else None
        ckpt.save_policy_and_proposal(
            self.policy, proposal, output_dir, state_dict=state_dict,
            processing_class=self.processing_class, extra_files={"training_args.bin": self.args},
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ negative data
    def _negative_data_writer(self, args, policy) -> NegativeDataWriter | None:
        """The writer of ``save_negdata`` (``None`` without it); an existing file that no trl_ext run wrote is refused
        here, before training (another run's file is refused when training starts, once resuming is known)."""
        if not args.save_negdata:
            return None
        from accelerate.utils import gather_object

        reward = self.reward_model
        config = {
            "save_negdata_threshold": args.save_negdata_threshold,
            "model": getattr(getattr(policy, "config", None), "_name_or_path", None) or type(policy).__name__,
            "reward_model": getattr(getattr(reward, "config", None), "_name_or_path", None)
            or getattr(reward, "name", None)
            or type(reward).__name__,
            "loss_type": args.loss_type,
            "num_samples_per_prompt": args.num_samples_per_prompt,
            "proposal_samples_per_prompt": args.proposal_num_samples,
            "response_length": args.response_length,
            "temperature": args.temperature,
            "seed": args.seed,
        }
        writer = NegativeDataWriter(
            args.save_negdata, args.save_negdata_threshold, lambda ids: self.tokenizer.decode(ids),
            gather=gather_object if self.accelerator.num_processes > 1 else None,
            is_main_process=self.accelerator.is_main_process, output_dir=args.output_dir, config=config,
        )  # fmt: skip
        writer.check_not_foreign()
        return writer

    def _start_negative_data(self, resume_from_checkpoint: str | None) -> None:
        """Before training: continue this run's negative-data file (the resumed checkpoint's run id) or start a new
        one; another run's file is refused on every process (`NegativeDataWriter.start`)."""
        if self._negdata is None:
            return
        resume_run_id = None
        record = os.path.join(resume_from_checkpoint, NEGDATA_RUN_NAME) if resume_from_checkpoint else None
        if record is not None and os.path.isfile(record):
            with open(record, encoding="utf-8") as f:
                resume_run_id = json.load(f).get("run_id")
        error = None
        if self.accelerator.is_main_process:
            try:
                overwrite = bool(getattr(self.args, "overwrite_output_dir", False))
                self._negdata.start(resume_run_id, resuming=resume_from_checkpoint is not None, overwrite=overwrite)
            except ValueError as err:
                error = str(err)
        if self.accelerator.num_processes > 1:  # every process stops together
            from accelerate.utils import broadcast_object_list

            error = broadcast_object_list([error])[0]
        if error is not None:
            raise ValueError(error)

    def _after_save(self, folder: str, is_checkpoint: bool) -> None:
        """A checkpoint also records the negative-data file's run id (``negdata_run.json``), so that a run resumed
        from it continues that file."""
        if is_checkpoint and self._negdata is not None and self._negdata.run_id and self.args.should_save:
            with open(os.path.join(folder, NEGDATA_RUN_NAME), "w", encoding="utf-8") as f:
                json.dump({"run_id": self._negdata.run_id, "path": self._negdata.path}, f)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """`Trainer.push_to_hub`: the policy (root of ``output_dir``) with its model card; the proposal in
        ``proposal/`` only with ``push_proposal_to_hub=True``."""
        proposal_dir = os.path.join(self.args.output_dir, ckpt.PROPOSAL_DIR)
        if self.args.push_proposal_to_hub or self.proposal is None:
            return super().push_to_hub(commit_message, blocking, **kwargs)  # the mixin's: clear errors offline
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
    @evaluates_with_ema
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample ``num_samples_per_prompt`` responses per eval prompt from the policy and log the mean raw reward
        (``{prefix}_reward``), the fraction below ``save_negdata_threshold`` (``{prefix}_p_bad``) and the KL to
        ``p_0`` (``{prefix}_kl``; ``p_0`` is run for it also with ``kl_coef == 0``). Runs under a forked RNG, so it
        does not change the training run. With ``eval_with_ema`` the policy's EMA weights are evaluated."""
        start = time.time()
        dataset = self._eval_prompts(eval_dataset)
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (prompts), passed here or to the trainer.")
        loader = self._eval_dataloader(dataset, collate_fn=self.data_collator)
        scores, kls = [], []
        with forked_rng():
            for index, batch in enumerate(loader):
                ids, mask = left_padded(batch["input_ids"], batch.get("attention_mask"), self.tokenizer.pad_token_id)
                with self.evaluation_row_keys(index):  # seed_per_row: the eval batches' own streams
                    rollout = self._sample(
                        "policy", self.model_wrapped, ids, mask, batch.get("vision"), columns=batch.get(COLUMNS_KEY)
                    )
                ref = rollout.ref_logprobs
                if ref is None:  # kl_coef == 0: training rollouts skip p_0, evaluation still reports the KL
                    ref = self._reference_logprobs(rollout)
                kl = kl_estimate(rollout.logprobs, ref, self.args.kl_estimator, rollout.response_mask)
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

    # ----------------------------------------------------------------------------------------------- metrics
    def _save_negative_data(self, rollouts: HarmlessnessRollouts) -> None:
        if self._negdata is None:
            return
        step = self.state.global_step
        self._negdata.add(rollouts.policy, rollouts.policy.scores, step=step, source="policy")
        if rollouts.proposal is not None and not rollouts.proposal_reused:  # (a reused rollout was saved when drawn)
            self._negdata.add(rollouts.proposal, rollouts.proposal.scores, step=step, source="proposal")

    def _record_step(self, rollouts, rewards, p_out: LossOutput, p_lp: torch.Tensor, q_out) -> None:
        """Per-step metrics (:func:`~trl_ext.trainers.harmlessness.steps.step_metrics`), averaged over processes
        (``*/logprob_diff``: the largest), plus timings and the current ``beta``/``alpha``."""
        weights = self._last_weights if self.args.uses_negative_samples else None
        kl_coef = self.kl_controller.value
        values = step_metrics(self.args, rollouts, rewards, p_out, p_lp, q_out, weights, kl_coef=kl_coef)
        if self._ptx is not None:
            values["loss/ptx"] = self._last_ptx
        keys = list(values)
        device = rollouts.policy.scores.device
        stacked = torch.stack([torch.as_tensor(values[k], dtype=torch.float32, device=device) for k in keys])
        stacked = self.accelerator.gather(stacked.unsqueeze(0)).float()
        for key, column in zip(keys, stacked.T):
            self._metrics.add(key, column.max() if key.endswith("logprob_diff") else column.mean())
        kl_sum, micro_steps, samples = self._kl_accumulator
        kl = float(stacked[:, keys.index("base/kl")].mean()) if "base/kl" in keys else 0.0  # 0: p_0 not scored
        samples += rollouts.policy.batch_size * self.accelerator.num_processes
        self._kl_accumulator = (kl_sum + kl, micro_steps + 1, samples)
        self._metrics.scalars["base/kl_coef"] = kl_coef
        for part, rollout in (("policy", rollouts.policy), ("proposal", rollouts.proposal)):
            if rollout is None:
                continue
            self._metrics.add(f"timing/generation_{part}", sum(rollout.timings.values()))
            for key, seconds in rollout.timings.items():  # "generation" (sampling) and "scoring"
                self._metrics.add(f"timing/{'sampling' if key == 'generation' else key}_{part}", seconds)
        for key, seconds in self._timings.items():
            if rollouts.proposal is not None or not key.startswith("proposal"):  # no proposal: no proposal timings
                self._metrics.add(f"timing/{key}", seconds)
        self._metrics.scalars.update(beta=self.beta, alpha=self.alpha)
        self._metrics.add_reward_components(rollouts.policy, self.accelerator.gather)  # a list: rewards/<name>/*
        if rollouts.proposal is not None:
            self._metrics.add_reward_components(rollouts.proposal, self.accelerator.gather, "proposal/rewards/")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the metrics collected since the last log (and the proposal's learning rate) to `Trainer`'s logs."""
        if not any(key.startswith("eval_") for key in logs):
            logs.update(self._metrics.pop(self._gather_object()))  # every process's metrics
            if self.optimizer is not None and "learning_rate" in logs and self.proposal is not None:
                # `learning_rate` is the policy's, read before the scheduler's step; the proposal's follows it.
                initial = {g.get("part"): g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups}
                if initial.get("policy"):
                    logs["proposal/learning_rate"] = logs["learning_rate"] * initial["proposal"] / initial["policy"]
        super().log(logs, start_time)
