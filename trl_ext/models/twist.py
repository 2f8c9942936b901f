"""Twist values ``v_t = log ψ_t`` of the proposal parameterisations of docs/algorithms.md §6, as pure tensor functions.

A twist loss (`trl_ext.losses.twist`) trains ``q`` through ``v_t``, the log-twist evaluated at each sampled token
``s_t``. How ``v_t`` is read off the model depends on the parameterisation (``--parameterization`` in the research
code):

==============================  =====================================================================================
``policy_psi_q_p_s_t``          ``v_t = log q(s_t|s_<t) − sg[log p(s_t|s_<t)]``  (all paper runs)
``policy_psi_q_p_s_1_to_t``     ``v_t = Σ_{k≤t} mask_k·(log q(s_k|s_<k) − sg[log p(s_k|s_<k)])``
``policy_psi_unnorm``           ``v_t = ℓ^q_t[s_t] − sg[log p(s_t|s_<t)]`` (raw, unnormalised q-logit)
``modulation_model``,           ``v_t = m_t[s_t]``, the raw modulation logit of a `ModulatedCausalLM`
``modulation_linear_head``,     (``modulation_logits`` of its output); ``modulation_mlp_head`` is accepted for
``modulation_nn_head``          ``modulation_nn_head``
==============================  =====================================================================================

``sg`` is stop-gradient: ``p`` is the reference (frozen ``p_0`` or the current ``p_θ``) and never receives gradient
through ``v``. Shapes: any ``(...)`` per-token tensors (e.g. ``(B, T)`` or ``(P, N, T)``), time on the last axis.
The per-token functions are elementwise, so they also give all-vocabulary values from ``(..., V)`` log-probs (what
the DPG loss needs), and `psi_modulation` with ``tokens=None`` returns the full ``m``.

Alignment: ``v_t`` scores token ``s_t``, whose distribution is read at position ``t − 1`` of a causal LM's outputs;
shifting (``logits[:, :-1]`` against ``input_ids[:, 1:]``) is the caller's job, as in `trl_ext.ops.logprobs`.
"""

from __future__ import annotations

import torch

__all__ = [
    "MODULATION_PARAMETERIZATIONS",
    "POLICY_PARAMETERIZATIONS",
    "TWIST_PARAMETERIZATIONS",
    "modulation_kind_of",
    "psi_modulation",
    "psi_q_p_s_1_to_t",
    "psi_q_p_s_t",
    "psi_unnorm",
    "twist_values",
]

POLICY_PARAMETERIZATIONS = ("policy_psi_q_p_s_t", "policy_psi_q_p_s_1_to_t", "policy_psi_unnorm")
MODULATION_PARAMETERIZATIONS = (
    "modulation_model",
    "modulation_linear_head",
    "modulation_nn_head",
    "modulation_mlp_head",
)
TWIST_PARAMETERIZATIONS = POLICY_PARAMETERIZATIONS + MODULATION_PARAMETERIZATIONS
_MODULATION_KIND = {
    "modulation_model": "model",
    "modulation_linear_head": "linear_head",
    "modulation_nn_head": "mlp_head",
    "modulation_mlp_head": "mlp_head",
}


def _same_shape(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{names} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}.")


def psi_q_p_s_t(q_logprobs: torch.Tensor, p_logprobs: torch.Tensor) -> torch.Tensor:
    """``v_t = log q(s_t|s_<t) − sg[log p(s_t|s_<t)]`` (``policy_psi_q_p_s_t``), i.e. ``log ψ_t = log q_t/p_t``.

    Args:
        q_logprobs: ``(...)`` log-probs of the proposal at the sampled tokens, with gradient.
        p_logprobs: ``(...)`` log-probs of the reference ``p`` (detached here).

    Returns:
        ``(...)`` twist values; gradient flows to ``q_logprobs`` only.
    """
    _same_shape(q_logprobs, p_logprobs, "q_logprobs and p_logprobs")
    return q_logprobs - p_logprobs.detach()


