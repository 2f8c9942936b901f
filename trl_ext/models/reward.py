"""Reward-model loading, reward normalisation at the score head, and reading scores at the last real token.

Three things live here:

- :func:`load_reward_model` loads a reward model from a ``*ForSequenceClassification`` checkpoint (GPT-NeoX, Llama,
  BERT-style, ...) or from an OpenRLHF-style checkpoint (a backbone plus a value head stored under a key prefix such
  as ``value_head`` or ``score``), with an optional LoRA adapter, 4-bit quantisation and normalisation statistics.
- Normalisation ``r = (s − μ) / σ`` is applied by a forward hook on the score head module itself (``model.score``,
  ``model.classifier`` or the value head), so it acts wherever the score is read: in ``model(...)``, in
  :func:`get_sequence_scores` and in code that calls ``model.score(hidden)`` directly. The statistics live in the
  model config (``normalize_reward``, ``reward_mean``, ``reward_std``; OpenRLHF's ``mean``/``std`` are read too)
  and the hook reads them at call time, so saving writes raw weights plus the statistics, and reloading with
  :func:`load_reward_model` applies them again.
- :func:`get_sequence_scores` reads one score per sequence at the last real token given by the attention mask
  (never by token ids), so it is right for left and right padding and when ``pad_token == eos_token``.
  ``transformers``' own ``*ForSequenceClassification.forward`` looks for the last non-pad *id*, which scores the token
  before a real final eos when pad == eos; use :func:`get_sequence_scores` in training code.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import os
from typing import Any

import torch
from torch import nn

from ..ops.sequences import last_token_index, position_ids_from_attention_mask
from ..utils import require_peft, unwrap_model
from .fsdp import call_as_root_forward
from .quantization import bnb_4bit_config, resolve_dtype

logger = logging.getLogger(__name__)

__all__ = [
    "ValueHeadRewardModel",
    "apply_reward_normalization",
    "clear_reward_normalization",
    "get_reward_normalization",
    "get_sequence_scores",
    "get_token_scores",
    "load_reward_model",
    "score_head",
    "set_reward_normalization",
]

# Keyword arguments of `from_pretrained` that also say where the files are (used to inspect the checkpoint).
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder", "force_download")
_HEAD_HINTS = ("head", "score", "classifier", "reward", "value", "embed_out", "out_proj")


# ------------------------------------------------------------------------------------------------- model anatomy
def score_head(model: nn.Module) -> nn.Module:
    """The module that maps hidden states to scores: ``score`` (decoder classifiers, value-head models) or
    ``classifier`` (BERT-style encoders)."""
    inner = unwrap_model(model)
    for name in ("score", "classifier"):
        head = getattr(inner, name, None)
        if isinstance(head, nn.Module):
            return head
    raise TypeError(
        f"{type(inner).__name__} has no `score` or `classifier` module: it is not a reward model. Load one with "
        "`load_reward_model` (a sequence-classification checkpoint, or pass `value_head_prefix=` for a value head)."
    )


def _decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(backbone, head)`` when the score is a per-token head on the backbone's hidden states, else ``None``."""
    inner = unwrap_model(model)
    head = getattr(inner, "score", None)
    backbone = getattr(inner, getattr(inner, "base_model_prefix", "") or "", None)
    if isinstance(head, nn.Module) and isinstance(backbone, nn.Module) and backbone is not inner:
        return backbone, head
    return None


