"""The parameter tensors of a model, read from its config without building its weights.

:func:`resolve_model` turns what a user types after ``--model`` into a :class:`ModelShape`:

- a known name (:data:`KNOWN_MODELS`: ``smollm2-135m``, ``llama-3.2-1b``, ``llama-3.1-8b``, ...; the Hub id such as
  ``HuggingFaceTB/SmolLM2-135M`` works too) — the shapes of the published ``config.json``, written here, so that
  nothing is downloaded;
- a ``config.json`` file or a model folder that holds one;
- a parameter count (``135m``, ``1.2b``, ``8e9``, ``8030261248``): no layer structure, so only full fine-tuning can be
  planned (LoRA and 4/8-bit need the linear layers' shapes).

The model is instantiated on PyTorch's ``meta`` device (``AutoModelFor*.from_config``), where tensors have shapes
and dtypes but no storage: an 8B model takes a second and no memory. Tied weights (e.g. SmolLM2's embedding and LM
head) are counted once, as `named_parameters` yields them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, replace

__all__ = [
    "KNOWN_MODELS",
    "MODEL_KINDS",
    "ModelShape",
    "ParamInfo",
    "config_shape",
    "param_count_shape",
    "resolve_config",
    "resolve_model",
]

# Shapes of the published config.json files (Hub id in "hub_id"; everything else is passed to the config class).
KNOWN_MODELS: dict[str, dict] = {
    "smollm2-135m": dict(hub_id="HuggingFaceTB/SmolLM2-135M", model_type="llama", hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192),
    "smollm2-360m": dict(hub_id="HuggingFaceTB/SmolLM2-360M", model_type="llama", hidden_size=960,
                         intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192),
    "smollm2-1.7b": dict(hub_id="HuggingFaceTB/SmolLM2-1.7B", model_type="llama", hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                         vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-3.2-1b": dict(hub_id="meta-llama/Llama-3.2-1B", model_type="llama", hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072),
    "llama-3.2-3b": dict(hub_id="meta-llama/Llama-3.2-3B", model_type="llama", hidden_size=3072,
                         intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072),
    "llama-3.1-8b": dict(hub_id="meta-llama/Llama-3.1-8B", model_type="llama", hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072),
    "llama-3.1-70b": dict(hub_id="meta-llama/Llama-3.1-70B", model_type="llama", hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=128, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072),
}  # fmt: skip

# kind -> (transformers auto class, config overrides)
MODEL_KINDS: dict[str, tuple[str, dict]] = {
    "causal_lm": ("AutoModelForCausalLM", {}),
    "seq_cls": ("AutoModelForSequenceClassification", {"num_labels": 1}),  # reward models and critics
    "token_cls": ("AutoModelForTokenClassification", {"num_labels": 2}),  # process reward models
}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*$", re.I)
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
_LAYER = re.compile(r"^(.*?\.(?:layers|h|layer|blocks)\.\d+)\.")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor: its name, shape, and whether it is the weight of an ``nn.Linear`` (LoRA targets and
    bitsandbytes quantise those) other than the output head (kept in full precision by transformers)."""

    name: str
    shape: tuple[int, ...]
    linear: bool = False
    out_features: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        """The owning module's name (``model.layers.0.self_attn.q_proj``)."""
        return self.name.rpartition(".")[0]

    @property
    def unit(self) -> str:
        """The block the parameter belongs to: ``<...>.layers.<i>`` for a transformer layer, else its module."""
        match = _LAYER.match(self.name)
        return match.group(1) if match else self.module


@dataclass(frozen=True)
class ModelShape:
    """The parameter tensors of one model. ``exact=False``: built from a bare parameter count (one pseudo-tensor,
    no layer structure). ``hidden_size`` sizes a shared value head; ``model_type`` picks PEFT's default LoRA
    targets."""

    name: str
    params: tuple[ParamInfo, ...]
    hidden_size: int | None = None
    model_type: str | None = None
    exact: bool = True

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def with_params(self, extra: tuple[ParamInfo, ...], suffix: str) -> ModelShape:
        """A copy with ``extra`` tensors appended (e.g. a value head) and ``suffix`` added to the name."""
        return replace(self, name=f"{self.name}{suffix}", params=self.params + tuple(extra))


def parse_param_count(text: str) -> int | None:
    """``"135m"`` -> 135_000_000, ``"1.2b"``, ``"8e9"``, ``"8030261248"``; ``None`` when ``text`` is not a count."""
    match = _COUNT.match(str(text))
    if match is None:
        return None
    return int(round(float(match.group(1)) * _SUFFIX[match.group(2).lower()]))


