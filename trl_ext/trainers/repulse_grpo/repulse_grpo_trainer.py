"""`RePULSeGRPOTrainer`: TRL's `GRPOTrainer` plus RePULSe's learned proposal and push-down term.

Everything GRPO does is left to `GRPOTrainer` (generation of the policy's samples, also with vLLM, ``reward_funcs``
with dataset columns, ``num_generations``, its loss types, ``beta`` and the reference model, logging). Each
micro-step adds, through public hooks only:

1. :meth:`training_step`, before GRPO's step: the step's distinct prompts (the raw dataset rows GRPO's identity
   collator hands over) are sampled ``proposal_samples_per_prompt`` times by the proposal ``q_ξ`` and scored by the
   same reward functions (:mod:`.rewards`), with ``log p_θ`` of the current policy (:meth:`sample_proposal`); the
   proposal's twist loss towards ``σ ∝ p_θ·exp(β·r)`` (:meth:`compute_proposal_loss`) is back-propagated into q,
   whose own optimizer steps at the end of each accumulation (before the policy's update: the "q then p" order);
2. :meth:`compute_loss`: GRPO's loss plus ``α`` × the σ-weighted log-likelihood of those q-samples under the policy
   (:meth:`compute_push_down_loss`), one backward pass for both.

All proposal work runs on its own random stream (seeded by the step), so the policy's random draws are GRPO's; with
``alpha=0`` the push-down term is skipped and the policy trains exactly as with `GRPOTrainer`. Checkpoints hold the
proposal and its optimizer in ``checkpoint-N/proposal/`` (:mod:`.proposal_state`), restored by :meth:`train`.

The one place this reads GRPO's internals: its attributes set in ``__init__`` and used as plain data (``reward_funcs``,
``reward_processing_classes``, ``reward_weights``, ``reward_func_names``, ``chat_template``, ``chat_template_kwargs``,
``temperature``, ``tools``, ``environment_factories``) and its metrics dict ``_metrics`` (TRL's documented logging
pattern); no private method is called or overridden.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Iterator

import torch
from torch import nn
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import pad

from ...losses import LossOutput
from ...losses.reinforce import push_down_loss
from ...losses.weights import ORIGINAL_INDICATOR_THRESHOLD, effective_sample_size, sigma_weights
from ...ops import group_rows
from ...rewards import log_target_weight
from ...rollout import ReferencePolicy, Rollout, RolloutGenerator, SamplingSettings, forward_response
from ...rollout.negdata import NegativeDataWriter
from ...rollout.reward_list import reward_component_metrics
from ..common.model_parts import add_adapters
from ..common.stepping import step_own_optimizer
from ..harmlessness.config_checks import HEAD_PARAMETERIZATIONS
from ..harmlessness.harmlessness_trainer import HarmlessnessTrainer
from ..harmlessness.models import head_proposal
from ..harmlessness.steps import negative_term_scale
from ..twist.twist_step import TwistLossOutput, twist_loss
from .proposal_state import ProposalCheckpointCallback, load_proposal_state, resume_checkpoint, save_proposal_state
from .repulse_grpo_config import RePULSeGRPOConfig
from .rewards import PROMPT_KEY, build_proposal_reward

__all__ = ["RePULSeGRPOTrainer"]

logger = logging.getLogger(__name__)

#: Keys of a dataset row that are not passed to reward functions as columns (as in GRPO).
_NOT_COLUMNS = ("prompt", "completion", "completion_ids")


class RePULSeGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with RePULSe: a learned proposal finds the policy's low-reward outputs and a term weighted by
    ``alpha`` pushes their probability down (see the module docs and docs/grpo_repulse.md).

    Args:
        model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
        callbacks, optimizers, peft_config: as in `GRPOTrainer` (``args`` must be a `RePULSeGRPOConfig`).
        proposal_model: the proposal ``q_ξ`` (trained). `None`: a copy of the initial ``model`` (before GRPO adds
            ``peft_config``'s adapters), or with a ``modulation_*_head`` parameterization a head on the live policy.
        proposal_peft_config: a `peft.PeftConfig`: the proposal is trained as a LoRA adapter on its copy.
        **kwargs: passed on to `GRPOTrainer` (tools and environments are refused: the proposal samples one turn).

    Public hooks: :meth:`sample_proposal`, :meth:`compute_proposal_loss`, :meth:`compute_push_down_loss`; the
    proposal is :attr:`proposal`, its optimizer :attr:`proposal_optimizer`.
    """

    _tag_names = ["trl", "trl-ext", "grpo", "repulse"]
    _name = "RePULSe-GRPO"
    _paper = HarmlessnessTrainer._paper  # the RePULSe paper

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: RePULSeGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        proposal_model: nn.Module | None = None,
        proposal_peft_config=None,
        **kwargs,
    ) -> None:
        if not isinstance(args, RePULSeGRPOConfig):
            raise TypeError(
                f"RePULSeGRPOTrainer needs args=RePULSeGRPOConfig(...) (a GRPOConfig with the RePULSe options); got "
                f"{type(args).__name__}."
            )
        for name in ("tools", "environment_factory", "rollout_func"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"RePULSeGRPOTrainer does not support {name}=: the proposal samples single-turn completions "
                    "without tool calls; drop it or use GRPOTrainer."
                )
        head = args.parameterization in HEAD_PARAMETERIZATIONS
        if proposal_model is not None and (proposal_model is model):
            raise ValueError("proposal_model is the policy object itself: pass a separate copy (or None).")
        if head and proposal_model is not None:
            raise ValueError(
                f"parameterization={args.parameterization!r} builds the proposal as a head on the policy's trunk; "
                "pass proposal_model=None, or choose a policy_psi_* parameterization to train the model you passed."
            )
        if not head and proposal_model is None:  # before GRPO adds adapters (PEFT injects in place)
            proposal_model = self._initial_copy(model, args)
        super().__init__(
            model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, reward_processing_classes=reward_processing_classes,
            callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, **kwargs,
        )  # fmt: skip
        if self.environment_factories is not None or self.tools:
            raise ValueError("RePULSeGRPOTrainer does not support tools or environments (single-turn proposal).")
        if not hasattr(self.processing_class, "pad_token_id") or hasattr(self.processing_class, "image_processor"):
            raise ValueError("RePULSeGRPOTrainer supports text-only policies (a tokenizer as processing_class).")
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_fsdp_enabled or (plugin is not None and getattr(plugin, "zero_stage", 0) == 3):
            raise ValueError(
                "RePULSeGRPOTrainer scores the proposal's samples with the unwrapped policy, which FSDP and DeepSpeed "
                "ZeRO-3 shard; use DDP or DeepSpeed ZeRO-1/2."
            )
        self._warn_unused_sampling_options(args)
        policy = self.accelerator.unwrap_model(self.model)
        if head:
            proposal = head_proposal(args, policy)
        else:
            proposal = proposal_model
            if proposal_peft_config is not None:
                proposal = add_adapters(proposal, copy.deepcopy(proposal_peft_config), "proposal_model")
        if args.disable_dropout:
            from trl.trainer import disable_dropout_in_model

            disable_dropout_in_model(proposal)
        self.proposal: nn.Module = proposal.to(self.accelerator.device)
        params = [p for p in self.proposal.parameters() if p.requires_grad]
        if not params:
            raise ValueError("The proposal has no trainable parameters.")
        self.proposal_optimizer = torch.optim.AdamW(
            params, lr=args.effective_proposal_learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, weight_decay=args.weight_decay,
        )  # fmt: skip
        dataset_sample = next(iter(train_dataset)) if train_dataset is not None else {"prompt": ""}
        self._conversational = is_conversational(dataset_sample)
        settings = SamplingSettings(
            max_new_tokens=args.max_completion_length, pad_token_id=self.processing_class.pad_token_id,
            temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p,
            stop_token_ids=(self.processing_class.eos_token_id,), eos_token_id=self.processing_class.eos_token_id,
            num_samples_per_prompt=args.proposal_num_samples,
        )  # fmt: skip
        self._proposal_sampler = RolloutGenerator(
            settings, build_proposal_reward(self, self._conversational), ReferencePolicy(model=policy),
            forward_batch_size=args.per_device_train_batch_size * args.proposal_num_samples,
            accelerator=self.accelerator,
        )  # fmt: skip
        self._negdata = self._negative_data_writer(args)
        self._pending_push_down: tuple[Rollout, torch.Tensor] | None = None
        self._proposal_clock = (-1, 0)  # (global_step, micro-steps done in it): keys the proposal's random stream
        self.add_callback(ProposalCheckpointCallback(self))

    # ------------------------------------------------------------------------------------------------ setup
    @staticmethod
    def _initial_copy(model, args) -> nn.Module:
        """A trainable copy of the initial policy: a deep copy of a module, or a second load of a checkpoint path."""
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            kwargs = dict(args.model_init_kwargs or {})
            kwargs.pop("device_map", None)
            return AutoModelForCausalLM.from_pretrained(model, **kwargs)
        logger.info("No proposal_model given: the proposal starts as a copy of the initial policy.")
        return copy.deepcopy(model)

    @staticmethod
    def _warn_unused_sampling_options(args) -> None:
        options = {
            "min_p": args.min_p is not None,
            "repetition_penalty": args.repetition_penalty != 1.0,
            "generation_kwargs": bool(args.generation_kwargs),
        }
        unused = [name for name, used in options.items() if used]
        if unused:
            logger.warning(
                "The proposal samples with temperature, top_k and top_p only; %s apply to the policy's samples.",
                ", ".join(unused),
            )

    def _negative_data_writer(self, args) -> NegativeDataWriter | None:
        if not args.save_negdata:
            return None
        path = args.save_negdata
        path = path if os.path.isabs(path) else os.path.join(args.output_dir, path)
        config = {
            "save_negdata_threshold": args.save_negdata_threshold, "trainer": type(self).__name__,
            "proposal_samples_per_prompt": args.proposal_num_samples, "seed": args.seed,
        }  # fmt: skip
        writer = NegativeDataWriter(
            path, args.save_negdata_threshold, lambda ids: self.processing_class.decode(ids),
            is_main_process=self.accelerator.is_main_process, output_dir=args.output_dir, config=config,
        )  # fmt: skip
        writer.check_not_foreign()
        return writer

    @property
    def policy(self) -> nn.Module:
        """The policy ``p_θ`` (unwrapped)."""
        return self.accelerator.unwrap_model(self.model)

    def _uses_proposal(self) -> bool:
        return self.args.alpha > 0 or self.args.train_proposal_at_zero_alpha

    # ------------------------------------------------------------------------------------------- the step
    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The proposal's step on this micro-step's prompts (module docs), then `GRPOTrainer.training_step` (whose
        :meth:`compute_loss` adds the push-down term)."""
        self._pending_push_down = None
        if self._uses_proposal():
            start = time.perf_counter()
            self._next_micro_step()
            prompt_ids, prompt_mask, columns = self._proposal_prompts(inputs)
            for extra in range(1, self.args.q_steps_per_p_step):  # extra q-steps, each on fresh samples
                with self._proposal_stream(extra):
                    rollout = self.sample_proposal(prompt_ids, prompt_mask, columns)
                    out = self._proposal_backward(rollout, self._log_phi(rollout), scale=1.0)
                self._step_proposal()
                self._metric("proposal/loss_extra", out.loss.loss)
            with self._proposal_stream(0):
                rollout = self.sample_proposal(prompt_ids, prompt_mask, columns)
                log_phi = self._log_phi(rollout)
                out = self._proposal_backward(rollout, log_phi, scale=1.0 / self.current_gradient_accumulation_steps)
            if self.accelerator.sync_gradients:
                self._step_proposal()
            self._record_proposal(rollout, log_phi, out)
            if self.args.alpha > 0:
                self._pending_push_down = (rollout, log_phi)
            self._metric("timing/proposal", time.perf_counter() - start)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """GRPO's loss, plus (training, ``alpha > 0``) ``α ×`` the push-down term of this micro-step's proposal
        samples, divided by the accumulation steps as GRPO's loss is."""
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        pending, self._pending_push_down = self._pending_push_down, None
        if pending is None or not model.training:
            return loss
        start = time.perf_counter()
        out = self.compute_push_down_loss(model, *pending)
        self._metric("repulse/push_down_loss", out.loss)
        for key in ("neg_logprob_weighted", "neg_weight_ess", "neg_active_frac"):
            self._metric(f"repulse/{key}", out.metrics[key])
        self._metric("timing/push_down", time.perf_counter() - start)
        return loss + out.loss / self.current_gradient_accumulation_steps

    # ------------------------------------------------------------------------------------------ public hooks
    def sample_proposal(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, columns: dict | None) -> Rollout:
        """``proposal_samples_per_prompt`` proposal samples per left-padded prompt, scored by the reward functions
        (with the prompts' dataset ``columns``) and by the current policy (``ref_logprobs`` = ``log p_θ``), in eval
        mode."""
        self._proposal_sampler.reference = ReferencePolicy(model=self.policy)
        self._proposal_sampler.forward_batch_size = prompt_ids.shape[0] * self.args.proposal_num_samples
        rollout = self._proposal_sampler(self.proposal, prompt_ids, prompt_mask, columns=columns)
        if self._negdata is not None:
            self._negdata.add(rollout, rollout.scores, step=self.state.global_step, source="proposal")
        return rollout

    def compute_proposal_loss(self, rollout: Rollout, log_phi: torch.Tensor) -> TwistLossOutput:
        """The proposal's twist loss (``proposal_loss_type``, ``parameterization``) on its own samples towards
        ``σ ∝ p_θ·exp(log φ)`` (`trl_ext.trainers.twist.twist_step.twist_loss`)."""
        args = self.args
        batch = {
            "input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
            "response_mask": rollout.response_mask, "old_logprobs": rollout.logprobs,
            "ref_logprobs": rollout.ref_logprobs, "log_phi": log_phi,
        }  # fmt: skip
        self.proposal.train()
        with self.accelerator.autocast():
            return twist_loss(
                self.proposal, batch, num_samples_per_prompt=args.proposal_num_samples,
                parameterization=args.parameterization, loss_type=args.proposal_loss_type,
                temperature=args.temperature, aggregation=args.loss_aggregation, reference_model=self.policy,
                return_entropy=False,
            )  # fmt: skip

    def proposal_weights(self, rollout: Rollout, log_phi: torch.Tensor) -> torch.Tensor:
        """``(P, M)`` σ-weights of the proposal's samples (`trl_ext.losses.weights.sigma_weights`, masked sums) from
        the policy's sampling-time log-probs on them, with the indicator under ``indicator_mask``."""
        M = self.args.proposal_num_samples
        mask = group_rows(rollout.response_mask, samples_per_prompt=M)
        return sigma_weights(
            group_rows(rollout.ref_logprobs, samples_per_prompt=M), group_rows(rollout.logprobs, samples_per_prompt=M),
            group_rows(log_phi, samples_per_prompt=M), mask,
            indicator_threshold=ORIGINAL_INDICATOR_THRESHOLD if self.args.indicator_mask else None,
        )  # fmt: skip

    def compute_push_down_loss(self, model: nn.Module, rollout: Rollout, log_phi: torch.Tensor) -> LossOutput:
        """``α`` × the σ-weighted log-likelihood of the proposal's samples under the policy ``model`` (with gradient;
        `trl_ext.losses.reinforce.push_down_loss`, ``alpha_convention``, ``loss_aggregation``), not yet divided by the
        accumulation steps. Minimising it lowers those samples' probability."""
        args, M = self.args, self.args.proposal_num_samples
        logprobs = forward_response(
            model, rollout.input_ids, rollout.attention_mask, rollout.response_length, temperature=self.temperature
        ).logprobs
        return push_down_loss(
            group_rows(logprobs, samples_per_prompt=M), self.proposal_weights(rollout, log_phi),
            group_rows(rollout.response_mask, samples_per_prompt=M), alpha=args.alpha * negative_term_scale(args),
            alpha_convention=args.alpha_convention, aggregation=args.loss_aggregation,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ internals
    def _proposal_prompts(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The distinct prompts of GRPO's raw rows (each prompt's ``num_generations`` copies are adjacent), tokenised
        as GRPO tokenises text prompts, left-padded, with their reward columns (and the raw prompts themselves)."""
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
            raise TypeError("RePULSeGRPOTrainer expects GRPO's raw batch (a list of dataset rows) in training_step.")
        distinct = [row for i, row in enumerate(rows) if i == 0 or row != rows[i - 1]]
        prompts = [row["prompt"] for row in distinct]
        tok = self.processing_class
        if self._conversational:
            ids = tok.apply_chat_template(
                conversation=prompts, chat_template=self.chat_template, add_generation_prompt=True, tokenize=True,
                return_dict=True, **self.chat_template_kwargs,
            )["input_ids"]  # fmt: skip
        else:
            ids = tok(text=prompts)["input_ids"]
        device = self.accelerator.device
        tensors = [torch.tensor(x, dtype=torch.long, device=device) for x in ids]
        prompt_ids = pad(tensors, padding_value=tok.pad_token_id, padding_side="left")
        prompt_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left")
        names = [k for k in distinct[0] if k not in _NOT_COLUMNS]
        columns = {k: [row.get(k) for row in distinct] for k in names}
        columns[PROMPT_KEY] = prompts
        return prompt_ids, prompt_mask, columns

    def _next_micro_step(self) -> int:
        """The index of this micro-step within the current optimizer step (0, 1, ...; from the step count, so a
        resumed run numbers its micro-steps as the uninterrupted one)."""
        step, micro = self._proposal_clock
        micro = micro + 1 if step == self.state.global_step else 0
        self._proposal_clock = (self.state.global_step, micro)
        return micro

    @contextlib.contextmanager
    def _proposal_stream(self, stream: int) -> Iterator[None]:
        """The proposal's own random stream for this micro-step (seeded by seed, optimizer step, micro-step, process
        and ``stream``); the global random state is restored afterwards, so GRPO's draws are untouched."""
        micro = self._proposal_clock[1]
        seed = (self.args.seed * 1_000_003 + self.state.global_step * 10_007 + micro * 101 + stream * 7) % (2**62)
        seed += self.accelerator.process_index * 7919
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    def _log_phi(self, rollout: Rollout) -> torch.Tensor:
        return log_target_weight(rollout.scores, self.args.target_dist_beta).to(rollout.scores.device)

    def _proposal_backward(self, rollout: Rollout, log_phi: torch.Tensor, scale: float) -> TwistLossOutput:
        out = self.compute_proposal_loss(rollout, log_phi)
        (out.loss.loss * scale).backward()
        return out

    def _step_proposal(self) -> None:
        """The proposal's own clip-and-step (`trainers/common/stepping.py`); its norm is ``proposal/grad_norm``."""
        params = [p for p in self.proposal.parameters() if p.requires_grad]
        norm = step_own_optimizer(self.accelerator, params, self.proposal_optimizer, self.args.max_grad_norm)
        self._metric("proposal/grad_norm", norm)

    def _metric(self, name: str, value) -> None:
        value = float(value.detach().float().mean()) if torch.is_tensor(value) else float(value)
        self._metrics["train"][name].append(value)

    def _record_proposal(self, rollout: Rollout, log_phi: torch.Tensor, out: TwistLossOutput) -> None:
        scores = rollout.scores.float()
        self._metric("proposal/loss", out.loss.loss)
        self._metric("proposal/reward_mean", scores.mean())
        self._metric("proposal/p_bad", (scores < self.args.save_negdata_threshold).float().mean())
        with torch.no_grad():
            self._metric("proposal/ess", effective_sample_size(self.proposal_weights(rollout, log_phi)).mean())
            kl = ((rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask).sum(-1)
            self._metric("proposal/kl_to_policy", kl.mean())
        for key, value in reward_component_metrics(rollout.reward_components, prefix="proposal/rewards/").items():
            self._metric(key, value)

    # ------------------------------------------------------------------------------------------ saving, resume
    def save_proposal_checkpoint(self, checkpoint_dir: str) -> None:
        """Write the proposal, its optimizer and the negative-data run id to ``checkpoint_dir/proposal/``."""
        run_id = self._negdata.run_id if self._negdata is not None else None
        save_proposal_state(
            self.proposal, self.proposal_optimizer, checkpoint_dir, processing_class=self.processing_class,
            extra={"negdata_run_id": run_id, "global_step": self.state.global_step},
        )  # fmt: skip

    def save_proposal(self, output_dir: str | None = None) -> str:
        """Write the proposal (weights and tokenizer, no optimizer) to ``output_dir/proposal`` (default
        ``args.output_dir``); returns the folder."""
        output_dir = output_dir or self.args.output_dir
        path = os.path.join(output_dir, "proposal")
        self.accelerator.unwrap_model(self.proposal).save_pretrained(path)
        self.processing_class.save_pretrained(path)
        return path

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model` (the policy); with ``push_proposal_to_hub`` the final save (the run's
        ``output_dir``, which `push_to_hub` uploads) also holds the proposal in ``proposal/``."""
        super().save_model(output_dir, _internal_call)
        target = os.path.abspath(output_dir or self.args.output_dir)
        if self.args.push_proposal_to_hub and target == os.path.abspath(self.args.output_dir):
            if self.accelerator.is_main_process:
                self.save_proposal(target)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`, after restoring the proposal and its optimizer from the resumed checkpoint
        (``resume_from_checkpoint=True``: the newest checkpoint with a complete ``proposal/``)."""
        checkpoint = resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        run_id = None
        if checkpoint is not None:
            run_id = load_proposal_state(self.proposal, self.proposal_optimizer, checkpoint).get("negdata_run_id")
            self.proposal.to(self.accelerator.device)
        if self._negdata is not None and self.accelerator.is_main_process:
            self._negdata.start(run_id, resuming=checkpoint is not None)
        return super().train(
            resume_from_checkpoint=checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
        )
