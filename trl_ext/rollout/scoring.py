"""The one forward pass that scores response tokens: :func:`forward_response` (sampling-time and reference log-probs,
the trainers' losses, held-out evaluation), with :func:`causal_lm_outputs` for callers that need the logits.

Two things keep it lean without changing what is computed:

- **No ``(B, T, V)`` logits** where the model allows it (:func:`~trl_ext.models.lm_head.split_lm_head`): the
  backbone gives the last hidden states and the log-probs (and entropies) of the response tokens come from them
  chunk by chunk (`trl_ext.ops.logprobs_from_hidden`). Always without gradients or with a frozen head; with
  gradients into the head when the logits would be large (:data:`HIDDEN_PATH_MIN_BYTES`), since the backward pass
  then recomputes them chunk by chunk.
  Modules that hold several models (`~trl_ext.trainers.common.model_parts.ModelParts`, possibly DDP-wrapped)
  compute them inside their own forward (``token_labels=``), so a distributed wrapper sees the LM head's use.
  Anything else (modulated policies, vision-language models, soft-capped logits, ...) takes the logits path.
- **Padding-free rows** (``padding_free=True``): the real tokens of all rows are packed into one sequence with
  per-row ``position_ids`` and no attention mask, which transformers' attention implementations (SDPA / eager /
  flex with a block-diagonal mask, flash-attention's varlen kernels) treat as independent sequences; results are
  scattered back to the padded layout. `trl_ext.models.padding_free.check_padding_free` tells whether a model
  supports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._deprecation import moved_names
from ..models.lm_head import LMHeadSplit, split_lm_head
from ..ops.logprobs import DEFAULT_CHUNK_SIZE, logprobs_from_logits
from ..ops.sequences import distinct_prompts, position_ids_from_attention_mask
from .probing import supports_logits_to_keep as _supports_logits_to_keep
from .vision import VisionInputs, add_vision_inputs

__all__ = ["HIDDEN_PATH_MIN_BYTES", "PolicyOutput", "causal_lm_outputs", "forward_response"]

#: With gradients into a trained LM head, the hidden-state path recomputes each chunk's logits in the backward pass:
#: one more LM-head matrix product (about +30% of the head's cost, measured on CPU). :func:`forward_response` then
#: takes it only when the fp32 logits it avoids would take at least this many bytes (a 49,152-token vocabulary: from
#: ~1,400 scored tokens per micro-batch). Without gradients, or with a frozen head (LoRA), it costs nothing extra and
#: is taken whenever the model allows it.
HIDDEN_PATH_MIN_BYTES = 256 * 2**20


@dataclass
class PolicyOutput:
    """Per-response-token outputs of :func:`forward_response`, all ``(B, T)`` and zero where the mask is zero."""

    logprobs: torch.Tensor
    values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def causal_lm_outputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, last: int, vision=None):
    """One forward pass of a causal LM over (possibly left-padded) rows, positions taken from the mask, no KV cache;
    only the ``last`` logits are computed when the model supports ``logits_to_keep`` (callers slice the last ``last``
    positions either way). ``vision``: the rows' image inputs (:func:`~trl_ext.rollout.vision.add_vision_inputs`).
    Returns the model's output."""
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_attention_mask(attention_mask),
        "use_cache": False,
    }
    if _supports_logits_to_keep(model):
        kwargs["logits_to_keep"] = last
    return model(**add_vision_inputs(kwargs, vision))


# ------------------------------------------------------------------------------------------------ routes
def _route(model: nn.Module) -> tuple[str, LMHeadSplit | None]:
    """``("parts", split)``: a module holding several models that scores from hidden states in its forward;
    ``("split", split)``: a plain model scored through its backbone and head here; ``("logits", None)``."""
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    splitter = getattr(inner, "lm_head_split", None)
    if callable(splitter):
        split = splitter()
        return ("parts", split) if split is not None else ("logits", None)
    if inner is not model:  # a DDP / DeepSpeed / FSDP wrapper of a plain model: its forward only
        return "logits", None
    split = split_lm_head(model)
    return ("split", split) if split is not None else ("logits", None)


