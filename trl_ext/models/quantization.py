"""Model loading with sane CPU defaults and optional bitsandbytes 4-bit / 8-bit quantisation (QLoRA).

- `load_model(auto_class, name_or_path, ...)` (and `load_causal_lm`, `load_sequence_classifier`) call
  `from_pretrained` with `dtype=torch.float32` when the model lands on the CPU: transformers 5 otherwise keeps the
  checkpoint's dtype, and bf16 matmuls were ~17x slower than fp32 on the CPUs we test on.
- `load_in_4bit=True` passes `bnb_4bit_config(...)` (NF4, double quantisation, compute dtype = the load dtype);
  `prepare_for_training=True` then calls `peft.prepare_model_for_kbit_training` (freezes the base, upcasts
  non-quantised fp16/bf16 weights, optional gradient checkpointing). Follow with `apply_lora` for QLoRA:

      model = load_causal_lm(path, load_in_4bit=True, prepare_for_training=True)
      model = apply_lora(model)  # trl_ext.models.lora

bitsandbytes is the optional extra `trl_ext[quantization]`. bitsandbytes >= 0.45 imports on CPU-only machines and
its 4-bit NF4/FP4 layers run there (forward and backward, float32 compute), as do 8-bit `Linear8bitLt` layers
(inputs are cast to float16 internally). By default transformers keeps the output embedding, tied weights and the
last module (e.g. a reward model's `score` head) out of quantisation, so those heads stay trainable.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import torch

from ..utils import require_peft

__all__ = [
    "QUANTIZATION_INSTALL_HINT",
    "bnb_4bit_config",
    "bnb_8bit_config",
    "is_bitsandbytes_available",
    "is_quantized",
    "keep_4bit_layers_trainable",
    "load_causal_lm",
    "load_model",
    "load_sequence_classifier",
    "require_bitsandbytes",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

QUANTIZATION_INSTALL_HINT = "install trl_ext[quantization] (`pip install 'trl_ext[quantization]'`: bitsandbytes>=0.45)"
_QUANT_TYPES = ("nf4", "fp4")
_DTYPE_ALIASES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# -------------------------------------------------------------------------------------------------- bitsandbytes
def is_bitsandbytes_available() -> bool:
    """True when `import bitsandbytes` succeeds (any failure, e.g. a broken native library, counts as missing)."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001 - bitsandbytes can fail with OSError/RuntimeError on odd platforms
        return False
    return True


def require_bitsandbytes(feature: str = "bitsandbytes quantisation") -> None:
    """Raise an `ImportError` that says what to install when bitsandbytes cannot be imported."""
    if is_bitsandbytes_available():
        return
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # noqa: BLE001 - reported in the message
        reason = f"{type(err).__name__}: {err}"
    else:  # imports, but is_bitsandbytes_available() said no (e.g. patched off)
        reason = "reported unavailable"
    raise ImportError(
        f"{feature} needs bitsandbytes, which could not be imported ({reason}); {QUANTIZATION_INSTALL_HINT}."
    )


