"""`HarmlessnessTrainer`: RePULSe (Zhao et al., NeurIPS 2025) on `transformers.Trainer` — REINFORCE for a policy
``p_θ`` plus a term that lowers the probability of its low-reward outputs, which a learned proposal ``q_ξ`` finds.

How it sits on `Trainer`: the policy and the proposal are one module (:class:`HarmlessnessModels`) with one
optimizer holding a parameter group per model. One `Trainer` optimizer step is one outer step
(docs/algorithms.md §9.3); each micro-step of it takes a fresh batch of prompts and

1. samples ``N`` responses per prompt from ``p_θ`` (reference ``p_0``) and, when a proposal is trained, ``M``
   (``proposal_samples_per_prompt``, default ``N``) from ``q_ξ`` (reference: the current ``p_θ``), both in eval
   mode (:meth:`rollout`);
2. turns the raw rewards into the policy's return and the target's ``log φ = β·R`` (:meth:`compute_rewards`);
3. ``order="q_then_p"`` (default): back-propagates the proposal's twist loss (:meth:`compute_proposal_loss`), then
   the policy's loss (:meth:`compute_policy_loss`) — the policy loss's inputs do not depend on ``q``'s update, so
   this is exactly "q-step, then p-step" (the policy's forward runs first and also gives the proposal's reference
   log-probs, :meth:`_fuses_negative_forward`); ``order="p_then_q"``: the policy is updated first and the
   proposal's reference log-probs are recomputed with the updated policy.

Each model is clipped on its own. The step's *leading* model (the proposal with ``q_then_p``, the policy with
``p_then_q``) is back-propagated and clipped-and-stepped alone (:meth:`_leading_step`); the *closing* one's loss goes
through :meth:`compute_loss` and `Trainer`'s backward and optimizer step, whose clipping then sees only its gradients
(how every online trainer steps: `trainers/common/stepping.py`). Extra proposal-only steps (``q_steps_per_p_step >
1``) sample fresh proposal responses and are leading steps too. Under DeepSpeed both losses close the step together
and the engine clips their joint norm (extra steps are refused there).
"""

from __future__ import annotations

import inspect
import logging
import textwrap
from dataclasses import replace

import torch
from torch import nn
from trl.trainer.base_trainer import _BaseTrainer

from ...losses import LossOutput, get_loss_spec
from ...losses.weights import ORIGINAL_INDICATOR_THRESHOLD
from ...ops import kl_estimate, masked_sum
from ...rewards import log_target_weight
from ...rollout import (
    ReferencePolicy,
    Rollout,
    RolloutGenerator,
    rollout_logprobs,
)
from ...rollout.columns import rollout_inputs
from ...rollout.data import left_padded
from ...rollout.fsdp import call_as_root_forward
from ...rollout.vision import check_vision_models
from ...utils import eval_mode
from ..common.metrics import OnlineMetrics
from ..common.online import OnlineTrainerMixin
from ..common.ptx import build_ptx
from ..common.reward_setup import build_reward
from ..twist.twist_step import TwistLossOutput, twist_loss
from .harmlessness_config import HarmlessnessConfig
from .io import HarmlessnessTrainerIO
from .models import HarmlessnessModels, build_harmlessness_models, parameter_groups
from .reuse import ProposalReuse, ProposalReuseMixin
from .smc_negatives import SMCNegatives, smc_negatives
from .stepping import TwoModelStepping
from .steps import (
    HarmlessnessRewards,
    HarmlessnessRollouts,
    HarmlessnessStep,
    group,
    log_spaced_value,
    negative_sample_weights,
    negative_term_scale,
    reward_shapings,
)

__all__ = ["HarmlessnessTrainer"]

logger = logging.getLogger(__name__)


