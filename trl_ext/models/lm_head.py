"""A causal LM seen as *trunk + linear LM head*, so that token log-probs can be computed from hidden states in chunks
(`trl_ext.ops.logprobs_from_hidden`) without ever building the ``(B, T, V)`` logits.

:func:`split_lm_head` returns the split of a model when scoring through it is *exactly* what the model's own forward
computes — ``logits = lm_head(backbone(...).last_hidden_state)`` — and ``None`` otherwise, in which case callers
use the model's logits as before. A split is given for:

- plain Hugging Face causal LMs (``*ForCausalLM``, ``GPT2LMHeadModel``, ...: a ``base_model`` backbone and an
  ``nn.Linear`` output embedding, tied or not);
- the same inside a PEFT model (LoRA-type adapters: they live inside the backbone's layers, so calling the
  backbone runs them, and ``disable_adapter()`` switches them off there too);
- `AutoModelForCausalLMWithValueHead` (plain or PEFT-wrapped): the split also carries the value head, applied to
  the same last hidden state as the model's forward does.

No split (logits path) for: modulated policies (`ModulatedCausalLM`, whose distribution is not ``softmax(head(h))``),
vision-language models, configs whose forward rescales or soft-caps the logits (``final_logit_softcapping``,
``logit_scale``, ``logits_scaling``, ...), prompt-learning PEFT methods (they change the inputs in the PEFT
forward), LM heads that are not a plain hook-free ``nn.Linear`` (LoRA on the head, quantized or offloaded heads),
and weights that are not plain local tensors (DeepSpeed ZeRO-3 partitions, FSDP ``DTensor`` shards, meta tensors).
Finally, the first time a model is split, a 4-token probe checks that ``lm_head(backbone(x))`` equals the model's
own logits; a model whose forward does something else (an unknown architecture's logit scaling, ...) keeps the
logits path. The verdict is cached per model object.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..ops.logprobs import DEFAULT_CHUNK_SIZE, logprobs_from_hidden
from ..utils import eval_mode
from .lora import is_peft_model

__all__ = ["LMHeadSplit", "hidden_chunk_size", "split_lm_head"]

logger = logging.getLogger(__name__)

# Config attributes that transform the logits after the LM head (as in TRL's `add_fused_lm_head`).
_LOGIT_TRANSFORM_ATTRS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
_PROBE_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Logits held per chunk of :meth:`LMHeadSplit.token_logprobs` (16M fp32 values = 64 MiB; 341 rows of a 49,152-token
#: vocabulary): large enough for efficient matrix products, small next to the activations of a long sequence.
CHUNK_ELEMENTS = 2**24


def hidden_chunk_size(vocab_size: int, chunk_size: int | None = DEFAULT_CHUNK_SIZE) -> int:
    """Rows per chunk of the hidden-state log-probs: ``chunk_size`` capped at ``CHUNK_ELEMENTS / V`` (at least 16)."""
    cap = max(16, CHUNK_ELEMENTS // max(int(vocab_size), 1))
    return cap if chunk_size is None else max(1, min(int(chunk_size), cap))


@dataclass(frozen=True)
class LMHeadSplit:
    """A causal LM as ``backbone`` (to the final norm) + ``head`` (``nn.Linear``), plus an optional value head.

    ``logits = head(hidden_states(...))`` exactly as the model's forward computes them.
    """

    backbone: nn.Module
    head: nn.Linear
    value_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    """``hidden (..., H) -> (..., 1)`` of an `AutoModelForCausalLMWithValueHead`, else ``None``."""

    def hidden_states(self, **kwargs) -> torch.Tensor:
        """``(B, L, H)`` last hidden states (after the final norm) for the causal-LM keyword arguments ``kwargs``
        (``input_ids``, ``attention_mask``, ``position_ids``, ``use_cache``, ...; ``logits_to_keep`` is dropped)."""
        kwargs.pop("logits_to_keep", None)
        out = self.backbone(**kwargs, return_dict=True)
        return out.last_hidden_state

    def token_logprobs(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        return_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``log_softmax(head(hidden) / T)`` at ``labels`` and, optionally, the entropies (no gradient), without the
        ``(..., V)`` logits: ``(logprobs, entropy or None)``, fp32, shaped like ``labels``, 0 where ``labels == -100``.

        ``hidden`` ``(..., H)``, ``labels`` ``(...)``: the label at a position is the token its hidden state
        predicts. Only the labelled positions are projected (`trl_ext.ops.logprobs_from_hidden`, chunked)."""
        weight, bias = self.head.weight, self.head.bias
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        valid = labels != -100
        computed = logprobs_from_hidden(
            hidden[valid], weight, labels[valid], bias, temperature=temperature,
            chunk_size=hidden_chunk_size(weight.shape[0], chunk_size), return_entropy=return_entropy,
        )  # fmt: skip
        logprobs, entropy = computed if return_entropy else (computed, None)

        def scatter(x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(valid.shape).masked_scatter(valid, x)

        return scatter(logprobs), (scatter(entropy) if entropy is not None else None)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, L)`` fp32 values of a value-head model from :meth:`hidden_states`' output."""
        if self.value_head is None:
            raise ValueError("This model has no value head.")
        return self.value_head(hidden).squeeze(-1).float()


