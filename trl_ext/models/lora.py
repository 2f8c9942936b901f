"""LoRA in one call: pick the layers to adapt automatically, keep the heads trainable, state the reference rule.

`apply_lora(model)` wraps a model in a `peft.PeftModel` whose LoRA adapters sit on the model's linear layers
(`nn.Linear`, bitsandbytes `Linear4bit` / `Linear8bitLt`, and transformers' `Conv1D` in GPT-2-style models), and
never on the parts that must not be adapted:

- the output embedding (`lm_head`, GPT-NeoX's `embed_out`, whatever `get_output_embeddings()` returns): it is tied to
  the input embedding in many models and a rank-r update of a 50k-150k vocabulary projection is costly and rarely
  what a run wants;
- trainable heads (`score`, `v_head`, `value_head`, `reward_head`, `classifier` and any module whose name contains
  both `modulation` and `head`, e.g. `modulation_head`): they are small, often freshly initialised and must be
  trained in full, so they go to PEFT's `modules_to_save` instead (a full trainable copy saved with the adapter);
- vision / audio towers and projectors of multimodal models (`vision_tower`, `visual`, `vision_model`,
  `multi_modal_projector`, `mm_projector`, ...).

**The LoRA reference rule (QUALITY_BARS item 8).** With LoRA the frozen base weights are still inside the model, so
the reference policy of a KL penalty or of DPO is *the same model with its adapters disabled*:

    with adapters_disabled(peft_model):          # == peft_model.disable_adapter()
        ref_logits = peft_model(**batch).logits  # exactly the logits of the model before apply_lora

Disabling the adapters also switches every `modules_to_save` head back to its original copy. Trainers call
`reference_is_base_with_adapters_disabled(model, ref_model)` to decide (and log) which reference they use; any other
reference must be passed explicitly.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Iterator, Sequence

from torch import nn

from ..utils import require_peft, unwrap_model
from .quantization import keep_4bit_layers_trainable

__all__ = [
    "OUTPUT_EMBEDDING_NAMES",
    "TRAINABLE_HEAD_NAMES",
    "VISION_MODULE_NAMES",
    "adapters_disabled",
    "apply_lora",
    "build_lora_config",
    "count_parameters",
    "find_lora_target_modules",
    "find_trainable_heads",
    "is_peft_model",
    "reference_is_base_with_adapters_disabled",
]

logger = logging.getLogger(__name__)

#: Leaf names of output-embedding (LM head) layers, in addition to what `get_output_embeddings()` returns.
OUTPUT_EMBEDDING_NAMES: tuple[str, ...] = ("lm_head", "embed_out")
#: Module names (any component of the dotted path) of heads that are trained in full, never LoRA-adapted.
#: A name containing both "modulation" and "head" (`modulation_head`, `modulation_nn_head`) counts as well; a module
#: named just `modulation` may be a whole transformer (a modulation *model*) and is adapted like any backbone.
TRAINABLE_HEAD_NAMES: tuple[str, ...] = ("score", "v_head", "value_head", "reward_head", "classifier")
_MODULATION_SUBSTRING = "modulation"
#: Module names (any component of the dotted path) of vision / audio encoders and of their projectors.
VISION_MODULE_NAMES: tuple[str, ...] = (
    "vision_tower",
    "vision_model",
    "vision_encoder",
    "visual",
    "image_encoder",
    "vision_embed_tokens",
    "multi_modal_projector",
    "mm_projector",
    "vision_projection",
    "visual_projection",
    "image_projection",
    "audio_tower",
    "audio_model",
    "audio_encoder",
)

_LORA_INTERNALS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "base_layer", "modules_to_save")


# ----------------------------------------------------------------------------------------------------- detection
def _is_adaptable_layer(module: nn.Module) -> bool:
    """True for the layer types LoRA adapts here: `nn.Linear` (bitsandbytes' `Linear4bit` / `Linear8bitLt` subclass
    it) and transformers' `Conv1D` (GPT-2, whose weight is stored transposed: `fan_in_fan_out=True`)."""
    if isinstance(module, nn.Linear):
        return True
    return _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return False
    return isinstance(module, Conv1D)