def psi_q_p_s_1_to_t(q_logprobs: torch.Tensor, p_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``v_t = Σ_{k≤t} mask_k·(log q(s_k|s_<k) − sg[log p(s_k|s_<k)])`` (``policy_psi_q_p_s_1_to_t``).

    The log-ratio of the *prefix* probabilities ``log q(s_{1:t}) − log p(s_{1:t})``, accumulated along the last axis.
    Masked tokens contribute nothing (so padding anywhere in the window is harmless), and the result is ``0`` where
    ``mask`` is ``0``.

    Args:
        q_logprobs: ``(..., T)`` proposal log-probs, with gradient.
        p_logprobs: ``(..., T)`` reference log-probs (detached here).
        mask: ``(..., T)`` 1 on real tokens.

    Returns:
        ``(..., T)`` cumulative twist values.
    """
    _same_shape(q_logprobs, p_logprobs, "q_logprobs and p_logprobs")
    _same_shape(q_logprobs, mask, "q_logprobs and mask")
    keep = mask != 0
    step = torch.where(keep, q_logprobs - p_logprobs.detach(), torch.zeros_like(q_logprobs))
    return torch.where(keep, step.cumsum(dim=-1), torch.zeros_like(step))


def psi_unnorm(q_logits_at_token: torch.Tensor, p_logprobs: torch.Tensor) -> torch.Tensor:
    """``v_t = ℓ^q_t[s_t] − sg[log p(s_t|s_<t)]`` (``policy_psi_unnorm``): the proposal's raw logit at the sampled
    token (not its log-prob) minus the reference log-prob.

    Args:
        q_logits_at_token: ``(...)`` proposal logits gathered at the sampled tokens, with gradient.
        p_logprobs: ``(...)`` reference log-probs (detached here).
    """
    _same_shape(q_logits_at_token, p_logprobs, "q_logits_at_token and p_logprobs")
    return q_logits_at_token - p_logprobs.detach()


def psi_modulation(
    modulation_logits: torch.Tensor, tokens: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """``v_t = m_t[s_t]`` (``modulation_*``): the raw modulation logit of a `ModulatedCausalLM` at the sampled token.

    For a modulated policy ``q ∝ p·exp(m)`` the modulation is the log-twist itself, ``log ψ_t = m_t`` (unnormalised,
    B17); no reference term is subtracted.

    Args:
        modulation_logits: ``(..., V)`` modulation ``m`` (``outputs.modulation_logits``, already aligned with
            ``tokens``: position ``t`` holds the vector that scores ``s_t``).
        tokens: ``(...)`` token ids; ``ignore_index`` positions give ``0``. ``None`` returns ``m`` itself
            (all-vocabulary twist, e.g. for DPG).

    Returns:
        ``(...)`` (or ``(..., V)``) twist values in the dtype of ``modulation_logits``, with gradient.
    """
    if tokens is None:
        return modulation_logits
    if tokens.shape != modulation_logits.shape[:-1]:
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must equal modulation_logits.shape[:-1] = "
            f"{tuple(modulation_logits.shape[:-1])}."
        )
    valid = tokens != ignore_index
    safe = torch.where(valid, tokens, torch.zeros_like(tokens)).long()
    values = modulation_logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, values, torch.zeros_like(values))


def modulation_kind_of(parameterization: str) -> str | None:
    """The `ModulatedCausalLM` kind (``"model"``, ``"linear_head"``, ``"mlp_head"``) a ``modulation_*``
    parameterisation needs, or ``None`` for the policy parameterisations. Raises on unknown names."""
    if parameterization in _MODULATION_KIND:
        return _MODULATION_KIND[parameterization]
    if parameterization in POLICY_PARAMETERIZATIONS or parameterization == "policy":
        return None
    raise ValueError(_unknown(parameterization))


def _unknown(parameterization: str) -> str:
    return f"Unknown twist parameterization {parameterization!r}; choose one of {TWIST_PARAMETERIZATIONS}."


def _need(parameterization: str, **inputs) -> None:
    missing = [name for name, value in inputs.items() if value is None]
    if missing:
        raise ValueError(f"Parameterization {parameterization!r} needs {', '.join(missing)}.")


def twist_values(
    parameterization: str,
    *,
    q_logprobs: torch.Tensor | None = None,
    p_logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    q_logits_at_token: torch.Tensor | None = None,
    modulation_logits: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``v_t`` for a parameterisation name of docs/algorithms.md §6 (see the module table).

    Inputs by parameterisation (others are ignored):

    - ``policy_psi_q_p_s_t``: ``q_logprobs``, ``p_logprobs``;
    - ``policy_psi_q_p_s_1_to_t``: ``q_logprobs``, ``p_logprobs``, ``mask``;
    - ``policy_psi_unnorm``: ``q_logits_at_token``, ``p_logprobs``;
    - ``modulation_model`` / ``modulation_linear_head`` / ``modulation_nn_head`` (= ``modulation_mlp_head``):
      ``modulation_logits`` and ``tokens`` (``tokens=None`` gives the all-vocabulary ``m``).

    Raises:
        ValueError: unknown name (the message lists the options), the plain ``"policy"`` parameterisation (it has
            no twist: PPO/evaluation only), or a missing input.
    """
    if parameterization == "policy_psi_q_p_s_t":
        _need(parameterization, q_logprobs=q_logprobs, p_logprobs=p_logprobs)
        return psi_q_p_s_t(q_logprobs, p_logprobs)
    if parameterization == "policy_psi_q_p_s_1_to_t":
        _need(parameterization, q_logprobs=q_logprobs, p_logprobs=p_logprobs, mask=mask)
        return psi_q_p_s_1_to_t(q_logprobs, p_logprobs, mask)
    if parameterization == "policy_psi_unnorm":
        _need(parameterization, q_logits_at_token=q_logits_at_token, p_logprobs=p_logprobs)
        return psi_unnorm(q_logits_at_token, p_logprobs)
    if parameterization in _MODULATION_KIND:
        _need(parameterization, modulation_logits=modulation_logits)
        return psi_modulation(modulation_logits, tokens)
    if parameterization == "policy":
        raise ValueError(
            "The 'policy' parameterization has no twist (PPO/evaluation only); twist losses need one of "
            f"{TWIST_PARAMETERIZATIONS}."
        )
    raise ValueError(_unknown(parameterization))
