"""`ProposalTrainer`: learn a proposal ``q`` towards ``σ(s) ∝ p_ref(s)·exp(β·R(s))`` (twist learning) on
`transformers.Trainer`.

How it sits on `Trainer`: the train dataloader yields ``per_device_train_batch_size`` prompts per micro-step
(:class:`~trl_ext.rollout.data.RolloutSampler`, one rollout per batch). Each micro-step

1. samples ``num_samples_per_prompt`` responses per prompt from ``q`` and scores them — ``q``'s and the frozen
   reference's log-probs in eval mode, and the raw reward — (:meth:`ProposalTrainer.rollout`);
2. maps the raw scores to ``R`` and ``log φ = β·R`` (:meth:`ProposalTrainer.compute_rewards`,
   `trl_ext.rewards.RewardShaping`);
3. computes the twist loss (:meth:`ProposalTrainer.compute_twist_loss`, i.e.
   :func:`~trl_ext.trainers.twist.twist_step.twist_loss`), which `Trainer` back-propagates.

Gradient accumulation, the optimizer, scheduler, clipping, mixed precision, logging, callbacks, checkpoints and resume
are `Trainer`'s; a rollout batch is therefore independent of the update batch (``gradient_accumulation_steps``
rollouts per optimizer step).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import textwrap
import time
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader
from trl.trainer.base_trainer import _BaseTrainer

from ...models.lora import adapters_disabled, reference_is_base_with_adapters_disabled
from ...models.modulated import ModulatedCausalLM
from ...models.modulated_utils import load_modulation_state_dict
from ...models.twist import MODULATION_PARAMETERIZATIONS, modulation_kind_of
from ...rollout import ReferencePolicy, Rollout, generate_responses, supports_logits_to_keep
from ...rollout.columns import COLUMNS_KEY, rollout_inputs
from ...rollout.data import left_padded
from ...rollout.fsdp import call_as_root_forward
from ..common import checkpoint as ckpt
from ..common.checks import refuse_same_object
from ..common.metrics import log_reward_components
from ..common.model_parts import add_adapters, shares_parameters
from ..common.online import OnlineTrainerMixin, evaluates_with_ema, forked_rng
from ..common.reward_setup import build_reward
from ..common.run_folder import stage_prefix
from ..twist.twist_step import TwistLossOutput, twist_loss, validate_twist_setup
from .metrics import ProposalMetrics, proposal_diagnostics
from .proposal_config import ProposalConfig

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


class ProposalTrainer(OnlineTrainerMixin, _BaseTrainer):
    """Trainer of a proposal (twist) ``q`` towards ``σ ∝ p_ref·exp(β·R)``, with CTL, DPG or SIXO.

    Args:
        args (`ProposalConfig`): training arguments.
        processing_class: the tokenizer of ``q`` (it needs a pad token; prompts are left-padded for generation).
        model: the proposal ``q``. For a ``policy_psi_*`` parameterisation a causal LM (optionally trained with LoRA
            through ``peft_config``); for ``modulation_*`` a `ModulatedCausalLM` of the matching kind, or a plain
            causal LM that is wrapped with `ModulatedCausalLM.from_base` (it becomes the frozen base). A folder or
            Hub id (here and for ``ref_model``) is loaded with `trl_ext.models.load_causal_lm` defaults.
        ref_model: the frozen ``p_ref`` of the target. `None`: the modulated model's own base (``modulation_*``),
            the LoRA base with adapters disabled (``peft_config``), else a frozen copy of the initial ``model``.
        reward_model: a reward model sharing the tokenizer (scored at the last real token), or a ``(model,
            tokenizer)`` pair, a `RewardFunction`, a callable ``(prompts, completions) -> scores`` (``trl.rewards``
            too) or a URL; or a list of them, summed with ``reward_weights`` (``reward_funcs=``: the same argument).
        train_dataset: prompts, in a ``prompt`` column (text or chat messages) or an ``input_ids`` column; its other
            columns reach reward functions as keyword lists.
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
    _config_class = ProposalConfig
    _saved_models = "the proposal"

    def __init__(
        self,
        args: ProposalConfig,
        processing_class,
        model: nn.Module | str,
        ref_model: nn.Module | str | None = None,
        reward_model=None,
        train_dataset=None,
        eval_dataset=None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
        reward_funcs=None,
    ) -> None:
        refuse_same_object(model, ref_model)
        self._begin_setup(args, processing_class, train_dataset, reward_model, eval_dataset, reward_funcs)
        self._needs = validate_twist_setup(args.parameterization, args.loss_type)
        self.reward_shaping = args.reward_shaping()
        model, ref_model = self._load_models(model=model, ref_model=ref_model)
        model, self.reference = self._build_models(args, model, ref_model, peft_config)
        self.ref_model = self.reference.model
        self._disable_dropout(model, self.ref_model, self.reward_model)

        train_dataset, eval_dataset = self._prepare_datasets(args, train_dataset, eval_dataset)
        self._check_prompts_fit(args, model, train_dataset, eval_dataset)
        self._check_padding_free(args, proposal=model)
        if args.max_steps <= 0 and args.total_episodes is not None:
            args.max_steps = args.steps_for_episodes()
        prompts_per_step = args.per_device_train_batch_size * args.world_size
        if len(train_dataset) < prompts_per_step:
            raise ValueError(
                f"train_dataset has {len(train_dataset)} prompts but one micro-step needs {prompts_per_step} "
                f"(per_device_train_batch_size={args.per_device_train_batch_size} × {args.world_size} processes); add "
                "prompts or lower per_device_train_batch_size."
            )
        self._init_trainer(
            model, model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
        )  # fmt: skip
        self._sampling = self._sampling_settings(args)
        self._build_vllm([model])
        reward = build_reward(self.reward_model, self.tokenizer, args)
        self.rollout_generator = self._rollout_generator(reward, self.reference)
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
                model = add_adapters(model, peft_config)
            if ref_model is None and reference_is_base_with_adapters_disabled(model, None):
                return model, ReferencePolicy()
            if ref_model is None:
                ref_model = copy.deepcopy(model)
                logger.info("No ref_model given: p_ref is a frozen copy of the initial proposal.")
        own_base = isinstance(model, ModulatedCausalLM) and ref_model is model.base_lm
        if not own_base and shares_parameters(ref_model, model):
            raise ValueError("ref_model shares parameters with model: the reference must be a separate frozen copy.")
        ref_model.requires_grad_(False).eval()
        return model, ReferencePolicy(ref_model)

    def _frozen_modules(self) -> dict[str, nn.Module]:
        """The reward model and a separate reference (a modulation's own base is part of ``q`` already)."""
        modules = super()._frozen_modules()
        q = self.accelerator.unwrap_model(self.model)
        if isinstance(q, ModulatedCausalLM) and self.ref_model is q.base_lm:
            modules.pop("ref_model", None)
        return modules

    def _reference_module(self) -> nn.Module:
        """``p_ref`` as a module for DPG's all-vocabulary log-probs (the LoRA base under PEFT)."""
        if self.ref_model is not None:
            return self.ref_model
        return _AdaptersDisabled(self.model, supports_logits_to_keep(self.model))

    # ------------------------------------------------------------------------------------- Trainer plumbing
    def _start_training(self, resume_from_checkpoint: str | None) -> None:
        self._micro_step = None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # `Trainer`'s loader expects the full weights of the module it trains; a modulation checkpoint holds only the
        # modulation, and transformers renames some keys on load. Optimizer, scheduler, RNG and state are Trainer's.
        if self.is_fsdp_enabled:  # FSDP2's sharded weights: `Trainer` reloads its own full copy of the trained module
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
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
            ckpt.load_model_weights(q, resume_from_checkpoint)

    def _write_models(self, output_dir: str, state_dict: dict | None) -> None:
        """``q`` in HF format (a modulation saves only its own weights, a PEFT model its adapter)."""
        if state_dict is not None:
            state_dict = {f"policy.{k}": v for k, v in state_dict.items()}
        ckpt.save_model_pair(
            self.accelerator.unwrap_model(self.model), None, "", output_dir, state_dict=state_dict,
            processing_class=self.processing_class, extra_files={"training_args.bin": self.args},
            tokenizer_with_second=False, stage_prefix=stage_prefix("ppo"),
        )  # fmt: skip

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
        rollout = self.rollout(model, prompt_ids, prompt_mask, **rollout_inputs(inputs, device))  # reward columns
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
            keys = self.rollout_row_keys(prompt_ids.shape[0], self._micro_step or 0, stream=1)  # seed_per_row
            responses, response_mask, _ = call_as_root_forward(  # under FSDP2, as the root's forward
                unwrapped, generate_responses, reference, ids, mask, self._sampling,
                self.args.local_rollout_forward_batch_size, row_keys=keys,
                share_prompts=self.args.shared_prefix_rollouts,
            )  # fmt: skip
        self._metrics.add("timing/reference_generation", time.perf_counter() - start)
        return {
            "input_ids": torch.cat([ids, responses], 1),
            "attention_mask": torch.cat([mask, response_mask], 1),
            "response_mask": response_mask,
        }

    # ------------------------------------------------------------------------------------------ public hooks
    def rollout(self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, columns=None) -> Rollout:
        """Sample ``num_samples_per_prompt`` responses of ``q`` per left-padded prompt and score them: ``q``'s and
        ``p_ref``'s log-probs (eval mode, no grad) and the raw rewards (see
        :class:`~trl_ext.rollout.generator.RolloutGenerator`; ``columns``: the prompts' reward columns, passed only
        when there are some). With ``seed_per_row`` each row samples from its own stream, keyed by the micro-step
        (:meth:`rollout_row_keys`). Override to change how samples are collected."""
        keys = self.rollout_row_keys(prompt_ids.shape[0], self._micro_step or 0)
        return self.rollout_generator(model, prompt_ids, prompt_mask, row_keys=keys, columns=columns)

    def compute_rewards(self, rollout: Rollout) -> ProposalRewards:
        """Raw scores (``missing_eos_penalty`` already subtracted) → ``(R, log φ = β·R)`` with the config's
        `~trl_ext.rewards.RewardShaping` (``rm_type``, ``reward_cap``, ``reward_threshold``, ``target_dist_beta``)."""
        scores = rollout.scores
        rewards = self.reward_shaping.mapped(scores).to(scores.device)
        return ProposalRewards(rewards, self.reward_shaping.log_phi(scores).to(scores.device))

    def compute_twist_loss(self, model: nn.Module, batch: dict) -> TwistLossOutput:
        """The twist loss of ``q`` on one rollout (:func:`~trl_ext.trainers.twist.twist_step.twist_loss` with the
        config's ``parameterization``, ``loss_type``, ``temperature`` and ``loss_aggregation``)."""
        args = self.args
        reference = self._reference_module() if self._needs.all_vocab else None
        with self.reference.placed() if reference is self.ref_model else contextlib.nullcontext():  # ref_offload
            return twist_loss(
                model,
                batch,
                num_samples_per_prompt=args.num_samples_per_prompt,
                parameterization=args.parameterization,
                loss_type=args.loss_type,
                temperature=args.temperature,
                aggregation=args.loss_aggregation,
                reference_model=reference,
                base_batch=batch.get("base_batch"),
                padding_free=args.padding_free,
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
        log_reward_components(self._metrics, rollout, self.accelerator.gather)  # a list: rewards/<name>/mean, std
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
        dataset = self._eval_prompts(dataset)
        return self._eval_dataloader(dataset) if dataset is not None else None

    @torch.no_grad()
    @evaluates_with_ema
    def generate_completions(self, dataset=None) -> list[dict] | None:
        """One sampled response of ``q`` per prompt of the first eval batch (or of ``dataset``), with its raw score;
        printed as a table and logged to wandb / trackio / comet when they are in ``report_to``. Runs under a forked
        RNG, so it does not change the training run."""
        loader = self._eval_loader(dataset)
        if loader is None:
            return None
        settings = copy.copy(self._sampling)
        settings.num_samples_per_prompt = 1
        with forked_rng():
            batch = next(iter(loader))
            ids, mask = left_padded(batch["input_ids"], batch["attention_mask"], self.tokenizer.pad_token_id)
            rows = self._completion_rows(ids, mask, settings, "proposal response", columns=batch.get(COLUMNS_KEY))
        return self._publish_completions(rows, "Proposal samples")

    @torch.no_grad()
    @evaluates_with_ema
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
        with forked_rng():
            for index, batch in enumerate(loader if loader is not None else []):
                ids, mask = left_padded(batch["input_ids"], batch["attention_mask"], self.tokenizer.pad_token_id)
                with self.evaluation_row_keys(index):  # seed_per_row: the eval batches' own streams
                    rollout = self.rollout(self.model_wrapped, ids, mask, **rollout_inputs(batch, ids.device))
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
