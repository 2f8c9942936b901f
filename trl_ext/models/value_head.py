"""Causal LM with a scalar value head: one trunk shared by the policy (LM head) and the critic (value head).

`AutoModelForCausalLMWithValueHead` wraps any Hugging Face causal LM (kept whole as ``model.pretrained_model``) and
adds ``model.v_head = Linear(hidden, 1)`` applied to the last hidden state, so one forward gives the next-token
logits *and* a value per position. It is a `transformers.PreTrainedModel`, so `save_pretrained`, `from_pretrained`,
`push_to_hub`, `Trainer` checkpoints and resume handle the value head like any other weight (same safetensors file).

Example:

    from trl_ext.models.value_head import AutoModelForCausalLMWithValueHead

    model = AutoModelForCausalLMWithValueHead.from_pretrained("path/to/sft-model")  # fresh value head, logged
    out = model(input_ids, attention_mask=attention_mask)
    out.logits  # (B, T, V), exactly as the wrapped model
    out.value  # (B, T) float32, V_t read from the hidden state at position t
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8)  # the wrapped model's generate

Design notes:

- **Vision-language models.** A model of `AutoModelForImageTextToText` (Qwen2-VL, LLaVA, ...) is wrapped the same way:
  the value head reads the language model's last hidden state (its size from ``config.get_text_config()``) and
  image inputs (``pixel_values``, ...) pass through ``forward`` to the wrapped model.
- **Config.** `CausalLMWithValueHeadConfig` (``model_type="causal_lm_with_value_head"``, registered with `AutoConfig`
  and `AutoModelForCausalLM`) holds the wrapped config as the sub-config ``text_config`` (``get_text_config()``
  returns it; attributes the wrapper lacks, e.g. ``vocab_size``, ``use_cache``, are read from / written to it).
- **Loading.** The wrapped architecture's checkpoint conversion mapping (e.g. GPT-NeoX ``embed_out`` → ``lm_head``)
  applies to the nested model: transformers scopes the mappings of nested `PreTrainedModel`s. A *plain* causal-LM
  folder is loaded with `AutoModelForCausalLM` and gets a fresh value head (logged; listed as missing keys).
- **Value head.** ``weight ~ N(0, std²)``, ``std = value_head_init_std or 1/sqrt(hidden + 1)``, zero bias; optional
  dropout before it (``value_head_dropout``, default 0). Values come back as ``out.value``, not ``out.values``: model
  outputs are ordered dicts whose ``.values()`` torch's pytree, DDP and accelerate call.
- **TRL's fused LM head.** ``forward(..., labels=..., fused_lm_head=True)`` implements TRL 1.16's protocol natively.
  `trl.trainer.utils.add_fused_lm_head(model)` assigns ``model.forward`` on the instance, which would bypass this
  class's forward: that one assignment is refused (its temperature and outputs are adopted), logged once at info
  level. Other assignments of ``forward`` (e.g. accelerate's autocast wrapper) go through.
- **PEFT.** `prepare_value_head_for_peft`: LoRA on the trunk, value head trained fully and saved with the adapter.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.configuration_utils import SubConfigSpec
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl.trainer.utils import FusedCausalLMOutput

from ..ops.logprobs import logprobs_from_hidden, logprobs_from_logits
from ..utils import require_peft
from .critic import default_value_head_std
from .fused_patch import RefusesTrlForwardPatch
from .kv_cache import cache_kwargs, pop_cache

__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "CausalLMOutputWithValue",
    "CausalLMWithValueHeadConfig",
    "FUSED_OUTPUT_FIELDS",
    "FusedCausalLMOutputWithValue",
    "prepare_value_head_for_peft",
]

logger = logging.getLogger(__name__)

MODEL_TYPE = "causal_lm_with_value_head"
#: Per-token fields of `FusedCausalLMOutput` that the fused forward can compute (``log_probs`` always is).
FUSED_OUTPUT_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Config attributes that transform the logits after the LM head; with any of them the fused path uses full logits.
_LOGIT_TRANSFORM_ATTRS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
_HUB_KWARGS = tuple("cache_dir force_download local_files_only token revision subfolder trust_remote_code".split())
_VALUE_HEAD_KWARGS = ("value_head_init_std", "value_head_dropout", "value_head_bias")
_DEFAULT_FUSED_SETTINGS = dict(temperature=1.0, outputs=("log_probs",), cast_lm_head_to_fp32=False, chunk_size=None)
_LOGGED: set[str] = set()


def _log_once(key: str, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(msg)


# --------------------------------------------------------------------------------------------------------- config
class CausalLMWithValueHeadConfig(PreTrainedConfig):
    r"""Configuration of [`AutoModelForCausalLMWithValueHead`].

    Parameters:
        text_config (`dict` or `PreTrainedConfig`, *optional*):
            Config of the wrapped causal LM (any architecture `AutoModelForCausalLM` knows).
        value_head_init_std (`float`, *optional*):
            Standard deviation of the value-head weight init; `None` means `1 / sqrt(hidden_size + 1)`.
        value_head_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout applied to the hidden state before the value head.
        value_head_bias (`bool`, *optional*, defaults to `True`):
            Whether the value head has a bias (initialised to zero).

    Attributes the wrapper does not define are forwarded to `text_config`, so `config.vocab_size`,
    `config.pad_token_id`, `config.use_cache = False`, ... behave as on the wrapped model's config.
    """

    model_type = MODEL_TYPE
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama", optional=True)}

    text_config: dict | PreTrainedConfig | None = None
    value_head_init_std: float | None = None
    value_head_dropout: float = 0.0
    value_head_bias: bool = True

    def __post_init__(self, **kwargs):
        # The base class sets `attn_implementation` (default None) on every sub-config: keep the wrapped model's.
        if isinstance(self.text_config, PreTrainedConfig) and "attn_implementation" not in kwargs:
            kwargs["attn_implementation"] = self.text_config._attn_implementation
        super().__post_init__(**kwargs)
        if not 0.0 <= float(self.value_head_dropout) < 1.0:
            raise ValueError(f"value_head_dropout must be in [0, 1), got {self.value_head_dropout}.")
        if self.value_head_init_std is not None and not self.value_head_init_std > 0:
            raise ValueError(f"value_head_init_std must be positive or None, got {self.value_head_init_std}.")

    def get_text_config(self, decoder=None, encoder=None) -> PreTrainedConfig:
        """The wrapped model's text config (its own `get_text_config`, so a wrapped VLM gives its text part)."""
        text_config = self.__dict__.get("text_config")
        if text_config is None:
            return self
        return text_config.get_text_config(decoder=decoder, encoder=encoder)

    def _forwards(self, key: str) -> bool:
        text_config = self.__dict__.get("text_config")
        return (
            text_config is not None
            and not key.startswith("_")
            and key not in self.__dict__
            and not hasattr(type(self), key)
            and hasattr(text_config, key)
        )

    def __getattr__(self, key):  # only called when the normal lookup failed
        if not key.startswith("_"):
            text_config = self.__dict__.get("text_config")
            if text_config is not None:
                return getattr(text_config, key)
        raise AttributeError(f"{type(self).__name__} has no attribute {key!r}")

    def __setattr__(self, key, value):
        if self._forwards(key):
            setattr(self.__dict__["text_config"], key, value)
        else:
            super().__setattr__(key, value)