def has_logit_transform(text_config) -> bool:
    """Whether a config's forward rescales or soft-caps the logits after the LM head."""
    values = [getattr(text_config, name, None) for name in _LOGIT_TRANSFORM_ATTRS]
    return getattr(text_config, "final_logit_softcapping", None) is not None or any(v not in (None, 1) for v in values)


def _plain_weight(weight: torch.Tensor) -> bool:
    """A local, materialised tensor (not a ZeRO-3 partition, an FSDP ``DTensor`` shard or a meta tensor)."""
    if hasattr(weight, "ds_id") or weight.device.type == "meta":
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return True
    return not isinstance(weight, DTensor)


def _plain_linear(head: nn.Module | None) -> bool:
    if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks or hasattr(head, "_hf_hook"):
        return False
    if "forward" in vars(head):  # a forward replaced on the instance (e.g. by a wrapping library)
        return False
    return all(_plain_weight(p) for p in head.parameters())


@torch.no_grad()
def _probe(lm: nn.Module, backbone: nn.Module, head: nn.Linear) -> bool:
    """``head(backbone(x)) == lm(x).logits`` on a 4-token input, in eval mode."""
    embeddings = lm.get_input_embeddings()
    vocab = int(getattr(embeddings, "num_embeddings", 0) or head.out_features)
    device = embeddings.weight.device if getattr(embeddings, "weight", None) is not None else head.weight.device
    ids = (torch.arange(4, device=device) * 7 + 1).remainder(max(vocab, 1)).unsqueeze(0)
    try:
        with eval_mode(lm):
            full = lm(input_ids=ids, use_cache=False).logits
            split = head(backbone(input_ids=ids, use_cache=False, return_dict=True).last_hidden_state.to(device))
    except Exception as err:  # noqa: BLE001 - any failure means: do not use the split
        logger.info("%s: hidden-state log-probs disabled (the probe failed: %s).", type(lm).__name__, err)
        return False
    full, split = full.float(), split.float().to(full.device)
    if full.shape != split.shape:
        return False
    scale = max(1.0, float(full.abs().max()))
    return bool(torch.allclose(full, split, rtol=1e-3, atol=1e-3 * scale))


def _verdict(lm: nn.Module, backbone: nn.Module, head: nn.Linear) -> bool:
    verdict = _PROBE_VERDICTS.get(lm)
    if verdict is None:
        verdict = _PROBE_VERDICTS[lm] = _probe(lm, backbone, head)
        if not verdict:
            logger.info(
                "%s: its logits are not lm_head(backbone(x)); token log-probs are computed from its logits.",
                type(lm).__name__,
            )
    return verdict


def split_lm_head(model: nn.Module) -> LMHeadSplit | None:
    """The :class:`LMHeadSplit` of ``model`` (see the module docs for what qualifies), or ``None``.

    ``model`` is the module a caller would run (not a DDP / DeepSpeed / FSDP wrapper: those keep the logits path).
    """
    from transformers import PreTrainedModel

    from .modulated import ModulatedCausalLM
    from .value_head import AutoModelForCausalLMWithValueHead

    lm = model
    if is_peft_model(lm):
        config = getattr(lm, "active_peft_config", None)
        if config is None or getattr(config, "is_prompt_learning", False):
            return None
        lm = lm.get_base_model()
    value_head = None
    if isinstance(lm, AutoModelForCausalLMWithValueHead):
        value_head, lm = lm.score, lm.pretrained_model
    if not isinstance(lm, PreTrainedModel) or isinstance(lm, ModulatedCausalLM):
        return None
    config = lm.config
    if getattr(config, "vision_config", None) is not None or has_logit_transform(config.get_text_config()):
        return None
    backbone = lm.base_model
    head = lm.get_output_embeddings()
    if backbone is lm or not _plain_linear(head):
        return None
    if not _verdict(lm, backbone, head):
        return None
    return LMHeadSplit(backbone=backbone, head=head, value_head=value_head)