@dataclass
class _Layout:
    """How the rows go into the model: padded (the last ``T + 1`` positions scored) or packed (all real tokens)."""

    kwargs: dict
    labels: torch.Tensor
    """The token each scored position predicts (``-100``: none): ``(B, T + 1)`` padded, ``(1, N)`` packed."""
    keep_all: torch.Tensor | None = None
    """Packed only: ``(B, L)`` the real tokens, in packing order."""

    @classmethod
    def build(cls, input_ids, attention_mask, T: int, padding_free: bool) -> _Layout:
        real = attention_mask != 0
        if not padding_free:
            kwargs = {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids_from_attention_mask(attention_mask),
                "use_cache": False,
            }
            ignored = torch.full_like(input_ids[:, :1], -100)
            labels = torch.cat([torch.where(real[:, -T:], input_ids[:, -T:], -100), ignored], dim=1)
            return cls(kwargs, labels)
        # Position p predicts the token at p + 1 when that one is a real response token (the last T columns).
        predicts = torch.zeros_like(real)
        predicts[:, -(T + 1) : -1] = real[:, -T:]
        targets = torch.full_like(input_ids, -100)
        targets[:, :-1] = input_ids[:, 1:]
        targets = torch.where(predicts, targets, -100)
        kwargs = {
            "input_ids": input_ids[real].unsqueeze(0),
            "attention_mask": None,
            "position_ids": position_ids_from_attention_mask(attention_mask)[real].unsqueeze(0),
            "use_cache": False,
        }
        return cls(kwargs, targets[real].unsqueeze(0), keep_all=real)

    def response(self, x: torch.Tensor, T: int) -> torch.Tensor:
        """``(B, T)`` of a per-position result ``x`` (``(B, K ≥ T + 1)`` padded, ``(1, N)`` packed) at the positions
        before the response tokens: those whose logits predict them, and the states ``V_t`` is read at."""
        if self.keep_all is not None:
            x = x.new_zeros(self.keep_all.shape).masked_scatter(self.keep_all.to(x.device), x[0])
        return x[:, -(T + 1) : -1]


def _scored(model, route, split, layout: _Layout, T, temperature, chunk_size, return_entropy, return_values, vision):
    """``(logprobs, entropy, value)`` per position of ``layout`` (value: per position, or ``None``)."""
    kwargs = dict(layout.kwargs)
    if layout.keep_all is None and route != "split" and _supports_logits_to_keep(model):
        kwargs["logits_to_keep"] = T + 1
    if route == "parts":
        out = model(
            **kwargs, token_labels=layout.labels, temperature=temperature, chunk_size=chunk_size,
            return_entropy=return_entropy,
        )  # fmt: skip
        return out.logprobs, getattr(out, "entropy", None), getattr(out, "value", None)
    if route == "split":
        hidden = split.hidden_states(**kwargs)
        K = layout.labels.shape[1]
        logprobs, entropy = split.token_logprobs(
            hidden[:, -K:], layout.labels, temperature=temperature, chunk_size=chunk_size,
            return_entropy=return_entropy,
        )  # fmt: skip
        value = split.values(hidden) if return_values and split.value_head is not None else None
        return logprobs, entropy, value
    out = model(**add_vision_inputs(kwargs, vision))
    # The last T + 1 positions, whole: slicing off the final one would make the logits non-contiguous, and every pass
    # over them (log-probs forward and backward, entropy) would then copy them. The final position has the ignored
    # label instead (log-prob exactly 0, no gradient).
    logits = out.logits[:, -layout.labels.shape[1] :]
    computed = logprobs_from_logits(
        logits, layout.labels.to(logits.device), temperature=temperature, chunk_size=chunk_size,
        return_entropy=return_entropy,
    )  # fmt: skip
    logprobs, entropy = computed if return_entropy else (computed, None)
    return logprobs, entropy, getattr(out, "value", None)