def _known_key(spec: str) -> str | None:
    key = spec.strip().lower()
    if key in KNOWN_MODELS:
        return key
    for name, entry in KNOWN_MODELS.items():
        if entry["hub_id"].lower() == key or entry["hub_id"].lower().split("/")[-1] == key:
            return name
    return None


def resolve_config(spec: str):
    """A `transformers.PretrainedConfig` for ``spec`` (known name, Hub id of a known model, ``config.json`` file or
    model folder), or an ``int`` parameter count. Never downloads: anything else is a `ValueError`."""
    from transformers import AutoConfig

    known = _known_key(spec)
    if known is not None:
        kwargs = {k: v for k, v in KNOWN_MODELS[known].items() if k != "hub_id"}
        config = AutoConfig.for_model(**kwargs)
        config.name_or_path = KNOWN_MODELS[known]["hub_id"]
        return config
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{spec!r} is a folder without a config.json; pass a model folder or its config.json.")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if "model_type" not in data:
            raise ValueError(f"{path} has no 'model_type'; is it a transformers config.json?")
        data.pop("quantization_config", None)  # plan the weights as trained, not as shipped
        config = AutoConfig.for_model(**data)
        config.name_or_path = os.path.dirname(os.path.abspath(path))
        return config
    count = parse_param_count(spec)
    if count is not None:
        return count
    raise ValueError(
        f"Unknown model {spec!r}: pass a config.json file, a model folder, a parameter count (e.g. 135m, 8b) or one "
        f"of the known models ({', '.join(KNOWN_MODELS)}). Nothing is downloaded."
    )


def _output_modules(model) -> set[str]:
    """Names of the modules transformers keeps out of quantisation and PEFT's all-linear leaves out: the output
    embedding and a classification head (the last ``nn.Linear`` of the model)."""
    names = set()
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = []
    for name, module in model.named_modules():
        if module is output:
            names.add(name)
        if _out_features(module) is not None:
            linears.append(name)
    if linears and not names:
        names.add(linears[-1])
    return names


def _out_features(module) -> int | None:
    """Output size of an ``nn.Linear`` or of GPT-2's ``Conv1D`` (weight stored transposed); ``None`` otherwise."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, Conv1D):
        return module.nf
    return None


def config_shape(config, kind: str = "causal_lm", name: str | None = None) -> ModelShape:
    """The :class:`ModelShape` of ``config`` as a ``kind`` model (:data:`MODEL_KINDS`), built on the meta device."""
    import copy

    import torch
    import transformers

    if kind not in MODEL_KINDS:
        raise ValueError(f"Unknown model kind {kind!r}; choose one of {', '.join(MODEL_KINDS)}.")
    auto_class, overrides = MODEL_KINDS[kind]
    config = copy.deepcopy(config)
    for key, value in overrides.items():
        setattr(config, key, value)
    auto = getattr(transformers, auto_class)
    # The class itself: `from_config` builds under deepspeed.zero.Init in a ZeRO-3 process (which fails on meta).
    try:
        model_class = auto._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{auto_class} has no model class for config {type(config).__name__}.") from None
    except AttributeError:  # pragma: no cover - a transformers without the mapping attribute
        model_class = None
    with torch.device("meta"):
        model = model_class(config) if model_class is not None else auto.from_config(config)
    skip = _output_modules(model)
    linear_weights = {
        f"{module_name}.weight": _out_features(module)
        for module_name, module in model.named_modules()
        if _out_features(module) is not None and module_name not in skip
    }
    params = tuple(
        ParamInfo(name, tuple(param.shape), name in linear_weights, linear_weights.get(name))
        for name, param in model.named_parameters()
    )
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShape(
        name=name or getattr(config, "name_or_path", None) or config.model_type,
        params=params,
        hidden_size=getattr(text_config, "hidden_size", None),
        model_type=config.model_type,
    )


def param_count_shape(count: int, name: str | None = None) -> ModelShape:
    """A :class:`ModelShape` of ``count`` parameters with no structure (one pseudo-tensor)."""
    if count <= 0:
        raise ValueError(f"A model needs a positive parameter count, got {count}.")
    return ModelShape(name=name or f"{count:,} params", params=(ParamInfo("params", (count,)),), exact=False)


@functools.lru_cache(maxsize=64)
def resolve_model(spec: str, kind: str = "causal_lm") -> ModelShape:
    """:func:`resolve_config` then :func:`config_shape` (or :func:`param_count_shape` for a bare count); cached
    (a config file edited in between is read again only after ``resolve_model.cache_clear()``)."""
    config = resolve_config(spec)
    if isinstance(config, int):
        return param_count_shape(config, name=str(spec))
    known = _known_key(spec)
    return config_shape(config, kind, name=known or getattr(config, "name_or_path", None) or str(spec))
