"""`ProposalTrainer`: learn a proposal ``q`` towards ``σ(s) ∝ p_ref(s)·exp(β·R(s))`` (twist learning) on
`transformers.Trainer`.

How it sits on `Trainer`: the train dataloader yields ``per_device_train_batch_size`` prompts per micro-step
(:class:`~trl_ext.trainers.data.RolloutSampler`, one rollout per batch). Each micro-step

1. samples ``num_samples_per_prompt`` responses per prompt from ``q`` and scores them — ``q``'s and the frozen
   reference's log-probs in eval mode, and the raw reward — (:meth:`ProposalTrainer.rollout`);
2. maps the raw scores to ``R`` and ``log φ = β·R`` (:meth:`ProposalTrainer.compute_rewards`,
   `trl_ext.rewards.RewardShaping`);
3. computes the twist loss (:meth:`ProposalTrainer.compute_twist_loss`, i.e.
   :func:`~trl_ext.trainers.twist_step.twist_loss`), which `Trainer` back-propagates.

Gradient accumulation, the optimizer, scheduler, clipping, mixed precision, logging, callbacks, checkpoints and resume
are `Trainer`'s; a rollout batch is therefore independent of the update batch (``gradient_accumulation_steps``
rollouts per optimizer step).
"""

from __future__ import annotations

import copy
import logging
import os
import textwrap
import time
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_utils import enable_full_determinism, set_seed
from trl.trainer import disable_dropout_in_model
from trl.trainer.base_trainer import _BaseTrainer

from ..models.lora import adapters_disabled, is_peft_model, reference_is_base_with_adapters_disabled
from ..models.modulated import ModulatedCausalLM
from ..models.modulated_utils import load_modulation_state_dict
from ..models.twist import MODULATION_PARAMETERIZATIONS, modulation_kind_of
from . import checkpoint as ckpt
from .data import PromptCollator, RolloutSampler, check_pad_token, left_padded, prepare_prompt_dataset, tokenizer_of
from .ppo_metrics import log_completions_table, print_completions_table
from .proposal_config import ProposalConfig
from .proposal_metrics import ProposalMetrics, proposal_diagnostics
from .rollout import ReferencePolicy, Rollout, RolloutGenerator, RolloutReward, SamplingSettings, generate_responses
from .twist_step import TwistLossOutput, twist_loss, validate_twist_setup

__all__ = ["ProposalRewards", "ProposalTrainer"]

logger = logging.getLogger(__name__)


class ProposalRewards(NamedTuple):
    """Result of :meth:`ProposalTrainer.compute_rewards`; both ``(B,)`` fp32."""

    rewards: torch.Tensor
    """``R``: the raw scores through the ``rm_type`` map (and cap)."""
    log_phi: torch.Tensor
    """``log φ = target_dist_beta · R``."""


class _AdaptersDisabled(nn.Module):
    """A PEFT model run with its adapters disabled, as a module (the reference of DPG under LoRA). The PEFT model is
    held without being registered, so this wrapper owns no parameters and its train/eval mode is not the model's."""

    def __init__(self, peft_model: nn.Module, supports_logits_to_keep: bool):
        super().__init__()
        self._peft = [peft_model]
        self.supports_logits_to_keep = supports_logits_to_keep

    def forward(self, **kwargs):
        with adapters_disabled(self._peft[0]) as base:
            return base(**kwargs)


