"""Building the vLLM engine of an online trainer (``use_vllm=True``, `vllm_config.VLLMConfigMixin`), the checks of
what vLLM can sample for. (The importance-sampling correction of the advantages is in `trl_ext.ops.advantages`.)

:func:`build_vllm_engine` returns a :class:`~trl_ext.rollout.vllm.VLLMRolloutEngine` for the rollout generator, or
``None`` (``use_vllm=False``, or a policy vLLM cannot run with ``vllm_fallback=True``: the rollout then uses
``generate`` and a warning is logged). Without ``vllm_fallback``, an unsupported policy or a missing vLLM is an error
at construction that names the option.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ...models.lora import is_peft_model
from ...models.modulated import ModulatedCausalLM
from ...models.value_head import AutoModelForCausalLMWithValueHead
from ...ops.advantages import importance_corrected_advantages as _corrected
from ...rollout.vision import is_vision_language_model
from ...rollout.vllm import VLLM_INSTALL_HINT, VLLMRolloutEngine, is_vllm_installed

__all__ = ["build_vllm_engine", "importance_corrected_advantages", "vllm_unsupported_reason"]

logger = logging.getLogger(__name__)


def vllm_unsupported_reason(model: nn.Module) -> str | None:
    """Why vLLM cannot sample from ``model`` (the module that generates), or ``None`` when it can."""
    base = model.get_base_model() if is_peft_model(model) else model
    if isinstance(base, ModulatedCausalLM):
        return (
            "the model that samples is a modulated policy (ModulatedCausalLM, q ∝ p·exp(m), e.g. a modulation_* twist "
            "parameterisation): vLLM can only load a plain causal LM"
        )
    if isinstance(base, AutoModelForCausalLMWithValueHead) or hasattr(base, "v_head"):
        return (
            "the policy is a value-head wrapper (shared_actor_critic=True or AutoModelForCausalLMWithValueHead): use "
            "a separate value model (shared_actor_critic=False) with use_vllm"
        )
    if is_vision_language_model(base):
        return "the policy is a vision-language model, which the vLLM rollout does not support"
    return None


def _engine_folder(model: nn.Module) -> str:
    """A folder holding only ``model``'s config (no weights, no tokenizer): the colocated engine is built from it
    with random weights (``load_format="dummy"``) and gets the real ones at its first weight load."""
    base = model.get_base_model() if is_peft_model(model) else model
    config = base.config.to_dict()
    config.pop("quantization_config", None)  # e.g. a GGUF-loaded model: the weights we send are plain
    config.pop("_name_or_path", None)
    folder = tempfile.mkdtemp(prefix="trl_ext_vllm_model_")
    type(base.config).from_dict(config).save_pretrained(folder)
    return folder


def _dtype_name(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return str(param.dtype).removeprefix("torch.") if param is not None else "auto"


def build_vllm_engine(
    args,
    models: Sequence[nn.Module],
    accelerator,
    trainer: str,
    version_fn: Callable[[], object] | None = None,
) -> VLLMRolloutEngine | None:
    """The engine every model in ``models`` samples from (one engine; their weights are swapped in as they sample),
    or ``None`` (see the module docs). ``models[0]`` gives the architecture."""
    if not getattr(args, "use_vllm", False):
        return None
    reasons = [r for r in map(vllm_unsupported_reason, models) if r is not None]
    if not is_vllm_installed():
        reasons.insert(0, f"vLLM is not installed ({VLLM_INSTALL_HINT})")
    if reasons:
        if args.vllm_fallback:
            logger.warning("%s: use_vllm=True but %s; vllm_fallback=True: using generate.", trainer, reasons[0])
            return None
        error = ImportError if not is_vllm_installed() else ValueError
        raise error(
            f"{trainer}: use_vllm=True but {reasons[0]}. Set use_vllm=False, or vllm_fallback=True to sample with "
            "model.generate() instead."
        )
    from ...rollout.vllm import ColocateEngine, ServerEngine

    if args.vllm_mode == "server":
        engine = ServerEngine(
            base_url=args.vllm_server_base_url, host=args.vllm_server_host, port=args.vllm_server_port,
            timeout=args.vllm_server_timeout, group_port=args.vllm_group_port, device=accelerator.device,
        )  # fmt: skip
        return VLLMRolloutEngine(engine, version_fn, accelerator, shared_engine=True)
    if args.vllm_tensor_parallel_size > 1 and accelerator.num_processes > 1:
        raise ValueError(
            f"{trainer}: vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} with "
            f"{accelerator.num_processes} processes is not supported in colocate mode (one engine per process); use "
            "vllm_mode='server' for a tensor-parallel engine."
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = ColocateEngine(
        _engine_folder(models[0]), seed=args.seed + accelerator.process_index, dtype=_dtype_name(models[0]),
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        tensor_parallel_size=args.vllm_tensor_parallel_size, max_model_len=args.vllm_max_model_length,
        enable_sleep_mode=args.vllm_enable_sleep_mode, load_format="dummy",
    )  # fmt: skip
    return VLLMRolloutEngine(engine, version_fn, accelerator)


def importance_corrected_advantages(args, rollout, advantages: torch.Tensor, metrics=None) -> torch.Tensor:
    """Deprecated: the correction is an advantage estimator now,
    `trl_ext.ops.advantages.importance_corrected_advantages` (pure; PPOTrainer logs its ``vllm/*`` statistics). This
    wrapper keeps the old signature until trl_ext 0.3."""
    warnings.warn(
        "trl_ext.trainers.common.vllm_setup.importance_corrected_advantages moved to "
        "trl_ext.ops.advantages.importance_corrected_advantages (tensors in, (advantages, stats) out).",
        DeprecationWarning,
        stacklevel=2,
    )
    advantages, stats = _corrected(
        advantages, rollout.logprobs, rollout.engine_logprobs, rollout.response_mask,
        correct=getattr(args, "vllm_importance_sampling_correction", False),
        mode=getattr(args, "vllm_importance_sampling_mode", "token_truncate"),
        clip_max=getattr(args, "vllm_importance_sampling_clip_max", None),
        clip_min=getattr(args, "vllm_importance_sampling_clip_min", None),
    )  # fmt: skip
    for name, value in stats.items():
        if metrics is not None:
            metrics.add(f"vllm/{name}", value)
    return advantages