def _backbone_hidden(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **extra,
) -> torch.Tensor:
    """Last hidden states ``(B, T, H)``; position ids come from the mask (unless given), so left padding does not
    shift positions. ``extra`` inputs (e.g. ``token_type_ids``) are passed when the backbone's ``forward`` takes
    them."""
    params = inspect.signature(unwrap_model(backbone).forward).parameters  # PEFT wraps forward(*args, **kwargs)
    kwargs: dict[str, Any] = {k: v for k, v in extra.items() if k in params and v is not None}
    kwargs["attention_mask"] = attention_mask
    if position_ids is None and attention_mask is not None:
        position_ids = position_ids_from_attention_mask(attention_mask)
    if "position_ids" in params and position_ids is not None:
        kwargs["position_ids"] = position_ids
    if "use_cache" in params:
        kwargs["use_cache"] = False
    out = backbone(input_ids=input_ids, **kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# ------------------------------------------------------------------------------------------------- normalisation
def get_reward_normalization(model_or_config) -> tuple[float, float] | None:
    """The ``(mean, std)`` stored in the config, or ``None`` when normalisation is off.

    Normalisation is on when ``config.normalize_reward`` is true. The statistics are ``reward_mean``/``reward_std``,
    falling back to OpenRLHF's ``mean``/``std`` (and to 0/1 when neither is present).
    """
    config = getattr(unwrap_model(model_or_config), "config", model_or_config)
    if not getattr(config, "normalize_reward", False):
        return None
    mean = getattr(config, "reward_mean", None)
    std = getattr(config, "reward_std", None)
    mean = getattr(config, "mean", 0.0) if mean is None else mean
    std = getattr(config, "std", 1.0) if std is None else std
    return float(mean), float(std)


class _ConfigNormalizer:
    """Forward hook on a score head: ``out ← (out − μ) / σ`` with ``(μ, σ)`` read from ``config`` at call time."""

    def __init__(self, config):
        self.config = config

    def __call__(self, module: nn.Module, args, output):
        stats = get_reward_normalization(self.config)
        if stats is None or not torch.is_tensor(output):
            return output
        mean, std = stats
        return (output - mean) / std


def _normalizer_hook(head: nn.Module) -> _ConfigNormalizer | None:
    return next((h for h in head._forward_hooks.values() if isinstance(h, _ConfigNormalizer)), None)


def apply_reward_normalization(model: nn.Module) -> bool:
    """Attach the normalising hook to the score head (idempotent) and return whether normalisation is on.

    Called by :func:`load_reward_model`, :func:`get_sequence_scores` and ``ModelReward``, so a model whose config
    carries statistics is normalised even when it was loaded with plain ``from_pretrained``.
    """
    inner = unwrap_model(model)
    head = score_head(inner)
    hook = _normalizer_hook(head)
    if hook is None:
        head.register_forward_hook(_ConfigNormalizer(inner.config))
    elif hook.config is not inner.config:  # e.g. after the head was deep-copied on its own
        hook.config = inner.config
    stats = get_reward_normalization(inner.config)
    if stats is not None and hook is None:
        logger.info("Reward normalisation on for %s: score <- (score - %.6g) / %.6g.", type(inner).__name__, *stats)
    return stats is not None


def set_reward_normalization(model: nn.Module, mean: float, std: float) -> None:
    """Normalise the scores of ``model`` as ``(s − mean) / std`` from now on, wherever they are read.

    The statistics are written to ``model.config`` (``normalize_reward``, ``reward_mean``, ``reward_std``), so
    ``save_pretrained`` stores them next to the unchanged raw weights.
    """
    mean, std = float(mean), float(std)
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ValueError(f"Reward normalisation needs a finite mean and a std > 0; got mean={mean}, std={std}.")
    apply_reward_normalization(model)  # attach the hook (idempotent); it reads the statistics below at call time
    config = unwrap_model(model).config
    config.normalize_reward = True
    config.reward_mean = mean
    config.reward_std = std
    logger.info("Reward normalisation set: score <- (score - %.6g) / %.6g.", mean, std)


def clear_reward_normalization(model: nn.Module) -> None:
    """Turn normalisation off (``config.normalize_reward = False``): scores are raw again."""
    unwrap_model(model).config.normalize_reward = False


# ------------------------------------------------------------------------------------------------ score reading
def get_token_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token scores ``head(h_t)`` of shape ``(B, T, num_labels)`` for decoder reward / value models.

    Positions come from the mask (see :func:`get_sequence_scores`) unless ``position_ids`` are given (packed rows:
    ``attention_mask=None`` with per-row positions); normalisation, if on, is applied by the head. Gradients flow
    (use ``torch.no_grad()`` for inference).
    """
    parts = _decoder_parts(model)
    if parts is None:
        raise TypeError(
            f"{type(unwrap_model(model)).__name__} has no per-token score head (`score` on top of its backbone); "
            "per-token scores need a decoder model such as `*ForSequenceClassification` or `ValueHeadRewardModel`."
        )
    apply_reward_normalization(model)
    backbone, head = parts
    # The backbone and the head are below the model: an FSDP2-sharded model runs them as its forward (`fsdp.py`).
    return call_as_root_forward(model, _head_on_backbone, backbone, head, input_ids, attention_mask, position_ids)


def _head_on_backbone(backbone, head, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    return head(_backbone_hidden(backbone, input_ids, attention_mask, position_ids))


def _head_at_last_token(backbone, head, input_ids, attention_mask, **model_kwargs) -> torch.Tensor:
    hidden = _backbone_hidden(backbone, input_ids, attention_mask, **model_kwargs)
    idx = last_token_index(attention_mask).to(hidden.device)
    return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), idx])


def get_sequence_scores(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, **model_kwargs
) -> torch.Tensor:
    """One float32 score per sequence, read at its last real token: ``r_b = head(h_{b, i_b})``, ``i_b = max{t:
    mask[b, t] = 1}``.

    The index comes from the attention mask, never from token ids, so the score is read at the right place for left
    and right padding and when the pad token is the eos token (a real final eos is scored at the eos). Positions are
    computed from the mask, so a left-padded row scores like the same row unpadded. Encoder models (BERT-style, a
    ``classifier`` on the pooled first token) are called as they are. Normalisation from the config is applied. An
    FSDP2-sharded model (e.g. a frozen reward model with ``frozen_models_placement="sharded"``) runs its backbone and
    head as its own forward, so that its root weights are gathered (`trl_ext.models.fsdp`).

    Args:
        model: a ``*ForSequenceClassification`` model with one label, a :class:`ValueHeadRewardModel`, or either
            wrapped by PEFT.
        input_ids: ``(B, T)`` token ids.
        attention_mask: ``(B, T)`` mask, 1 on real tokens.
        **model_kwargs: further tokenizer outputs such as ``token_type_ids`` (BERT pairs), passed when accepted.

    Returns:
        ``(B,)`` float32 scores (gradients flow; wrap in ``torch.no_grad()`` for inference).
    """
    if attention_mask is None:
        raise ValueError("get_sequence_scores needs the attention mask to find the last real token of each row.")
    apply_reward_normalization(model)
    parts = _decoder_parts(model)
    if parts is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).logits
    else:
        backbone, head = parts  # below the model: an FSDP2-sharded one runs them as its forward (`fsdp.py`)
        logits = call_as_root_forward(
            model, _head_at_last_token, backbone, head, input_ids, attention_mask, **model_kwargs
        )
    if logits.shape[-1] != 1:
        raise ValueError(
            f"A reward model must have a single output; this one has {logits.shape[-1]} (num_labels). Combine the "
            "logits yourself (e.g. logit[safe] - logit[unsafe]) and wrap that in a CallableReward."
        )
    return logits[..., 0].float()


# --------------------------------------------------------------------------------------- value-head reward model
class ValueHeadRewardModel(nn.Module):
    """A backbone (``AutoModel``) plus a linear value head, the layout of OpenRLHF reward and critic checkpoints.

    ``forward(input_ids, attention_mask)`` returns ``SequenceClassifierOutput`` whose ``logits`` ``(B, 1)`` are read
    at the last real token of each row (from the mask). The head is ``self.score`` so the model reads like a
    ``*ForSequenceClassification`` model; on disk it is stored as ``<value_head_prefix>.weight``.
    """

    base_model_prefix = "backbone"

    def __init__(self, backbone: nn.Module, value_head_prefix: str = "value_head", head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        hidden_size = backbone.config.get_text_config().hidden_size
        self.score = head if head is not None else nn.Linear(hidden_size, 1, bias=False)
        self.value_head_prefix = value_head_prefix

    @property
    def config(self):
        """The backbone's config (carries the normalisation statistics and ``value_head_prefix``)."""
        return self.backbone.config

    @property
    def device(self) -> torch.device:
        return self.score.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.score.weight.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        from transformers.modeling_outputs import SequenceClassifierOutput

        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = _backbone_hidden(self.backbone, input_ids, attention_mask)
        idx = last_token_index(attention_mask).to(hidden.device)
        logits = self.score(hidden[torch.arange(hidden.shape[0], device=hidden.device), idx])
        return SequenceClassifierOutput(logits=logits)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Write the backbone with ``save_pretrained`` and the raw head as ``<value_head_prefix>.weight`` in the same
        safetensors checkpoint; the config records ``value_head_prefix`` and the normalisation statistics."""
        from safetensors.torch import load_file, save_file

        save_directory = os.fspath(save_directory)
        self.config.value_head_prefix = self.value_head_prefix
        stats = get_reward_normalization(self.config)
        if stats is not None:  # OpenRLHF reads `mean` / `std`
            self.config.mean, self.config.std = stats
        self.backbone.save_pretrained(save_directory, **kwargs)
        head = {
            f"{self.value_head_prefix}.{k}": v.detach().cpu().contiguous() for k, v in self.score.state_dict().items()
        }
        single = os.path.join(save_directory, "model.safetensors")
        index = os.path.join(save_directory, "model.safetensors.index.json")
        if os.path.isfile(single):
            save_file({**load_file(single), **head}, single, metadata={"format": "pt"})
        elif os.path.isfile(index):
            save_file(head, os.path.join(save_directory, "value_head.safetensors"), metadata={"format": "pt"})
            with open(index) as f:
                data = json.load(f)
            data["weight_map"].update(dict.fromkeys(head, "value_head.safetensors"))
            with open(index, "w") as f:
                json.dump(data, f, indent=2)
        else:
            raise RuntimeError(f"No safetensors checkpoint written in {save_directory}; cannot add the value head.")


# --------------------------------------------------------------------------------------- checkpoint inspection
def _weight_files(name_or_path: str, hub_kwargs: dict) -> list[str]:
    """Local paths of the checkpoint's weight files (downloading them if needed); ``[]`` when none is found."""
    from transformers.utils import cached_file

    def find(filename: str) -> str | None:
        try:
            return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        except OSError:
            return None

    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = find(index_name)
        if index is not None:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [path for path in map(find, shards) if path is not None]
    for single in ("model.safetensors", "pytorch_model.bin"):
        path = find(single)
        if path is not None:
            return [path]
    return []


def _load_weight_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _tensor_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor in the checkpoint (safetensors headers only; ``.bin`` files are mapped)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        else:
            shapes.update({k: tuple(v.shape) for k, v in _load_weight_file(path).items()})
    return shapes


def _head_like_keys(shapes: dict[str, tuple[int, ...]], base_prefix: str) -> list[str]:
    """Keys that could hold a head: those outside the backbone prefix, else top-level keys named like a head."""
    outside = [k for k in shapes if base_prefix and not k.startswith(base_prefix + ".")]
    if not outside or len(outside) == len(shapes):
        outside = [k for k in shapes if k.count(".") <= 1 and any(h in k.lower() for h in _HEAD_HINTS)]
    return [f"{k} {list(shapes[k])}" for k in sorted(outside)]


def _base_model_prefix(config) -> str:
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        return MODEL_MAPPING[type(config)].base_model_prefix
    except Exception:  # custom / remote-code architectures
        return ""


def _no_head_error(name_or_path: str, shapes: dict, config, wanted: str) -> ValueError:
    keys = _head_like_keys(shapes, _base_model_prefix(config)) if shapes else []
    listing = "\n  ".join(keys) if keys else "(none found)"
    return ValueError(
        f"{name_or_path!r} has no reward head: {wanted}. Keys that look like heads:\n  {listing}\n"
        "Pass value_head_prefix='<name>' for a value head stored as '<name>.weight' (OpenRLHF: 'value_head' or "
        "'score'). A plain causal LM has no trained reward head: train one (`load_critic` gives a new value head)."
    )


# ---------------------------------------------------------------------------------------------------- loading
def _load_tokenizer(tokenizer, name_or_path: str, trust_remote_code: bool, hub_kwargs: dict):
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        source = name_or_path if tokenizer is None else os.fspath(tokenizer)
        tok_kwargs = {k: v for k, v in hub_kwargs.items() if k != "subfolder"}
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **tok_kwargs)
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"The reward tokenizer ({type(tokenizer).__name__}) has no pad token, so batches cannot be padded. Set "
            "`tokenizer.pad_token = tokenizer.eos_token` (or add a pad token) and pass it as `tokenizer=`."
        )
    return tokenizer


