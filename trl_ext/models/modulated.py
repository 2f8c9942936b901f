"""Modulated policies: a frozen base causal LM ``p`` times a learned exponential tilt, docs/algorithms.md §6.

The policy is

    log q(·|s_<t) = log_softmax( log_softmax(ℓ^p_t) + m_t ),     i.e.  q(v|s_<t) ∝ p(v|s_<t) · exp(m_t[v]),

where ``ℓ^p_t`` are the base model's logits and ``m_t ∈ R^V`` the output of a trainable *modulation* network. For the
twist losses the modulation *is* the log-twist: ``log ψ_t(v) = m_t[v]`` (an unnormalised logit, B17).
Three modulation kinds (``ModulatedConfig.modulation_kind``):

- ``"model"``: a full copy of the base transformer (initialised from it, trained) whose output head is replaced by a
  fresh ``Linear(h, V)``;
- ``"linear_head"``: ``Linear(h, V)`` on the base model's final hidden state (computed without gradient);
- ``"mlp_head"`` (a.k.a. ``"nn_head"``): ``Linear(h,h)–ReLU–Linear(h,h)–ReLU–Linear(h,V)`` on that hidden state.

The last ``Linear`` of every kind starts as ``xavier_normal / init_scale_divider`` with a zero bias, or, with
``init_head_from_base=True`` (``"model"``/``"linear_head"``), as the base LM head divided by the divider. The
divider is applied in every case (fix of B17). Only modulation parameters train; the base is frozen and always in
eval mode.

`ModulatedCausalLM` is a ``transformers.PreTrainedModel`` with ``GenerationMixin``:

- ``forward`` returns `ModulatedCausalLMOutput` whose ``logits`` are the modulated log-probs ``log q`` (fp32), so
  ``model.generate(...)`` samples from ``q`` with every `GenerationConfig` option (temperature/top-k/top-p act on
  ``log q`` exactly as on any LM's logits), using a KV cache for the base and for the modulation backbone
  (`trl_ext.models.modulated_generation.ModulatedCache`). ``modulation_logits`` and ``base_logits`` are returned too.
- ``forward(..., labels=..., fused_lm_head=True)`` implements TRL 1.16's fused LM-head protocol natively and returns
  ``trl.trainer.utils.FusedCausalLMOutput`` for ``q``. TRL's ``add_fused_lm_head`` (called by DPO/KTO/SFT/GRPO/RLOO)
  assigns ``model.forward`` on the instance, which would bypass the modulation; that assignment is intercepted and
  ignored (its ``temperature`` is kept, see `ModulatedCausalLM.fused_temperature`).
- ``save_pretrained`` writes only the modulation weights and a config recording ``base_model_name_or_path``;
  ``ModulatedCausalLM.from_pretrained(dir)`` reloads the base from that path (or takes ``base_model=``) and the
  modulation from ``dir``. ``push_to_hub`` is the standard one.

Temperature convention: ``T`` divides the policy's logits ``log q`` (the whole tilted distribution, as in
``generate``), i.e. ``q_T ∝ (p·e^m)^{1/T}``; `trl_ext.ops.logprobs.modulated_logprobs` uses the same convention, so
log-probs scored with it match what ``generate`` samples.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
from dataclasses import dataclass

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..ops.logprobs import full_logprobs, logprobs_from_logits, modulated_logprobs
from .fused_patch import RefusesTrlForwardPatch
from .kv_cache import cache_kwargs, output_cache, pop_cache
from .modulated_generation import ModulatedCache, resolve_modulated_cache
from .modulated_utils import (
    MODULATION_KINDS,
    build_modulation_head,
    fused_token_outputs,
    keep_positions,
    load_modulation_state_dict,
    normalize_modulation_kind,
    split_hub_kwargs,
)

logger = logging.getLogger(__name__)

__all__ = [
    "MODULATION_KINDS",
    "ModulatedCache",
    "ModulatedCausalLM",
    "ModulatedCausalLMOutput",
    "ModulatedConfig",
    "build_modulation_head",
    "normalize_modulation_kind",
]


@strict
class ModulatedConfig(PreTrainedConfig):
    """Configuration of a `ModulatedCausalLM` (what ``config.json`` of a saved modulation holds).

    Parameters:
        base_model_name_or_path: Hub id or local folder of the frozen base LM; ``from_pretrained`` loads it from
            there unless given ``base_model=``. ``None`` when the base was built in memory.
        modulation_kind: ``"model"``, ``"linear_head"`` or ``"mlp_head"`` (aliases accepted, see
            `normalize_modulation_kind`).
        init_scale_divider: ``d > 0``; the last modulation layer starts as ``xavier_normal/d`` (or base head ``/d``).
            The research code's ``--additional_sd_divider``.
        init_head_from_base: start the output ``Linear`` from the base LM head (kinds ``model``/``linear_head``).
        vocab_size, hidden_size: the base's output vocabulary and hidden sizes (checked when the base is attached).
        use_cache: default of ``forward``'s ``use_cache``.
        pad_token_id, bos_token_id, eos_token_id: copied from the base config.
    """

    model_type = "trl_ext_modulated"

    base_model_name_or_path: str | None = None
    modulation_kind: str = "linear_head"
    init_scale_divider: float | int = 1.0
    init_head_from_base: bool = False
    vocab_size: int | None = None
    hidden_size: int | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        divider = kwargs.pop("additional_sd_divider", None)  # the research code's name
        if divider is not None:
            self.init_scale_divider = divider
        self.modulation_kind = normalize_modulation_kind(self.modulation_kind)
        if not float(self.init_scale_divider) > 0:
            raise ValueError(f"init_scale_divider must be positive, got {self.init_scale_divider}.")
        if self.init_head_from_base and self.modulation_kind == "mlp_head":
            raise ValueError(
                "init_head_from_base=True needs the output Linear to read the base's final hidden state; the "
                "mlp_head's last layer reads an MLP output instead. Use modulation_kind='linear_head' or 'model'."
            )
        super().__post_init__(**kwargs)


@dataclass
class ModulatedCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` of a modulated policy.

    Attributes:
        logits: ``(B, T', V)`` fp32 modulated log-probs ``log q = log_softmax(log_softmax(ℓ^p) + m)``.
        base_logits: ``(B, T', V)`` logits ``ℓ^p`` of the frozen base model (no gradient).
        modulation_logits: ``(B, T', V)`` modulation ``m = log ψ`` (with gradient), in the head's dtype (fp32 for the
            heads, which are created in fp32 whatever the base dtype).
        past_key_values: a `ModulatedCache` when ``use_cache`` (the field is ``cache`` from transformers 5.24 on).
    """

    base_logits: torch.Tensor | None = None
    modulation_logits: torch.Tensor | None = None


