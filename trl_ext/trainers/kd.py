"""Knowledge distillation on top of TRL's `SFTTrainer`: `KDConfig` and `KDTrainer`.

The student is trained on a mix of the usual next-token loss on the dataset's completions and a distillation loss that
pulls its next-token distribution towards a frozen teacher's at the same positions::

    loss = (1 − kd_coef) · NLL(student, labels) + kd_coef · KL(p_teacher^τ ‖ p_student^τ)

Both terms are token means over the positions that carry a label (the completion tokens under TRL's
`completion_only_loss`, every non-pad token otherwise). The maths lives in the registry (`get_loss("gpt_lm")`,
`get_loss("kd")`, `trl_ext/losses/supervised.py`); the trainer only runs the two forwards and mixes the results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from trl import SFTConfig, SFTTrainer

from ..losses import get_loss
from ..models.offload import check_offloadable, on_device
from .common.checkpointing_defaults import ActivationCheckpointingDefault
from .common.distributed import CpuFsdpMixin
from .common.finite import FiniteStepsArguments, FiniteStepsMixin
from .common.model_card import CompleteModelCard
from .common.resume import ResumeConfigMixin, VerifiedResumeMixin
from .common.run_summary import RunSummaryMixin
from .common.shared_docs import document_shared_options

__all__ = ["KDConfig", "KDTrainer"]


@document_shared_options
@dataclass
class KDConfig(ActivationCheckpointingDefault, FiniteStepsArguments, ResumeConfigMixin, SFTConfig):
    r"""
    Configuration class for [`~trl_ext.trainers.kd.KDTrainer`]: TRL's [`~trl.SFTConfig`] plus the teacher and the
    mixing of the two losses. Everything about the data (`dataset_text_field`, `completion_only_loss`, `max_length`,
    packing, ...) works as in SFT.

    Parameters:
        > Parameters that control the teacher

        teacher_model_name_or_path (`str`, *optional*):
            Folder or Hub id of the teacher, a causal LM with the **same vocabulary** as the student (same tokenizer).
            Used when no `teacher_model` is passed to the trainer.
        teacher_model_init_kwargs (`dict[str, Any]`, *optional*):
            Keyword arguments of `trl_ext.models.load_causal_lm` when the trainer loads the teacher from a path (e.g.
            `{"dtype": "bfloat16"}`; default float32 on a CPU, the checkpoint's dtype on an accelerator).
        teacher_offload (`bool`, *optional*, defaults to `False`):
            Keep the teacher on the CPU and move it to the accelerator only for its forward pass (once per
            micro-batch, then back): same losses, less accelerator memory between teacher passes, at the cost of a
            host-to-device copy of the teacher per micro-batch. Not under DeepSpeed or FSDP (use their own
            parameter offload).

        > Parameters that control the loss

        kd_coef (`float`, *optional*, defaults to `0.5`):
            Weight ``c`` of the distillation term: ``loss = (1 − c)·NLL + c·KD``. `0` is plain SFT (the teacher still
            runs, its KL is logged), `1` pure distillation.
        kd_temperature (`float`, *optional*, defaults to `1.0`):
            Temperature ``τ`` applied to both the student's and the teacher's logits inside the KD term only (the NLL
            term uses the raw logits). No ``τ²`` factor is applied; scale `kd_coef` if you want one.

        {resume_options}
        > Parameters that control non-finite steps (trl_ext addition)

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step whose loss or gradients hold NaN/inf is skipped (weights and optimizer state unchanged,
            logged as `nonfinite/skipped_steps`); more than this many in a row stop the run. `0`: stop at the first.

    > [!NOTE]
    > `loss_type` must stay `"nll"` and `label_smoothing_factor` `0`: the mixed loss replaces SFT's own loss variants.
    > The metrics `nll_loss`, `kd_loss` and `mean_token_accuracy` are logged (with an `eval_` prefix in evaluation).
    """

    _VALID_DICT_FIELDS = SFTConfig._VALID_DICT_FIELDS + ["teacher_model_init_kwargs"]

    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Teacher checkpoint (folder or Hub id): a causal LM with the same vocabulary as the student. Used "
            "when no teacher model is passed to the trainer."
        },
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of `trl_ext.models.load_causal_lm` when loading the teacher from a path, e.g. "
            '\'{"dtype": "bfloat16"}\'.'
        },
    )
    teacher_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep the teacher on the CPU and move it to the accelerator only for its forward pass (once per "
            "micro-batch): same losses, less accelerator memory, a host-to-device copy per micro-batch. Not under "
            "DeepSpeed or FSDP (use their own parameter offload)."
        },
    )
    kd_coef: float = field(
        default=0.5,
        metadata={"help": "Weight c of the distillation term: loss = (1 - c) * NLL + c * KD (0: SFT, 1: pure KD)."},
    )
    kd_temperature: float = field(
        default=1.0,
        metadata={"help": "Temperature of the student and teacher logits inside the KD term (no tau^2 factor)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.kd_coef <= 1.0:
            raise ValueError(f"`kd_coef` must be in [0, 1] (loss = (1 - c)·NLL + c·KD), got {self.kd_coef}.")
        if not self.kd_temperature > 0:
            raise ValueError(f"`kd_temperature` must be > 0, got {self.kd_temperature}.")
        if self.loss_type != "nll":
            raise ValueError(
                f"KDTrainer mixes the plain next-token NLL with the KD loss; `loss_type={self.loss_type!r}` is not "
                "supported. Set `loss_type='nll'`."
            )
        if self.label_smoothing_factor:
            raise ValueError(
                "KDTrainer does not apply label smoothing (the teacher already gives soft targets); set "
                "`label_smoothing_factor=0`."
            )


class KDTrainer(RunSummaryMixin, CompleteModelCard, FiniteStepsMixin, VerifiedResumeMixin, CpuFsdpMixin, SFTTrainer):
    """[`~trl.SFTTrainer`] that adds a distillation term towards a frozen teacher (see [`KDConfig`]).

    Args:
        model: the student, as for `SFTTrainer` (a model or a path).
        teacher_model: the teacher (a causal LM or a path); default `args.teacher_model_name_or_path`. It is put in
            eval mode, frozen and placed like the student (DeepSpeed / FSDP prepared when those are on). Its
            vocabulary size must equal the student's.
        args: a [`KDConfig`].
        **kwargs: every other `SFTTrainer` argument (`train_dataset`, `processing_class`, `peft_config`, ...).

    Override `compute_loss` to change how the two terms are combined.
    """

    _tag_names = ["trl", "sft", "trl_ext", "knowledge-distillation"]
    _name = "KD"

    def __init__(self, model, teacher_model=None, args: KDConfig | None = None, **kwargs):
        if not isinstance(args, KDConfig):
            raise ValueError(
                f"KDTrainer needs `args=KDConfig(...)` (with the teacher and `kd_coef`), got {type(args).__name__}."
            )
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("KDTrainer computes its own mixed loss: do not pass `compute_loss_func`.")
        if teacher_model is None:
            if args.teacher_model_name_or_path is None:
                raise ValueError(
                    "KDTrainer needs a teacher: pass `teacher_model=` or set `teacher_model_name_or_path` in KDConfig."
                )
            teacher_model = args.teacher_model_name_or_path
        if isinstance(teacher_model, str):
            from ..models import load_causal_lm

            teacher_model = load_causal_lm(teacher_model, **dict(args.teacher_model_init_kwargs or {}))
        super().__init__(model=model, args=args, **kwargs)

        student_vocab = self.model.config.get_text_config().vocab_size
        teacher_vocab = teacher_model.config.get_text_config().vocab_size
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"The student has vocab_size {student_vocab} but the teacher has {teacher_vocab}: token-level "
                "distillation compares the two next-token distributions, so both models must share one tokenizer "
                "and vocabulary. Use a teacher of the same family (same tokenizer), or resize the embeddings of both."
            )
        self.teacher_model = self._prepare_teacher(teacher_model)
        self._kd_loss = get_loss("kd", "supervised")
        self._nll_loss = get_loss("gpt_lm", "supervised")

    def _prepare_teacher(self, teacher: torch.nn.Module) -> torch.nn.Module:
        teacher.eval()
        teacher.requires_grad_(False)
        # With teacher_offload: where `compute_loss` moves the teacher (kept on the CPU) for its forward pass.
        self.teacher_offload_device = None
        if self.args.teacher_offload:
            if self.is_deepspeed_enabled or self.is_fsdp_enabled:
                backend = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
                raise ValueError(
                    f"teacher_offload=True is not supported under {backend}: there the teacher is prepared (sharded) "
                    f"by {backend}, which has its own parameter offload. Set teacher_offload=False and use ZeRO-3's "
                    "`offload_param: {device: cpu}` (DeepSpeed) or FSDP's CPU offload (`offload_params`) instead."
                )
            check_offloadable(teacher, "teacher_offload")
            self.teacher_offload_device = self.accelerator.device
            return teacher.to("cpu")
        if self.is_deepspeed_enabled:
            from trl.models import prepare_deepspeed

            return prepare_deepspeed(teacher, self.accelerator)
        if self.is_fsdp_enabled:
            from trl.models import prepare_fsdp

            return prepare_fsdp(teacher, self.accelerator)
        return teacher.to(self.accelerator.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``(1 − kd_coef)·NLL + kd_coef·KD`` on the labelled positions of the batch.

        Both terms are divided by the same token count: ``num_items_in_batch`` when the `Trainer` gives it (the
        labelled tokens of the whole gradient-accumulation batch, like SFT) and the micro-batch's otherwise.
        """
        mode = "train" if self.model.training else "eval"
        labels = inputs["labels"]
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        model_inputs["use_cache"] = False
        outputs = model(**model_inputs)
        student_logits = outputs.logits
        with torch.no_grad(), on_device(self.teacher_model, self.teacher_offload_device):  # teacher_offload
            teacher_logits = self.teacher_model(**model_inputs).logits

        normalizer = None if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).clamp(min=1)
        nll = self._nll_loss(student_logits, labels, shift=True, normalizer=normalizer)
        kd = self._kd_loss(
            student_logits[:, :-1],
            teacher_logits[:, :-1],
            labels=labels[:, 1:],
            temperature=self.args.kd_temperature,
            normalizer=normalizer,
        )
        coef = self.args.kd_coef
        loss = (1.0 - coef) * nll.loss + coef * kd.loss
        # As in SFTTrainer: with a global token count, DDP's gradient averaging must be undone.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())

        # Logged per micro-batch as token means over every process's labelled tokens, whatever the normalizer of the
        # optimised loss: per-process token sums and counts are gathered (N processes log what one process would).
        count = nll.metrics["num_tokens"].float().reshape(())
        rescale = count if normalizer is None else torch.as_tensor(normalizer, dtype=torch.float32)
        sums = torch.stack(
            [
                nll.loss.detach().float() * rescale,
                kd.loss.detach().float() * rescale,
                nll.metrics["token_accuracy"].float() * count,
                count,
            ]
        ).to(student_logits.device)
        totals = self.accelerator.gather_for_metrics(sums.unsqueeze(0)).sum(0)
        tokens = totals[-1].clamp(min=1)
        for name, total in zip(("nll_loss", "kd_loss", "mean_token_accuracy"), totals[:-1]):
            self._metrics[mode][name].append((total / tokens).item())
        return (loss, outputs) if return_outputs else loss
