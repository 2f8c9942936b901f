"""`PPOTrainer`: PPO for language models on `transformers.Trainer`, with TRL 1.12's constructor and config.

How it sits on `Trainer` (the way TRL's GRPO does): the train dataloader yields the prompts of one rollout per
process, repeated once per optimisation micro-step (:class:`~trl_ext.rollout.data.RolloutSampler`). At the first
micro-step of a rollout :meth:`PPOTrainer.training_step` samples and scores responses (:meth:`rollout`), builds the
rewards (:meth:`compute_rewards`) and advantages (:meth:`compute_advantages`) and a schedule: for each PPO epoch a
fresh permutation of the rollout, cut into ``num_mini_batches`` minibatches, each cut into
``gradient_accumulation_steps`` micro-batches. Every micro-step then computes the loss of its micro-batch
(:meth:`compute_policy_loss`, :meth:`compute_value_loss`), normalised by the whole minibatch's sequence or token
count, and `Trainer` back-propagates it; `Trainer`'s optimizer step after each accumulation is one minibatch update.
Optimizer, scheduler, gradient clipping, mixed precision, logging, callbacks, checkpoints and resume are `Trainer`'s.

The route of one PPO update (a rollout and all its optimizer steps), file by file — rewards → advantages → losses:

1. this file: :meth:`PPOTrainer.training_step` → ``_make_experience`` → :meth:`rollout`, :meth:`compute_rewards`,
   :meth:`compute_advantages`, then :meth:`compute_loss` on each micro-batch;
2. `trl_ext/ops/kl.py` (the per-token KL estimate) and `trl_ext/ops/rewards.py` (score − β·KL per token, the score at
   the last position, located with `trl_ext/ops/sequences.py`);
3. `trl_ext/ops/advantages.py` (GAE with a critic; return − baseline without; the vLLM importance correction) and
   `trl_ext/ops/stats.py` (masked means and whitening);
4. `trl_ext/losses/ppo.py` (the clipped policy and value losses) on `trl_ext/losses/base.py` (their reduction);
5. around them: `trl_ext/trainers/ppo/experience.py` (the epochs × minibatches × micro-batches schedule),
   `trl_ext/trainers/common/online.py` (what every online trainer shares: row keys, the running reward
   normaliser, sums over processes), `trl_ext/trainers/common/metrics.py` (the logged metrics) and
   `trl_ext/trainers/common/finite.py` (a non-finite loss or gradient skips the optimizer step).

Sampling and scoring (`trl_ext.rollout`: generate, the log-probs of the responses, the reference, the critic and the
reward) and the models (`trl_ext.models`, `policy_value.py`'s policy-and-critic forward) are the two boxes this
route calls into; `tests/trainers/ppo/test_ppo_route.py` checks that an update runs these files and no others.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import textwrap
import time
from dataclasses import replace

import torch
from torch import nn
from torch.utils.data import DataLoader
from trl.trainer.base_trainer import _BaseTrainer

from ...losses import LossOutput, get_loss, get_loss_spec
from ...models.critic import load_critic
from ...ops import (
    assemble_token_rewards,
    extend_mask_past_last,
    gae_advantages,
    importance_corrected_advantages,
    kl_estimate,
    masked_sum,
    masked_whiten,
    sequence_advantages,
)
from ...ops.kl_control import AdaptiveKLController
from ...rollout import Rollout, forward_response
from ...rollout.columns import COLUMNS_KEY, rollout_inputs
from ...rollout.data import left_padded
from ...rollout.finite import drop_rows, expand_to_groups
from ...rollout.vision import check_vision_critic, check_vision_models
from ..common.checks import check_ppo_under_deepspeed, load_model_argument, refuse_same_object
from ..common.manifest import naming_file
from ..common.metrics import OnlineMetrics, rollout_metrics
from ..common.online import OnlineTrainerMixin, evaluates_with_ema, forked_rng
from ..common.ptx import build_ptx
from ..common.reward_setup import build_reward
from . import checkpoint as ckpt
from .compat import TRL112Attributes, UpdateCadence, update_columns
from .experience import (
    Experience,
    PPORewards,
    micro_step_normalizers,
    rollout_schedule,
    schedule_position,
    shared_prefix_group_size,
)
from .policy_value import PolicyAndValueModel, build_ppo_models
from .ppo_config import PPOConfig

__all__ = ["PPOTrainer", "PPORewards"]

logger = logging.getLogger(__name__)


class PPOTrainer(TRL112Attributes, OnlineTrainerMixin, _BaseTrainer):
    """Trainer for Proximal Policy Optimization (PPO) of language models, with TRL 1.12's constructor.

    Args:
        args (`PPOConfig`): training arguments.
        processing_class: the policy's tokenizer (it needs a pad token; prompts are left-padded for generation), or
            a vision-language policy's processor.
        model: the policy to train (`AutoModelForCausalLM`, a value-head model, a PEFT model, a modulated policy, or
            a vision-language model from `AutoModelForImageTextToText`, see ``docs/vision.md``), or a folder / Hub
            id, loaded with `trl_ext.models.load_causal_lm` defaults (load it yourself for other options).
        ref_model: the frozen reference policy (a model, or a folder / Hub id like ``model``). `None`: the LoRA base
            (adapters disabled) under PEFT, otherwise a frozen copy of the initial policy. Must not be ``model``
            itself.
        reward_model: a reward model sharing the policy's tokenizer (scored on token ids, at the last real token),
            or a ``(model, tokenizer)`` pair, a `RewardFunction`, a callable ``(prompts, completions) -> scores``
            (TRL's ``trl.rewards`` too), a reward-server URL (scored on decoded text); or a list of them, summed with
            ``reward_weights`` (``reward_funcs=``, GRPO's name, is the same argument; see ``docs/rewards.md``).
        train_dataset: prompts, in a ``prompt`` column (text or chat messages) or an ``input_ids`` column; for a
            vision-language policy ``prompt`` plus ``image`` (a PIL image or a path per row) or ``images``. Its other
            columns reach reward functions as keyword lists (e.g. ``solution`` for ``trl.rewards.accuracy_reward``).
        value_model: the critic (e.g. `AutoModelForSequenceClassification` with ``num_labels=1``, or a folder / Hub
            id loaded with `trl_ext.load_critic`); `None` with ``shared_actor_critic=True`` or a REINFORCE-type
            ``actor_loss_type``.
        data_collator: collates dataset rows into ``input_ids``/``attention_mask`` (default: left-padding).
        eval_dataset: prompts for sample-completion tables and :meth:`evaluate`.
        optimizers: ``(optimizer, scheduler)``; default: `Trainer`'s, over the policy and the critic together.
        callbacks: extra `TrainerCallback`s.
        peft_config: a `peft.PeftConfig` to train the policy with adapters (the critic is trained fully).
        pretrain_dataset: texts (a ``pretrain_text_column`` column) for the pretraining loss with ``ptx_coef > 0``
            (InstructGPT's PPO-ptx, `trl_ext.trainers.common.ptx`); a dataset dict is read at ``pretrain_split``.

    Public hooks for research code: :meth:`rollout`, :meth:`compute_rewards`, :meth:`compute_advantages`,
    :meth:`compute_policy_loss`, :meth:`compute_value_loss`.
    """

    _tag_names = ["trl", "trl-ext", "ppo"]
    _name = "PPO"
    _paper = {
        "title": "Fine-Tuning Language Models from Human Preferences",
        "id": "1909.08593",
        "citation": textwrap.dedent(
            """\
            @article{ziegler2019finetuning,
                title   = {{Fine-Tuning Language Models from Human Preferences}},
                author  = {Daniel M. Ziegler and Nisan Stiennon and Jeffrey Wu and Tom B. Brown and Alec Radford and
                           Dario Amodei and Paul F. Christiano and Geoffrey Irving},
                year    = 2019,
                eprint  = {arXiv:1909.08593}
            }"""
        ),
    }
    # Micro-batch losses are normalised by the whole minibatch (see `aggregate(normalizer=...)`): no GA division.
    loss_is_scaled_for_ga = True
    _config_class = PPOConfig

    def __init__(
        self,
        args: PPOConfig,
        processing_class,
        model: nn.Module | str,
        ref_model: nn.Module | str | None,
        reward_model=None,
        train_dataset=None,
        value_model: nn.Module | str | None = None,
        data_collator=None,
        eval_dataset=None,
        optimizers: tuple = (None, None),
        callbacks: list | None = None,
        peft_config=None,
        pretrain_dataset=None,
        reward_funcs=None,
    ) -> None:
        refuse_same_object(model, ref_model)
        self._begin_setup(args, processing_class, train_dataset, reward_model, eval_dataset, reward_funcs)
        model, ref_model = self._load_models(model=model, ref_model=ref_model)
        value_model = load_model_argument(value_model, "value_model", loader=load_critic, trainer="PPOTrainer")
        policy, value_model, reference = build_ppo_models(args, model, ref_model, value_model, peft_config)
        self._disable_dropout(policy, reference.model, value_model, self.reward_model)
        self.policy_model, self.ref_model, self.value_model = policy, reference.model, value_model
        self.reference = reference

        train_dataset, eval_dataset = self._prepare_datasets(args, train_dataset, eval_dataset, model=policy)
        check_vision_models(self.vision_spec, ref_model=reference.model)
        check_vision_critic(self.vision_spec, value_model)
        self._check_prompts_fit(args, policy, train_dataset, eval_dataset)
        self._check_padding_free(args, policy=policy, value_model=value_model)
        self._set_sizes(args, len(train_dataset))
        wrapper = PolicyAndValueModel(
            policy, value_model, use_policy_value_head=args.shared_actor_critic and args.uses_critic
        )
        self._init_trainer(
            wrapper, policy, args, data_collator, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
        )  # fmt: skip
        check_ppo_under_deepspeed(args, self.accelerator, self.is_deepspeed_enabled)
        self._sampling = self._sampling_settings(args)
        self._build_vllm([policy])
        self.rollout_generator = self._rollout_generator(
            build_reward(self.reward_model, self.tokenizer, args),
            None if self.kl_is_off else self.reference, policy_of=lambda m: m.policy, with_values=wrapper.has_critic,
        )  # fmt: skip
        self._metrics = OnlineMetrics()
        # The losses, looked up in the registry once (`trl_ext.losses`): the update calls the functions themselves.
        actor = get_loss_spec(args.actor_loss_type)
        self._actor_loss = actor if actor.kind == "reinforce" else get_loss_spec(args.actor_loss_type, "policy")
        self._value_loss = get_loss("clipped_value", "value")
        self._resume_path: str | None = None
        self._micro_step: int | None = None
        self._experience: Experience | None = None
        self._actor_frozen = False
        self._group_size = shared_prefix_group_size(args, wrapper)
        self._ptx = build_ptx(args, pretrain_dataset, self.tokenizer, type(self).__name__)

    # ------------------------------------------------------------------------------------------------ setup
    def _set_sizes(self, args: PPOConfig, dataset_length: int) -> None:
        args.set_batch_sizes(dataset_length)
        self._max_steps = args.total_updates
        self._micro_steps_per_rollout = args.updates_per_rollout * args.gradient_accumulation_steps
        self._prompts_per_process = args.local_batch_size // args.num_samples_per_prompt
        if dataset_length < self._prompts_per_process * args.world_size:
            raise ValueError(
                f"train_dataset has {dataset_length} prompts but one rollout needs "
                f"{self._prompts_per_process * args.world_size} (local_batch_size={args.local_batch_size} responses / "
                f"num_samples_per_prompt={args.num_samples_per_prompt} × {args.world_size} processes); add prompts or "
                "lower per_device_train_batch_size / gradient_accumulation_steps."
            )
        self._sample_every = (
            max(1, args.num_total_batches // args.num_sample_generations) if args.num_sample_generations else 0
        )
        args.sample_generations_freq = self._sample_every  # where TRL 1.12 kept it

    # ------------------------------------------------------------------------------------- Trainer plumbing
    def get_train_dataloader(self) -> DataLoader:
        """One rollout's prompts per process, repeated once per micro-step (:class:`RolloutSampler`)."""
        return self._prompt_dataloader(self._prompts_per_process, repeat=self._micro_steps_per_rollout)

    def set_initial_training_values(self, args, dataloader):
        """`Trainer`'s values with PPO's number of optimizer steps: ``num_total_batches × updates_per_rollout``."""
        (_, per_epoch, num_examples, _, total_train_batch_size, steps_in_epoch, _) = (
            super().set_initial_training_values(args, dataloader)
        )
        num_train_epochs = max(1, math.ceil(self._max_steps / per_epoch))
        num_train_samples = args.total_episodes if args.max_steps <= 0 else self._max_steps * args.mini_batch_size
        return (
            num_train_epochs, per_epoch, num_examples, num_train_samples, total_train_batch_size, steps_in_epoch,
            self._max_steps,
        )  # fmt: skip

    def _start_training(self, resume_from_checkpoint: str | None) -> None:
        if not any(isinstance(c, UpdateCadence) for c in self.callback_handler.callbacks):
            self.add_callback(UpdateCadence())
        self._resume_path = resume_from_checkpoint
        self._micro_step, self._experience = None, None
        self._train_start, self._episode_start = time.time(), None

    def run_summary_unit(self) -> tuple[str, int]:
        return "PPO update", self.args.updates_per_rollout  # the end-of-run table's "seconds per PPO update"

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # `Trainer`'s loader expects one weight file for the module it trains; PPO checkpoints keep the policy in HF
        # format at the root and the critic in value_model/ (see `checkpoint.py`). Optimizer, scheduler, RNG and
        # trainer state are still restored by `Trainer`.
        if self.is_fsdp_enabled:  # FSDP2's sharded weights: `Trainer` reloads its own full copy of the trained module
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        wrapper = self.accelerator.unwrap_model(model if model is not None else self.model)
        ckpt.load_policy_and_value(wrapper.policy, wrapper.value_model, resume_from_checkpoint)

    def _ema_module(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model).policy  # ema_beta averages the policy, not the critic

    def _after_save(self, folder: str, is_checkpoint: bool) -> None:
        """`save_model` writes the policy (HF format, or the adapter under PEFT), the critic in ``value_model/``, the
        tokenizer, the training arguments and the model card (`trl_ext.trainers.ppo.checkpoint`); a checkpoint taken
        in the middle of a rollout also gets that rollout, so that resuming continues it exactly."""
        if is_checkpoint and self._experience is not None and self._micro_step % self._micro_steps_per_rollout:
            os.makedirs(folder, exist_ok=True)
            name = ckpt.ROLLOUT_STATE_PATTERN.format(rank=self.accelerator.process_index)
            torch.save(self._experience.state_dict(), os.path.join(folder, name))

    def _write_models(self, output_dir: str, state_dict: dict | None) -> None:
        wrapper = self.accelerator.unwrap_model(self.model)
        ckpt.save_policy_and_value(
            wrapper.policy, wrapper.value_model, output_dir, state_dict=state_dict,
            processing_class=self.processing_class, extra_files={"training_args.bin": self.args},
        )  # fmt: skip

    # ------------------------------------------------------------------------------------- the training step
    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """One micro-step: make the rollout's experience on its first micro-step, then train on micro-batch
        ``position`` of the schedule (forward, PPO losses, backward through `Trainer.training_step`)."""
        if self._micro_step is None:
            self._position_after_resume()
        position = self._micro_step % self._micro_steps_per_rollout
        if position == 0 or self._experience is None:
            self._experience = self._make_experience(model, inputs)
            self._training_time = 0.0
        self._position = position
        self._actor_frozen = self._micro_step // self._micro_steps_per_rollout < self.args.freezing_actor_steps
        start = time.perf_counter()
        loss = super().training_step(model, self._experience.micro_batch(position), num_items_in_batch)
        self._training_time += time.perf_counter() - start
        self._micro_step += 1
        if position == self._micro_steps_per_rollout - 1:  # the rollout is used up
            self._metrics.add("timing/training", self._training_time)
            self._experience = None
            rollout_index = self._micro_step // self._micro_steps_per_rollout - 1
            if self._sample_every and rollout_index % self._sample_every == 0 and self.eval_dataset is not None:
                self.generate_completions(sampling=True)
        return loss

    def _position_after_resume(self) -> None:
        self._micro_step = self.state.global_step * self.args.gradient_accumulation_steps
        if self._micro_step % self._micro_steps_per_rollout == 0:
            return
        name = ckpt.ROLLOUT_STATE_PATTERN.format(rank=self.accelerator.process_index)
        path = os.path.join(self._resume_path or "", name)
        if not os.path.isfile(path):
            raise RuntimeError(
                f"Step {self.state.global_step} is in the middle of a rollout, but {path} is missing: resume from a "
                "checkpoint written by trl_ext's PPOTrainer (it saves the rollout in progress)."
            )
        with naming_file(path, "the rollout in progress"):
            state = torch.load(path, map_location="cpu", weights_only=True)
        self._experience = Experience.from_state_dict(state, self.accelerator.device)
        self._training_time = 0.0
        logger.info("Resumed in the middle of a rollout from %s.", path)

    def _make_experience(self, model: nn.Module, inputs: dict) -> Experience:
        device = self.accelerator.device
        prompt_ids, prompt_mask = left_padded(
            inputs["input_ids"], inputs.get("attention_mask"), self.tokenizer.pad_token_id
        )
        rollout_index = self._micro_step // self._micro_steps_per_rollout
        self._rollout_index = rollout_index  # keys the rows' random streams with seed_per_row (`rollout`)
        extras = rollout_inputs(inputs, device)  # images, reward columns
        rollout = self._drop_nonfinite(self.rollout(model, prompt_ids.to(device), prompt_mask.to(device), **extras))
        # normalize_reward: once per rollout, before its rewards (the dropped samples left out)
        self._update_reward_normalizer(rollout.scores, rollout.dropped)
        rewards = self.compute_rewards(rollout)
        if self.reward_normalizer is not None:
            self._metrics.scalars["objective/score_mean_running"] = self.reward_normalizer.mean
            self._metrics.scalars["objective/score_std_running"] = self.reward_normalizer.std
        self._metrics.scalars["objective/kl_coef"] = self.kl_controller.value  # the coefficient of these rewards
        self._update_kl_controller(rewards.kl, rollout.response_mask)
        advantages, returns = self.compute_advantages(rollout, rewards)
        advantages = self._importance_corrected(rollout, advantages)  # use_vllm
        args, mean = self.args, functools.partial(self.accelerator.reduce, reduction="mean")
        schedule = rollout_schedule(args, rollout, rollout_index, self.accelerator.process_index, self._group_size)
        normalizers = micro_step_normalizers(schedule, rollout.response_mask, args, mean, rollout.dropped)
        value_mask = value_normalizers = None
        if returns is not None and args.score_position == "after_last_token":
            value_mask = self.score_mask(rollout.response_mask)
            value_normalizers = micro_step_normalizers(schedule, value_mask, args, mean, rollout.dropped)
        self._log_rollout(rollout, rewards, rollout_index)
        return Experience(
            rollout,
            advantages,
            returns,
            schedule,
            normalizers,
            value_mask=value_mask,
            value_normalizers=value_normalizers,
        )

    def _importance_corrected(self, rollout: Rollout, advantages: torch.Tensor) -> torch.Tensor:
        """With vLLM samples: log ``vllm/logprob_diff`` and, with ``vllm_importance_sampling_correction``, weigh the
        advantages by the truncated importance weights (``vllm/is_weight_mean``; `trl_ext.ops.advantages`)."""
        args = self.args
        advantages, stats = importance_corrected_advantages(
            advantages, rollout.logprobs, rollout.engine_logprobs, rollout.response_mask,
            correct=args.vllm_importance_sampling_correction, mode=args.vllm_importance_sampling_mode,
            clip_max=args.vllm_importance_sampling_clip_max, clip_min=args.vllm_importance_sampling_clip_min,
        )  # fmt: skip
        for name, value in stats.items():
            self._metrics.add(f"vllm/{name}", value)
        return advantages

    def _drop_nonfinite(self, rollout: Rollout) -> Rollout:
        """With ``nonfinite_rewards="drop"``: log ``objective/nonfinite_rewards`` (the samples of this rollout with a
        non-finite reward, over all processes; ``..._total``: since the start of the run) and, with the leave-one-out
        baseline of REINFORCE-type losses (``reinforce_baseline="rloo"``), drop the other samples of their prompts
        too (each one's baseline would hold the dropped sample)."""
        if rollout.dropped is None:
            return rollout
        count = float(self.accelerator.reduce(rollout.dropped.sum().float(), reduction="sum"))
        self._metrics.add("objective/nonfinite_rewards", count)
        total = self._metrics.scalars.get("objective/nonfinite_rewards_total", 0.0) + count
        self._metrics.scalars["objective/nonfinite_rewards_total"] = total
        if rollout.values is None and self.args.reinforce_baseline in ("rloo", "expectation") and count:
            rollout = drop_rows(rollout, expand_to_groups(rollout.dropped, rollout.num_samples_per_prompt))
        return rollout

    def _update_kl_controller(self, kl: torch.Tensor, mask: torch.Tensor) -> None:
        """Feed this rollout's mean per-sequence KL (``objective/kl``, averaged over processes) and its
        ``batch_size`` responses to the KL controller; the new coefficient applies from the next rollout's rewards.
        Done when the rollout is made, so a checkpoint inside the rollout holds the updated value and its rewards."""
        if not isinstance(self.kl_controller, AdaptiveKLController):
            return
        mean_kl = self.accelerator.reduce(masked_sum(kl, mask, dim=-1).mean().float(), reduction="mean")
        self.kl_controller.update(float(mean_kl), self.args.batch_size)

    # ------------------------------------------------------------------------------------------ public hooks
    def rollout(self, model: nn.Module, prompt_ids, prompt_mask, vision=None, columns=None) -> Rollout:
        """Sample ``num_samples_per_prompt`` responses per left-padded prompt and score them (see
        :class:`~trl_ext.rollout.generator.RolloutGenerator`); ``vision``: the prompts' image inputs, ``columns``:
        their dataset columns for the reward functions (each passed only when there are some). With
        ``seed_per_row`` each row samples from its own stream (:meth:`rollout_row_keys`). Override to change how
        experience is collected."""
        keys = self.rollout_row_keys(prompt_ids.shape[0], getattr(self, "_rollout_index", 0))
        return self.rollout_generator(model, prompt_ids, prompt_mask, vision=vision, row_keys=keys, columns=columns)

    def score_mask(self, response_mask: torch.Tensor) -> torch.Tensor:
        """The positions the rewards (and, with a critic, the returns and the value loss) cover: the response mask,
        extended by one position past each response's last token with ``score_position="after_last_token"``
        (TRL ≤ 1.12's ``padding_mask_p1``; `trl_ext.ops.extend_mask_past_last`)."""
        if self.args.score_position == "after_last_token":
            return extend_mask_past_last(response_mask)
        return response_mask

    def compute_rewards(self, rollout: Rollout) -> PPORewards:
        """Per-token rewards: the KL estimate (``kl_estimator``) times ``−kl_coef`` (the KL controller's current
        value, :attr:`kl_controller`: ``kl_coef`` unless ``kl_target`` is set) on every response token, plus
        the score (clipped to ``reward_clip``) at the last position of :meth:`score_mask` (the last response token;
        one later with ``score_position="after_last_token"``, `trl_ext.ops.assemble_token_rewards`); whitened (mean
        kept) over that mask of every process with ``whiten_rewards``. With ``normalize_reward`` the score is first
        normalised with the running statistics (:meth:`normalized_scores`; updated with this rollout's scores before
        this call).
        A rollout without reference log-probs (``kl_coef == 0``, :attr:`kl_is_off`) gets a KL of 0."""
        args, mask = self.args, rollout.response_mask
        if rollout.ref_logprobs is None:
            kl = torch.zeros_like(rollout.logprobs)
        else:
            kl = kl_estimate(rollout.logprobs, rollout.ref_logprobs, args.kl_estimator, mask)
        score_mask = self.score_mask(mask)
        placement = score_mask
        if rollout.dropped is not None:  # a dropped row has no token: its score goes on column 0, then is zeroed
            placement = score_mask.clone()
            placement[:, 0] = torch.where(rollout.dropped, torch.ones_like(placement[:, 0]), placement[:, 0])
        rewards, non_score = assemble_token_rewards(
            kl, self.normalized_scores(rollout.scores), placement, self.kl_controller.value, clamp=args.reward_clip
        )
        if rollout.dropped is not None:
            rewards, non_score = rewards * (score_mask != 0), non_score * (score_mask != 0)
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, score_mask, shift_mean=False, reduce=self._sum_over_processes())
        return PPORewards(rewards, non_score, kl)

    def compute_advantages(self, rollout: Rollout, rewards: PPORewards) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(advantages, returns)``, both ``(B, T)``.

        With a critic: GAE(``gamma``, ``lam``) on the rewards and the rollout's values over :meth:`score_mask`,
        advantages whitened over the response tokens of every process (`trl_ext.ops.gae_advantages`,
        `masked_whiten`: N processes whiten as one holding all the rows, not each its own share); returns cover
        the score mask, as the value loss does. Without (REINFORCE-type losses): the
        sequence return (sum of the token rewards) minus ``reinforce_baseline`` computed per prompt group, the same
        value at every token of the sequence; ``returns`` is ``None``.
        """
        args, mask = self.args, rollout.response_mask
        score_mask = self.score_mask(mask)
        if rollout.values is not None:
            advantages, returns = gae_advantages(rewards.rewards, rollout.values, score_mask, args.gamma, args.lam)
            return masked_whiten(advantages, mask, reduce=self._sum_over_processes()), returns
        advantages = sequence_advantages(
            rewards.rewards, score_mask, mask, rollout.num_samples_per_prompt,
            args.reinforce_baseline, args.reinforce_baseline_value,
        )  # fmt: skip
        return advantages, None

    def compute_policy_loss(self, logprobs: torch.Tensor, batch: dict, normalizer: float) -> LossOutput:
        """The actor loss of a micro-batch (``actor_loss_type``, looked up in the loss registry when the trainer is
        built).

        ``batch`` holds ``old_logprobs``, ``advantages``, ``response_mask`` (``(B, T)``). A ``"policy"`` loss is
        called as ``loss(logprobs, old_logprobs, advantages, mask, cliprange=, dual_clip=, aggregation=,
        normalizer=)`` (its protocol, checked when it was registered); a ``"reinforce"`` loss gets the per-sequence
        advantage as its reward and no baseline (the baseline is already in the advantage).
        """
        args, mask = self.args, batch["response_mask"]
        spec = self._actor_loss
        common = {"aggregation": args.loss_aggregation, "normalizer": normalizer}
        if spec.kind == "reinforce":
            return spec.fn(logprobs, batch["advantages"][:, 0], mask, baseline="none", **common)
        return spec.fn(
            logprobs, batch["old_logprobs"], batch["advantages"], mask,
            cliprange=args.cliprange, dual_clip=args.dual_clip, **common,
        )  # fmt: skip

    def compute_value_loss(self, values: torch.Tensor, batch: dict, normalizer: float) -> LossOutput:
        """The clipped value loss of a micro-batch (`trl_ext.losses.clipped_value_loss`, ``cliprange_value``) over
        ``batch["value_mask"]`` (the :meth:`score_mask`; the response mask when absent)."""
        args = self.args
        return self._value_loss(
            values, batch["old_values"], batch["returns"], batch.get("value_mask", batch["response_mask"]),
            cliprange_value=args.cliprange_value, aggregation=args.loss_aggregation, normalizer=normalizer,
        )  # fmt: skip

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Policy loss + ``vf_coef`` × value loss of the micro-batch ``inputs`` (built by :meth:`training_step`).

        During the critic warm-up (the first ``freezing_actor_steps`` rollouts) the policy loss is computed for the
        metrics but left out of the loss: the policy gets no gradient (``grad`` stays ``None``), so the optimizer
        skips its parameters — weights, Adam moments and step count unchanged — and only the critic trains.

        With ``ptx_coef > 0`` the pretraining term :meth:`compute_ptx_loss` is added (not during the warm-up)."""
        mask = inputs["response_mask"]
        uses_critic = "returns" in inputs
        out = forward_response(
            model, inputs["input_ids"], inputs["attention_mask"], mask.shape[1], temperature=self.args.temperature,
            return_values=uses_critic, return_entropy=True, vision=inputs.get("vision"),
            padding_free=self.args.padding_free, shared_prefix=self._group_size > 1,
        )  # fmt: skip
        policy = self.compute_policy_loss(out.logprobs, inputs, inputs["normalizer"])
        loss = policy.loss
        value = None
        if uses_critic:
            normalizer = inputs.get("value_normalizer", inputs["normalizer"])
            value = self.compute_value_loss(out.values, inputs, normalizer)
            value_term = self.args.vf_coef * value.loss
            loss = value_term if self._actor_frozen else loss + value_term
        if self._ptx is not None and not self._actor_frozen:
            loss = loss + self.compute_ptx_loss(model)
        self._record_step(out.logprobs.detach(), out.entropy, inputs, policy, value)
        return (loss, out) if return_outputs else loss

    def compute_ptx_loss(self, model: nn.Module) -> torch.Tensor:
        """``ptx_coef × NLL / gradient_accumulation_steps``: ``NLL`` is the policy's mean token NLL on ptx micro-batch
        number ``micro-step`` of this process (`trl_ext.trainers.common.ptx.PtxLoss`), logged as ``loss/ptx``. The
        other micro-batch losses are normalised by the whole minibatch, so this division makes an optimizer step see
        ``ptx_coef ×`` the mean NLL of its micro-batches. The policy runs outside the DDP wrapper (one wrapped forward
        per backward), under the accelerator's autocast."""
        accelerator = self.accelerator
        with accelerator.autocast():
            out = self._ptx(
                accelerator.unwrap_model(model).policy, self._micro_step, accelerator.process_index,
                accelerator.num_processes, accelerator.device,
            )  # fmt: skip
        self._metrics.add("loss/ptx", out.loss.detach())
        return self._ptx.coef * out.loss / self.args.gradient_accumulation_steps

    # ----------------------------------------------------------------------------------------------- metrics
    def _record_step(self, logprobs, entropy, inputs, policy: LossOutput, value: LossOutput | None) -> None:
        args = self.args
        epoch, minibatch, micro = schedule_position(
            self._position, args.num_mini_batches, args.gradient_accumulation_steps
        )
        self._metrics.add_micro_batch(
            logprobs, inputs["old_logprobs"], entropy, inputs["response_mask"], policy, value,
            first_minibatch=epoch == 0 and minibatch == 0,
            last_micro_batch=micro == args.gradient_accumulation_steps - 1,
        )  # fmt: skip

    def _log_rollout(self, rollout: Rollout, rewards: PPORewards, rollout_index: int) -> None:
        kl = rewards.kl if rollout.ref_logprobs is not None else None  # no reference scored: no KL metrics
        values = rollout_metrics(
            rollout.scores, rollout.logprobs, kl, rewards.non_score_rewards, rollout.response_mask,
            rollout.contains_stop,
        )  # fmt: skip
        self._metrics.add_rollout(values, rollout.timings, int(rollout.response_mask.sum()), self.accelerator.gather)
        self._metrics.add_reward_components(rollout, self.accelerator.gather)  # rewards/<name>/mean, std (lists)
        episode = (rollout_index + 1) * self.args.batch_size
        if self._episode_start is None:
            self._episode_start = rollout_index * self.args.batch_size
        self._metrics.scalars["episode"] = episode
        self._metrics.scalars["eps"] = (episode - self._episode_start) / max(time.time() - self._train_start, 1e-9)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the PPO metrics collected since the last log to `Trainer`'s logs (TRL's names, plus ``lr``)."""
        if not any(key.startswith("eval_") for key in logs):
            logs.update(self._metrics.pop(self._gather_object()))  # every process's metrics
            if "learning_rate" in logs:
                logs["lr"] = logs["learning_rate"]
        logs.update(update_columns(self.state.global_step, self.args.updates_per_rollout))
        super().log(logs, start_time)

    # ----------------------------------------------------------------------------------- samples & evaluation
    @torch.no_grad()
    @evaluates_with_ema
    def generate_completions(self, sampling: bool = False, dataset=None) -> list[dict] | None:
        """Greedy completions of the eval prompts (or of ``dataset``) with their scores; prints the first rows as a
        table and logs the table to wandb / trackio / comet when they are in ``report_to``. ``sampling=True``: the
        first batch only. Runs under a forked RNG, so it does not change the training run. With ``eval_with_ema``
        the policy's EMA weights answer (so :meth:`evaluate` uses them too)."""
        dataset = self._eval_prompts(dataset)
        if dataset is None:
            return None
        settings = replace(self._sampling, do_sample=False, num_samples_per_prompt=1)
        rows = []
        with forked_rng():
            for batch in self._eval_dataloader(dataset):
                ids, mask, extra = batch["input_ids"], batch["attention_mask"], {"vision": batch.get("vision")}
                extra["columns"] = batch.get(COLUMNS_KEY)  # the reward columns of the prompts
                rows += self._completion_rows(ids, mask, settings, "model response", **extra)
                if sampling:
                    break
        return self._publish_completions(rows, "PPO samples")

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy completions of the eval prompts, scored by the reward: logs ``{prefix}_objective/scores``.

        ``eval_dataset``: a prompt dataset, or the key of one in a dict ``eval_dataset``; default: the eval set."""
        start = time.time()
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        rows = self.generate_completions(sampling=False, dataset=eval_dataset) or []
        metrics = {
            f"{metric_key_prefix}_objective/scores": sum(r["score"] for r in rows) / max(len(rows), 1),
            f"{metric_key_prefix}_runtime": time.time() - start,
        }
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
