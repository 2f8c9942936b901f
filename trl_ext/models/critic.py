"""Separate value models (critics) for PPO: loading and per-token values.

A critic is a ``*ForSequenceClassification`` model with one label (or an OpenRLHF-style
:class:`~trl_ext.models.reward.ValueHeadRewardModel`) whose ``score`` head is applied to *every* hidden state:
``V_t = w·h_t (+ b)``. :func:`load_critic` builds one from

- a pretrained causal LM: the trunk is loaded from the checkpoint and a fresh ``score`` head is drawn from
  ``N(0, σ²)`` with ``σ = 1/sqrt(hidden_size + 1)`` (the initialisation of the original research code), or
- a sequence-classification / reward checkpoint: its trained head is kept (a common PPO choice: critic from the RM).

:func:`get_token_values` returns the ``(B, T)`` values, positions computed from the attention mask.
"""

from __future__ import annotations

import copy
import logging
import math
import os

import torch
from torch import nn

from ..utils import unwrap_model
from .quantization import resolve_dtype
from .reward import (
    _HUB_KWARGS,
    _decoder_parts,
    _load_sequence_classifier,
    _load_value_head_model,
    _tensor_shapes,
    _weight_files,
    get_token_scores,
)

logger = logging.getLogger(__name__)

__all__ = ["default_value_head_std", "get_token_values", "init_value_head", "load_critic"]


def default_value_head_std(hidden_size: int) -> float:
    """``1 / sqrt(hidden_size + 1)``: the std of a fresh value head, i.e. variance ``1/(h+1)``."""
    return 1.0 / math.sqrt(hidden_size + 1)


@torch.no_grad()
def init_value_head(head: nn.Module, std: float | None = None) -> float:
    """Draw the head's weight from ``N(0, std²)`` (default: :func:`default_value_head_std`), zero its bias.

    Returns the std used.
    """
    weight = head.weight
    std = default_value_head_std(weight.shape[-1]) if std is None else float(std)
    if not std > 0:
        raise ValueError(f"value_head_init_std must be > 0, got {std}.")
    weight.normal_(mean=0.0, std=std)
    if getattr(head, "bias", None) is not None:
        head.bias.zero_()
    return std


def _log_new_head(model: nn.Module, std: float, source: str) -> None:
    hidden = unwrap_model(model).score.weight.shape[-1]
    logger.info(
        "Critic from %s: the value head `score` (Linear(%d, 1)) is NEW, not loaded from the checkpoint; initialised "
        "N(0, %.4g^2). Values are meaningless until it is trained.",
        source,
        hidden,
        std,
    )


def _critic_from_causal_lm(lm: nn.Module, value_head_init_std: float | None) -> nn.Module:
    """A ``*ForSequenceClassification`` (one label) whose trunk is a copy of ``lm``'s and whose head is new."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(lm.config)
    config.num_labels = 1
    critic = AutoModelForSequenceClassification.from_config(config)
    trunk = getattr(lm, lm.base_model_prefix)
    critic.get_submodule(critic.base_model_prefix).load_state_dict(trunk.state_dict())
    ref = next(lm.parameters())
    critic.to(device=ref.device, dtype=ref.dtype)
    std = init_value_head(critic.score, value_head_init_std)
    _log_new_head(critic, std, type(lm).__name__)
    return critic


def load_critic(
    name_or_path_or_model,
    *,
    value_head_init_std: float | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    value_head_prefix: str | None = None,
    trust_remote_code: bool = False,
    **kwargs,
) -> nn.Module:
    """Load or build a value model whose ``score`` head gives one value per token.

    Args:
        name_or_path_or_model: a folder / Hub id, or an already loaded model. A causal LM gets a new head on its
            trunk (the trunk weights are those of the LM); a sequence classifier (e.g. a reward model) or a
            ``ValueHeadRewardModel`` keeps its head.
        value_head_init_std: std of a new head; default ``1/sqrt(hidden_size + 1)``. Ignored when the head is loaded.
        dtype: load dtype; default float32 on CPU, the checkpoint's dtype elsewhere.
        device: device to move the critic to.
        value_head_prefix: load an OpenRLHF-style critic whose head is stored as ``<prefix>.weight``.
        trust_remote_code: passed to ``from_pretrained``.
        **kwargs: further ``from_pretrained`` arguments (``revision``, ``attn_implementation``, ...).

    Returns:
        The critic, in train mode (it is trained by PPO). Read values with :func:`get_token_values`.
    """
    if isinstance(name_or_path_or_model, nn.Module):
        model = name_or_path_or_model
        if _decoder_parts(model) is None:
            model = _critic_from_causal_lm(unwrap_model(model), value_head_init_std)
        elif unwrap_model(model).score.weight.shape[0] != 1:
            raise ValueError("A critic needs a single-output score head; this model has several labels.")
        if device is not None:
            model.to(device)
        return model

    from transformers import AutoConfig

    name_or_path = os.fspath(name_or_path_or_model)
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **hub_kwargs)
    dtype = resolve_dtype(dtype, device_map=device if device is not None else "cpu")
    load_kwargs = {"trust_remote_code": trust_remote_code, **kwargs, "dtype": dtype}
    prefix = value_head_prefix or getattr(config, "value_head_prefix", None)
    if prefix is not None:
        files = _weight_files(name_or_path, hub_kwargs)
        model = _load_value_head_model(name_or_path, prefix, files, _tensor_shapes(files), config, load_kwargs)
    else:
        model, head_is_new = _load_sequence_classifier(name_or_path, {}, config, load_kwargs, allow_new_head=True)
        if head_is_new:
            std = init_value_head(model.score, value_head_init_std)
            _log_new_head(model, std, name_or_path)
        else:
            logger.info("Critic from %s: value head `score` loaded from the checkpoint.", name_or_path)
    if device is not None:
        model.to(device)
    return model.train()


def get_token_values(
    critic: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token values ``V_{b,t} = head(h_{b,t})`` as float32 ``(B, T)``, zero on padding positions.

    Positions are computed from the mask, so left padding gives the same values as no padding. ``V_t`` is the
    value of the prefix ending at token ``t``; aligning it with actions (PPO reads ``V`` at the token *before* each
    action) is the caller's job. Gradients flow. Packed rows (padding-free): ``attention_mask=None`` and the rows'
    ``position_ids`` ``(1, N)`` (restarting at 0 for every row).
    """
    values = get_token_scores(critic, input_ids, attention_mask, position_ids=position_ids)
    if values.shape[-1] != 1:
        raise ValueError(f"A critic needs a single-output head; got {values.shape[-1]} outputs.")
    if attention_mask is None:
        return values[..., 0].float()
    return values[..., 0].float() * (attention_mask != 0).to(torch.float32)