def _output_embedding_ids(model: nn.Module) -> set[int]:
    """`id()` of every module that some (sub)model reports as its output embedding."""
    ids: set[int] = set()
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if not callable(getter):
            continue
        try:
            out = getter()
        except (NotImplementedError, AttributeError, TypeError):
            continue
        if isinstance(out, nn.Module):
            ids.add(id(out))
    return ids


def _is_trainable_head_component(component: str) -> bool:
    return component in TRAINABLE_HEAD_NAMES or (_MODULATION_SUBSTRING in component and "head" in component)


def _compile_patterns(patterns: str | Iterable[str] | None) -> list[re.Pattern]:
    """Each pattern is a regex searched in the full module name; one that is not a valid regex is a plain substring."""
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error:
            compiled.append(re.compile(re.escape(pattern)))
    return compiled


def _exclusion_reason(name: str, module: nn.Module, output_ids: set[int], user: list[re.Pattern]) -> str | None:
    """Why module `name` must not get a LoRA adapter, or None when it may."""
    components = name.split(".")
    if id(module) in output_ids or components[-1] in OUTPUT_EMBEDDING_NAMES:
        return "output embedding"
    if any(_is_trainable_head_component(c) for c in components):
        return "trainable head (modules_to_save)"
    if any(c in VISION_MODULE_NAMES for c in components):
        return "vision/audio tower or projector"
    if any(c in _LORA_INTERNALS for c in components):
        return "existing adapter layer"
    if any(p.search(name) for p in user):
        return "matches `exclude`"
    return None


def _peft_list_matches(target: str, key: str) -> bool:
    """How PEFT matches one entry of a *list* `target_modules`: the exact name or a dotted suffix."""
    return key == target or key.endswith("." + target)


def _compress_targets(selected: Sequence[str], all_names: Sequence[str]) -> list[str] | str:
    """The shortest PEFT `target_modules` value that selects exactly `selected`.

    A leaf name (`q_proj`) is used when every module of the model ending in that leaf is selected, full names for
    the rest. If even the full names would match extra modules (a suffix of a longer path), an anchored regex of the
    escaped full names is returned instead (PEFT applies `re.fullmatch` to a string `target_modules`).
    """
    selected_set = set(selected)
    by_leaf: dict[str, list[str]] = {}
    for name in selected:
        by_leaf.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    targets: list[str] = []
    for leaf, names in sorted(by_leaf.items()):
        matched = {key for key in all_names if _peft_list_matches(leaf, key)}
        targets.extend([leaf] if matched == set(names) else sorted(names))
    matched_all = {key for key in all_names if any(_peft_list_matches(t, key) for t in targets)}
    if matched_all == selected_set:
        return targets
    return "(?:" + "|".join(re.escape(n) for n in sorted(selected_set)) + ")"