class HarmlessnessTrainer(
    HarmlessnessTrainerIO, TwoModelStepping, ProposalReuseMixin, OnlineTrainerMixin, _BaseTrainer
):
    """Trainer for RePULSe and its baselines (REINFORCE, reward transforms, the ``p_θ``-proposal ablation).

    Args:
        args (`HarmlessnessConfig`): training arguments.
        processing_class: the tokenizer shared by every model (it needs a pad token), or a vision-language policy's
            processor.
        model: the policy ``p_θ`` to train (a causal LM, a PEFT model, or a vision-language model from
            `AutoModelForImageTextToText` trained on a dataset with images, see ``docs/vision.md``). A folder or Hub
            id is loaded with `trl_ext.models.load_causal_lm` defaults (so are ``proposal_model`` and ``ref_model``).
        reward_model: a reward model sharing the tokenizer (scored on token ids), a ``(model, tokenizer)`` pair, a
            `RewardFunction` (e.g. `trl_ext.rewards.LexicalReward`), a callable ``(prompts, completions) ->
            scores`` (``trl.rewards`` too) or a reward-server URL; or a list of them, summed with ``reward_weights``
            (``reward_funcs=`` is the same argument, GRPO's name). Higher = better.
        train_dataset: prompts, in a ``prompt`` column (text or chat messages) or an ``input_ids`` column; its other
            columns reach reward functions as keyword lists (for the policy's and the proposal's samples).
        proposal_model: the proposal ``q_ξ`` (trained). `None`: a copy of the initial ``model``. Unused (and
            ignored with a warning) with ``loss_type="reinforce"`` or ``use_base_as_proposal=True``.
        ref_model: the frozen ``p_0`` of the KL penalty. `None`: a frozen copy of the initial ``model``, or under
            PEFT the policy with its adapters disabled.
        eval_dataset: prompts for :meth:`evaluate` (mean reward and fraction of bad samples of the policy).
        data_collator: collates dataset rows into ``input_ids``/``attention_mask`` (default: left padding).
        callbacks: extra `TrainerCallback`s.
        optimizers: ``(optimizer, scheduler)``; default: `Trainer`'s optimizer (``optim``) with one parameter group
            per model (``learning_rate`` for the policy, ``proposal_learning_rate`` for the proposal).
        peft_config: a `peft.PeftConfig`: adapters are added to the policy and to the proposal (which gets its own
            frozen base copy); ``p_0`` is then the policy with its adapters disabled.
        pretrain_dataset: texts (a ``pretrain_text_column`` column) for the policy's pretraining loss with
            ``ptx_coef > 0`` (:meth:`compute_ptx_loss`); a dataset dict is read at ``pretrain_split``.

    Public hooks for research code: :meth:`rollout`, :meth:`compute_rewards`, :meth:`compute_proposal_loss`,
    :meth:`compute_policy_loss`. Models: :attr:`policy`, :attr:`proposal`.
    """

    _tag_names = ["trl", "trl-ext", "repulse", "harmlessness"]
    _name = "RePULSe"
    _paper = {
        "title": "Reducing the Probability of Undesirable Outputs in Language Models Using Probabilistic Inference",
        "id": "2510.21184",
        "citation": textwrap.dedent(
            """\
            @inproceedings{zhao2025reducing,
                title     = {{Reducing the Probability of Undesirable Outputs in Language Models Using Probabilistic
                              Inference}},
                author    = {Stephen Zhao and Aidan Li and Rob Brekelmans and Roger Grosse},
                booktitle = {Advances in Neural Information Processing Systems},
                year      = 2025,
                eprint    = {arXiv:2510.21184}
            }"""
        ),
    }
    # Each micro-step's loss is divided by the number of accumulation steps here (one prompt batch each).
    loss_is_scaled_for_ga = True
    _config_class = HarmlessnessConfig
    _saved_models = "the policy and the proposal"

    def __init__(
        self,
        args: HarmlessnessConfig,
        processing_class,
        model: nn.Module | str,
        reward_model=None,
        train_dataset=None,
        proposal_model: nn.Module | str | None = None,
        ref_model: nn.Module | str | None = None,
        eval_dataset=None,
        data_collator=None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
        pretrain_dataset=None,
        reward_funcs=None,
    ) -> None:
        if isinstance(eval_dataset, dict):
            raise ValueError(
                "HarmlessnessTrainer evaluates one eval_dataset; pass a single prompt dataset (not a dict of them)."
            )
        self._begin_setup(args, processing_class, train_dataset, reward_model, eval_dataset, reward_funcs)
        model, proposal_model, ref_model = self._load_models(
            model=model, proposal_model=proposal_model, ref_model=ref_model
        )
        policy, proposal, reference = build_harmlessness_models(args, model, proposal_model, ref_model, peft_config)
        if args.disable_dropout:
            self._disable_dropout(policy, proposal, reference.model, self.reward_model)
        self.ref_model, self.reference = reference.model, reference

        train_dataset, eval_dataset = self._prepare_datasets(args, train_dataset, eval_dataset, model=policy)
        check_vision_models(self.vision_spec, proposal_model=proposal, ref_model=reference.model)
        self._check_prompts_fit(args, policy, train_dataset, eval_dataset)
        self._check_padding_free(args, policy=policy, proposal_model=proposal)
        if self.vision_spec is not None and args.negative_sampler == "smc":
            raise ValueError("negative_sampler='smc' does not support image inputs; use negative_sampler='proposal'.")
        self._init_trainer(
            HarmlessnessModels(policy, proposal), policy, args, data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
        )  # fmt: skip
        if self.is_deepspeed_enabled and (args.order == "p_then_q" or args.q_steps_per_p_step > 1):
            raise ValueError(
                "order='p_then_q' and q_steps_per_p_step > 1 step one model inside a training step, which the "
                "DeepSpeed engine cannot do; use order='q_then_p' with q_steps_per_p_step=1 under DeepSpeed."
            )
        self._sampling = self._sampling_settings(args)
        # One engine for p and q: each one's weights are loaded before its samples (docs/vllm.md).
        self._build_vllm([m for m in (policy, proposal) if m is not None], always_sync=True)
        reward = build_reward(self.reward_model, self.tokenizer, args)
        # kl_coef == 0 (not adaptive): p_0 is not scored (its only use besides the metrics is the KL term)
        self._generators = {"policy": self._generator(reward, None if self.kl_is_off else self.reference)}
        if proposal is not None:  # the proposal's "reference" is the current policy: its target's base
            settings = replace(self._sampling, num_samples_per_prompt=args.proposal_num_samples)
            self._generators["proposal"] = self._generator(reward, ReferencePolicy(model=policy), settings)
            # without the no-grad log p_θ pass, for the steps whose policy forward provides it (`_fuses_...`)
            self._generators["proposal_unscored"] = self._generator(reward, None, settings)
        self._negdata = self._negative_data_writer(args, policy)  # refuses a file another run (or nobody) wrote
        self._loss = get_loss_spec(args.loss_type)
        self._needs_neg_rewards = "neg_rewards" in inspect.signature(self._loss.fn).parameters
        self._policy_shaping, self._target_shaping = reward_shapings(args)
        self._metrics = OnlineMetrics()
        self._timings: dict[str, float] = {}
        self._last_weights: torch.Tensor | None = None
        self._kl_accumulator: tuple[float, int, int] = (0.0, 0, 0)  # (Σ base/kl, micro-steps, samples) this update
        self.beta, self.alpha = self._schedule(0)
        self._ptx = build_ptx(args, pretrain_dataset, self.tokenizer, type(self).__name__)
        self._last_ptx: torch.Tensor | None = None
        self._micro_step: int | None = None  # micro-steps so far (keys the rows' streams with seed_per_row)
        self._fusing = False  # inside a step whose policy forward scores the proposal's samples
        self._skip_proposal = False  # inside a step whose negatives are a kept proposal rollout
        self._proposal_reuse = ProposalReuse(args.proposal_reuse_steps, args.proposal_reuse_min_ess)

    # ------------------------------------------------------------------------------------------------ setup
    def _generator(self, reward, reference: ReferencePolicy | None, settings=None) -> RolloutGenerator:
        return self._rollout_generator(reward, reference, settings, policy_of=lambda m: m.acting_model())

    @property
    def _wrapper(self) -> HarmlessnessModels:
        return self.accelerator.unwrap_model(self.model)

    @property
    def policy(self) -> nn.Module:
        """The policy ``p_θ`` (unwrapped)."""
        return self._wrapper.policy

    def _ema_module(self) -> nn.Module:
        return self.policy  # ema_beta averages p_θ, not the proposal

    @property
    def proposal(self) -> nn.Module | None:
        """The proposal ``q_ξ`` (unwrapped), or ``None`` when no proposal is trained."""
        return self._wrapper.proposal

    def _schedule(self, update: int) -> tuple[float, float]:
        """``(β, α)`` for policy update number ``update`` (0-based; q-only steps do not count — fix of B4)."""
        args = self.args
        total = max(int(getattr(self.state, "max_steps", 0) or 0), 1)
        beta, alpha = args.target_dist_beta, args.alpha
        if args.anneal_target_dist_beta is not None:
            beta = log_spaced_value(args.anneal_target_dist_beta, args.target_dist_beta, update, total)
        if args.start_alpha is not None:
            alpha = log_spaced_value(args.start_alpha, args.alpha, update, total)
        return beta, alpha

    # ------------------------------------------------------------------------------------- Trainer plumbing
    def create_optimizer(self, model=None):
        """`Trainer`'s optimizer (``optim``, its ``weight_decay`` rule) with one parameter group per model and
        weight-decay class: ``learning_rate`` for the policy, ``proposal_learning_rate`` for the proposal."""
        if self.optimizer is not None:
            return self.optimizer
        wrapper = self._wrapper
        optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, wrapper)
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)) or any(
            key in kwargs for key in ("params", "model", "optimizer_dict")
        ):
            raise ValueError(
                f"optim={self.args.optim!r} builds its own parameter groups, but HarmlessnessTrainer needs one group "
                "per model (policy and proposal learning rates); use a standard optimizer such as 'adamw_torch' or "
                "'adamw_torch_fused', or pass optimizers=(optimizer, scheduler)."
            )
        rates = {"policy": self.args.learning_rate, "proposal": self.args.effective_proposal_learning_rate}
        decay = set(self.get_decay_parameter_names(wrapper))
        groups = parameter_groups(wrapper, decay, rates, self.args.weight_decay)
        self.optimizer = optimizer_cls(groups, **kwargs)
        return self.optimizer

    # ------------------------------------------------------------------------------------- the training step
    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """One micro-step on one batch of prompts: rollouts and rewards, the leading model's loss, backward and own
        step (:meth:`_leading_step`), then `Trainer.training_step` with the closing model's loss
        (:meth:`compute_loss`); `Trainer`'s optimizer step ends the accumulation."""
        args = self.args
        if self._micro_step is None:  # a fresh or resumed run: micro-steps of the optimizer steps done
            self._micro_step = self.state.global_step * args.gradient_accumulation_steps
        self.guard_optimizer_steps()  # non-finite losses/gradients skip the optimizer step (`common/finite.py`)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        self.beta, self.alpha = self._schedule(self.state.global_step)
        device = self.accelerator.device
        prompt_ids, prompt_mask = left_padded(
            inputs["input_ids"], inputs.get("attention_mask"), self.tokenizer.pad_token_id
        )
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        extras = rollout_inputs(inputs, device)  # images, reward columns
        scale = 1.0 / self.current_gradient_accumulation_steps
        self._timings = {"proposal_step": 0.0, "policy_step": 0.0, "proposal_optimizer": 0.0}
        for extra in range(args.q_steps_per_p_step - 1):
            self._proposal_only_step(model, prompt_ids, prompt_mask, **extras, stream=2 + extra)
        self._fusing = self._fuses_negative_forward()
        self._skip_proposal = self._proposal_reuse.available()
        try:
            rollouts = self.rollout(model, prompt_ids, prompt_mask, **extras)
            if self._skip_proposal and not self._reused_proposal(rollouts, self._fusing):
                rollouts.proposal = self._sample_proposal(model, prompt_ids, prompt_mask, **extras)
        finally:
            self._fusing, fused, self._skip_proposal = False, self._fusing, False
        if rollouts.proposal is not None and not rollouts.proposal_reused:
            self._proposal_reuse.keep(rollouts.proposal)
        self._update_policy_reward_normalizer(rollouts.policy)
        forward = None
        if fused:  # the policy's forward first: its log p_θ on q's samples are q's reference log-probs
            share = self._is_head_proposal() and not rollouts.proposal_reused  # (a reused rollout has no q-step)
            with self._timed("policy_step"):
                forward = self._policy_forward(model, rollouts, share_trunk=share)
            q = rollouts.proposal
            if q.ref_logprobs is None:  # (a reused rollout checked with `proposal_reuse_min_ess` has them)
                q.ref_logprobs = torch.where(q.response_mask != 0, forward[1].detach(), torch.zeros_like(q.logprobs))
        rewards = self.compute_rewards(rollouts)
        self._save_negative_data(rollouts)
        step = HarmlessnessStep(rollouts, rewards, scale, forward=forward)
        step.closing = self._leading_step(model, step)
        with self._timed(f"{'proposal' if step.closing == 'proposal' else 'policy'}_step"):
            super().training_step(model, {"step": step}, num_items_in_batch)  # -> compute_loss, backward
        q_out = step.proposal_out
        self._record_step(rollouts, rewards, step.policy_out, step.policy_logprobs, q_out)
        if self.accelerator.sync_gradients:  # the policy's optimizer step follows: one update of the KL controller
            self._update_kl_controller()
        loss = step.policy_out.loss.detach() + (q_out.loss.loss.detach() if q_out is not None else 0.0)
        self._micro_step += 1
        return loss * scale

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The closing loss of the micro-step ``inputs["step"]`` (a `HarmlessnessStep`, made by
        :meth:`training_step`), scaled for gradient accumulation; `Trainer.training_step` back-propagates it.
        ``"policy"``: the policy loss (:meth:`compute_policy_loss`, plus :meth:`compute_ptx_loss`); ``"proposal"``:
        the proposal's twist loss (:meth:`compute_proposal_loss`); ``"both"``: their sum."""
        step: HarmlessnessStep = inputs["step"]
        rollouts, rewards = step.rollouts, step.rewards
        if step.closing == "proposal":
            step.proposal_out = self.compute_proposal_loss(model, rollouts.proposal, rewards.proposal_log_phi)
            self.note_loss(step.proposal_out.loss.loss, "proposal loss")
            loss = step.proposal_out.loss.loss * step.scale
        else:
            extra = None
            if step.closing == "both":
                with self._timed("proposal_step"):
                    step.proposal_out = self.compute_proposal_loss(model, rollouts.proposal, rewards.proposal_log_phi)
                extra = step.proposal_out.loss.loss * step.scale
            loss = self._policy_loss(model, step, extra_loss=extra)
            self.note_loss(loss, "policy loss")
        return (loss, step) if return_outputs else loss

    def _start_training(self, resume_from_checkpoint: str | None) -> None:
        self._micro_step = None
        self._start_negative_data(resume_from_checkpoint)  # a new header, or this run's (resumed) file

    def _update_kl_controller(self) -> None:
        """Feed the update's mean per-sequence KL to ``p_0`` (``base/kl``, averaged over its micro-steps and the
        processes) and its number of policy samples to the KL controller; the next update uses the new value."""
        kl_sum, micro_steps, samples = self._kl_accumulator
        self._kl_accumulator = (0.0, 0, 0)
        if micro_steps:
            self.kl_controller.update(kl_sum / micro_steps, samples)

    def _proposal_only_step(self, model, prompt_ids, prompt_mask, vision=None, stream: int = 2, columns=None) -> None:
        """An extra proposal update on fresh proposal samples (``q_steps_per_p_step > 1``; no accumulation);
        ``stream``: the samples' stream with ``seed_per_row``."""
        rollout = self._sample("proposal", model, prompt_ids, prompt_mask, vision, stream=stream, columns=columns)
        log_phi = self._target_log_phi(rollout.scores)
        if self._negdata is not None:
            self._negdata.add(rollout, rollout.scores, step=self.state.global_step, source="proposal")
        out = self._proposal_backward(model, rollout, log_phi, 1.0)
        self._step_alone("proposal")
        self._metrics.add("loss/proposal_extra", out.loss.loss.detach())

    def compute_ptx_loss(self) -> torch.Tensor:
        """``ptx_coef × NLL``: the policy's mean token NLL on this micro-step's ptx micro-batch
        (`trl_ext.trainers.common.ptx`), logged as ``loss/ptx``; scaled by ``1/gradient_accumulation_steps`` with the
        policy loss. The policy runs outside the DDP wrapper (one wrapped forward per backward)."""
        acc = self.accelerator
        index = self._ptx.next_index(self.state.global_step, self.args.gradient_accumulation_steps)
        with acc.autocast():
            out = self._ptx(self.policy, index, acc.process_index, acc.num_processes, acc.device)
        self._last_ptx = out.loss.detach()
        return self._ptx.coef * out.loss

    @torch.no_grad()
    def _policy_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """``log p_θ`` of the current policy on ``rollout``'s samples, no gradient, eval mode (chunked)."""
        policy = self.policy
        with eval_mode(policy):
            with self.accelerator.autocast():  # below an FSDP2 root: run as its forward (`rollout/fsdp.py`)
                return call_as_root_forward(self._wrapper, self._logprobs_of, policy, rollout)

    def _logprobs_of(self, model: nn.Module, rollout: Rollout) -> torch.Tensor:
        return rollout_logprobs(model, rollout, self.args.local_rollout_forward_batch_size, self.args.temperature)

    # ------------------------------------------------------------------------------------------ public hooks
    def _sample(
        self, part: str, model, prompt_ids, prompt_mask, vision=None, stream=None, columns=None, generator=None
    ) -> Rollout:
        """``part``'s samples (scored with the prompts' reward ``columns``); with ``seed_per_row`` from the rows' own
        streams (:meth:`rollout_row_keys`: 0: the policy, 1: the proposal, or ``stream``) keyed by the micro-step.
        ``generator``: the name of the rollout generator (default ``part``)."""
        stream = stream if stream is not None else {"policy": 0, "proposal": 1}[part]
        sampler = self._generators[generator or part]
        n = sampler.settings.num_samples_per_prompt
        keys = self.rollout_row_keys(prompt_ids.shape[0], self._micro_step or 0, stream, samples_per_prompt=n)
        with self._wrapper.acting_as(part):
            return sampler(model, prompt_ids, prompt_mask, vision, keys, columns)

    def rollout(self, model: nn.Module, prompt_ids, prompt_mask, vision=None, columns=None) -> HarmlessnessRollouts:
        """Sample ``num_samples_per_prompt`` responses per left-padded prompt from the policy (scored by the
        reward, reference ``p_0``) and, when a proposal is trained, ``proposal_samples_per_prompt`` from the
        proposal (reference: the current policy). Both sample in eval mode; ``vision``: the prompts' image
        inputs, ``columns``: their reward columns (each passed only when there are some). Override to change how
        experience is collected."""
        policy = self._sample("policy", model, prompt_ids, prompt_mask, vision, columns=columns)
        proposal = None
        if self.proposal is not None and not self._skip_proposal:
            proposal = self._sample_proposal(model, prompt_ids, prompt_mask, vision, columns)
        rollouts = HarmlessnessRollouts(policy=policy, proposal=proposal)
        if self.args.negative_sampler == "smc":  # (image inputs are refused at construction)
            drawn = self.sample_negatives(prompt_ids, prompt_mask)
            rollouts.negatives, rollouts.negative_weights = drawn.rollout, drawn.weights
            self._metrics.add("negatives/resampling_count", drawn.num_resampling.float().mean())
            self._metrics.add("negatives/log_z", drawn.log_z.float().mean())
        return rollouts

    def _sample_proposal(self, model, prompt_ids, prompt_mask, vision=None, columns=None) -> Rollout:
        """The proposal's samples of a step; without the no-grad ``log p_θ`` pass when the step's policy forward
        gives it (:meth:`_fuses_negative_forward`)."""
        generator = "proposal_unscored" if self._fusing else "proposal"
        return self._sample("proposal", model, prompt_ids, prompt_mask, vision, columns=columns, generator=generator)

    def sample_negatives(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> SMCNegatives:
        """``N`` negatives per prompt by twisted SMC towards σ, the proposal as twist (`smc_negatives`)."""
        args, sampling = self.args, self._sampling
        generator = self._generators["proposal"]
        return call_as_root_forward(
            self._wrapper, smc_negatives, self.policy, self.proposal, args.parameterization, generator.reward,
            self._target_log_phi,
            prompt_ids, prompt_mask, num_particles=args.num_samples_per_prompt,
            max_new_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids or []),
            pad_token_id=sampling.pad_token_id, resampling=args.smc_resampling, ess_threshold=args.smc_ess_threshold,
            missing_eos_penalty=args.missing_eos_penalty,
            indicator_threshold=ORIGINAL_INDICATOR_THRESHOLD if args.indicator_mask else None,
        )  # fmt: skip

    def _target_log_phi(self, raw: torch.Tensor) -> torch.Tensor:
        """``log φ = β·R`` of raw rewards with the current β (transformed first with ``transform_both_sides``)."""
        shaping = replace(self._target_shaping, beta=self.beta)
        if self.args.transform_both_sides:
            return log_target_weight(shaping.transformed(raw), self.beta).to(raw.device)
        return shaping.log_phi(raw).to(raw.device)

    def _update_policy_reward_normalizer(self, rollout: Rollout) -> None:
        """With ``normalize_reward``: add the policy samples' ``r'`` (every process's) to the running statistics,
        once per rollout, before :meth:`compute_rewards` normalises with them; log the statistics."""
        if self.reward_normalizer is None:
            return
        self._update_reward_normalizer(self._policy_shaping.transformed(rollout.scores).to(rollout.scores.device))
        self._metrics.scalars["base/reward_mean_running"] = self.reward_normalizer.mean
        self._metrics.scalars["base/reward_std_running"] = self.reward_normalizer.std

    def compute_rewards(self, rollouts: HarmlessnessRollouts) -> HarmlessnessRewards:
        """Raw rewards → the policy's reward ``r'`` (``rlhf`` map, cap, optional transform; with ``normalize_reward``
        then ``(r' − mean) / std`` with the running statistics, :meth:`normalized_scores`), its return
        ``r' − kl_coef·Σ_t kl_t`` (KL to ``p_0`` at sampling time, a constant; ``kl_coef`` is the KL controller's
        current value, fixed unless ``kl_target`` is set) and the target's ``log φ = β·R`` of both sample sets, always
        from the raw rewards (see :class:`HarmlessnessRewards`). With ``kl_coef == 0`` (:attr:`kl_is_off`) ``p_0`` is
        not run: the KL terms are 0."""
        args, p = self.args, rollouts.policy
        reward = self.normalized_scores(self._policy_shaping.transformed(p.scores).to(p.scores.device))
        if p.ref_logprobs is None:
            kl = torch.zeros_like(p.logprobs)
        else:
            kl = kl_estimate(p.logprobs, p.ref_logprobs, args.kl_estimator, p.response_mask)
        kl_coef = self.kl_controller.value
        returns = reward - kl_coef * masked_sum(kl, p.response_mask, dim=-1)
        out = HarmlessnessRewards(reward, kl, returns, self._target_log_phi(p.scores))
        q = rollouts.proposal
        if q is not None:
            out.proposal_log_phi = self._target_log_phi(q.scores)
            if self._needs_neg_rewards:
                shaped = self._policy_shaping.transformed(q.scores).to(q.scores.device)
                out.proposal_reward = self.normalized_scores(shaped)  # normalize_reward: the policy's statistics
                if self.kl_is_off:
                    out.proposal_return = out.proposal_reward
                    return out
                ref0 = self._reference_logprobs(q)
                q_kl = kl_estimate(q.ref_logprobs, ref0, args.kl_estimator, q.response_mask)
                out.proposal_return = out.proposal_reward - kl_coef * masked_sum(q_kl, q.response_mask, dim=-1)
        return out

    @torch.no_grad()
    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """``log p_0`` on ``rollout``'s samples, in eval mode (for the proposal samples' returns of ``neg_reinforce``,
        and for ``evaluate``'s KL when the rollouts score no reference)."""
        with self.reference.module(self.policy) as reference, self.accelerator.autocast(), eval_mode(reference):
            return call_as_root_forward(self._wrapper, self._logprobs_of, reference, rollout)

    def compute_proposal_loss(self, model: nn.Module, rollout: Rollout, log_phi: torch.Tensor) -> TwistLossOutput:
        """The proposal's twist loss (``proposal_loss_type``, ``parameterization``) on its own samples, towards
        ``σ ∝ p_θ·exp(log φ)``: ``rollout.ref_logprobs`` are the current policy's log-probs
        (:func:`~trl_ext.trainers.twist.twist_step.twist_loss`, run through ``model`` with the proposal acting)."""
        args = self.args
        batch = {
            "input_ids": rollout.input_ids,
            "attention_mask": rollout.attention_mask,
            "response_mask": rollout.response_mask,
            "old_logprobs": rollout.logprobs,
            "ref_logprobs": rollout.ref_logprobs,
            "log_phi": log_phi,
        }
        if rollout.vision is not None:
            batch["vision"] = rollout.vision
        with self._wrapper.acting_as("proposal"):
            return twist_loss(
                model, batch, num_samples_per_prompt=args.proposal_num_samples,
                parameterization=args.parameterization, loss_type=args.proposal_loss_type,
                temperature=args.temperature, aggregation=args.loss_aggregation, reference_model=self.policy,
                padding_free=args.padding_free, return_entropy=False,  # (q's entropy is not logged here)
                response_outputs=self._head_outputs(rollout),  # a head proposal: from the policy forward's hidden
            )  # fmt: skip

    def neg_weights(
        self, rollouts: HarmlessnessRollouts, rewards: HarmlessnessRewards, weight_logprobs: torch.Tensor
    ) -> torch.Tensor:
        """``(P, N)`` σ-weights of the negative samples (:func:`~.steps.negative_sample_weights`);
        ``weight_logprobs``: ``(B, T)`` ``log p_θ`` on those samples."""
        return negative_sample_weights(self.args, rollouts, rewards, weight_logprobs)

    def compute_policy_loss(
        self,
        logprobs: torch.Tensor,
        rollouts: HarmlessnessRollouts,
        rewards: HarmlessnessRewards,
        neg_logprobs: torch.Tensor | None = None,
        weight_logprobs: torch.Tensor | None = None,
    ) -> LossOutput:
        """The policy loss (``loss_type`` from the registry) of one step.

        ``logprobs`` ``(B, T)``: ``log p_θ`` with gradient on the policy's samples. For a loss with negative samples
        also ``neg_logprobs`` (with gradient) and ``weight_logprobs`` (no gradient, for :meth:`neg_weights`) on the
        proposal's samples (the policy's own with ``use_base_as_proposal``). REINFORCE losses get
        ``(logprobs, returns, mask)`` grouped ``(P, N, ·)``; harmlessness losses are called by keyword (with
        ``neg_rewards`` when they take it) and the current ``alpha``.
        """
        args, N, p = self.args, self.args.num_samples_per_prompt, rollouts.policy
        M = args.negative_samples_per_prompt
        loss = self._loss
        common = {
            "baseline": args.reinforce_baseline,
            "baseline_value": args.reinforce_baseline_value,
            "aggregation": args.loss_aggregation,
        }
        grouped = (group(logprobs, N), group(rewards.policy_return, N), group(p.response_mask, N))
        if not args.uses_negative_samples:
            return loss.call(*grouped, **common)
        negative = p if args.use_base_as_proposal else rollouts.proposal
        if rollouts.negatives is not None:
            negative = rollouts.negatives
        neg_rewards = rewards.policy_return if args.use_base_as_proposal else rewards.proposal_return
        if rollouts.negative_weights is not None:
            self._last_weights = rollouts.negative_weights
        else:
            self._last_weights = self.neg_weights(rollouts, rewards, weight_logprobs)
        kwargs = {
            "logprobs": grouped[0],
            "rewards": grouped[1],
            "mask": grouped[2],
            "neg_logprobs": group(neg_logprobs, M),
            "neg_weights": self._last_weights,
            "neg_mask": group(negative.response_mask, M),
            "alpha": self.alpha * negative_term_scale(args),
            "alpha_convention": args.alpha_convention,
            **common,
        }
        if self._needs_neg_rewards and neg_rewards is not None:  # loss-specific: only for losses naming it
            kwargs["neg_rewards"] = group(neg_rewards, M)
        return loss.call(**kwargs)