# -------------------------------------------------------------------------------------------------------- outputs
@dataclass
class CausalLMOutputWithValue(CausalLMOutputWithPast):
    """The wrapped causal LM's output (``loss``, ``logits``, ``past_key_values``, ...) plus ``value``.

    Args:
        value (`torch.FloatTensor` of shape `(batch, seq_len)`): float32 value of each position, ``V_t`` read from the
            hidden state at position ``t`` (the state after reading token ``t``); `None` with ``return_values=False``.
        aux_loss, router_logits: MoE fields, when the wrapped model returns them.
    """

    value: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class FusedCausalLMOutputWithValue(FusedCausalLMOutput):
    """TRL's `FusedCausalLMOutput` plus ``value`` `(batch, seq_len)` (see `CausalLMOutputWithValue`)."""

    value: torch.FloatTensor | None = None


# ----------------------------------------------------------------------------------------------- fused log-probs
def _has_logit_transform(text_config) -> bool:
    """Whether the wrapped forward rescales or soft-caps the logits after the LM head."""
    values = [getattr(text_config, name, None) for name in _LOGIT_TRANSFORM_ATTRS]
    return getattr(text_config, "final_logit_softcapping", None) is not None or any(v not in (None, 1) for v in values)


def _token_fields(z: torch.Tensor, labels: torch.Tensor, fields: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """Requested per-token fields from fp32, temperature-scaled logits ``z`` of shape ``(n, V)``."""
    logp = torch.log_softmax(z, dim=-1)
    compute = {
        "log_probs": lambda: logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
        "entropy": lambda: -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1),
        "log_sum_sq_probs": lambda: torch.logsumexp(2.0 * logp, dim=-1).detach(),
        "mean_logits": lambda: z.mean(-1).detach(),
        "is_top1": lambda: z.argmax(-1) == labels,
    }
    return tuple(compute[name]() for name in fields)