class ProposalTrainer(_BaseTrainer):
    """Trainer of a proposal (twist) ``q`` towards ``σ ∝ p_ref·exp(β·R)``, with CTL, DPG or SIXO.

    Args:
        args (`ProposalConfig`): training arguments.
        processing_class: the tokenizer of ``q`` (it needs a pad token; prompts are left-padded for generation).
        model: the proposal ``q``. For a ``policy_psi_*`` parameterisation a causal LM (optionally trained with LoRA
            through ``peft_config``); for ``modulation_*`` a `ModulatedCausalLM` of the matching kind, or a plain
            causal LM that is wrapped with `ModulatedCausalLM.from_base` (it becomes the frozen base).
        ref_model: the frozen ``p_ref`` of the target. `None`: the modulated model's own base (``modulation_*``),
            the LoRA base with adapters disabled (``peft_config``), else a frozen copy of the initial ``model``.
        reward_model: a reward model sharing the tokenizer (scored at the last real token), or a ``(model,
            tokenizer)`` pair, a `RewardFunction`, a callable ``(prompts, completions) -> scores`` or a URL.
        train_dataset: prompts, in a ``prompt`` column (text or chat messages) or an ``input_ids`` column.
        eval_dataset: prompts for :meth:`evaluate` (the ELBO / IWAE bound on held-out prompts) and sample tables.
        callbacks: extra `TrainerCallback` s.
        optimizers: ``(optimizer, scheduler)``; default: `Trainer`'s, over the trainable parameters of ``q``.
        peft_config: a `peft.PeftConfig` to train a ``policy_psi_*`` proposal with adapters.

    Public hooks: :meth:`rollout`, :meth:`compute_rewards`, :meth:`compute_twist_loss`.
    """

    _tag_names = ["trl", "trl-ext", "twist-learning"]
    _name = "Proposal (twist learning)"
    _paper = {
        "title": "Probabilistic Inference in Language Models via Twisted Sequential Monte Carlo",
        "id": "2404.17546",
        "citation": textwrap.dedent(
            """\
            @inproceedings{zhao2024probabilistic,
                title     = {{Probabilistic Inference in Language Models via Twisted Sequential Monte Carlo}},
                author    = {Stephen Zhao and Rob Brekelmans and Alireza Makhzani and Roger Grosse},
                booktitle = {International Conference on Machine Learning},
                year      = 2024,
                eprint    = {arXiv:2404.17546}
            }"""
        ),
    }
    # Each micro-step's loss is the mean over its own rollout: `Trainer` divides it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        args: ProposalConfig,
        processing_class,
        model: nn.Module,
        ref_model: nn.Module | None = None,
        reward_model=None,
        train_dataset=None,
        eval_dataset=None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
    ) -> None:
        if not isinstance(args, ProposalConfig):
            raise TypeError(f"args must be a trl_ext ProposalConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: a dataset with a 'prompt' or an 'input_ids' column.")
        if reward_model is None:
            raise ValueError("`reward_model` is required (a reward model, a reward function, a callable or a URL).")
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object: the reference must stay frozen. Pass a separate "
                "copy, or ref_model=None for a frozen copy of the initial model."
            )
        if args.load_best_model_at_end:
            raise ValueError("load_best_model_at_end is not supported by ProposalTrainer (there is no eval loss).")
        self.tokenizer = tokenizer_of(processing_class)
        check_pad_token(self.tokenizer)
        self.stop_token_id = self.tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        self._needs = validate_twist_setup(args.parameterization, args.loss_type)
        self.reward_shaping = args.reward_shaping()

        # Seeded before any weight is created here (a fresh modulation, LoRA adapters), as `Trainer` does for
        # `model_init`, so they are reproducible from `args.seed`.
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        model, self.reference = self._build_models(args, model, ref_model, peft_config)
        self.ref_model, self.reward_model = self.reference.model, reward_model
        for module in (model, self.ref_model, reward_model):
            if isinstance(module, nn.Module):
                disable_dropout_in_model(module)

        train_dataset = prepare_prompt_dataset(train_dataset, self.tokenizer, num_proc=args.dataset_num_proc)
        if isinstance(eval_dataset, dict):
            eval_dataset = {
                k: prepare_prompt_dataset(v, self.tokenizer, num_proc=args.dataset_num_proc, name=f"eval_dataset[{k}]")
                for k, v in eval_dataset.items()
            }
        elif eval_dataset is not None:
            eval_dataset = prepare_prompt_dataset(
                eval_dataset, self.tokenizer, num_proc=args.dataset_num_proc, name="eval_dataset"
            )
        if args.max_steps <= 0 and args.total_episodes is not None:
            args.max_steps = args.steps_for_episodes()
        prompts_per_step = args.per_device_train_batch_size * args.world_size
        if len(train_dataset) < prompts_per_step:
            raise ValueError(
                f"train_dataset has {len(train_dataset)} prompts but one micro-step needs {prompts_per_step} "
                f"(per_device_train_batch_size={args.per_device_train_batch_size} × {args.world_size} processes); add "
                "prompts or lower per_device_train_batch_size."
            )
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(self._tag_names)
        super().__init__(
            model=model,
            args=args,
            data_collator=PromptCollator(self.tokenizer.pad_token_id),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._place_frozen_models()
        self._sampling = SamplingSettings(
            max_new_tokens=args.response_length,
            pad_token_id=self.tokenizer.pad_token_id,
            temperature=args.temperature,
            stop_token_ids=(self.stop_token_id,) if self.stop_token_id is not None else None,
            eos_token_id=self.tokenizer.eos_token_id,
            num_samples_per_prompt=args.num_samples_per_prompt,
        )
        self.rollout_generator = RolloutGenerator(
            self._sampling,
            RolloutReward(self.reward_model, self.tokenizer),
            self.reference,
            forward_batch_size=args.local_rollout_forward_batch_size,
            accelerator=self.accelerator,
            missing_eos_penalty=args.missing_eos_penalty,
            gather_deepspeed3_params=args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=args.activation_checkpointing_kwargs,
        )
        self._metrics = ProposalMetrics()
        self._micro_step: int | None = None

    # ------------------------------------------------------------------------------------------------ setup
    @staticmethod
    def _build_models(args: ProposalConfig, model, ref_model, peft_config) -> tuple[nn.Module, ReferencePolicy]:
        """``(q, reference)``: wrap/adapt ``model`` as the parameterisation needs and pick the frozen reference."""
        if args.parameterization in MODULATION_PARAMETERIZATIONS:
            kind = modulation_kind_of(args.parameterization)
            if peft_config is not None:
                raise ValueError(
                    "peft_config is for policy_psi_* proposals; a modulation already trains only its own parameters. "
                    "Drop peft_config or use a policy parameterisation."
                )
            if not isinstance(model, ModulatedCausalLM):
                model = ModulatedCausalLM.from_base(
                    model,
                    kind,
                    init_scale_divider=args.modulation_init_scale_divider,
                    init_head_from_base=args.modulation_init_head_from_base,
                )
                logger.info("Wrapped the model in a %r ModulatedCausalLM (its weights become the frozen base).", kind)
            elif model.config.modulation_kind != kind:
                raise ValueError(
                    f"parameterization={args.parameterization!r} needs a {kind!r} modulation, but the model's "
                    f"modulation_kind is {model.config.modulation_kind!r}; pick the matching parameterisation."
                )
            if ref_model is None:
                ref_model = model.base_lm
                logger.info("Proposal reference p_ref: the modulated model's own frozen base.")
        else:
            if isinstance(model, ModulatedCausalLM):
                raise ValueError(
                    f"parameterization={args.parameterization!r} is for a plain causal LM, but the model is a "
                    f"ModulatedCausalLM; use parameterization='modulation_{model.config.modulation_kind}'."
                )
            if peft_config is not None:
                from peft import PeftConfig, get_peft_model

                if not isinstance(peft_config, PeftConfig):
                    raise TypeError(f"peft_config must be a peft.PeftConfig, got {type(peft_config).__name__}.")
                if is_peft_model(model):
                    raise ValueError(
                        "You passed a PeftModel together with a peft_config: merge and unload the existing adapter "
                        "first, or pass the PeftModel without peft_config."
                    )
                model = get_peft_model(model, peft_config)
            if ref_model is None and reference_is_base_with_adapters_disabled(model, None):
                return model, ReferencePolicy()
            if ref_model is None:
                ref_model = copy.deepcopy(model)
                logger.info("No ref_model given: p_ref is a frozen copy of the initial proposal.")
        own_base = isinstance(model, ModulatedCausalLM) and ref_model is model.base_lm
        if not own_base and {id(p) for p in ref_model.parameters()} & {id(p) for p in model.parameters()}:
            raise ValueError("ref_model shares parameters with model: the reference must be a separate frozen copy.")
        ref_model.requires_grad_(False).eval()
        return model, ReferencePolicy(ref_model)

    def _place_frozen_models(self) -> None:
        """Put a separate reference and the reward model where ``q`` is (DeepSpeed-prepared under DeepSpeed)."""
        q = self.accelerator.unwrap_model(self.model)
        modules = {"reward_model": self.reward_model} if isinstance(self.reward_model, nn.Module) else {}
        own_base = isinstance(q, ModulatedCausalLM) and self.ref_model is q.base_lm
        if self.ref_model is not None and not own_base:
            modules["ref_model"] = self.ref_model
        for name, module in modules.items():
            if self.is_deepspeed_enabled:
                from trl.models import prepare_deepspeed

                module = prepare_deepspeed(module, self.accelerator)
            else:
                module = module.to(self.accelerator.device)
            setattr(self, name, module)
        self.reference.model = self.ref_model
        if isinstance(self.reward_model, nn.Module):
            self.reward_model.eval()

    def _reference_module(self) -> nn.Module:
        """``p_ref`` as a module for DPG's all-vocabulary log-probs (the LoRA base under PEFT)."""
        if self.ref_model is not None:
            return self.ref_model
        from .rollout import supports_logits_to_keep

        return _AdaptersDisabled(self.model, supports_logits_to_keep(self.model))

    # ------------------------------------------------------------------------------------- Trainer plumbing
    def get_train_dataloader(self) -> DataLoader:
        """``per_device_train_batch_size`` prompts per process and micro-step, in a seeded order per epoch."""
        args = self.args
        sampler = RolloutSampler(
            len(self.train_dataset),
            args.per_device_train_batch_size * args.world_size,
            repeat=1,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        loader = DataLoader(
            self.train_dataset,
            batch_size=args.per_device_train_batch_size,
            sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
        )
        return self.accelerator.prepare(loader)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`Trainer.train`; ``resume_from_checkpoint=True`` picks the newest *complete* checkpoint."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = ckpt.last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint (with trainer_state.json) in {self.args.output_dir}.")
        elif resume_from_checkpoint:
            if not ckpt.is_complete_checkpoint(resume_from_checkpoint):
                raise ValueError(
                    f"{resume_from_checkpoint} is not a complete checkpoint (no trainer_state.json); resume from an "
                    "earlier one, or pass resume_from_checkpoint=True."
                )
        else:
            resume_from_checkpoint = None
            # Each process samples with its own seed (the same seed would draw the same responses everywhere).
            torch.manual_seed(self.args.seed + 100003 * self.accelerator.process_index)
        self._micro_step = None
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # `Trainer`'s loader expects the full weights of the module it trains; a modulation checkpoint holds only the
        # modulation, and transformers renames some keys on load. Optimizer, scheduler, RNG and state are Trainer's.
        q = self.accelerator.unwrap_model(model if model is not None else self.model)
        if isinstance(q, ModulatedCausalLM):
            result = q.load_state_dict(load_modulation_state_dict(resume_from_checkpoint, {}), strict=False)
            missing = [k for k in result.missing_keys if not k.startswith("base_lm.")]
            if missing or result.unexpected_keys:
                raise RuntimeError(
                    f"{resume_from_checkpoint} does not hold this model's modulation: missing {missing[:5]}, "
                    f"unexpected {result.unexpected_keys[:5]}."
                )
        else:
            ckpt.load_policy_and_value(q, None, resume_from_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save ``q`` in HF format at ``output_dir`` (a modulation saves only its own weights, a PEFT model its
        adapter), with the tokenizer and the training arguments; push with ``push_to_hub``."""
        output_dir = os.path.normpath(output_dir if output_dir is not None else self.args.output_dir)
        state_dict = None
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            engine = self.deepspeed if self.is_deepspeed_enabled else self.model
            try:
                state_dict = {f"policy.{k}": v for k, v in self.accelerator.get_state_dict(engine).items()}
            except ValueError:
                logger.warning(
                    "Could not gather the full weights (ZeRO-3 without stage3_gather_16bit_weights_on_model_save): "
                    "the proposal is not written in HF format; the DeepSpeed engine checkpoint holds it."
                )
                state_dict = False
        if self.args.should_save and state_dict is not False:
            ckpt.save_policy_and_value(
                self.accelerator.unwrap_model(self.model),
                None,
                output_dir,
                state_dict=state_dict,
                processing_class=self.processing_class,
                extra_files={"training_args.bin": self.args},
            )
        if not _internal_call:
            hub_id = self.args.hub_model_id
            self.create_model_card(model_name=hub_id.split("/")[-1] if hub_id else os.path.basename(output_dir))
            if self.args.push_to_hub:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ------------------------------------------------------------------------------------- the training step
    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """One micro-step: a fresh rollout of ``q`` on the prompts ``inputs``, then the twist loss (forward,
        backward through `Trainer.training_step`)."""
        accumulation = self.args.gradient_accumulation_steps
        if self._micro_step is None:
            self._micro_step = self.state.global_step * accumulation
        batch = self._make_batch(model, inputs)
        start = time.perf_counter()
        loss = super().training_step(model, batch, num_items_in_batch)
        self._metrics.add("timing/training", time.perf_counter() - start)
        self._micro_step += 1
        tables = self.args.num_sample_generations
        if tables and self.eval_dataset is not None and self._micro_step % accumulation == 0:
            every = max(1, self.state.max_steps // tables)
            if (self._micro_step // accumulation) % every == 0:
                self.generate_completions()
        return loss

    def _make_batch(self, model: nn.Module, inputs: dict) -> dict:
        device = self.accelerator.device
        prompt_ids, prompt_mask = left_padded(
            inputs["input_ids"], inputs.get("attention_mask"), self.tokenizer.pad_token_id
        )
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        rollout = self.rollout(model, prompt_ids, prompt_mask)
        rewards = self.compute_rewards(rollout)
        batch = {
            "input_ids": rollout.input_ids,
            "attention_mask": rollout.attention_mask,
            "response_mask": rollout.response_mask,
            "old_logprobs": rollout.logprobs,
            "ref_logprobs": rollout.ref_logprobs,
            "log_phi": rewards.log_phi.to(device),
        }
        if self._needs.base_samples:
            batch["base_batch"] = self._sample_reference(model, prompt_ids, prompt_mask)
        self._log_rollout(rollout, rewards)
        return batch

    @torch.no_grad()
    def _sample_reference(self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> dict:
        """Fresh samples of ``p_ref`` for the same prompts (``N`` each), for exact SIXO's negative term."""
        n = self.args.num_samples_per_prompt
        ids, mask = prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
        start = time.perf_counter()
        unwrapped = self.accelerator.unwrap_model(model)
        with self.reference.module(unwrapped) as reference:
            responses, response_mask, _ = generate_responses(
                reference, ids, mask, self._sampling, self.args.local_rollout_forward_batch_size
            )
        self._metrics.add("timing/reference_generation", time.perf_counter() - start)
        return {
            "input_ids": torch.cat([ids, responses], 1),
            "attention_mask": torch.cat([mask, response_mask], 1),
            "response_mask": response_mask,
        }

    # ------------------------------------------------------------------------------------------ public hooks
    def rollout(self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Rollout:
        """Sample ``num_samples_per_prompt`` responses of ``q`` per left-padded prompt and score them: ``q``'s and
        ``p_ref``'s log-probs (eval mode, no grad) and the raw rewards (see
        :class:`~trl_ext.trainers.rollout.RolloutGenerator`). Override to change how samples are collected."""
        return self.rollout_generator(model, prompt_ids, prompt_mask)

    def compute_rewards(self, rollout: Rollout) -> ProposalRewards:
        """Raw scores (``missing_eos_penalty`` already subtracted) → ``(R, log φ = β·R)`` with the config's
        `~trl_ext.rewards.RewardShaping` (``rm_type``, ``reward_cap``, ``reward_threshold``, ``target_dist_beta``)."""
        scores = rollout.scores
        rewards = self.reward_shaping.mapped(scores).to(scores.device)
        return ProposalRewards(rewards, self.reward_shaping.log_phi(scores).to(scores.device))

    def compute_twist_loss(self, model: nn.Module, batch: dict) -> TwistLossOutput:
        """The twist loss of ``q`` on one rollout (:func:`~trl_ext.trainers.twist_step.twist_loss` with the config's
        ``parameterization``, ``loss_type``, ``temperature`` and ``loss_aggregation``)."""
        args = self.args
        return twist_loss(
            model,
            batch,
            num_samples_per_prompt=args.num_samples_per_prompt,
            parameterization=args.parameterization,
            loss_type=args.loss_type,
            temperature=args.temperature,
            aggregation=args.loss_aggregation,
            reference_model=self._reference_module() if self._needs.all_vocab else None,
            base_batch=batch.get("base_batch"),
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The twist loss of the rollout ``inputs`` built by :meth:`training_step`."""
        out = self.compute_twist_loss(model, inputs)
        with torch.no_grad():
            mask = inputs["response_mask"] != 0
            diff = (out.q_logprobs - inputs["old_logprobs"]).abs()
            values = {
                "loss": out.loss.loss.detach(),
                "logprob_diff": torch.where(mask, diff, torch.zeros_like(diff)).max(),
                **out.loss.metrics,
            }
            if out.entropy is not None:
                values["token_entropy"] = out.entropy[mask].float().mean()
        self._metrics.add_many(values, "proposal/", self.accelerator.gather)
        return (out.loss.loss, out) if return_outputs else out.loss.loss

    # ----------------------------------------------------------------------------------------------- metrics
    def _log_rollout(self, rollout: Rollout, rewards: ProposalRewards) -> None:
        values = proposal_diagnostics(
            rollout.logprobs,
            rollout.ref_logprobs,
            rewards.log_phi,
            rollout.response_mask,
            rollout.num_samples_per_prompt,
        )
        values["reward"] = rollout.scores.float().mean()
        values["mapped_reward"] = rewards.rewards.float().mean()
        values["response_length"] = rollout.response_mask.float().sum(-1).mean()
        self._metrics.add_many(values, "proposal/", self.accelerator.gather)
        generation = rollout.timings.get("generation", 0.0)
        self._metrics.add("timing/generation", generation)
        self._metrics.add("timing/scoring", rollout.timings.get("scoring", 0.0))
        self._metrics.add("tokens_per_second", float(rollout.response_mask.sum()) / max(generation, 1e-9))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the metrics collected since the last log (``proposal/*``, ``timing/*``) to `Trainer`'s logs."""
        if not any(key.startswith("eval_") for key in logs):
            logs.update(self._metrics.pop())
        super().log(logs, start_time)

    # ----------------------------------------------------------------------------------- samples & evaluation
    def _eval_loader(self, dataset) -> DataLoader | None:
        if dataset is not None and not isinstance(dataset, dict) and "input_ids" not in dataset.column_names:
            dataset = prepare_prompt_dataset(dataset, self.tokenizer, name="dataset")
        dataset = dataset if dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            dataset = next(iter(dataset.values()), None)
        if dataset is None:
            return None
        collator = PromptCollator(self.tokenizer.pad_token_id)
        return self.accelerator.prepare(
            DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=collator)
        )

    @torch.no_grad()
    def generate_completions(self, dataset=None) -> list[dict] | None:
        """One sampled response of ``q`` per prompt of the first eval batch (or of ``dataset``), with its raw score;
        printed as a table and logged to wandb / trackio / comet when they are in ``report_to``. Runs under a forked
        RNG, so it does not change the training run."""
        loader = self._eval_loader(dataset)
        if loader is None:
            return None
        rows = []
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            batch = next(iter(loader))
            ids, mask = left_padded(batch["input_ids"], batch["attention_mask"], self.tokenizer.pad_token_id)
            settings = copy.copy(self._sampling)
            settings.num_samples_per_prompt = 1
            with self.rollout_generator._generation_model(self.model_wrapped) as q:
                responses, response_mask, _ = generate_responses(
                    q, ids, mask, settings, self.args.local_rollout_forward_batch_size
                )
            scores = self.rollout_generator.reward(ids, mask, responses, response_mask)
            prompts = self.tokenizer.batch_decode([r[m != 0] for r, m in zip(ids, mask)], skip_special_tokens=True)
            texts = self.tokenizer.batch_decode([r[m != 0] for r, m in zip(responses, response_mask)])
            for prompt, text, score in zip(prompts, texts, scores.tolist()):
                rows.append({"query": prompt, "proposal response": text, "score": score})
        from accelerate.utils import gather_object

        rows = gather_object(rows)
        if self.accelerator.is_main_process:
            print_completions_table(rows, title=f"Proposal samples at step {self.state.global_step}")
            log_completions_table(rows, self.args.report_to)
        return rows

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample ``N`` responses of ``q`` per eval prompt and log the averaged :func:`proposal_diagnostics`
        (``{prefix}_proposal/f_q``, ``iwae_bound``, ``kl_q_ref``, ``entropy``, ``log_phi``) and the mean raw reward.
        ``eval_dataset``: a prompt dataset, or the key of one in a dict ``eval_dataset``. Runs under a forked RNG."""
        start = time.time()
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        loader = self._eval_loader(eval_dataset)
        totals: dict[str, float] = {}
        batches = 0
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            for batch in loader if loader is not None else []:
                ids, mask = left_padded(batch["input_ids"], batch["attention_mask"], self.tokenizer.pad_token_id)
                rollout = self.rollout(self.model_wrapped, ids, mask)
                rewards = self.compute_rewards(rollout)
                values = proposal_diagnostics(
                    rollout.logprobs, rollout.ref_logprobs, rewards.log_phi, rollout.response_mask,
                    rollout.num_samples_per_prompt,
                )  # fmt: skip
                values["reward"] = rollout.scores.float().mean()
                stacked = self.accelerator.gather(torch.stack(list(values.values())).unsqueeze(0)).mean(0)
                for key, value in zip(values, stacked.tolist()):
                    totals[key] = totals.get(key, 0.0) + value
                batches += 1
        metrics = {f"{metric_key_prefix}_proposal/{k}": v / max(batches, 1) for k, v in totals.items()}
        metrics[f"{metric_key_prefix}_runtime"] = time.time() - start
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