def _as_dtype(dtype: torch.dtype | str, what: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    raise ValueError(f"Unknown {what} {dtype!r}; use a torch dtype or one of {sorted(_DTYPE_ALIASES)}.")


def bnb_4bit_config(
    quant_type: str = "nf4",
    compute_dtype: torch.dtype | str = torch.float32,
    double_quant: bool = True,
    quant_storage: torch.dtype | str | None = None,
    skip_modules: list[str] | None = None,
):
    """A `transformers.BitsAndBytesConfig` for 4-bit weights (QLoRA).

    Args:
        quant_type: `"nf4"` (NormalFloat4, the QLoRA default) or `"fp4"`.
        compute_dtype: dtype of the de-quantised matmul; float32 on CPU, bfloat16 on recent GPUs.
        double_quant: also quantise the quantisation constants (saves ~0.4 bit per weight).
        quant_storage: storage dtype of the packed weights (`torch.uint8` by default; FSDP needs the model dtype).
        skip_modules: module names kept in full precision. `None` lets transformers choose (output embedding, tied
            weights, last module). A list *replaces* that choice, so include `lm_head` / `score` yourself.

    Raises:
        ImportError: bitsandbytes is not importable ("install trl_ext[quantization]").
        ValueError: unknown `quant_type` or dtype.
    """
    from transformers import BitsAndBytesConfig

    require_bitsandbytes("4-bit loading")
    if quant_type not in _QUANT_TYPES:
        raise ValueError(f"Unknown 4-bit quant_type {quant_type!r}; choose one of {_QUANT_TYPES}.")
    kwargs: dict[str, Any] = {}
    if quant_storage is not None:
        kwargs["bnb_4bit_quant_storage"] = _as_dtype(quant_storage, "quant_storage")
    if skip_modules is not None:
        kwargs["llm_int8_skip_modules"] = list(skip_modules)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=_as_dtype(compute_dtype, "compute_dtype"),
        bnb_4bit_use_double_quant=double_quant,
        **kwargs,
    )


def bnb_8bit_config(skip_modules: list[str] | None = None):
    """A `transformers.BitsAndBytesConfig` for LLM.int8() 8-bit weights; `skip_modules` as in `bnb_4bit_config`."""
    from transformers import BitsAndBytesConfig

    require_bitsandbytes("8-bit loading")
    kwargs = {"llm_int8_skip_modules": list(skip_modules)} if skip_modules is not None else {}
    return BitsAndBytesConfig(load_in_8bit=True, **kwargs)


