"""Whether a model keeps the rows of a packed ("padding-free") batch apart: :func:`check_padding_free`.

A padding-free forward concatenates the real tokens of all rows into one sequence of shape ``(1, N)``, passes
``position_ids`` that restart at 0 for every row and **no attention mask**. Transformers 5 detects the restarts and
gives every row its own causal block: ``sdpa``, ``eager`` and ``flex_attention`` through the block-diagonal mask of
``create_causal_mask``, the ``flash_attention_*`` implementations through their varlen kernels (``cu_seqlens`` from
the position ids; on GPU this is where padding-free saves the most). A model whose attention does not go through
that machinery (custom attention functions, remote code building its own mask) would let rows attend to each other
and train silently wrong, so trainers run this check once, at construction, when ``padding_free=True``.

Note on cost: with ``sdpa``/``eager`` the block-diagonal mask is dense, ``N × N`` for ``N`` packed tokens: packing
removes the padding from every other layer, but the attention itself then costs ``N²`` instead of ``Σ_b L_b²``.
It pays off for short rows of unequal length; for long rows use flash-attention (varlen) or keep padding.
"""

from __future__ import annotations

import torch
from torch import nn

from ..utils import eval_mode, unwrap_model
from .reward import _decoder_parts, get_token_scores

__all__ = ["check_padding_free"]

_LENGTHS = (5, 3)


def _per_token(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor):
    if _decoder_parts(model) is not None:  # a value / reward model: its per-token head outputs
        return get_token_scores(model, ids, mask, position_ids=position_ids)
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits


def _attn_implementation(model: nn.Module) -> str | None:
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None)


@torch.no_grad()
def check_padding_free(model: nn.Module, what: str = "model") -> None:
    """Raise a ``ValueError`` unless ``model`` gives two rows packed into one sequence (per-row ``position_ids``, no
    attention mask) the same per-token outputs as each row alone.

    ``model``: a causal LM (plain, PEFT, value-head, modulated) or a decoder value / reward model (per-token head on
    its backbone). ``what`` names it in the error. Runs two tiny forward passes in eval mode.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is None:
        param = next(model.parameters(), None)
        device, vocab = (param.device if param is not None else "cpu"), 2
    else:
        device, vocab = weight.device, max(int(weight.shape[0]), 1)
    rows = [(torch.arange(n, device=device) * (7 + i) + 3 + i).remainder(vocab) for i, n in enumerate(_LENGTHS)]
    positions = [torch.arange(n, device=device) for n in _LENGTHS]
    problem = None
    try:
        with eval_mode(model):
            alone = [_per_token(model, r[None], torch.ones_like(r)[None], p[None]) for r, p in zip(rows, positions)]
            packed = _per_token(model, torch.cat(rows)[None], None, torch.cat(positions)[None])
    except Exception as err:  # noqa: BLE001 - reported below
        problem = f"its forward pass failed on packed rows ({type(err).__name__}: {err})"
    else:
        expected = torch.cat(alone, dim=1).float()
        packed = packed.float().to(expected.device)
        scale = max(1.0, float(expected.abs().max()))
        if packed.shape != expected.shape or not torch.allclose(packed, expected, rtol=1e-3, atol=1e-3 * scale):
            problem = "its outputs on two rows packed into one sequence differ from the rows run separately"
    if problem is not None:
        raise ValueError(
            f"padding_free=True: the {what} ({type(unwrap_model(model)).__name__}, attn_implementation="
            f"{_attn_implementation(model)!r}) does not keep packed rows apart: {problem}. Use a model whose "
            "attention mask comes from transformers' create_causal_mask with attn_implementation='sdpa', 'eager', "
            "'flex_attention' or 'flash_attention_2', or set padding_free=False."
        )