class ModulatedCausalLM(RefusesTrlForwardPatch, PreTrainedModel, GenerationMixin):
    """A frozen causal LM ``p`` tilted by a trainable modulation ``m``: ``q(v|s_<t) ∝ p(v|s_<t)·exp(m_t[v])``.

    Build one with `ModulatedCausalLM.from_base(base_or_path, modulation_kind=...)`, reload a saved one with
    `ModulatedCausalLM.from_pretrained(dir, base_model=None)`. Submodules: ``base_lm`` (frozen),
    ``modulation_backbone`` (kind ``"model"`` only, a trainable copy of the base transformer) and
    ``modulation_head``. See the module docstring for the forward, generation and saving contracts.
    """

    config_class = ModulatedConfig
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True

    def __init__(
        self,
        config: ModulatedConfig,
        base_model: PreTrainedModel | None = None,
        *,
        live_base: bool = False,
        **base_model_kwargs,
    ):
        super().__init__(config)
        if live_base and base_model is None:
            raise ValueError("live_base=True modulates a model trained elsewhere: pass it as base_model.")
        if base_model is None:
            if not config.base_model_name_or_path:
                raise ValueError(
                    "ModulatedCausalLM needs its base model: pass base_model=<loaded causal LM> or set "
                    "config.base_model_name_or_path to a Hub id or local folder."
                )
            base_model = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, **base_model_kwargs)
        if isinstance(base_model, ModulatedCausalLM):
            raise TypeError(
                "The base of a ModulatedCausalLM must be a plain causal LM, not another ModulatedCausalLM."
            )
        hidden_size, vocab_size = self._base_sizes(base_model)
        for name, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            if getattr(config, name) is None:
                setattr(config, name, value)
            elif getattr(config, name) != value:
                raise ValueError(
                    f"The base model has {name}={value} but the modulation config says {getattr(config, name)}: "
                    "this modulation was trained on another base model."
                )
        base_head = base_model.get_output_embeddings() if config.init_head_from_base else None
        device = next(base_model.parameters()).device

        self.modulation_backbone = None
        if config.modulation_kind == "model":
            backbone = base_model.base_model
            if backbone is base_model:
                raise ValueError(
                    f"{type(base_model).__name__} exposes no transformer backbone (`base_model` is the model "
                    "itself), so modulation_kind='model' cannot copy it."
                )
            if getattr(base_model, "hf_quantizer", None) is not None or getattr(
                base_model, "is_loaded_in_4bit", False
            ):
                raise ValueError(
                    "modulation_kind='model' trains a copy of the base transformer, which cannot be done on a "
                    "quantized base: load the base unquantized, or use a 'linear_head'/'mlp_head' modulation."
                )
            self.modulation_backbone = copy.deepcopy(backbone).requires_grad_(True)  # in the base's dtype
        # The head is small: keep it in fp32 whatever the base dtype (its output is used in fp32 anyway).
        self.modulation_head = build_modulation_head(
            config.modulation_kind, hidden_size, vocab_size, float(config.init_scale_divider), base_head
        ).to(device=device)

        self.live_base = live_base
        if live_base:
            # The base is another model's (RePULSe's policy, trained by its own optimizer): keep it out of this
            # module's parameters, state dict and train/eval switches, and leave its requires_grad alone.
            object.__setattr__(self, "base_lm", base_model)
        else:
            self.base_lm = base_model.requires_grad_(False).eval()
        self._base_takes_logits_to_keep = "logits_to_keep" in inspect.signature(base_model.forward).parameters
        self._select_last_hidden = True
        self.fused_temperature = 1.0
        if getattr(base_model, "generation_config", None) is not None:
            self.generation_config = copy.deepcopy(base_model.generation_config)
        self.post_init()

    # --------------------------------------------------------------------------------------------- construction
    @staticmethod
    def _base_sizes(base_model) -> tuple[int, int]:
        text_config = base_model.config.get_text_config()
        hidden_size = getattr(text_config, "hidden_size", None)
        head = base_model.get_output_embeddings()
        vocab_size = head.weight.shape[0] if getattr(head, "weight", None) is not None else text_config.vocab_size
        if hidden_size is None or vocab_size is None:
            raise ValueError(f"Cannot read hidden_size/vocab_size from the base model {type(base_model).__name__}.")
        return int(hidden_size), int(vocab_size)

    @classmethod
    def from_base(
        cls,
        base_model: PreTrainedModel | str | os.PathLike,
        modulation_kind: str = "linear_head",
        *,
        init_scale_divider: float = 1.0,
        init_head_from_base: bool = False,
        base_model_name_or_path: str | None = None,
        live_base: bool = False,
        **base_model_kwargs,
    ) -> ModulatedCausalLM:
        """A new modulated policy on ``base_model`` (a loaded causal LM, or a Hub id / folder to load it from with
        ``base_model_kwargs``). ``base_model_name_or_path`` overrides the path recorded for reloading (defaults to
        the base's ``name_or_path``; a model built from a config has none, so reloading then needs ``base_model=``).
        ``live_base=True``: the base is a model trained elsewhere (RePULSe's policy, whose proposal is then
        ``q ∝ p_θ·exp(m)``): it is not frozen, not registered as a submodule (so neither in this module's
        parameters nor in its state dict) and its train/eval mode is left to its owner; its forward still runs
        without gradient here. The modulation is initialised with the global torch RNG."""
        if isinstance(base_model, (str, os.PathLike)):
            base_model_name_or_path = base_model_name_or_path or os.fspath(base_model)
            base_model = AutoModelForCausalLM.from_pretrained(os.fspath(base_model), **base_model_kwargs)
        elif base_model_kwargs:
            raise TypeError(f"Unexpected arguments for an already loaded base model: {sorted(base_model_kwargs)}.")
        text_config = base_model.config.get_text_config()
        config = ModulatedConfig(
            base_model_name_or_path=base_model_name_or_path or getattr(base_model, "name_or_path", None) or None,
            modulation_kind=modulation_kind,
            init_scale_divider=init_scale_divider,
            init_head_from_base=init_head_from_base,
            pad_token_id=getattr(text_config, "pad_token_id", None),
            bos_token_id=getattr(text_config, "bos_token_id", None),
            eos_token_id=getattr(text_config, "eos_token_id", None),
        )
        return cls(config, base_model=base_model, live_base=live_base)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args,
        base_model: PreTrainedModel | None = None,
        config: ModulatedConfig | None = None,
        **kwargs,
    ) -> ModulatedCausalLM:
        """Reload a saved modulation (local folder or Hub repo) together with its base model.

        The base is ``base_model`` when given (checked against the saved sizes), else loaded with
        ``AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, **kwargs)`` — so ``dtype``,
        ``device_map``, ``attn_implementation``... apply to the base; Hub arguments (``revision``, ``token``,
        ``cache_dir``, ``subfolder``...) apply to the modulation repo. The modulation weights must all be present.
        """
        if model_args:
            raise TypeError(
                f"ModulatedCausalLM.from_pretrained takes no extra positional arguments, got {model_args}."
            )
        hub_kwargs, kwargs = split_hub_kwargs(kwargs)
        if config is None:
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        if not isinstance(config, ModulatedConfig):
            raise ValueError(
                f"{pretrained_model_name_or_path} holds a {type(config).__name__}, not a ModulatedConfig; to modulate "
                "a plain causal LM use ModulatedCausalLM.from_base(...)."
            )
        if base_model is not None and kwargs:
            logger.warning(f"Ignoring base loading arguments {sorted(kwargs)}: base_model was given.")
        model = cls(config, base_model=base_model, **({} if base_model is not None else kwargs))
        state_dict = load_modulation_state_dict(pretrained_model_name_or_path, hub_kwargs)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not k.startswith("base_lm.")]
        if missing or unexpected:
            raise ValueError(
                f"The checkpoint in {pretrained_model_name_or_path} does not match a {config.modulation_kind!r} "
                f"modulation of this base: missing {missing[:5]}, unexpected {unexpected[:5]}."
            )
        try:
            model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        except OSError:
            pass  # no generation_config.json: keep the base's
        model.config._name_or_path = os.fspath(pretrained_model_name_or_path)
        return model.eval()

    def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained` restricted to the modulation: the frozen base weights are never
        written (also not when a trainer passes a full ``state_dict``). Keys are saved as named in this module
        (``save_original_format`` is forced off, there is nothing to convert back)."""
        if not self.config.base_model_name_or_path:
            logger.warning(
                "Saving a modulation whose base model has no recorded name or path: reload it with "
                "ModulatedCausalLM.from_pretrained(path, base_model=<the same base>)."
            )
        if state_dict is None:
            state_dict = self.state_dict()
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("base_lm.")}
        kwargs["save_original_format"] = False
        return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)

    def init_weights(self):
        # `post_init` would otherwise run transformers' initialisation over every submodule, re-randomising a base
        # built from a config (its modules are not flagged as initialised). The modulation is initialised explicitly
        # in `__init__` and the base keeps its weights, so there is nothing to do.
        return None

    # ------------------------------------------------------------------------------------------------ behaviour
    def train(self, mode: bool = True):
        """Set train/eval mode for the modulation; the frozen base always stays in eval mode (no dropout), a live base
        keeps the mode its own trainer set."""
        super().train(mode)
        if not self.live_base:
            self.base_lm.eval()
        return self

    def adopt_trl_fused_settings(self, settings: dict) -> None:
        """Keep the temperature of a refused TRL `add_fused_lm_head` patch (see `RefusesTrlForwardPatch`)."""
        if settings.get("temperature") is not None:
            self.fused_temperature = float(settings["temperature"])

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # `generate` must not build a DynamicCache from the wrapper config; the forward builds a ModulatedCache.
        return False

    def get_input_embeddings(self) -> nn.Module:
        owner = self.modulation_backbone if self.modulation_backbone is not None else self.base_lm
        return owner.get_input_embeddings()

    def get_output_embeddings(self):
        return None  # the policy has no single output projection (base head + modulation)

    def modulation_parameters(self):
        """The trainable parameters (everything outside ``base_lm``; a live base is not a submodule at all)."""
        return [p for n, p in self.named_parameters() if not n.startswith("base_lm.")]

    def outputs_from_hidden(self, hidden: torch.Tensor, base_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log q, m)`` from the base's final hidden states ``hidden`` ``(..., H)`` (computed elsewhere, e.g. by a
        live base's own training forward) and its LM head ``base_head`` (run without gradient): what `forward`
        returns as ``logits`` / ``modulation_logits`` at those positions, for a ``linear_head``/``mlp_head`` kind."""
        if self.modulation_backbone is not None:
            raise ValueError("modulation_kind='model' reads its own backbone, not the base's hidden states.")
        hidden = hidden.detach()
        with torch.no_grad():
            base_logits = base_head(hidden)
        modulation = self._head(hidden)
        return modulated_logprobs(base_logits.to(modulation.device), modulation), modulation

    # -------------------------------------------------------------------------------------------------- forward
    def _run(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep, extra):
        """Base logits ``ℓ^p`` (no grad) and the hidden state the modulation head reads, at the kept positions."""
        common = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **extra)
        head_on_base = self.modulation_backbone is None
        base_kwargs = dict(common)
        if self._base_takes_logits_to_keep:
            base_kwargs["logits_to_keep"] = logits_to_keep
        past = cache.base if cache is not None else None
        with torch.no_grad():
            out = self._base_forward(input_ids, past, head_on_base, base_kwargs)
        returned = output_cache(out)
        if cache is not None and returned is not None and returned is not cache.base:
            cache.base = returned
        base_logits = out.logits if self._base_takes_logits_to_keep else keep_positions(out.logits, logits_to_keep)
        if head_on_base:
            if not out.hidden_states:
                raise ValueError(
                    f"The base model {type(self.base_lm).__name__} returned no hidden states with "
                    "output_hidden_states; the linear/mlp modulation heads need its final hidden state."
                )
            hidden = out.hidden_states[-1]
        else:
            past_m = cache.modulation if cache is not None else None
            mod_out = self.modulation_backbone(input_ids=input_ids, **cache_kwargs(past_m), **common)
            returned = output_cache(mod_out)
            if cache is not None and returned is not None and returned is not past_m:
                cache.modulation = returned
            hidden = mod_out.last_hidden_state
        return base_logits, keep_positions(hidden, logits_to_keep)

    def _base_forward(self, input_ids, past, want_hidden: bool, kwargs: dict):
        """The frozen base's forward; with ``want_hidden`` only its last hidden state is requested when the model
        supports transformers 5's index selection (``output_hidden_states=[-1]``), all of them otherwise."""
        if want_hidden and self._select_last_hidden:
            try:
                return self.base_lm(input_ids=input_ids, **cache_kwargs(past), output_hidden_states=[-1], **kwargs)
            except ValueError as err:  # raised before the forward runs, e.g. no `num_hidden_layers` in the config
                if "hidden states" not in str(err):
                    raise
                self._select_last_hidden = False
        if want_hidden:
            kwargs = {**kwargs, "output_hidden_states": True}
        return self.base_lm(input_ids=input_ids, **cache_kwargs(past), **kwargs)

    @property
    def _head_weight(self) -> torch.Tensor:
        head = self.modulation_head
        return (head[0] if isinstance(head, nn.Sequential) else head).weight

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``m = head(h)``, computed on the head's device and in its dtype."""
        weight = self._head_weight
        return self.modulation_head(hidden.to(device=weight.device, dtype=weight.dtype))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        fused_lm_head: bool = False,
        shift_labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_dict: bool | None = None,
        cache=None,
        **kwargs,
    ):
        """Modulated log-probs ``log q = log_softmax(log_softmax(ℓ^p) + m)`` of every (kept) position.

        Args:
            input_ids, attention_mask, position_ids: as for any causal LM (left padding is fine; ``generate``
                builds ``position_ids`` from the mask).
            past_key_values: ``None`` or a `ModulatedCache` (built here on the first cached call); ``cache`` is the
                same argument under the name transformers ≥ 5.24 uses (`trl_ext.models.kv_cache`).
            labels: optional; the loss is ``−Σ_t log q(labels_{t+1}|·) / n`` over labels ≠ −100, with ``n`` the
                label count or ``num_items_in_batch``.
            use_cache: defaults to ``config.use_cache`` (off when ``fused_lm_head``).
            logits_to_keep: keep only the last ``k`` positions (``0``: all) or the given indices.
            fused_lm_head: TRL's protocol: return ``FusedCausalLMOutput`` with per-token ``log_probs`` of the
                next-token labels under ``q`` at temperature `fused_temperature` (``(B, T−1)``, or ``(B, T)`` with
                ``shift_labels``), zero where the label is −100, plus ``entropy``, ``log_sum_sq_probs``,
                ``mean_logits``, ``is_top1`` (no gradient), ``label_mask`` and ``loss``.

        Returns:
            `ModulatedCausalLMOutput` (or ``FusedCausalLMOutput``).
        """
        if inputs_embeds is not None:
            raise ValueError(
                "ModulatedCausalLM takes `input_ids`, not `inputs_embeds`: the base model and the modulation "
                "embed the tokens separately. Pass the token ids."
            )
        if input_ids is None:
            raise ValueError("input_ids is required.")
        kwargs.pop("output_hidden_states", None)
        kwargs.pop("cache_position", None)
        if fused_lm_head:
            return self._fused_forward(
                input_ids, attention_mask, position_ids, labels, shift_labels, num_items_in_batch, kwargs
            )
        if cache is not None:
            past_key_values = pop_cache({"cache": cache}, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = resolve_modulated_cache(
            past_key_values,
            bool(use_cache),
            self.base_lm.config,
            self.modulation_backbone.config if self.modulation_backbone is not None else None,
        )
        base_logits, hidden = self._run(
            input_ids, attention_mask, position_ids, cache, bool(use_cache), logits_to_keep, kwargs
        )
        modulation = self._head(hidden)
        base_logits = base_logits.to(modulation.device)
        logits = modulated_logprobs(base_logits, modulation)
        loss = None
        if labels is not None or shift_labels is not None:
            if shift_labels is None:
                if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                    raise ValueError("labels need the log-probs of every position (logits_to_keep=0).")
                targets, scores = labels[:, 1:], logits[:, :-1]
            else:
                targets, scores = shift_labels, logits
            token_logprobs = logprobs_from_logits(scores, targets.to(scores.device))
            count = (targets != -100).sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
            loss = -token_logprobs.sum() / count
        output = ModulatedCausalLMOutput(
            loss=loss,
            logits=logits,
            **cache_kwargs(cache if use_cache else None),
            base_logits=base_logits,
            modulation_logits=modulation,
        )
        if return_dict is False:
            return output.to_tuple()
        return output

    def _fused_forward(self, input_ids, attention_mask, position_ids, labels, shift_labels, num_items_in_batch, extra):
        """TRL's ``fused_lm_head=True`` protocol for ``q`` (see `forward`); ``(N, V)`` work only at the N labels."""
        from trl.trainer.utils import FusedCausalLMOutput

        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True needs labels (or shift_labels).")
        extra = {k: v for k, v in extra.items() if k not in ("use_cache", "output_router_logits")}
        base_logits, hidden = self._run(input_ids, attention_mask, position_ids, None, False, 0, extra)
        if shift_labels is None:
            base_logits, hidden, targets = base_logits[:, :-1], hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        if targets.shape != base_logits.shape[:2]:
            raise ValueError(
                f"{'shift_labels' if shift_labels is not None else 'labels'} of shape {tuple(targets.shape)} do not "
                f"match the scored positions {tuple(base_logits.shape[:2])} (shift_labels are (B, T), pre-shifted)."
            )
        device = self._head_weight.device  # everything below lives with the head
        targets, base_logits, hidden = targets.to(device), base_logits.to(device), hidden.to(device)
        mask = targets != -100
        selected = targets[mask]
        # ℓ = log_softmax(ℓ^p) + m at the labelled positions only; the base part carries no gradient.
        scores = full_logprobs(base_logits[mask]) + self._head(hidden[mask]).float()
        temperature = float(self.fused_temperature)
        token_logprobs = logprobs_from_logits(scores, selected, temperature=temperature)
        log_probs = token_logprobs.new_zeros(mask.shape).masked_scatter(mask, token_logprobs)
        stats = {
            name: value.new_zeros(mask.shape).masked_scatter(mask, value)
            for name, value in fused_token_outputs(scores.detach(), selected, temperature).items()
        }
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count, log_probs=log_probs, label_mask=mask, aux_loss=None, **stats
        )


AutoConfig.register(ModulatedConfig.model_type, ModulatedConfig, exist_ok=True)
AutoModelForCausalLM.register(ModulatedConfig, ModulatedCausalLM, exist_ok=True)