def _quantization_kwargs(dtype, device) -> dict:
    """``from_pretrained`` arguments for 4-bit NF4 (raises ``ImportError`` naming ``trl_ext[quantization]``)."""
    on_cpu = device is not None and torch.device(device).type == "cpu"
    compute = dtype if isinstance(dtype, torch.dtype) else (torch.float32 if on_cpu else torch.bfloat16)
    target = device if device is not None else (torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    return {
        "quantization_config": bnb_4bit_config(compute_dtype=compute),
        "device_map": {"": target},
        "dtype": compute,
    }


def _load_value_head_model(name_or_path, prefix, files, shapes, config, load_kwargs) -> ValueHeadRewardModel:
    from transformers import AutoModel

    weight_key, bias_key = f"{prefix}.weight", f"{prefix}.bias"
    if weight_key not in shapes:
        raise _no_head_error(name_or_path, shapes, config, f"no tensor '{weight_key}' (value_head_prefix={prefix!r})")
    backbone = AutoModel.from_pretrained(name_or_path, config=config, **load_kwargs)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update({k: v for k, v in _load_weight_file(path).items() if k in (weight_key, bias_key)})
    weight = tensors[weight_key].reshape(-1, tensors[weight_key].shape[-1])
    if weight.shape[0] != 1:
        raise ValueError(f"The value head '{weight_key}' has {weight.shape[0]} outputs; a reward needs exactly one.")
    head = nn.Linear(weight.shape[1], 1, bias=bias_key in tensors)
    head.load_state_dict({"weight": weight, **({"bias": tensors[bias_key].reshape(1)} if bias_key in tensors else {})})
    ref = next(backbone.parameters())
    dtype = load_kwargs.get("dtype")
    if not isinstance(dtype, torch.dtype):  # "auto": follow the backbone
        dtype = ref.dtype if ref.is_floating_point() else torch.float32
    head.to(device=ref.device, dtype=dtype)
    return ValueHeadRewardModel(backbone, value_head_prefix=prefix, head=head)


def _load_sequence_classifier(name_or_path, shapes, config, load_kwargs, allow_new_head: bool = False):
    """``(model, head_is_new)`` from ``AutoModelForSequenceClassification`` with one label; a head missing from the
    checkpoint raises unless ``allow_new_head`` (critics), and missing backbone weights always raise."""
    from transformers import AutoModelForSequenceClassification

    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs) and config.num_labels != 1:
        raise ValueError(
            f"{name_or_path!r} is a classifier with {config.num_labels} labels; a reward model needs one output. "
            "Combine its logits yourself (e.g. logit[safe] - logit[unsafe]) and wrap that in a CallableReward."
        )
    config = copy.deepcopy(config)
    config.num_labels = 1
    model, info = AutoModelForSequenceClassification.from_pretrained(
        name_or_path, config=config, output_loading_info=True, **load_kwargs
    )
    prefix = model.base_model_prefix
    missing = sorted(info.get("missing_keys", ()))
    missing_head = [k for k in missing if not k.startswith(prefix + ".")]
    missing = [k for k in missing if k not in missing_head]
    if missing_head and not allow_new_head:
        raise _no_head_error(name_or_path, shapes, config, f"{', '.join(missing_head)} missing from the checkpoint")
    if missing:
        raise ValueError(
            f"Backbone weights of {name_or_path!r} did not load (they would be random): {missing[:8]}. The "
            "checkpoint's key names do not match the model class; check `architectures` in its config.json."
        )
    return model, bool(missing_head)