def _chunked_fields(rows, labels, project: Callable, fields: tuple[str, ...], temperature: float, chunk_size: int):
    """Fields over ``rows`` (hidden states or logits) ``chunk_size`` rows at a time.

    When gradients are needed each chunk runs under activation checkpointing, so only the chunk's input is kept
    and its ``(chunk, V)`` logits are recomputed in the backward pass.
    """

    def run(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = project(chunk).float()
        return _token_fields(z / temperature if temperature != 1.0 else z, chunk_labels, fields)

    needs_grad = torch.is_grad_enabled() and rows.requires_grad
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, rows.shape[0], chunk_size):
        args = (rows[start : start + chunk_size], labels[start : start + chunk_size])
        parts.append(checkpoint(run, *args, use_reentrant=False) if needs_grad else run(*args))
    if not parts:
        parts.append(run(rows[:0], labels[:0]))
    return tuple(torch.cat(column) for column in zip(*parts))


# --------------------------------------------------------------------------------------------------------- model
class AutoModelForCausalLMWithValueHead(RefusesTrlForwardPatch, PreTrainedModel):
    """Any causal LM plus a scalar value head on its last hidden state (shared actor-critic). See the module docs.

    Build it with `from_pretrained(path_or_model_id, **kwargs)` (a checkpoint of this class, or a plain causal LM
    which gets a fresh value head) or `from_model(causal_lm)` (wraps an existing instance, sharing its weights).
    Sub-modules: ``pretrained_model`` (the wrapped causal LM), ``v_head`` (``Linear(hidden, 1)``) and
    ``value_dropout``. When only the LM is trained (DPO, KTO, ...) the value head gets no gradient: under DDP with
    ``ddp_find_unused_parameters=False`` freeze it first (``model.v_head.requires_grad_(False)``).
    """

    config_class = CausalLMWithValueHeadConfig
    base_model_prefix = "pretrained_model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # Not a `GenerationMixin`: `generate` is delegated, but `from_pretrained` still reloads `generation_config.json`.
    adjust_generation_fn = GenerationMixin.adjust_generation_fn

    def __init__(self, config: CausalLMWithValueHeadConfig, pretrained_model: PreTrainedModel | None = None):
        super().__init__(config)
        if config.text_config is None:
            raise ValueError("CausalLMWithValueHeadConfig.text_config is None: give the wrapped causal LM's config.")
        if pretrained_model is None:
            pretrained_model = _causal_lm_from_config(config.text_config)
        else:  # already initialised: mark it so that `post_init` initialises only the value head
            for module in pretrained_model.modules():
                module._is_hf_initialized = True
        head = pretrained_model.get_output_embeddings() if hasattr(pretrained_model, "get_output_embeddings") else None
        if head is None:
            raise ValueError(
                f"{type(pretrained_model).__name__} has no output embeddings (`get_output_embeddings()` is None): "
                "AutoModelForCausalLMWithValueHead needs a causal LM with an LM head, e.g. one loaded with "
                "AutoModelForCausalLM rather than AutoModel."
            )
        hidden_size = getattr(pretrained_model.config.get_text_config(), "hidden_size", None)
        hidden_size = hidden_size or getattr(head, "in_features", None)
        if hidden_size is None:
            raise ValueError(f"Cannot infer the hidden size of {type(pretrained_model).__name__}.")
        self.pretrained_model = pretrained_model
        self.value_dropout = nn.Dropout(config.value_head_dropout)
        self.v_head = nn.Linear(hidden_size, 1, bias=config.value_head_bias)
        self._fused_settings = dict(_DEFAULT_FUSED_SETTINGS)
        self.post_init()

    # ------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_model(
        cls,
        pretrained_model: PreTrainedModel,
        value_head_init_std: float | None = None,
        value_head_dropout: float = 0.0,
        value_head_bias: bool = True,
    ) -> AutoModelForCausalLMWithValueHead:
        """Wrap an existing causal LM instance (its weights are shared, not copied) with a fresh value head.

        The value head is created on the LM head's device and in the wrapped model's dtype.
        """
        if isinstance(pretrained_model, cls):
            raise TypeError("The model already has a value head.")
        if not isinstance(pretrained_model, PreTrainedModel):
            raise TypeError(f"Expected a transformers PreTrainedModel, got {type(pretrained_model).__name__}.")
        text_config = pretrained_model.config
        if not text_config.architectures:
            text_config.architectures = [type(pretrained_model).__name__]
        head_kwargs = {"value_head_init_std": value_head_init_std, "value_head_dropout": value_head_dropout}
        config = CausalLMWithValueHeadConfig(text_config=text_config, value_head_bias=value_head_bias, **head_kwargs)
        config.name_or_path = text_config.name_or_path
        config.dtype = pretrained_model.dtype
        model = cls(config, pretrained_model=pretrained_model)
        head_param = next(pretrained_model.get_output_embeddings().parameters(), None)
        device = head_param.device if head_param is not None else pretrained_model.device
        model.v_head.to(device=device, dtype=pretrained_model.dtype)
        return model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a checkpoint of this class, or a plain causal LM checkpoint plus a fresh value head.

        All keyword arguments of `PreTrainedModel.from_pretrained` are accepted (``dtype``, ``device_map``,
        ``quantization_config``, ``attn_implementation``, ``revision``, ``output_loading_info``, ...), plus
        ``value_head_init_std``, ``value_head_dropout`` and ``value_head_bias``. For a plain causal LM the loading
        info lists ``v_head.*`` as missing keys (they are freshly initialised) and the other keys with the
        ``pretrained_model.`` prefix.
        """
        config = kwargs.get("config")
        if config is None:
            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        if isinstance(config, CausalLMWithValueHeadConfig):
            loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
            model = loaded[0] if isinstance(loaded, tuple) else loaded
            # The tiny head may sit at an unaligned offset of the memory-mapped file, where BLAS takes another code
            # path and values differ in the last bit from before saving: give it its own (aligned) storage.
            for param in model.v_head.parameters():
                if param.device.type == "cpu":
                    param.data = param.data.clone()
            return loaded
        head_kwargs = {k: kwargs.pop(k) for k in _VALUE_HEAD_KWARGS if k in kwargs}
        output_loading_info = kwargs.get("output_loading_info", False)
        auto_cls = _auto_class(config)
        loaded = auto_cls.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        lm, info = loaded if output_loading_info else (loaded, None)
        model = cls.from_model(lm, **head_kwargs)
        _log_once(
            f"fresh:{pretrained_model_name_or_path}",
            f"{pretrained_model_name_or_path} is a plain {type(lm).__name__} checkpoint: its weights are loaded and "
            "the value head `v_head` is freshly initialised.",
        )
        if info is None:
            return model
        info = dict(info)
        prefix = cls.base_model_prefix + "."
        for key in ("missing_keys", "unexpected_keys"):
            info[key] = {prefix + k for k in info.get(key, ())}
        info["missing_keys"] |= {f"v_head.{name}" for name, _ in model.v_head.named_parameters()}
        return model, info

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise the value head: ``N(0, std²)``, ``std = value_head_init_std or 1/sqrt(hidden + 1)``, bias 0."""
        if module is self.__dict__["_modules"].get("v_head"):
            std = self.config.value_head_init_std or default_value_head_std(module.in_features)
            hf_init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                hf_init.zeros_(module.bias)

    # ------------------------------------------------------------------------------------- the forward guard
    def adopt_trl_fused_settings(self, settings: dict) -> None:
        """Take the temperature/outputs/fp32 settings of a refused TRL `add_fused_lm_head` patch."""
        self.configure_fused_lm_head(**settings)

    def configure_fused_lm_head(self, temperature=None, outputs=None, cast_lm_head_to_fp32=None, chunk_size=None):
        """Set how ``forward(..., fused_lm_head=True)`` scores tokens (what TRL's `add_fused_lm_head` would set).

        Args:
            temperature (`float`): the logits are divided by it before the softmax.
            outputs (iterable of `str`): per-token fields among `FUSED_OUTPUT_FIELDS` (``log_probs`` always is).
            cast_lm_head_to_fp32 (`bool`): run the LM-head projection in float32 outside autocast.
            chunk_size (`int`): tokens scored at a time (default: about 32M logits per chunk).
        `None` leaves a setting unchanged.
        """
        if temperature is not None and not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}.")
        if outputs is not None and set(outputs) - set(FUSED_OUTPUT_FIELDS):
            raise ValueError(f"Unknown fused outputs {sorted(set(outputs) - set(FUSED_OUTPUT_FIELDS))}.")
        if chunk_size is not None and int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
        new = {"temperature": temperature, "cast_lm_head_to_fp32": cast_lm_head_to_fp32, "chunk_size": chunk_size}
        if outputs is not None:
            new["outputs"] = tuple(f for f in FUSED_OUTPUT_FIELDS if f in {*outputs, "log_probs"})
        self._fused_settings.update({k: v for k, v in new.items() if v is not None})

    # ---------------------------------------------------------------------------------------------- forward
    def score(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Value head on hidden states ``(..., H)`` → ``(..., 1)`` in the head's dtype (as a reward model's score)."""
        param = next(self.v_head.parameters())
        return self.v_head(self.value_dropout(hidden_states.to(device=param.device, dtype=param.dtype)))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        fused_lm_head: bool = False,
        shift_labels: torch.LongTensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        return_values: bool = True,
        cache=None,
        **kwargs,
    ) -> CausalLMOutputWithValue | FusedCausalLMOutputWithValue:
        """Run the wrapped causal LM and the value head.

        Args:
            input_ids, attention_mask, position_ids, past_key_values, use_cache, labels: as the wrapped model
                (``cache``: the KV cache under the name transformers ≥ 5.24 uses; either name works).
            fused_lm_head: TRL's fused LM-head protocol: return a `FusedCausalLMOutputWithValue` (a
                `FusedCausalLMOutput`) with the log-probs `(B, T-1)` of the next-token ``labels`` (or of the
                pre-shifted ``shift_labels``, `(B, T)`), zero where the label is ``-100``, without building the full
                logits. ``loss = −Σ log_probs / (num_items_in_batch or number of labels)``.
            shift_labels, num_items_in_batch: passed to the wrapped model's loss (or used by the fused protocol).
            return_values: compute ``value`` `(B, T)` (float32) from the last hidden state.
            **kwargs: anything else the wrapped model accepts (``inputs_embeds``, ``output_attentions``, ...).

        Returns:
            `CausalLMOutputWithValue`: the wrapped model's fields plus ``value``.
        """
        model_kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if cache is not None:
            past_key_values = pop_cache({"cache": cache}, past_key_values)
        model_kwargs.update(**cache_kwargs(past_key_values), use_cache=use_cache, **kwargs)
        if fused_lm_head:
            return self._fused_forward(model_kwargs, labels, shift_labels, num_items_in_batch, return_values)
        user_hidden = model_kwargs.pop("output_hidden_states", None)
        model_kwargs.pop("return_dict", None)
        loss_kwargs = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
        model_kwargs.update({k: v for k, v in loss_kwargs.items() if v is not None})
        out = self.pretrained_model(**model_kwargs, output_hidden_states=bool(return_values or user_hidden))
        value = self.score(out.hidden_states[-1]).squeeze(-1).float() if return_values else None
        fields = {k: v for k, v in out.items() if k in CausalLMOutputWithValue.__dataclass_fields__}
        if not user_hidden:
            fields.pop("hidden_states", None)
        return CausalLMOutputWithValue(**fields, value=value)

    def get_values(self, input_ids=None, attention_mask=None, **kwargs) -> torch.Tensor:
        """Values ``(B, T)`` (float32) without computing the LM logits: runs only the trunk and the value head."""
        hidden = self._trunk_hidden({"input_ids": input_ids, "attention_mask": attention_mask, **kwargs})
        return self.score(hidden).squeeze(-1).float()

    def _trunk_hidden(self, model_kwargs: dict) -> torch.Tensor:
        trunk = self.pretrained_model.base_model
        if trunk is self.pretrained_model:  # no separate backbone: take the last hidden state of the full forward
            return self.pretrained_model(**model_kwargs, output_hidden_states=True).hidden_states[-1]
        return trunk(**model_kwargs, return_dict=True).last_hidden_state

    def _fused_forward(self, model_kwargs, labels, shift_labels, num_items_in_batch, return_values):
        if labels is None and shift_labels is None:
            raise ValueError("forward(fused_lm_head=True) needs `labels` (or pre-shifted `shift_labels`).")
        # MoE load-balancing loss: only the wrapped model's own forward computes it, so take the full-logits path.
        with_router = bool(
            model_kwargs.get(
                "output_router_logits", getattr(self.config.get_text_config(), "output_router_logits", False)
            )
        )
        for key in ("output_hidden_states", "return_dict", "num_logits_to_keep", "logits_to_keep"):
            model_kwargs.pop(key, None)
        model_kwargs["use_cache"] = False
        settings = self._fused_settings
        temperature, fields = settings["temperature"], settings["outputs"]
        lm = self.pretrained_model
        head = lm.get_output_embeddings()
        full_logits = with_router or _has_logit_transform(lm.config.get_text_config()) or lm.base_model is lm
        aux_loss = None
        if full_logits:  # the wrapped forward applies its logit scale / softcapping / router loss: score its logits
            out = lm(**model_kwargs, output_hidden_states=bool(return_values))
            hidden, source = (out.hidden_states[-1] if return_values else None), out.logits
            aux_loss = getattr(out, "aux_loss", None) if with_router else None
        else:
            hidden = source = self._trunk_hidden(model_kwargs)
        if shift_labels is None:
            source, targets = source[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        device = source.device if full_logits else next(head.parameters()).device
        source, targets = source.to(device), targets.to(device)
        mask = targets != -100
        rows, row_labels = source[mask], targets[mask]
        per_token = self._score_rows(rows, row_labels, head, full_logits, fields, temperature)
        results = {name: x.new_zeros(mask.shape).masked_scatter(mask, x) for name, x in zip(fields, per_token)}
        log_probs = results["log_probs"]
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        value = self.score(hidden).squeeze(-1).float() if return_values else None
        loss = -log_probs.sum() / denominator
        if aux_loss is not None:
            loss = loss + getattr(self.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutputWithValue(loss=loss, label_mask=mask, value=value, aux_loss=aux_loss, **results)

    def _score_rows(self, rows, row_labels, head, rows_are_logits, fields, temperature):
        settings = self._fused_settings
        vocab = rows.shape[-1] if rows_are_logits else self.config.get_text_config().vocab_size
        chunk_size = settings["chunk_size"] or max(16, 2**25 // max(int(vocab or 1), 1))
        if rows_are_logits:
            if fields == ("log_probs",):
                return (logprobs_from_logits(rows, row_labels, temperature=temperature, chunk_size=chunk_size),)
            return _chunked_fields(rows, row_labels, lambda z: z, fields, temperature, chunk_size)
        # A plain Linear head is used through its weights; a wrapped one (e.g. LoRA on the LM head) is called.
        if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks:
            return _chunked_fields(rows, row_labels, head, fields, temperature, chunk_size)
        weight, bias = head.weight, head.bias
        cast = settings["cast_lm_head_to_fp32"]
        with torch.autocast(rows.device.type, enabled=False) if cast else nullcontext():
            if cast:
                rows, weight, bias = rows.float(), weight.float(), (None if bias is None else bias.float())
            if fields == ("log_probs",):
                kw = {"lm_head_bias": bias, "temperature": temperature, "chunk_size": chunk_size}
                return (logprobs_from_hidden(rows, weight, row_labels, **kw),)
            return _chunked_fields(
                rows, row_labels, lambda h: F.linear(h, weight, bias), fields, temperature, chunk_size
            )

    # ------------------------------------------------------------------------------------ causal-LM delegation
    def generate(self, *args, **kwargs):
        """The wrapped model's `generate` (the value head is not used)."""
        return self.pretrained_model.generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.pretrained_model.prepare_inputs_for_generation(*args, **kwargs)

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @property
    def generation_config(self):
        lm = self.__dict__["_modules"].get("pretrained_model")
        return lm.generation_config if lm is not None else self.__dict__.get("_pending_generation_config")

    @generation_config.setter
    def generation_config(self, value):
        lm = self.__dict__["_modules"].get("pretrained_model")
        if lm is not None:
            lm.generation_config = value
        else:  # during `PreTrainedModel.__init__`, before the wrapped model exists (then unused)
            self.__dict__["_pending_generation_config"] = value

    def get_input_embeddings(self) -> nn.Module:
        return self.pretrained_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.pretrained_model.get_output_embeddings()

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.pretrained_model.set_output_embeddings(new_embeddings)

    def resize_token_embeddings(self, *args, **kwargs):
        return self.pretrained_model.resize_token_embeddings(*args, **kwargs)


