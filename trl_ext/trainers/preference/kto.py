"""trl_ext's `KTOTrainer`: TRL 1.16's KTO plus an extra loss on the undesirable completions.

With no ``extra_loss`` it is TRL's trainer unchanged. ``extra_loss="negative_dpo"`` or ``"unlikelihood"`` (any
registered preference loss that never reads a chosen completion) adds ``extra_loss_coef × extra`` computed on the
batch's undesirable rows (``label=False``), from the log-probs of the forward passes TRL already ran. A batch
without undesirable rows adds an exact ``0`` (no ``nan``); a batch without desirable rows is handled by TRL's loss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
from .checks import check_config, check_kto_dataset, kto_loss_types
from .common import (
    ExtraLoss,
    ExtraLossArguments,
    ExtraLossLogging,
    check_reference_model,
)

logger = logging.getLogger(__name__)

__all__ = ["KTOConfig", "KTOTrainer"]


@document_shared_options
@dataclass
class KTOConfig(
    ActivationCheckpointingDefault, FiniteStepsArguments, ExtraLossArguments, ResumeConfigMixin, trl.KTOConfig
):
    r"""
    Configuration class for trl_ext's [`KTOTrainer`]: every parameter of TRL's `trl.KTOConfig` (same names, defaults
    and meaning) plus an extra loss on the undesirable completions. For the generic training arguments see
    [`~transformers.TrainingArguments`].

    Parameters:
        > Parameters of TRL's KTOConfig

        See `trl.KTOConfig` (`beta`, `loss_type`, `desirable_weight`, `undesirable_weight`,
        `precompute_ref_log_probs`, `max_length`, ...). Left alone, they train exactly as TRL does, except that
        `bf16` defaults to `False` on a machine without a GPU (TRL's default, `True`, refuses to start there).
        Unknown `loss_type` names and `max_length <= 0` are refused here.

        > Parameters that control the extra loss (trl_ext additions)

        extra_loss (`str`, *optional*):
            A registered `"preference"` loss that reads only the undesirable completions, added to TRL's loss:
            `"negative_dpo"` (alias `"npo"`; −log σ(−β(log π(y) − log π_ref(y))) per undesirable row) or
            `"unlikelihood"` (−Σ_t log(1 − π(y_t)) on the undesirable tokens). `None`: TRL's loss only.
        extra_loss_coef (`float`, *optional*, defaults to `1.0`):
            Weight of the extra loss: loss = TRL loss + `extra_loss_coef` × extra loss.
        extra_loss_beta (`float`, *optional*):
            β of the extra loss; `None` uses `beta`.
        sft_coef (`float`, *optional*, defaults to `1.0`):
            Unused by the KTO extras (kept so DPO and KTO configs share their extra-loss fields).
        unlikelihood_eps (`float`, *optional*, defaults to `1e-6`):
            Lower clamp of 1 − π(token) in `extra_loss="unlikelihood"`.
        unlikelihood_aggregation (`str`, *optional*, defaults to `"seq-mean-token-sum"`):
            Reduction of the unlikelihood terms: `"seq-mean-token-sum"`, `"seq-mean-token-mean"` or `"token-mean"`.
        extra_loss_average_log_probs (`bool`, *optional*, defaults to `False`):
            Give the extra loss per-token averaged completion log-probs instead of sums.
        extra_loss_kwargs (`dict`, *optional*):
            Further keyword arguments of the extra loss (a JSON object on the command line).

        {resume_options}
        > Parameters that control non-finite steps (trl_ext addition)

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step whose loss or gradients hold NaN/inf is skipped (weights and optimizer state unchanged,
            logged as `nonfinite/skipped_steps`); more than this many in a row stop the run. `0`: stop at the first.
    """

    def __post_init__(self):
        default_bf16_off_without_gpu(self)
        super().__post_init__()
        check_config(self, kto_loss_types())
        self._check_extra_loss(needs_rejected_only=True, trainer="KTOTrainer")


class KTOTrainer(
    RunSummaryMixin,
    CompleteModelCard,
    ExtraLossLogging,
    FiniteStepsMixin,
    VerifiedResumeMixin,
    CpuFsdpMixin,
    trl.KTOTrainer,
):
    """`trl.KTOTrainer` with an optional extra loss on the undesirable rows.

    Arguments are those of `trl.KTOTrainer`; ``args`` is a trl_ext [`KTOConfig`] (a plain `trl.KTOConfig` works
    too, without extra loss). As in trl_ext's `DPOTrainer`, ``ref_model=None`` is refused where TRL cannot rebuild a
    correct reference, and trl_ext models keep their own fused forward; empty datasets, missing columns, labels that
    are not booleans and chat rows without a chat template are refused before any model work. Logged on top of TRL's
    metrics: ``loss/kto`` (TRL's loss), ``loss/extra`` (the extra loss before its coefficient, ``0`` for a batch
    without undesirable rows) and the extra loss's own metrics as ``extra/<name>``.
    """

    _tag_names = ["trl", "kto", "trl_ext"]

    def __init__(
        self,
        model,
        ref_model=None,
        args: trl.KTOConfig | None = None,
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
            args = KTOConfig(f"{name.rstrip('/').split('/')[-1]}-KTO")
        check_kto_dataset(train_dataset, "train_dataset", processing_class)
        check_kto_dataset(eval_dataset, "eval_dataset", processing_class)
        check_reference_model(model, ref_model, args, peft_config, "KTOTrainer")
        extra = ExtraLoss(args, args.beta) if getattr(args, "extra_loss", None) else None
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
        if extra is not None:
            logger.info(
                "KTOTrainer: loss = TRL's %s + %s x %s on undesirable rows.", args.loss_type, extra.coef, extra.name
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's KTO loss plus ``extra_loss_coef ×`` the extra loss on the batch's undesirable rows."""
        if self.extra_loss is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.loss_with_extra_term(model, inputs, return_outputs, num_items_in_batch, "loss/kto")

    def _extra_term(self, inputs, token_logps, ref_token_logps):
        extra_fn = self.extra_loss
        mask = inputs["completion_mask"][:, 1:]
        width = mask.shape[1]
        token_logps = token_logps[:, -width:]
        if ref_token_logps is not None:
            ref_sequence = extra_fn.sequence_logps(ref_token_logps[:, -width:], mask)
        else:
            if self.precompute_ref_logps:
                ref_sums = inputs["ref_logps"]
            else:
                reference = self.ref_model if self.ref_model is not None else self.model
                ref_sums = self.compute_ref_log_probs(reference, inputs)[0]
            ref_sequence = ref_sums.detach().to(token_logps.dtype)
            if extra_fn.average_log_probs:
                ref_sequence = ref_sequence / mask.sum(-1).clamp(min=1).to(ref_sequence.dtype)
        undesirable = ~torch.as_tensor(inputs["label"], dtype=torch.bool, device=token_logps.device)
        rows = undesirable.nonzero(as_tuple=False).view(-1)
        rejected_tokens, rejected_mask = token_logps.index_select(0, rows), mask.index_select(0, rows)
        out = extra_fn(
            None,
            extra_fn.sequence_logps(rejected_tokens, rejected_mask),
            None,
            ref_sequence.index_select(0, rows.to(ref_sequence.device)),
            rejected_token_logps=rejected_tokens,
            rejected_mask=rejected_mask,
        )
        self._record("loss/extra", out.loss)
        for key, value in out.metrics.items():
            self._record(f"extra/{key}", value)
        return out
