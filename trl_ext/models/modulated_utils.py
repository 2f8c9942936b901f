"""Helpers of `trl_ext.models.modulated`: modulation kinds and heads, position selection, fused-head statistics,
recognising TRL's ``add_fused_lm_head`` patch, and loading a saved modulation's weights."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..ops.logprobs import entropy_from_logits

__all__ = [
    "MODULATION_KINDS",
    "build_modulation_head",
    "fused_token_outputs",
    "keep_positions",
    "load_modulation_state_dict",
    "normalize_modulation_kind",
    "split_hub_kwargs",
]

# Arguments that locate files: all of them apply to the modulation repo; all but `revision`/`subfolder` are also
# passed on to the base model's `from_pretrained`.
_HUB_KEYS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
_MODULATION_ONLY_KEYS = ("revision", "subfolder")


MODULATION_KINDS = ("model", "linear_head", "mlp_head")
_KIND_ALIASES = {"nn_head": "mlp_head", "mlp": "mlp_head", "linear": "linear_head", "modulation_model": "model"}


def normalize_modulation_kind(kind: str) -> str:
    """Canonical modulation kind: accepts ``model``/``linear_head``/``mlp_head``, ``nn_head`` and the
    ``modulation_<kind>`` parameterisation names of docs/algorithms.md §6. Raises ``ValueError`` listing the
    options."""
    name = str(kind)
    if name.startswith("modulation_") and name != "modulation_model":
        name = name[len("modulation_") :]
    name = _KIND_ALIASES.get(name, name)
    if name not in MODULATION_KINDS:
        raise ValueError(
            f"Unknown modulation kind {kind!r}; choose one of {MODULATION_KINDS} (aliases: 'nn_head' = 'mlp_head', "
            "and the parameterisation names 'modulation_model', 'modulation_linear_head', 'modulation_nn_head')."
        )
    return name


@torch.no_grad()
def build_modulation_head(
    kind: str,
    hidden_size: int,
    vocab_size: int,
    init_scale_divider: float = 1.0,
    base_head: nn.Module | None = None,
) -> nn.Module:
    """The trainable head: ``Linear(h, V)`` (kinds ``model``/``linear_head``) or ``Linear(h,h)–ReLU–Linear(h,h)–
    ReLU–Linear(h,V)`` (``mlp_head``), created in fp32 on the CPU with the global torch RNG.

    The last layer is ``W = xavier_normal(V×h)/d``, ``b = 0``; with ``base_head`` given, ``W = W_base/d`` and
    ``b = b_base/d`` (zero when the base head has no bias). Earlier MLP layers keep PyTorch's default init.
    """
    kind = normalize_modulation_kind(kind)
    last = nn.Linear(hidden_size, vocab_size, bias=True)
    if base_head is not None:
        if kind == "mlp_head":
            raise ValueError("init from the base head is only meaningful for 'model' and 'linear_head'.")
        weight = getattr(base_head, "weight", None)
        if weight is None or tuple(weight.shape) != (vocab_size, hidden_size):
            raise ValueError(
                f"Cannot initialise the modulation head from the base head: expected a weight of shape "
                f"({vocab_size}, {hidden_size}), got {None if weight is None else tuple(weight.shape)}."
            )
        last.weight.copy_(weight.float() / init_scale_divider)
        bias = getattr(base_head, "bias", None)
        last.bias.copy_(bias.float() / init_scale_divider if bias is not None else torch.zeros(vocab_size))
    else:
        nn.init.xavier_normal_(last.weight)
        last.weight.div_(init_scale_divider)
        nn.init.zeros_(last.bias)
    if kind == "mlp_head":
        return nn.Sequential(
            nn.Linear(hidden_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, hidden_size), nn.ReLU(), last
        )
    return last


def keep_positions(x: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """``x[:, -k:]`` for an int ``k > 0``, ``x`` for ``0``, ``x[:, idx]`` for an index tensor (HF semantics)."""
    if isinstance(logits_to_keep, int):
        return x if logits_to_keep == 0 else x[:, -logits_to_keep:]
    return x[:, logits_to_keep]


@torch.no_grad()
def fused_token_outputs(
    scores: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> dict[str, torch.Tensor]:
    """Per-token statistics of ``softmax(z)``, ``z = scores / T``, as TRL's ``FusedCausalLMOutput`` defines them.

    Args:
        scores: ``(N, V)`` unnormalised log-probs (fp32), here ``log_softmax(ℓ^p) + m``.
        labels: ``(N,)`` token ids.

    Returns:
        Each ``(N,)``, without gradient: ``entropy = −Σ_v p_v log p_v``, ``log_sum_sq_probs = log Σ_v p_v²``,
        ``mean_logits = mean_v log_softmax(scores)_v / T`` (the mean of the policy's output logits ``log q``,
        temperature-scaled; fp32) and ``is_top1 = [argmax_v z_v = label]`` (bool). Computed ``chunk_size`` rows at
        a time.
    """
    entropy = entropy_from_logits(scores, temperature=temperature, chunk_size=chunk_size)
    log_sum_sq = torch.empty(scores.shape[0], dtype=entropy.dtype, device=scores.device)
    mean_logits = torch.empty_like(log_sum_sq)
    for start in range(0, scores.shape[0], chunk_size):
        end = min(start + chunk_size, scores.shape[0])
        chunk = scores[start:end].to(entropy.dtype)
        log_p = torch.log_softmax(chunk / temperature, dim=-1)
        log_sum_sq[start:end] = torch.logsumexp(2 * log_p, dim=-1)
        mean_logits[start:end] = (chunk.mean(-1) - torch.logsumexp(chunk, dim=-1)) / temperature
    return {
        "entropy": entropy,
        "log_sum_sq_probs": log_sum_sq,
        "mean_logits": mean_logits,
        "is_top1": scores.argmax(-1) == labels,
    }


def split_hub_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """``(hub_kwargs for the modulation repo, kwargs for the base model's from_pretrained)``."""
    hub = {k: kwargs[k] for k in _HUB_KEYS if k in kwargs}
    rest = {k: v for k, v in kwargs.items() if k not in _MODULATION_ONLY_KEYS}
    return hub, rest


def load_modulation_state_dict(path_or_repo: str | os.PathLike, hub_kwargs: dict) -> dict[str, torch.Tensor]:
    """Read ``model.safetensors`` (or the shards listed in ``model.safetensors.index.json``) of a saved modulation
    from a local folder or a Hub repo. Raises ``OSError`` when neither exists."""
    from safetensors.torch import load_file
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file

    def locate(filename):
        return cached_file(
            os.fspath(path_or_repo),
            filename,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **hub_kwargs,
        )

    single = locate(SAFE_WEIGHTS_NAME)
    if single is not None:
        return load_file(single)
    index = locate(SAFE_WEIGHTS_INDEX_NAME)
    if index is None:
        raise OSError(
            f"No {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in {path_or_repo}: not a saved ModulatedCausalLM."
        )
    with open(index, encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        shard_file = locate(shard)
        if shard_file is None:
            raise OSError(f"Shard {shard} listed in {SAFE_WEIGHTS_INDEX_NAME} is missing from {path_or_repo}.")
        state_dict.update(load_file(shard_file))
    return state_dict