def _causal_lm_from_config(text_config: PreTrainedConfig) -> PreTrainedModel:
    """Build the wrapped model's class (its saved ``architectures`` if transformers has it) from its config."""
    import transformers

    for name in text_config.architectures or ():
        model_cls = getattr(transformers, name, None)
        if isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel):
            return model_cls._from_config(text_config)
    return _auto_class(text_config).from_config(text_config)


def _auto_class(config: PreTrainedConfig):
    """`AutoModelForImageTextToText` for a vision-language config (it has a ``vision_config``), else
    `AutoModelForCausalLM`."""
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def prepare_value_head_for_peft(model: AutoModelForCausalLMWithValueHead, peft_config):
    """Copy of a PEFT config (LoRA, ...) that trains the value head fully next to the adapters of the trunk.

    - adds ``"v_head"`` to ``modules_to_save``: PEFT then trains a copy of the value head and saves it inside the
      adapter (``adapter_model.safetensors``), while the trunk's base weights stay frozen;
    - fills ``target_modules`` when it is `None` with PEFT's default for the *wrapped* architecture (PEFT looks the
      default up by ``config.model_type``, which here is ``causal_lm_with_value_head``);

    Usage: ``peft_model = peft.get_peft_model(model, prepare_value_head_for_peft(model, LoraConfig(r=8)))``, or pass
    the returned config as ``peft_config=`` to a TRL trainer. Reload with
    ``PeftModel.from_pretrained(AutoModelForCausalLMWithValueHead.from_pretrained(base), adapter_dir)``.
    """
    if not hasattr(peft_config, "modules_to_save") or not hasattr(peft_config, "target_modules"):
        raise TypeError(f"{type(peft_config).__name__} has no `modules_to_save`/`target_modules` (use LoraConfig).")
    peft_config = copy.deepcopy(peft_config)
    modules = list(peft_config.modules_to_save or [])
    if "v_head" not in modules:
        modules.append("v_head")
    peft_config.modules_to_save = modules
    if peft_config.target_modules is None:
        require_peft("LoRA on a value-head model")
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        model_type = model.config.get_text_config().model_type
        if model_type not in defaults:
            raise ValueError(f"PEFT has no default target_modules for {model_type!r}: set `target_modules`.")
        peft_config.target_modules = set(defaults[model_type])
    return peft_config


AutoConfig.register(MODEL_TYPE, CausalLMWithValueHeadConfig, exist_ok=True)
AutoModelForCausalLM.register(CausalLMWithValueHeadConfig, AutoModelForCausalLMWithValueHead, exist_ok=True)
