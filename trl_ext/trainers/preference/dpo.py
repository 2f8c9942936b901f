"""trl_ext's `DPOTrainer`: TRL 1.16's DPO plus an extra loss from the trl_ext registry and negative-only data.

- With no ``extra_loss`` it *is* TRL's trainer: every ``loss_type`` gives the same loss as `trl.DPOTrainer`.
- ``extra_loss="negative_dpo" | "unlikelihood" | "sft_regularised" | <any registered preference loss>`` adds
  ``extra_loss_coef × extra`` to TRL's loss. The extra loss reads the per-token log-probs of the forward passes TRL
  already ran (through forward hooks, see `FusedCallRecorder`), so it costs no extra model pass.
- ``extra_loss_only=True`` trains on the extra loss alone; it is implied by a dataset without a ``chosen`` column,
  which only losses that never read the chosen completion (``negative_dpo``, ``unlikelihood``) accept.
- trl_ext models (`ModulatedCausalLM`, `AutoModelForCausalLMWithValueHead`) keep their own fused forward, and a
  reference model is required where TRL could not rebuild a correct one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import trl

from ..common.checkpointing_defaults import ActivationCheckpointingDefault
from ..common.distributed import CpuFsdpMixin
from ..common.finite import FiniteStepsArguments, FiniteStepsMixin
from ..common.model_card import CompleteModelCard
from ..common.precision import default_bf16_off_without_gpu
from ..common.resume import ResumeConfigMixin, VerifiedResumeMixin
from ..common.run_summary import RunSummaryMixin
from ..common.shared_docs import document_shared_options
from .checks import DPO_LOSS_TYPES, check_config, check_dpo_dataset
from .common import (
    _DUPLICATES_TRL_LOSS,
    ExtraLoss,
    ExtraLossArguments,
    ExtraLossLogging,
    check_reference_model,
    completion_labels,
    rejected_only_losses,
)

logger = logging.getLogger(__name__)

__all__ = ["DPOConfig", "DPOTrainer"]

# Batch keys of TRL's preference collator that are not model inputs.
_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}


@document_shared_options
@dataclass
class DPOConfig(
    ActivationCheckpointingDefault, FiniteStepsArguments, ExtraLossArguments, ResumeConfigMixin, trl.DPOConfig
):
    r"""
    Configuration class for trl_ext's [`DPOTrainer`]: every parameter of TRL's `trl.DPOConfig` (same names, defaults
    and meaning) plus an extra loss. For the generic training arguments see [`~transformers.TrainingArguments`].

    Parameters:
        > Parameters of TRL's DPOConfig

        See `trl.DPOConfig` (`beta`, `loss_type`, `loss_weights`, `label_smoothing`, `precompute_ref_log_probs`,
        `max_length`, ...). Left alone, they train exactly as TRL does, except that `bf16` defaults to `False` on a
        machine without a GPU (TRL's default, `True`, refuses to start there). Unknown `loss_type` names and
        `max_length <= 0` are refused here.

        > Parameters that control the extra loss (trl_ext additions)

        extra_loss (`str`, *optional*):
            Name of a registered `"preference"` loss (`trl_ext.losses.available_losses("preference")`) added to TRL's
            loss: `"negative_dpo"` (alias `"npo"`; −log σ(−β(log π(y_l) − log π_ref(y_l))), pushes rejected
            completions below the reference and needs no chosen), `"unlikelihood"` (−Σ_t log(1 − π(y_t)) on the
            rejected tokens, needs no chosen), `"sft_regularised"` (DPO + `sft_coef` × NLL of the chosen), or any
            other one such as `"ipo"`. `None`: TRL's loss only.
        extra_loss_coef (`float`, *optional*, defaults to `1.0`):
            Weight of the extra loss: loss = TRL loss + `extra_loss_coef` × extra loss.
        extra_loss_only (`bool`, *optional*, defaults to `False`):
            Train on `extra_loss_coef` × extra loss alone, without TRL's `loss_type` terms. Implied when the training
            dataset has no chosen completions.
        extra_loss_beta (`float`, *optional*):
            β of the extra loss; `None` uses `beta`.
        sft_coef (`float`, *optional*, defaults to `1.0`):
            Weight of the chosen NLL (token mean) in `extra_loss="sft_regularised"`.
        unlikelihood_eps (`float`, *optional*, defaults to `1e-6`):
            Lower clamp of 1 − π(token) in `extra_loss="unlikelihood"` (each token adds at most −log eps).
        unlikelihood_aggregation (`str`, *optional*, defaults to `"seq-mean-token-sum"`):
            Reduction of the unlikelihood terms: `"seq-mean-token-sum"`, `"seq-mean-token-mean"` or `"token-mean"`.
        extra_loss_average_log_probs (`bool`, *optional*, defaults to `False`):
            Give the extra loss per-token averaged completion log-probs instead of sums (TRL's IPO convention).
        extra_loss_kwargs (`dict`, *optional*):
            Further keyword arguments of the extra loss (a JSON object on the command line).

        {resume_options}
        > Parameters that control non-finite steps (trl_ext addition)

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step whose loss or gradients hold NaN/inf is skipped (weights and optimizer state unchanged,
            logged as `nonfinite/skipped_steps`); more than this many in a row stop the run. `0`: stop at the first.
    """

    extra_loss_only: bool = field(
        default=False,
        metadata={
            "help": "Train on the extra loss alone, without TRL's `loss_type` terms (e.g. "
            "extra_loss='sft_regularised' or 'ipo' from trl_ext's registry instead of TRL's). Implied when the "
            "dataset has no 'chosen' column."
        },
    )

    def __post_init__(self):
        default_bf16_off_without_gpu(self)
        super().__post_init__()
        check_config(self, DPO_LOSS_TYPES)
        self._check_extra_loss(needs_rejected_only=False, trainer="DPOTrainer")
        if self.extra_loss is None:
            if self.extra_loss_only:
                raise ValueError("extra_loss_only=True needs an extra loss: set extra_loss (e.g. 'negative_dpo').")
            return
        if self.ld_alpha is not None:
            raise ValueError(
                f"ld_alpha={self.ld_alpha} changes how TRL sums the completion log-probs, which the extra loss "
                "does not follow. Set ld_alpha=None or extra_loss=None."
            )
        repeated = _DUPLICATES_TRL_LOSS.get(self.extra_loss)
        if not self.extra_loss_only and repeated in self.loss_type:
            raise ValueError(
                f"extra_loss={self.extra_loss!r} already contains TRL's loss_type={repeated!r} term, which would then "
                f"count twice. Set extra_loss_only=True to train on {self.extra_loss!r} alone, or remove {repeated!r} "
                "from loss_type."
            )


def _conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _fill_missing_chosen(dataset, name: str, extra: ExtraLoss | None, extra_only: bool | None):
    """Give rows without a chosen completion an empty one so TRL's tokenizer and collator accept them.

    Returns ``(dataset, missing)``: ``"none"`` (every row has a chosen completion), ``"some"`` or ``"all"``. Raises a
    ``ValueError`` unless the extra loss never reads the chosen completion and TRL's loss is off (``extra_only``;
    ``None`` means "implied when no row has a chosen").
    """
    if dataset is None:
        return None, "none"
    first = next(iter(dataset))
    if "rejected" not in first or "chosen_ids" in first:
        return dataset, "none"  # tokenised or another format: TRL checks it
    columns = list(getattr(dataset, "column_names", None) or first.keys())
    if "chosen" in columns:
        values = dataset["chosen"] if hasattr(dataset, "__len__") else [first["chosen"]]
        missing = [i for i, v in enumerate(values) if v is None]
        if not missing:
            return dataset, "none"
        none_at_all = len(missing) == len(values) and hasattr(dataset, "__len__")
    else:
        missing, none_at_all = None, True
    described = "has no 'chosen' column" if missing is None else f"has rows without a chosen completion {missing[:5]}"
    if extra is None or extra.uses_chosen:
        needs = f"TRL's DPO loss and extra_loss={extra.name!r} need" if extra else "TRL's DPO loss needs"
        raise ValueError(
            f"{name} {described}. {needs} (chosen, rejected) pairs. Add chosen completions (e.g. "
            "`trl_ext.trainers.preference.data.pairs_from_negative_data(..., chosen_column=... or policy=...)`), or "
            f"train on the rejected completions alone with extra_loss set to one of "
            f"{', '.join(rejected_only_losses())}."
        )
    if not (extra_only or (extra_only is None and none_at_all)):
        raise ValueError(
            f"{name} {described}, but TRL's DPO loss is on and needs a chosen completion in every row. Drop those "
            "rows, or set extra_loss_only=True to train on the rejected completions alone."
        )
    placeholder = [{"role": "assistant", "content": ""}] if _conversational(first["rejected"]) else ""

    def fill(example):
        return {"chosen": example["chosen"] if example.get("chosen") is not None else placeholder}

    return dataset.map(fill), "all" if none_at_all else "some"


class DPOTrainer(
    RunSummaryMixin,
    CompleteModelCard,
    ExtraLossLogging,
    FiniteStepsMixin,
    VerifiedResumeMixin,
    CpuFsdpMixin,
    trl.DPOTrainer,
):
    """`trl.DPOTrainer` with an optional extra loss from `trl_ext.losses` and support for rejected-only data.

    Arguments are those of `trl.DPOTrainer`; ``args`` is a trl_ext [`DPOConfig`] (a plain `trl.DPOConfig` works too,
    without extra loss). Differences from TRL:

    - ``ref_model=None`` is refused with a clear error where TRL cannot rebuild the reference from the model's path
      (a model built from a config, or a trl_ext model class): pass ``ref_model=copy.deepcopy(model)``.
    - Empty datasets, missing columns and chat rows without a chat template are refused before any model work
      (`trl_ext.trainers.preference.checks`).
    - A dataset with ``prompt`` and ``rejected`` only (no ``chosen``) trains with ``extra_loss="negative_dpo"`` or
      ``"unlikelihood"`` alone; such rows get an empty placeholder chosen completion (a short prompt-only sequence in
      each batch) that no loss reads.
    - Logged on top of TRL's metrics (``rewards/chosen``, ``logps/rejected``, ...): ``loss/extra`` (the extra loss
      before its coefficient), ``loss/dpo`` (TRL's loss) and the extra loss's own metrics as ``extra/<name>``. With
      TRL's loss off, TRL's ``logps/*`` and ``rewards/*`` names are logged by this class (chosen ones only when the
      data has chosen completions).

    Example:

    ```python no-run
    trainer = DPOTrainer(
        model=policy,
        ref_model=copy.deepcopy(policy),
        args=DPOConfig(output_dir="out", extra_loss="negative_dpo", extra_loss_coef=0.5),
        train_dataset=dataset,  # prompt, chosen, rejected (or prompt, rejected with extra_loss_only)
        processing_class=tokenizer,
    )
    trainer.train()
    ```
    """

    _tag_names = ["trl", "dpo", "trl_ext"]

    def __init__(
        self,
        model,
        ref_model=None,
        args: trl.DPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = DPOConfig(f"{name.rstrip('/').split('/')[-1]}-DPO")
        check_dpo_dataset(train_dataset, "train_dataset", processing_class)
        check_dpo_dataset(eval_dataset, "eval_dataset", processing_class)
        check_reference_model(model, ref_model, args, peft_config, "DPOTrainer")
        extra = ExtraLoss(args, args.beta) if getattr(args, "extra_loss", None) else None
        requested_only = bool(getattr(args, "extra_loss_only", False))
        train_dataset, missing = _fill_missing_chosen(
            train_dataset, "train_dataset", extra, True if requested_only else None
        )
        extra_only = requested_only or missing == "all"
        if isinstance(eval_dataset, dict):
            eval_dataset = {
                key: _fill_missing_chosen(ds, f"eval_dataset[{key!r}]", extra, extra_only)[0]
                for key, ds in eval_dataset.items()
            }
        else:
            eval_dataset = _fill_missing_chosen(eval_dataset, "eval_dataset", extra, extra_only)[0]

        super().__init__(
            model=model,
            ref_model=ref_model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.finish_setup(extra)
        self.extra_loss_only = extra_only
        self.has_chosen = missing == "none"  # placeholder chosen completions are not logged as chosen ones
        if extra is not None:
            logger.info(
                "DPOTrainer: loss = %s%s x %s%s.",
                "" if extra_only else f"TRL's {args.loss_type} + ",
                extra.coef,
                extra.name,
                "" if self.has_chosen else " (no chosen completions in the data)",
            )

    # ------------------------------------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's DPO loss, plus ``extra_loss_coef × extra_loss`` (or the extra term alone with ``extra_loss_only``)."""
        if self.extra_loss is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.extra_loss_only:
            return self._extra_only_loss(model, inputs, return_outputs)
        return self.loss_with_extra_term(model, inputs, return_outputs, num_items_in_batch, "loss/dpo")

    def _extra_only_loss(self, model, inputs, return_outputs):
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        labels = completion_labels(inputs["input_ids"], inputs["completion_mask"])
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        extra = self._extra_term(inputs, outputs.log_probs, None, log_trl_names=True)
        loss = self.extra_loss.coef * extra.loss
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss
            self._record("aux_loss", outputs.aux_loss)
        if return_outputs:
            with torch.no_grad():
                model_kwargs.pop("output_router_logits", None)
                outputs = model(**model_kwargs)
            return loss, outputs
        return loss

    def _reference_sums(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed reference log-probs of (chosen, rejected): precomputed, or one no-grad reference pass."""
        if self.precompute_ref_logps:
            return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        reference = self.ref_model if self.ref_model is not None else self.model
        return self.compute_ref_log_probs(reference, inputs)

    def _extra_term(self, inputs, token_logps, ref_token_logps, log_trl_names: bool = False):
        """The extra loss from the policy's (and, when recorded, the reference's) per-token log-probs."""
        extra_fn = self.extra_loss
        mask = inputs["completion_mask"][:, 1:]
        width = mask.shape[1]
        token_logps = token_logps[:, -width:]
        sequence = extra_fn.sequence_logps(token_logps, mask)
        if ref_token_logps is not None:
            ref_sequence = extra_fn.sequence_logps(ref_token_logps[:, -width:], mask)
            ref_chosen, ref_rejected = ref_sequence.chunk(2, dim=0)
        else:
            ref_chosen, ref_rejected = (x.detach() for x in self._reference_sums(inputs))
            if extra_fn.average_log_probs:
                lengths = mask.sum(-1).clamp(min=1).to(ref_chosen.dtype)
                ref_chosen, ref_rejected = ref_chosen / lengths.chunk(2)[0], ref_rejected / lengths.chunk(2)[1]
        chosen, rejected = sequence.chunk(2, dim=0)
        chosen_tokens, rejected_tokens = token_logps.chunk(2, dim=0)
        chosen_mask, rejected_mask = mask.chunk(2, dim=0)
        use_chosen = extra_fn.uses_chosen
        out = extra_fn(
            chosen if use_chosen else None,
            rejected,
            ref_chosen if use_chosen else None,
            ref_rejected,
            chosen_token_logps=chosen_tokens if use_chosen else None,
            chosen_mask=chosen_mask if use_chosen else None,
            rejected_token_logps=rejected_tokens,
            rejected_mask=rejected_mask,
        )
        self._record("loss/extra", out.loss)
        for key, value in out.metrics.items():
            self._record(f"extra/{key}", value)
        if log_trl_names:
            self._record_trl_metrics(chosen, rejected, ref_chosen, ref_rejected)
        return out

    # ---------------------------------------------------------------------------------------- logging
    def _record_trl_metrics(self, chosen, rejected, ref_chosen, ref_rejected) -> None:
        """TRL's ``logps/*`` and ``rewards/*`` metrics, for batches where TRL's own loss (which logs them) is off."""
        with torch.no_grad():
            rejected_rewards = self.beta * (rejected.detach() - ref_rejected)
            self._record_rows("logps/rejected", rejected.detach())
            self._record_rows("rewards/rejected", rejected_rewards)
            if self.has_chosen:
                chosen_rewards = self.beta * (chosen.detach() - ref_chosen)
                self._record_rows("logps/chosen", chosen.detach())
                self._record_rows("rewards/chosen", chosen_rewards)
                self._record_rows("rewards/accuracies", (chosen_rewards > rejected_rewards).float())
                self._record_rows("rewards/margins", chosen_rewards - rejected_rewards)