def _shares_prompt(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> bool:
    """Whether ``model`` (a module holding several models, maybe DDP-wrapped) can run the rows' repeated prompts
    once: it says it can, and some prompt (the columns before the last ``T``) repeats."""
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    can = getattr(inner, "can_share_prompt", None)
    if not callable(can) or input_ids.shape[1] <= T or not can():
        return False
    P = input_ids.shape[1] - T
    return distinct_prompts(input_ids[:, :P], attention_mask[:, :P]) is not None


def forward_response(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    return_values: bool = False,
    return_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vision: VisionInputs | None = None,
    padding_free: bool = False,
    hidden_logprobs: bool | None = None,
    shared_prefix: bool = False,
) -> PolicyOutput:
    """Log-probs (and values, entropies) of the last ``response_length`` tokens of ``prompt + response`` rows.

    The one forward pass used for sampling-time log-probs, reference log-probs and the training losses. Positions
    come from the mask. Log-probs are ``log_softmax(logits / temperature)`` at the tokens: from the last hidden states
    in chunks when the model allows it (see the module docs), else from the logits (only the last ``T + 1`` computed
    when the model supports ``logits_to_keep``), chunked (`trl_ext.ops.logprobs_from_logits`). ``V_t`` is the critic
    output at the position *before* token ``t`` (the state the action is taken in), zero where that position is
    padding (so it is kept one position past the response's last token). Gradients flow through log-probs and values
    (entropies are computed without gradient, for logging). ``vision``: the rows' image inputs (vision-language
    models). ``padding_free``: run the rows packed into one sequence (see the module docs; not with ``vision``).
    ``hidden_logprobs``: ``True`` scores from hidden states whenever the model allows it, ``False`` never, ``None``
    (default) without gradients or with a frozen LM head, and with gradients into the head when the logits would
    take ``HIDDEN_PATH_MIN_BYTES`` or more. ``shared_prefix``: when rows repeat a prompt, a module holding several
    models that can (``model.can_share_prompt()``, e.g. PPO's policy and critic) runs each distinct prompt once and
    its responses on the copied cache (see :mod:`~trl_ext.rollout.shared_prefix`; padded rows only).
    """
    T = response_length
    if padding_free and vision is not None:
        raise ValueError("padding_free=True does not support image inputs; use padding_free=False.")
    route, split = _route(model) if vision is None else ("logits", None)
    layout = _Layout.build(input_ids, attention_mask, T, padding_free)
    if route != "logits":
        logits_bytes = layout.labels.numel() * split.head.out_features * 4  # what the logits path would hold
        head_trains = any(p.requires_grad for p in split.head.parameters())
        if hidden_logprobs is None:  # a frozen head (LoRA): the gradient is formed in the forward pass, no recompute
            hidden_logprobs = not (torch.is_grad_enabled() and head_trains) or logits_bytes >= HIDDEN_PATH_MIN_BYTES
        route = route if hidden_logprobs else "logits"
        if shared_prefix and not padding_free and _shares_prompt(model, input_ids, attention_mask, T):
            layout.kwargs["shared_prompt_length"] = input_ids.shape[1] - T
    logprobs, entropy, value = _scored(
        model, route, split, layout, T, temperature, chunk_size, return_entropy, return_values, vision
    )
    keep = attention_mask[:, -T:] != 0
    logprobs = layout.response(logprobs, T).to(keep.device)
    result = PolicyOutput(logprobs=torch.where(keep, logprobs, torch.zeros_like(logprobs)))
    if entropy is not None:
        entropy = layout.response(entropy, T).to(keep.device)
        result.entropy = torch.where(keep, entropy, torch.zeros_like(entropy))
    if return_values:
        if value is None:
            raise ValueError(f"{type(model).__name__} returned no `value`: it has no critic to read values from.")
        # V_t is read after the token before t: it is a real state, kept, whenever that token is real (so also one
        # position past a response's last token, where TRL 1.12's score position trains it); zero elsewhere.
        state = attention_mask[:, -(T + 1) : -1] != 0
        value = layout.response(value.float(), T).to(state.device)
        result.values = torch.where(state, value, torch.zeros_like(value))
    return result


__getattr__ = moved_names(__name__, {"supports_logits_to_keep": "trl_ext.rollout.probing"})
