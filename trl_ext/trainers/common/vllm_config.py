"""`VLLMConfigMixin`: the options of generation with vLLM, shared by `PPOConfig`, `HarmlessnessConfig` and
`ProposalConfig`, with the names and meanings of TRL 1.16's `GRPOConfig` (``use_vllm``, ``vllm_mode``, ...).

Put it before the online config in the bases (``class PPOConfig(VLLMConfigMixin, PtxConfigMixin, OnlineConfig)``):
its `_validate` runs the base's checks first, then its own. The class docstrings of the configs get the section
:data:`VLLM_DOC` from the decorator :func:`document_vllm_options` (written once here). The engine itself is
`trl_ext.rollout.vllm`; the launch commands are in docs/vllm.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["VLLM_DOC", "VLLM_IS_MODES", "VLLMConfigMixin", "document_vllm_options"]

#: `vllm_importance_sampling_mode` values (TRL 1.16's).
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

VLLM_DOC = """
        > Parameters that control generation with vLLM (docs/vllm.md; TRL 1.16 `GRPOConfig`'s names)

        use_vllm (`bool`, *optional*, defaults to `False`):
            Sample the responses with vLLM instead of `model.generate()` (same temperature, top-k, top-p, stop
            token, max tokens and samples per prompt). The behaviour log-probs are still computed by the trained
            model. Needs vLLM (`make setup-vllm`, or `pip install 'trl_ext[vllm]'` on a GPU machine).
        vllm_mode (`str`, *optional*, defaults to `"colocate"`):
            `"colocate"`: a vLLM engine in the training process (weights loaded into it in place after every
            optimizer step); `"server"`: a separate `trl vllm-serve` / `vllm serve` server reached over HTTP.
        vllm_gpu_memory_utilization (`float`, *optional*, defaults to `0.3`):
            Fraction of the GPU memory the colocated engine may take (colocate mode only).
        vllm_tensor_parallel_size (`int`, *optional*, defaults to `1`):
            Tensor-parallel size of the colocated engine (colocate mode only).
        vllm_max_model_length (`int`, *optional*):
            Context window of the colocated engine; `None`: from the model config.
        vllm_enable_sleep_mode (`bool`, *optional*, defaults to `False`):
            Put the colocated engine to sleep (weights and KV cache offloaded) between generations (GPU only).
        vllm_server_base_url (`str`, *optional*):
            Base URL of the vLLM server (e.g. `"http://127.0.0.1:8000"`); when set, host and port are ignored.
        vllm_server_host (`str`, *optional*, defaults to `"0.0.0.0"`):
            Host of the vLLM server.
        vllm_server_port (`int`, *optional*, defaults to `8000`):
            Port of the vLLM server.
        vllm_server_timeout (`float`, *optional*, defaults to `240.0`):
            Seconds to wait for the server to be up before failing with a `ConnectionError`.
        vllm_group_port (`int`, *optional*, defaults to `51216`):
            Port of the NCCL weight-update group of the server (CUDA only; see docs/vllm.md for CPU).
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            Weigh the policy loss by the truncated importance ratio `π_train / π_vLLM` of each sample (or token),
            correcting for vLLM's numerics differing from the trained model's (PPOTrainer only; not with top-k/top-p).
            Off by default (TRL's default is on) because our behaviour log-probs always come from the trained model.
        vllm_importance_sampling_mode (`str`, *optional*, defaults to `"sequence_mask"`):
            `"token_truncate"`, `"token_mask"`, `"sequence_truncate"` or `"sequence_mask"`: per token or per
            sequence, ratios outside `[clip_min, clip_max]` clipped (truncate) or given weight 0 (mask).
        vllm_importance_sampling_clip_max (`float`, *optional*, defaults to `3.0`):
            Upper bound C_max of the importance ratios (TRL's former `vllm_importance_sampling_cap`).
        vllm_importance_sampling_clip_min (`float`, *optional*):
            Lower bound C_min of the importance ratios (`None`: 0).
        vllm_fallback (`bool`, *optional*, defaults to `False`):
            When vLLM cannot sample for this policy (not installed, a modulated policy, a value-head wrapper, a
            modulation twist parameterisation, a vision-language model), generate with `model.generate()` and log
            a warning instead of failing at construction.
"""


def document_vllm_options(cls):
    """Class decorator: insert :data:`VLLM_DOC` into ``cls.__doc__`` before its first ``> [!NOTE]`` (or at the end)."""
    doc = cls.__doc__ or ""
    marker = "\n    > [!NOTE]"
    at = doc.find(marker)
    section = VLLM_DOC.rstrip("\n") + "\n"
    cls.__doc__ = doc + section if at < 0 else doc[:at] + section + doc[at:]
    return cls


@dataclass
class VLLMConfigMixin:
    """The vLLM options (documented in :data:`VLLM_DOC`, inserted into the configs' docstrings)."""

    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Sample responses with vLLM instead of model.generate() (same sampling settings; behaviour "
            "log-probs still from the trained model). Needs vLLM: `make setup-vllm` on CPU, or "
            "`pip install 'trl_ext[vllm]'` on a GPU machine."
        },
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'colocate': a vLLM engine inside the training process; 'server': a separate `trl vllm-serve` "
            "server reached over HTTP (vllm_server_*).",
            "choices": ["colocate", "server"],
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Fraction of GPU memory the colocated vLLM engine may use (colocate only)."}
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "Tensor-parallel size of the colocated vLLM engine (colocate only)."}
    )
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "Context window of the colocated vLLM engine; None: from the model config."}
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={"help": "Offload the colocated engine's weights and KV cache between generations (GPU only)."},
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={"help": "Base URL of the vLLM server (e.g. 'http://127.0.0.1:8000'); overrides host and port."},
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Host of the vLLM server."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the vLLM server."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait for the vLLM server to be up (then ConnectionError)."}
    )
    vllm_group_port: int = field(
        default=51216, metadata={"help": "Port of the server's NCCL weight-update group (CUDA only)."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "Weigh the policy loss by the truncated importance ratio pi_train / pi_vLLM of each sample or "
            "token (vllm_importance_sampling_mode), correcting vLLM's numerical mismatch (PPOTrainer only)."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "How the ratios are applied: 'token_truncate', 'token_mask', 'sequence_truncate' or "
            "'sequence_mask' (clip to [clip_min, clip_max], or weight 0 outside it; per token or per sequence).",
            "choices": list(VLLM_IS_MODES),
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the importance ratios (None: none)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the importance ratios (None: 0)."}
    )
    vllm_fallback: bool = field(
        default=False,
        metadata={
            "help": "When vLLM cannot sample for this policy (not installed, modulated policy, value-head wrapper, "
            "modulation twist, vision-language model), use model.generate() with a warning instead of failing."
        },
    )

    #: Whether the trainer applies ``vllm_importance_sampling_correction``; configs of trainers that do not, refuse it.
    _supports_vllm_is_correction = False

    def _validate(self) -> None:
        parent = getattr(super(), "_validate", None)
        if parent is not None:
            parent()
        name = type(self).__name__

        def fail(message: str) -> None:
            raise ValueError(f"{name}: {message}")

        if self.vllm_mode not in ("colocate", "server"):
            fail(f"unknown vllm_mode {self.vllm_mode!r}; choose 'colocate' or 'server'.")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            fail(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization}: set it in (0, 1].")
        if self.vllm_tensor_parallel_size < 1:
            fail(f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size}: set it to at least 1.")
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < 2:
            fail(f"vllm_max_model_length={self.vllm_max_model_length}: set it >= 2 or None (from the model).")
        if not self.vllm_server_timeout > 0:
            fail(f"vllm_server_timeout={self.vllm_server_timeout}: set it > 0 (seconds).")
        if self.vllm_importance_sampling_mode not in VLLM_IS_MODES:
            fail(
                f"unknown vllm_importance_sampling_mode {self.vllm_importance_sampling_mode!r}; choose one of "
                f"{', '.join(VLLM_IS_MODES)}."
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if high is not None and not high > 0:
            fail(f"vllm_importance_sampling_clip_max={high}: set it > 0 (e.g. 3.0) or None.")
        if low is not None and (low < 0 or (high is not None and low >= high)):
            fail(f"vllm_importance_sampling_clip_min={low}: set it in [0, vllm_importance_sampling_clip_max).")
        filtered = getattr(self, "top_k", None) or getattr(self, "top_p", 1.0) < 1.0
        if self.use_vllm and self.vllm_importance_sampling_correction and filtered:
            fail(
                "vllm_importance_sampling_correction=True with top_k/top_p: vLLM reports log-probs renormalised over "
                "the kept tokens, the trainer unfiltered ones, so their ratio is not a numerical correction; turn "
                "top_k/top_p off or set vllm_importance_sampling_correction=False."
            )
        if self.use_vllm and self.vllm_importance_sampling_correction and not self._supports_vllm_is_correction:
            fail(
                "vllm_importance_sampling_correction=True is supported by PPOTrainer only (here the losses weigh "
                "samples with their own importance weights); set vllm_importance_sampling_correction=False."
            )
