"""`PtxConfigMixin`: the options of the pretraining (ptx) loss, shared by `PPOConfig` and `HarmlessnessConfig`.

Put it before the online config in the bases (``class PPOConfig(PtxConfigMixin, OnlineConfig)``): its `_validate`
runs the base's checks first, then its own. See `trl_ext.trainers.common.ptx` for the loss and the data.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

__all__ = ["PtxConfigMixin"]


@dataclass
class PtxConfigMixin:
    """The ptx options (documented in the docstrings of the configs that use them)."""

    ptx_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight γ of the pretraining (ptx) loss, InstructGPT's PPO-ptx: every policy micro-step adds "
            "ptx_coef × the mean token NLL of one micro-batch of pretraining texts (divided by "
            "gradient_accumulation_steps, so one optimizer step sees ptx_coef × the mean over its micro-batches). "
            "0: off (the pretraining data is not read)."
        },
    )
    ptx_batch_size: int = field(
        default=1, metadata={"help": "Pretraining texts per policy micro-step and process (the ptx micro-batch)."}
    )
    ptx_max_length: int = field(
        default=512, metadata={"help": "Pretraining texts are truncated to this many tokens for the ptx loss."}
    )
    pretrain_data: str | None = field(
        default=None,
        metadata={
            "help": "Pretraining texts for the ptx loss, loaded by the recipes: a Hub dataset id, a local folder or "
            "a .json/.jsonl/.csv/.parquet file (the trainers take the dataset itself as `pretrain_dataset=`)."
        },
    )
    pretrain_text_column: str = field(
        default="text", metadata={"help": "Column of the pretraining dataset that holds the text."}
    )
    pretrain_split: str = field(default="train", metadata={"help": "Split of the pretraining dataset to read."})

    def _validate(self) -> None:
        parent = getattr(super(), "_validate", None)
        if parent is not None:
            parent()
        name = type(self).__name__
        if not (math.isfinite(self.ptx_coef) and self.ptx_coef >= 0):
            raise ValueError(f"{name}: ptx_coef={self.ptx_coef}: set ptx_coef >= 0 (0: no pretraining loss).")
        if self.ptx_batch_size < 1:
            raise ValueError(f"{name}: ptx_batch_size={self.ptx_batch_size}: set it to at least 1.")
        if self.ptx_max_length < 2:
            raise ValueError(
                f"{name}: ptx_max_length={self.ptx_max_length}: set it to at least 2 (a text needs two tokens to "
                "predict one)."
            )
        if not self.pretrain_text_column:
            raise ValueError(f"{name}: pretrain_text_column is empty: name the column that holds the text.")
        if self.pretrain_data is not None and not self.ptx_coef:
            warnings.warn(
                f"{name}: pretrain_data={self.pretrain_data!r} is set but ptx_coef=0, so it is not used; set "
                "ptx_coef > 0 to add the pretraining loss.",
                UserWarning,
                stacklevel=5,
            )