def find_lora_target_modules(
    model: nn.Module,
    exclude: str | Iterable[str] | None = None,
    *,
    return_full_names: bool = False,
) -> list[str] | str:
    """Find the linear layers of `model` that LoRA should adapt.

    Adaptable layers are `nn.Linear` (including bitsandbytes `Linear4bit` / `Linear8bitLt`) and transformers'
    `Conv1D`. Left out: the output embedding (`get_output_embeddings()`, `lm_head`, `embed_out`), trainable heads
    (`TRAINABLE_HEAD_NAMES`, `*modulation*head*`), vision/audio towers and projectors
    (`VISION_MODULE_NAMES`) and every module whose full name matches a pattern of `exclude`.

    PEFT accepts `target_modules` either as a list, where each entry matches a module whose full name equals it or
    ends with `"." + entry`, or as one regex string that must `fullmatch` the full name. Leaf names (`"q_proj"`) are
    PEFT's own convention: short, readable in `adapter_config.json` and valid for any depth of the same
    architecture, but ambiguous when the same leaf also names a module that must stay untouched (e.g. a `q_proj`
    inside a vision tower). So the result uses a leaf name where it selects exactly the wanted modules and full
    names (`"model.layers.0.self_attn.q_proj"`) where it would not; in the rare case that even a full name is the
    suffix of another module's path, an anchored regex string is returned.

    Args:
        model: any `nn.Module` (a transformers model, a value-head wrapper, a plain module).
        exclude: extra patterns to leave out: regexes searched in the full module name (so a plain substring such as
            `"mlp"` or `"layers.0."` works too; an invalid regex is taken literally).
        return_full_names: return the sorted full names of the chosen modules instead of PEFT's compact form.

    Returns:
        The value for `LoraConfig(target_modules=...)` (or the full names).

    Raises:
        ValueError: no adaptable layer is left; the message lists modules found and why they were left out.
    """
    user_patterns = _compile_patterns(exclude)
    output_ids = _output_embedding_ids(model)
    named = list(model.named_modules())
    selected: list[str] = []
    excluded: list[tuple[str, str]] = []
    for name, module in named:
        if not name or not _is_adaptable_layer(module):
            continue
        reason = _exclusion_reason(name, module, output_ids, user_patterns)
        if reason is None:
            selected.append(name)
        else:
            excluded.append((name, reason))
    if not selected:
        found = [f"{n or '<root>'} ({type(m).__name__})" for n, m in named[:8]]
        more = f" and {len(named) - 8} more" if len(named) > 8 else ""
        left_out = "; ".join(f"{n}: {r}" for n, r in excluded[:8]) or "none"
        raise ValueError(
            f"apply_lora(target_modules='auto') found no layer to adapt in {type(model).__name__}: LoRA adapts "
            f"nn.Linear / bitsandbytes Linear4bit/8bit / transformers Conv1D layers outside the output embedding, "
            f"the trainable heads and vision towers. Modules found: {', '.join(found)}{more}. Linear layers left "
            f"out: {left_out}. Pass `target_modules=[...]` explicitly or loosen `exclude`."
        )
    if return_full_names:
        return sorted(selected)
    return _compress_targets(selected, [n for n, _ in named if n])


def find_trainable_heads(model: nn.Module) -> list[str]:
    """Full names of the top-most modules named like a trainable head (`TRAINABLE_HEAD_NAMES`, or containing
    both "modulation" and "head") that hold parameters, e.g. `["score"]` for a reward model or `["v_head"]` for a
    value-head model.

    These go to PEFT's `modules_to_save`: a full-precision trainable copy, saved with the adapter, while the
    original stays in place for the adapters-disabled reference.

    Raises:
        ValueError: a head is quantized (bitsandbytes 4/8-bit weights cannot be trained in full); keep it out of
            quantization (`bnb_4bit_config(skip_modules=[...])`).
    """
    heads: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(h + ".") for h in heads):
            continue
        components = name.split(".")
        if not _is_trainable_head_component(components[-1]):
            continue
        if any(c in _LORA_INTERNALS for c in components):
            continue
        params = list(module.parameters())
        if not params:
            continue
        quantized = [type(p).__name__ for p in params if type(p).__name__ in ("Params4bit", "Int8Params")]
        if quantized:
            raise ValueError(
                f"The trainable head {name!r} is quantized ({quantized[0]}) and cannot be trained in full. Load the "
                f"model with this head kept in full precision, e.g. `bnb_4bit_config(skip_modules=[{name!r}])`, or "
                f"pass `modules_to_save=[]` to apply_lora to leave it frozen."
            )
        heads.append(name)
    return heads