def load_reward_model(
    name_or_path: str | os.PathLike,
    *,
    tokenizer=None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    normalize: bool | tuple[float, float] | None = None,
    value_head_prefix: str | None = None,
    load_in_4bit: bool = False,
    lora_path: str | os.PathLike | None = None,
    merge_lora: bool = True,
    trust_remote_code: bool = False,
    **kwargs,
):
    """Load a reward model and its tokenizer, ready for :func:`get_sequence_scores` / ``ModelReward``.

    Two checkpoint layouts are recognised:

    - ``*ForSequenceClassification`` with one label (e.g. the pythia TL;DR RM, Llama or BERT-style RMs). A checkpoint
      without a trained head (e.g. a plain causal LM) raises instead of getting a random head.
    - OpenRLHF-style: a backbone loaded with ``AutoModel`` plus a linear head stored as ``<value_head_prefix>.weight``
      (returned as :class:`ValueHeadRewardModel`). Detected from ``value_head_prefix``, from
      ``config.value_head_prefix``, or from a ``value_head.weight`` tensor in the checkpoint.

    Args:
        name_or_path: local folder or Hub id.
        tokenizer: a tokenizer, a path/id to load one from, or ``None`` for the checkpoint's own. It must have a pad
            token; ``model.config.pad_token_id`` is filled from it when unset.
        dtype: load dtype; default float32 on CPU (bf16 is ~17× slower there) and the checkpoint's dtype elsewhere.
        device: device to move the model to (for 4-bit: the ``device_map`` target).
        normalize: ``None`` — use the statistics in the config if ``config.normalize_reward`` is set; ``(mean, std)``
            — normalise with these (written to the config); ``True`` — require statistics in the config (OpenRLHF's
            ``mean``/``std`` count); ``False`` — raw scores.
        value_head_prefix: key prefix of an OpenRLHF-style value head (``"value_head"``, ``"score"``, ...).
        load_in_4bit: load the backbone in 4-bit NF4 with bitsandbytes (``pip install trl_ext[quantization]``).
        lora_path: a PEFT adapter folder to apply (merged into the weights unless ``merge_lora=False`` or 4-bit).
        merge_lora: merge the adapter after loading it.
        trust_remote_code: passed to ``from_pretrained``.
        **kwargs: further ``from_pretrained`` arguments (``revision``, ``attn_implementation``, ``cache_dir``, ...).

    Returns:
        ``(model, tokenizer)``: the model in eval mode, normalisation attached to its score head.
    """
    from transformers import AutoConfig

    name_or_path = os.fspath(name_or_path)
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **hub_kwargs)
    tokenizer = _load_tokenizer(tokenizer, name_or_path, trust_remote_code, hub_kwargs)

    dtype = resolve_dtype(dtype, device_map=device if device is not None else "cpu")
    load_kwargs = {"trust_remote_code": trust_remote_code, **kwargs, "dtype": dtype}
    if load_in_4bit:
        load_kwargs.update(_quantization_kwargs(load_kwargs["dtype"], device))

    files = _weight_files(name_or_path, hub_kwargs)
    shapes = _tensor_shapes(files) if files else {}
    prefix = value_head_prefix or getattr(config, "value_head_prefix", None)
    if (
        prefix is None
        and "value_head.weight" in shapes
        and not any(k.startswith(("score.", "classifier.")) for k in shapes)
    ):
        prefix = "value_head"
    if prefix is not None:
        if not files:
            raise FileNotFoundError(f"No weight files found for {name_or_path!r}; cannot read the value head.")
        model = _load_value_head_model(name_or_path, prefix, files, shapes, config, load_kwargs)
    else:
        model, _ = _load_sequence_classifier(name_or_path, shapes, config, load_kwargs)

    if lora_path is not None:
        require_peft("loading a LoRA reward-model checkpoint")
        from peft import PeftModel

        target = model.backbone if isinstance(model, ValueHeadRewardModel) else model
        adapted = PeftModel.from_pretrained(target, os.fspath(lora_path), is_trainable=False)
        if merge_lora and not load_in_4bit:
            adapted = adapted.merge_and_unload()
        if isinstance(model, ValueHeadRewardModel):
            model.backbone = adapted
        else:
            model = adapted
    if device is not None and not load_in_4bit:
        model.to(device)

    config = unwrap_model(model).config
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    if normalize is False:
        clear_reward_normalization(model)
    elif normalize is True:
        if all(getattr(config, name, None) is None for name in ("reward_mean", "reward_std", "mean", "std")):
            raise ValueError(
                f"normalize=True but {name_or_path!r} stores no statistics (config.reward_mean/reward_std or "
                "mean/std). Pass normalize=(mean, std) instead."
            )
        config.normalize_reward = True
    elif normalize is not None:
        mean, std = normalize
        set_reward_normalization(model, mean, std)
    apply_reward_normalization(model)
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        logger.info("Reward tokenizer has pad == eos: read scores with get_sequence_scores (mask-based), not forward.")
    return model.eval(), tokenizer