def is_quantized(model) -> bool:
    """True for a model loaded with bitsandbytes 4-bit or 8-bit weights."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


# ------------------------------------------------------------------------------------- 4-bit layers that train
def keep_4bit_layers_trainable(model: torch.nn.Module) -> int:
    """Keep bitsandbytes' CPU inference repacking away from the 4-bit layers of a model that will be trained.

    bitsandbytes 0.50 (checked up to 0.50.2), on a CPU with AVX512-BF16, rewrites a `Linear4bit` layer's weight into
    an inference-only layout the first time the layer runs in eval mode on an input that needs no gradient (a
    `torch.no_grad()` scoring pass, or generation). The rewrite is never undone when the model goes back to
    `train()`: every later forward takes a bf16 kernel that has no backward. A bias then fails with "a view of a
    leaf Variable that requires grad is being used in an in-place operation"; without a bias it is worse, the
    layer silently cuts the gradient to everything below it (LoRA adapters of lower layers stop learning), and
    eval-mode log-probs (bf16) no longer match training-mode ones (fp32). Trainers of a QLoRA policy, reward model
    or critic alternate exactly like that.

    This turns the repacking off on every 4-bit layer of ``model`` (``support_avx512bf16_for_cpu = False``, the
    attribute bitsandbytes reads before repacking) and converts back any layer already repacked, with
    bitsandbytes' own inverse (the one its ``state_dict`` uses; that round trip keeps bitsandbytes' bf16 rounding of
    the scales, so a warning says so). Frozen 4-bit models used only for inference are better left alone. The
    loaders (`load_model(..., prepare_for_training=True)`), `apply_lora` and every trl_ext trainer call this on the
    model they train; call it yourself when you train a 4-bit model another way.

    Returns:
        The number of 4-bit layers seen (0 when bitsandbytes was never imported or the model has none).
    """
    bnb = sys.modules.get("bitsandbytes")  # a model cannot hold bitsandbytes layers unless it was imported
    if bnb is None:
        return 0
    linear4bit = getattr(getattr(bnb, "nn", None), "Linear4bit", None)
    if linear4bit is None:
        return 0
    seen = repacked = 0
    for module in model.modules():
        if not isinstance(module, linear4bit):
            continue
        seen += 1
        module.support_avx512bf16_for_cpu = False
        weight = module.weight
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
            module.quant_state = weight.quant_state
            repacked += 1
    if repacked:
        warnings.warn(
            f"{repacked} 4-bit layer(s) had been repacked by bitsandbytes for CPU inference (an eval-mode forward "
            "before training); they were converted back so that they train, with their scales rounded to bf16 by "
            "that repacking. Call keep_4bit_layers_trainable(model) before any eval-mode forward to avoid it.",
            stacklevel=2,
        )
    return seen


# ---------------------------------------------------------------------------------------------------------- dtype
def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch < 2.6


def _loads_on_cpu(device_map) -> bool:
    """Whether `from_pretrained(device_map=device_map)` puts every weight on the CPU."""
    if device_map is None or device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        return not _accelerator_available()
    if isinstance(device_map, (str, torch.device)):
        return torch.device(device_map).type == "cpu"
    if isinstance(device_map, dict):
        return all(isinstance(v, (str, torch.device)) and str(v) in ("cpu", "disk") for v in device_map.values())
    return False  # an int: an accelerator index


def resolve_dtype(dtype: torch.dtype | str | None = None, device_map=None) -> torch.dtype | str:
    """The `dtype` to pass to `from_pretrained`.

    `None` → `torch.float32` when the model loads on the CPU, else `"auto"` (the checkpoint's own dtype). A string
    alias (`"bf16"`, `"float32"`, ...) becomes the torch dtype; `"auto"` is kept. Asking for bf16/fp16 on the CPU
    works but warns: it is many times slower than float32 there.
    """
    on_cpu = _loads_on_cpu(device_map)
    if dtype is None:
        return torch.float32 if on_cpu else "auto"
    if isinstance(dtype, str) and dtype == "auto":
        return dtype
    dtype = _as_dtype(dtype, "dtype")
    if on_cpu and dtype in (torch.bfloat16, torch.float16):
        warnings.warn(
            f"Loading in {dtype} on the CPU: expect it to be much slower than float32 (~17x for bf16 here).",
            stacklevel=3,
        )
    return dtype


def _default_compute_dtype(dtype: torch.dtype | str, on_cpu: bool) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if on_cpu:
        return torch.float32
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


# -------------------------------------------------------------------------------------------------------- loading
def _resolve_auto_class(auto_class):
    if isinstance(auto_class, str):
        import transformers

        cls = getattr(transformers, auto_class, None)
        if cls is None or not hasattr(cls, "from_pretrained"):
            raise ValueError(f"transformers has no model class {auto_class!r} with from_pretrained.")
        return cls
    if not hasattr(auto_class, "from_pretrained"):
        raise TypeError(f"auto_class must be a transformers model class, got {auto_class!r}.")
    return auto_class


def load_model(
    auto_class,
    name_or_path: str | os.PathLike,
    *,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    quant_type: str = "nf4",
    compute_dtype: torch.dtype | str | None = None,
    double_quant: bool = True,
    skip_modules: list[str] | None = None,
    quantization_config=None,
    dtype: torch.dtype | str | None = None,
    device_map=None,
    prepare_for_training: bool = False,
    gradient_checkpointing: bool = False,
    **kwargs,
):
    """Load a pretrained model with CPU-friendly dtype defaults and, optionally, bitsandbytes quantisation.

    Args:
        auto_class: a transformers class or its name (`AutoModelForCausalLM`, `"AutoModelForSequenceClassification"`,
            a concrete `LlamaForCausalLM`, ...).
        name_or_path: Hub id or local folder.
        load_in_4bit: quantise the linear layers to 4 bits (`bnb_4bit_config(quant_type, compute_dtype,
            double_quant, skip_modules=skip_modules)`).
        load_in_8bit: quantise them to 8 bits (LLM.int8()) instead.
        quant_type: `"nf4"` or `"fp4"` (4-bit only).
        compute_dtype: 4-bit compute dtype; defaults to the load dtype (float32 on CPU, bf16/fp16 on a GPU when the
            load dtype is `"auto"`).
        double_quant: 4-bit double quantisation.
        skip_modules: modules kept in full precision (see `bnb_4bit_config`).
        quantization_config: a ready quantisation config instead of the `load_in_*` flags.
        dtype: weight dtype; `None` → float32 on the CPU, the checkpoint's dtype (`"auto"`) on an accelerator
            (see `resolve_dtype`).
        device_map: as in `from_pretrained`. For a quantised load on an accelerator with `None`, each process puts
            the whole model on its own device (`{"": LOCAL_RANK}`), which is what data-parallel training needs.
        prepare_for_training: for a quantised model, call `peft.prepare_model_for_kbit_training` (freeze the base,
            upcast non-quantised half-precision weights). Ignored for full-precision models (nothing to prepare).
        gradient_checkpointing: with `prepare_for_training`, also turn on (non-reentrant) gradient checkpointing.
        **kwargs: passed to `from_pretrained` (`num_labels`, `revision`, `attn_implementation`, ...).

    Returns:
        The loaded model (a `transformers.PreTrainedModel`).

    Raises:
        ImportError: quantisation asked for but bitsandbytes is missing ("install trl_ext[quantization]").
        ValueError: conflicting options.
    """
    cls = _resolve_auto_class(auto_class)
    if load_in_4bit and load_in_8bit:
        raise ValueError("Choose one of load_in_4bit and load_in_8bit, not both.")
    if quantization_config is not None and (load_in_4bit or load_in_8bit):
        raise ValueError("Pass either quantization_config or load_in_4bit/load_in_8bit, not both.")
    if "torch_dtype" in kwargs:
        raise ValueError("`torch_dtype` is the transformers 4 name; pass `dtype=` instead.")
    on_cpu = _loads_on_cpu(device_map)
    dtype = resolve_dtype(dtype, device_map)
    if load_in_4bit:
        compute = compute_dtype if compute_dtype is not None else _default_compute_dtype(dtype, on_cpu)
        quantization_config = bnb_4bit_config(quant_type, compute, double_quant, skip_modules=skip_modules)
    elif load_in_8bit:
        quantization_config = bnb_8bit_config(skip_modules=skip_modules)
    quantized = quantization_config is not None
    if quantized and device_map is None and not on_cpu and "LOCAL_RANK" in os.environ:
        device_map = {"": int(os.environ["LOCAL_RANK"])}
    if quantized:
        kwargs["quantization_config"] = quantization_config
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = cls.from_pretrained(name_or_path, dtype=dtype, **kwargs)
    logger.info(
        "Loaded %s from %s (dtype=%s%s).",
        type(model).__name__,
        name_or_path,
        dtype,
        f", {_describe_quantization(quantization_config)}" if quantized else "",
    )
    if prepare_for_training and is_quantized(model):
        require_peft("k-bit training")
        from peft import prepare_model_for_kbit_training

        keep_4bit_layers_trainable(model)
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False} if gradient_checkpointing else None,
        )
    return model


def _describe_quantization(config) -> str:
    if getattr(config, "load_in_4bit", False):
        return (
            f"4-bit {config.bnb_4bit_quant_type}, compute {config.bnb_4bit_compute_dtype}, "
            f"double_quant={config.bnb_4bit_use_double_quant}"
        )
    if getattr(config, "load_in_8bit", False):
        return "8-bit LLM.int8()"
    return type(config).__name__


def load_causal_lm(name_or_path: str | os.PathLike, **kwargs):
    """`load_model(AutoModelForCausalLM, name_or_path, **kwargs)`: a policy / reference model."""
    return load_model("AutoModelForCausalLM", name_or_path, **kwargs)


def load_sequence_classifier(name_or_path: str | os.PathLike, num_labels: int = 1, **kwargs):
    """`load_model(AutoModelForSequenceClassification, ..., num_labels=1)`: a reward or value model backbone."""
    return load_model("AutoModelForSequenceClassification", name_or_path, num_labels=num_labels, **kwargs)