def _infer_task_type(model: nn.Module) -> str | None:
    """PEFT task type from the model class name; None when it is not one of the usual heads."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "CAUSAL_LM"
    if name.endswith("ForConditionalGeneration") and getattr(getattr(model, "config", None), "vision_config", None):
        return "CAUSAL_LM"  # a vision-language model (Qwen2-VL, LLaVA, ...) generates text like a causal LM
    if name.endswith("ForSequenceClassification"):
        return "SEQ_CLS"
    if name.endswith("ForTokenClassification"):
        return "TOKEN_CLS"
    if name.endswith("ForQuestionAnswering"):
        return "QUESTION_ANS"
    return None


# ------------------------------------------------------------------------------------------------------ building
def build_lora_config(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "auto",
    exclude: str | Iterable[str] | None = None,
    modules_to_save: Sequence[str] | None = None,
    task_type: str | None = None,
    **lora_kwargs,
):
    """The `peft.LoraConfig` that `apply_lora` uses, for trainers that take a `peft_config` (TRL style).

    Same arguments as `apply_lora` (without `adapter_name`). With `target_modules="auto"` the targets come from
    `find_lora_target_modules(model, exclude)`; an explicit list or regex is passed to PEFT as is, with `exclude`
    turned into PEFT's `exclude_modules`. `fan_in_fan_out` is set to True when a target is a transformers `Conv1D`
    (GPT-2) unless given in `lora_kwargs`.
    """
    require_peft("LoRA")
    from peft import LoraConfig

    if r <= 0:
        raise ValueError(f"LoRA rank r must be positive, got {r}.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}.")
    if isinstance(target_modules, str) and target_modules == "auto":
        targets = find_lora_target_modules(model, exclude)
        exclude_modules = None
    else:
        if not target_modules:
            raise ValueError("target_modules is empty: pass 'auto', a list of module names or a regex string.")
        targets = target_modules if isinstance(target_modules, str) else list(target_modules)
        patterns = [p.pattern for p in _compile_patterns(exclude)]
        exclude_modules = f".*(?:{'|'.join(patterns)}).*" if patterns else None
    if "fan_in_fan_out" not in lora_kwargs:
        lora_kwargs["fan_in_fan_out"] = _targets_conv1d(model, targets)
    if modules_to_save is None:
        modules_to_save = find_trainable_heads(model)
    if task_type is None:
        task_type = _infer_task_type(model)
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        exclude_modules=exclude_modules,
        modules_to_save=list(modules_to_save) or None,
        task_type=task_type,
        **lora_kwargs,
    )


def _targets_conv1d(model: nn.Module, targets: list[str] | str) -> bool:
    for name, module in model.named_modules():
        if not name or not _is_conv1d(module):
            continue
        if isinstance(targets, str):
            if re.fullmatch(targets, name):
                return True
        elif any(_peft_list_matches(t, name) for t in targets):
            return True
    return False


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """`(trainable, total)` parameter counts; a bitsandbytes 4-bit weight counts its unpacked size."""
    getter = getattr(model, "get_nb_trainable_parameters", None)
    if callable(getter):  # PEFT's own count handles Params4bit packing
        return tuple(getter())
    trainable = total = 0
    for param in model.parameters():
        n = param.numel() * (2 * param.element_size() if type(param).__name__ == "Params4bit" else 1)
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


def apply_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "auto",
    exclude: str | Iterable[str] | None = None,
    modules_to_save: Sequence[str] | None = None,
    task_type: str | None = None,
    adapter_name: str = "default",
    **lora_kwargs,
):
    """Wrap `model` in a `peft.PeftModel` with LoRA adapters; only the adapters and the trainable heads train.

    The model is modified in place (PEFT injects the adapter layers) and returned wrapped. The base weights are
    frozen; the reference policy of a LoRA run is this model with its adapters disabled (see the module docstring
    and `reference_is_base_with_adapters_disabled`). The chosen targets, heads and parameter counts are logged at
    INFO level on the `trl_ext.models.lora` logger.

    For a 4-bit or 8-bit model (`trl_ext.models.quantization.load_model(..., load_in_4bit=True,
    prepare_for_training=True)`), the adapters wrap the bitsandbytes layers: that is QLoRA.

    Args:
        model: a transformers model or any `nn.Module`; must not already be a `PeftModel`.
        r: LoRA rank.
        alpha: LoRA scaling numerator (`lora_alpha`; the update is scaled by `alpha / r`).
        dropout: dropout on the LoRA branch input.
        target_modules: `"auto"` (see `find_lora_target_modules`) or PEFT's own form: a list of names / suffixes or
            a regex string.
        exclude: patterns of module names to leave out (regexes searched in the full name, or plain substrings).
        modules_to_save: modules trained in full and saved with the adapter. `None` (default): the trainable heads
            found by `find_trainable_heads` (`score`, `v_head`, `value_head`, `reward_head`, `classifier`,
            `*modulation*head*`). A list is used as given (`[]`: none). Note that PEFT itself always adds `classifier`
            and `score` for `task_type="SEQ_CLS"`. For a modulation model whose fresh head *is* `lm_head`, pass
            `modules_to_save=["lm_head"]`.
        task_type: PEFT task type (`"CAUSAL_LM"`, `"SEQ_CLS"`, ...); `None` infers it from the class name
            (`*ForCausalLM` / `*LMHeadModel` and vision-language `*ForConditionalGeneration` → `CAUSAL_LM`,
            `*ForSequenceClassification` → `SEQ_CLS`), else none.
        adapter_name: name of the adapter.
        **lora_kwargs: any other `peft.LoraConfig` argument (`use_rslora`, `use_dora`, `init_lora_weights`,
            `layers_to_transform`, `bias`, `fan_in_fan_out`, ...).

    Returns:
        The `peft.PeftModel`.

    Raises:
        ValueError: the model is already a PEFT model, or no layer to adapt is found.
    """
    require_peft("LoRA")
    from peft import get_peft_model

    if is_peft_model(model) or getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError(
            f"{type(model).__name__} already carries PEFT adapters; add another one with "
            f"`model.add_adapter(name, config)` (config from `build_lora_config(model.get_base_model())`) or merge "
            f"the existing ones first (`model.merge_and_unload()`)."
        )
    config = build_lora_config(
        model,
        r=r,
        alpha=alpha,
        dropout=dropout,
        target_modules=target_modules,
        exclude=exclude,
        modules_to_save=modules_to_save,
        task_type=task_type,
        **lora_kwargs,
    )
    keep_4bit_layers_trainable(model)  # QLoRA: see its docstring (bitsandbytes' CPU inference repacking)
    peft_model = get_peft_model(model, config, adapter_name=adapter_name)
    trainable, total = count_parameters(peft_model)
    saved = sorted(set(peft_model.peft_config[adapter_name].modules_to_save or []))
    logger.info(
        "LoRA adapter %r (r=%d, alpha=%s, dropout=%s) on %s: target_modules=%s; modules_to_save=%s; "
        "trainable params %d / %d (%.3f%%). Reference policy = this model with adapters disabled.",
        adapter_name,
        r,
        alpha,
        dropout,
        type(model).__name__,
        config.target_modules if isinstance(config.target_modules, str) else sorted(config.target_modules),
        saved,
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return peft_model


# --------------------------------------------------------------------------------------------- reference policy
def is_peft_model(model: nn.Module) -> bool:
    """True when `model` (possibly wrapped by DDP / `torch.compile`) is a `peft.PeftModel`."""
    try:
        require_peft("LoRA")
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a hard dependency
        return False
    return isinstance(unwrap_model(model, peft=False), PeftModel)


def reference_is_base_with_adapters_disabled(model: nn.Module, ref_model: nn.Module | None = None) -> bool:
    """Decide and log which reference policy a trainer uses (QUALITY_BARS item 8).

    Returns True when the reference must be computed by `model` itself under `adapters_disabled(model)`: `model` is
    a PEFT model and no `ref_model` was passed. Returns False when an explicit `ref_model` is given (it is used
    as is, also for a PEFT policy) or when `model` has no adapters (the trainer then needs its own frozen copy).
    The decision is logged at INFO level, so every LoRA run states its reference.
    """
    peft = is_peft_model(model)
    if ref_model is not None:
        logger.info(
            "Reference policy: the explicitly passed %s%s.",
            type(unwrap_model(ref_model, peft=False)).__name__,
            " (not the LoRA base with adapters disabled)" if peft else "",
        )
        return False
    if peft:
        logger.info(
            "Reference policy: the LoRA base model with adapters disabled (peft `disable_adapter()`; "
            "modules_to_save heads use their original copies). Pass ref_model to use another reference."
        )
        return True
    logger.info("Reference policy: no adapters and no ref_model given; a frozen copy of the initial model is needed.")
    return False


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: run `model` (a PEFT model, possibly DDP-wrapped) as its base model, all adapters off.

    Inside, the outputs are those of the model before `apply_lora` (LoRA layers return their base layer's output,
    `modules_to_save` heads their original copies). Yields the unwrapped PEFT model. Gradients are not disabled:
    wrap it in `torch.no_grad()` for a reference forward pass.
    """
    inner = unwrap_model(model, peft=False)
    if not is_peft_model(inner):
        raise TypeError(
            f"adapters_disabled needs a peft.PeftModel, got {type(inner).__name__}: a model without adapters has no "
            "base to fall back to; pass an explicit reference model instead."
        )
    with inner.disable_adapter():
        yield inner
