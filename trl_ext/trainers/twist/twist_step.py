"""The twist step both twist trainers share: forward the proposal ``q`` on its samples, read the twist ``v``, call a
twist loss of the registry.

:func:`twist_loss` is all a trainer calls. For a batch of ``B = P·N`` samples (``N`` per prompt, rows grouped prompt
by prompt) it

1. runs ``q`` once on ``prompt + response`` (also on the base samples of exact SIXO, stacked into the same forward
   pass, so a DDP / ZeRO-3 / FSDP model sees one forward per backward);
2. reads the per-token twist ``v_t = log ψ_t`` of the parameterisation (:func:`trl_ext.models.twist.twist_values`):
   ``q``'s own log-probs (``policy_psi_q_p_s_t``, ``policy_psi_q_p_s_1_to_t``), its raw logits
   (``policy_psi_unnorm``) or the modulation logits of a `ModulatedCausalLM` (``modulation_*``), all at the sampled
   tokens (the distribution of token ``t`` is read at position ``t − 1``);
3. for DPG, builds the all-vocabulary twist ``log ψ_all`` and the reference's all-vocabulary ``log p`` (computed
   with ``reference_model`` under ``no_grad``);
4. reshapes everything to ``(P, N, T)`` and calls ``get_loss(loss_type, "twist")`` with the keywords it accepts.

No maths beyond gathering: the formulas live in :mod:`trl_ext.models.twist` and :mod:`trl_ext.losses.twist`.
Combinations that cannot work fail with a ``ValueError`` saying what to change (:func:`validate_twist_setup` runs the
model-independent checks, so configs can call it early).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ...losses import LossOutput, get_loss_spec
from ...losses.twist import sixo_approx_loss, sixo_loss
from ...models.modulated import ModulatedCausalLM
from ...models.twist import (
    MODULATION_PARAMETERIZATIONS,
    POLICY_PARAMETERIZATIONS,
    TWIST_PARAMETERIZATIONS,
    modulation_kind_of,
    twist_values,
)
from ...ops.logprobs import DEFAULT_CHUNK_SIZE, entropy_from_logits, full_logprobs, logprobs_from_logits
from ...ops.sequences import group_rows
from ...rollout import causal_lm_outputs, forward_response
from ...rollout.vision import concat_vision
from ...utils import eval_mode, unwrap_model

__all__ = [
    "TWIST_BATCH_KEYS",
    "TwistLossOutput",
    "TwistLossRequirements",
    "is_modulated_model",
    "twist_loss",
    "twist_loss_requirements",
    "twist_uses_logprobs_only",
    "validate_twist_setup",
]

#: Keys a batch passed to :func:`twist_loss` must hold.
TWIST_BATCH_KEYS: tuple[str, ...] = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "log_phi",
)
# Keywords `twist_loss` can supply to a loss; a loss that *requires* anything else cannot be called from here.
_SUPPLIED = {
    "aggregation",
    "normalizer",
    "log_psi_all",
    "ref_logprobs_all",
    "base_v",
    "base_mask",
    "base_normalizer",
}
# ctl_no_second_term drops CTL's per-step term, which is only a zero-mean control variate for these two.
_NO_SECOND_TERM_PARAMETERIZATIONS = ("policy_psi_q_p_s_t", "policy_psi_q_p_s_1_to_t")


@dataclass
class TwistLossOutput:
    """Result of :func:`twist_loss`.

    Attributes:
        loss: the registry's `LossOutput` (scalar ``loss`` with gradient into ``q`` only, detached ``metrics``).
        q_logprobs: ``(B, T)`` fp32 ``log q`` of the sampled tokens at the sampling temperature, detached, 0 on
            padding (for a modulated ``q``: the log-probs of the modulated distribution).
        entropy: ``(B, T)`` fp32 per-token entropy of ``q`` (detached, 0 on padding), or ``None``.
        v: ``(B, T)`` the twist values ``v_t`` the loss saw, detached.
    """

    loss: LossOutput
    q_logprobs: torch.Tensor
    entropy: torch.Tensor | None
    v: torch.Tensor


@dataclass(frozen=True)
class TwistLossRequirements:
    """What a twist loss needs besides the common inputs (see :func:`twist_loss_requirements`)."""

    all_vocab: bool
    """The loss takes ``log_psi_all``/``ref_logprobs_all`` (DPG): :func:`twist_loss` needs ``reference_model``."""
    base_samples: bool
    """The loss needs the twist on fresh samples of the base ``p`` (exact SIXO): pass ``base_batch``."""
    classifier: bool
    """The loss trains ``v`` as a classifier logit (SIXO): only ``modulation_*`` parameterisations fit."""


def _parameters(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def twist_loss_requirements(loss_type: str) -> TwistLossRequirements:
    """The extra inputs and constraints of the registered twist loss ``loss_type``.

    Raises:
        ValueError: unknown name, a loss of another kind, or a loss requiring keywords :func:`twist_loss` cannot
            give (e.g. ``mixed_ctl_value``, which needs critic values).
    """
    try:
        spec = get_loss_spec(loss_type, "twist")
    except KeyError as err:
        raise ValueError(str(err).strip("'\"")) from None
    params = _parameters(spec.fn)
    required = [
        name
        for index, (name, p) in enumerate(params.items())
        if index >= 5  # v, log_phi, mask, old_logprobs, ref_logprobs
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and name not in _SUPPLIED
    ]
    if required:
        raise ValueError(
            f"The twist loss {loss_type!r} requires {', '.join(required)}, which the twist step cannot provide (it "
            "gives the twist, log_phi, mask, old and reference log-probs, and for DPG/SIXO the all-vocabulary and "
            "base-sample inputs). Use ctl, ctl_no_second_term, sixo, sixo_approx or dpg, or register a loss whose "
            "extra arguments have defaults."
        )
    base_v = params.get("base_v")
    base_required = base_v is not None and base_v.default is inspect.Parameter.empty
    return TwistLossRequirements(
        all_vocab="log_psi_all" in params,
        base_samples=spec.fn is sixo_loss or base_required,
        classifier=spec.fn in (sixo_loss, sixo_approx_loss),
    )


def validate_twist_setup(parameterization: str, loss_type: str) -> TwistLossRequirements:
    """Check that ``parameterization`` and ``loss_type`` can be combined (no model needed); return the loss's
    requirements. Raises a ``ValueError`` saying what to change."""
    if parameterization == "policy":
        raise ValueError(
            "parameterization='policy' has no twist (it is for PPO/evaluation); choose one of "
            f"{', '.join(TWIST_PARAMETERIZATIONS)}."
        )
    if parameterization not in TWIST_PARAMETERIZATIONS:
        raise ValueError(
            f"Unknown parameterization {parameterization!r}; choose one of {', '.join(TWIST_PARAMETERIZATIONS)}."
        )
    needs = twist_loss_requirements(loss_type)
    if needs.classifier and parameterization in POLICY_PARAMETERIZATIONS:
        raise ValueError(
            f"loss_type={loss_type!r} (SIXO) trains the twist as a free classifier logit, which a policy "
            f"parameterisation ({parameterization!r}: v = log q − log p) cannot be; use a modulation "
            f"parameterisation ({', '.join(MODULATION_PARAMETERIZATIONS)}) or loss_type='ctl' / 'dpg'."
        )
    canonical = get_loss_spec(loss_type, "twist").fn
    if canonical is get_loss_spec("ctl_no_second_term").fn and parameterization not in (
        _NO_SECOND_TERM_PARAMETERIZATIONS
    ):
        raise ValueError(
            f"loss_type={loss_type!r} drops CTL's second term, which is only safe when that term has zero "
            f"expectation, i.e. for {' or '.join(_NO_SECOND_TERM_PARAMETERIZATIONS)}; with {parameterization!r} "
            "use loss_type='ctl'."
        )
    return needs


def twist_uses_logprobs_only(parameterization: str, loss_type: str) -> bool:
    """Whether :func:`twist_loss` needs only ``q``'s token log-probs, not its logits: the parameterisations
    ``v = log q − log p`` (``policy_psi_q_p_s_t``, ``policy_psi_q_p_s_1_to_t``) with a loss that takes no
    all-vocabulary inputs (not DPG). These score ``q`` from its hidden states (no ``(B, T, V)`` logits) and may run
    padding-free."""
    return parameterization in _NO_SECOND_TERM_PARAMETERIZATIONS and not twist_loss_requirements(loss_type).all_vocab


def is_modulated_model(model: nn.Module) -> bool:
    """True when ``model`` (possibly DDP/DeepSpeed/PEFT-wrapped) is a :class:`~trl_ext.models.ModulatedCausalLM`."""
    return isinstance(unwrap_model(model), ModulatedCausalLM)


def _check_model(model: nn.Module, parameterization: str) -> None:
    inner = unwrap_model(model)
    if callable(getattr(inner, "acting_model", None)):  # a trainer's module of several models (`ModelParts`)
        inner = unwrap_model(inner.acting_model())
    modulated = isinstance(inner, ModulatedCausalLM)
    if parameterization in MODULATION_PARAMETERIZATIONS:
        kind = modulation_kind_of(parameterization)
        if not modulated:
            raise ValueError(
                f"parameterization={parameterization!r} reads the modulation logits of a ModulatedCausalLM, but the "
                f"model is a {type(inner).__name__}. Wrap it first: ModulatedCausalLM.from_base(model, {kind!r}), "
                "or choose a policy_psi_* parameterisation."
            )
        if inner.config.modulation_kind != kind:
            raise ValueError(
                f"parameterization={parameterization!r} needs a {kind!r} modulation, but the model's modulation_kind "
                f"is {inner.config.modulation_kind!r}; pick the matching parameterisation or rebuild the model."
            )
    elif modulated:
        raise ValueError(
            f"parameterization={parameterization!r} treats q as a plain causal LM, but the model is a "
            "ModulatedCausalLM; use the modulation_* parameterisation of its kind "
            f"(modulation_kind={inner.config.modulation_kind!r})."
        )


def _check_batch(batch: dict, name: str, keys: tuple[str, ...]) -> tuple[int, int]:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"{name} is missing {', '.join(missing)}; it needs {', '.join(keys)}.")
    ids, mask = batch["input_ids"], batch["response_mask"]
    if ids.dim() != 2 or mask.dim() != 2 or batch["attention_mask"].shape != ids.shape:
        raise ValueError(
            f"{name}: input_ids and attention_mask must be (B, S) and response_mask (B, T); got "
            f"{tuple(ids.shape)}, {tuple(batch['attention_mask'].shape)} and {tuple(mask.shape)}."
        )
    B, T = mask.shape
    if ids.shape[0] != B or ids.shape[1] <= T:
        raise ValueError(
            f"{name}: response_mask {tuple(mask.shape)} does not fit input_ids {tuple(ids.shape)}: the rows must be "
            "the same and input_ids must hold at least one prompt token before the T response tokens."
        )
    for key in ("old_logprobs", "ref_logprobs"):
        if key in keys and batch[key].shape != mask.shape:
            raise ValueError(f"{name}: {key} has shape {tuple(batch[key].shape)}, expected {tuple(mask.shape)}.")
    if "log_phi" in keys and batch["log_phi"].shape != (B,):
        raise ValueError(f"{name}: log_phi has shape {tuple(batch['log_phi'].shape)}, expected ({B},).")
    return B, T


def _common_layout(batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Stack batches into one ``[left-padded prompt | right-padded response]`` layout with shared widths.

    Returns ``(input_ids, attention_mask, T_max)``; a single batch is returned unchanged."""
    if len(batches) == 1:
        b = batches[0]
        return b["input_ids"], b["attention_mask"], b["response_mask"].shape[1]
    t_max = max(b["response_mask"].shape[1] for b in batches)
    p_max = max(b["input_ids"].shape[1] - b["response_mask"].shape[1] for b in batches)
    ids_parts, mask_parts = [], []
    for b in batches:
        ids, mask, T = b["input_ids"], b["attention_mask"], b["response_mask"].shape[1]
        P = ids.shape[1] - T
        new_ids = ids.new_zeros(ids.shape[0], p_max + t_max)
        new_mask = mask.new_zeros(ids.shape[0], p_max + t_max)
        new_ids[:, p_max - P : p_max + T] = ids
        new_mask[:, p_max - P : p_max + T] = mask
        ids_parts.append(new_ids)
        mask_parts.append(new_mask)
    return torch.cat(ids_parts), torch.cat(mask_parts), t_max


def _response_outputs(model: nn.Module, batches: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """One forward of ``model`` over all ``batches``: per batch, the ``(B, T, V)`` logits that score the response
    tokens and (for a modulated model) the ``(B, T, V)`` modulation logits. Batches may carry image inputs
    (``"vision"``, see :mod:`~trl_ext.rollout.vision`)."""
    ids, mask, t_max = _common_layout(batches)
    out = causal_lm_outputs(model, ids, mask, t_max + 1, vision=concat_vision([b.get("vision") for b in batches]))
    logits = out.logits[:, -(t_max + 1) : -1]
    modulation = getattr(out, "modulation_logits", None)
    if modulation is not None:
        modulation = modulation[:, -(t_max + 1) : -1]
    results, start = [], 0
    for b in batches:
        rows = slice(start, start + b["input_ids"].shape[0])
        T = b["response_mask"].shape[1]
        results.append((logits[rows, :T], modulation[rows, :T] if modulation is not None else None))
        start = rows.stop
    return results


def _response_logprobs(
    model: nn.Module, batches: list[dict], temperature: float, chunk_size: int, entropy: bool, padding_free: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """One forward of ``model`` over all ``batches`` (`trl_ext.rollout.scoring.forward_response`, no ``(B, T, V)``
    logits where the model allows it): per batch, the ``(B, T)`` log-probs of its response tokens at
    ``temperature`` and, with ``entropy``, their entropies (no gradient); 0 on padding. Batches may carry image
    inputs (``"vision"``)."""
    ids, mask, t_max = _common_layout(batches)
    out = forward_response(
        model, ids, mask, t_max, temperature=temperature, return_entropy=entropy, chunk_size=chunk_size,
        padding_free=padding_free, vision=concat_vision([b.get("vision") for b in batches]),
    )  # fmt: skip
    results, start = [], 0
    for b in batches:
        rows = slice(start, start + b["input_ids"].shape[0])
        T = b["response_mask"].shape[1]
        results.append((out.logprobs[rows, :T], out.entropy[rows, :T] if entropy else None))
        start = rows.stop
    return results


def _token_twist(
    parameterization: str,
    logits: torch.Tensor,
    modulation: torch.Tensor | None,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    q_logprobs: torch.Tensor,
    p_logprobs: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """``v_t`` at the sampled tokens, zero on padding."""
    keep = mask != 0
    if parameterization in MODULATION_PARAMETERIZATIONS:
        labels = torch.where(keep, tokens, torch.full_like(tokens, -100))
        v = twist_values(parameterization, modulation_logits=modulation, tokens=labels)
    elif parameterization == "policy_psi_unnorm":
        raw = (logits.float() / temperature).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        v = twist_values(parameterization, q_logits_at_token=raw, p_logprobs=p_logprobs.float())
    else:
        v = twist_values(parameterization, q_logprobs=q_logprobs, p_logprobs=p_logprobs.float(), mask=mask)
    return torch.where(keep, v, torch.zeros_like(v))


def _all_vocab_twist(
    parameterization: str,
    logits: torch.Tensor,
    modulation: torch.Tensor | None,
    v: torch.Tensor,
    q_logprobs: torch.Tensor,
    p_logprobs: torch.Tensor,
    ref_all: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``log ψ_t(y)`` for every vocabulary token ``y`` (``(B, T, V)``), consistent with :func:`_token_twist`."""
    if parameterization in MODULATION_PARAMETERIZATIONS:
        return modulation.float()
    if parameterization == "policy_psi_unnorm":
        return logits.float() / temperature - ref_all
    step_all = full_logprobs(logits, temperature) - ref_all
    if parameterization == "policy_psi_q_p_s_1_to_t":
        prefix = v - (q_logprobs - p_logprobs.float())  # Σ_{k<t}(log q − log p), the same for every candidate y
        return prefix.unsqueeze(-1) + step_all
    return step_all


def twist_loss(
    model: nn.Module,
    batch: dict,
    *,
    num_samples_per_prompt: int,
    parameterization: str,
    loss_type: str,
    temperature: float = 1.0,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | None = None,
    reference_model: nn.Module | None = None,
    base_batch: dict | None = None,
    base_normalizer: float | None = None,
    return_entropy: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    padding_free: bool = False,
    response_outputs: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> TwistLossOutput:
    """The twist loss of ``q`` (``model``) on its own samples, towards ``σ ∝ p·exp(log φ)``.

    Args:
        model: the proposal ``q``: a causal LM (``policy_psi_*``) or a `ModulatedCausalLM` of the matching kind
            (``modulation_*``), possibly DDP/DeepSpeed/PEFT-wrapped. Called once, with gradient.
        batch: ``input_ids``/``attention_mask`` ``(B, S)`` (left-padded prompt + right-padded response),
            ``response_mask`` ``(B, T)``, ``old_logprobs`` ``(B, T)`` (``log q`` at sampling time),
            ``ref_logprobs`` ``(B, T)`` (``log p`` of the target's base model), ``log_phi`` ``(B,)`` (``β·R``);
            rows grouped prompt by prompt, ``B = P·N``.
        num_samples_per_prompt: ``N``.
        parameterization: one of `trl_ext.models.twist.TWIST_PARAMETERIZATIONS`.
        loss_type: a registered loss of kind ``"twist"`` (``ctl``, ``ctl_no_second_term``, ``sixo``,
            ``sixo_approx``, ``dpg``, or your own).
        temperature: the sampling temperature; log-probs are ``log_softmax(logits / T)`` (as in the rollout).
        aggregation, normalizer: passed to the loss (see `trl_ext.losses.aggregate`).
        reference_model: ``p`` (frozen ``p_0`` or the current ``p_θ``), needed by losses on all-vocabulary
            inputs (DPG); run under ``no_grad`` in eval mode.
        base_batch: fresh samples of ``p`` for the same prompts (``input_ids``, ``attention_mask``,
            ``response_mask``; ``B_b = P·N_b`` rows), for exact SIXO only.
        base_normalizer: normalizer of exact SIXO's base term (needed with ``aggregation="token-mean"`` and a
            ``normalizer``).
        return_entropy: also compute ``q``'s per-token entropy (no gradient).
        chunk_size: tokens per chunk of the log-prob computation.
        padding_free: run ``q`` with the rows packed into one sequence (only where
            :func:`twist_uses_logprobs_only`; see `trl_ext.rollout.scoring`).
        response_outputs: ``(logits, modulation_logits)`` ``(B, T, V)`` of ``q`` at the positions that predict the
            response tokens, computed by the caller (a head proposal on the policy's trunk, from the policy's own
            hidden states): ``model`` is then not run. Not with ``base_batch`` nor where
            :func:`twist_uses_logprobs_only`.

    When :func:`twist_uses_logprobs_only`, ``q`` is scored through
    :func:`~trl_ext.rollout.scoring.forward_response` (from its hidden states, no ``(B, T, V)`` logits, where the
    model allows it); otherwise from its logits.

    Returns:
        A :class:`TwistLossOutput`.

    Raises:
        ValueError: an unknown or unsupported parameterisation / loss combination, a model that does not fit the
            parameterisation, DPG without ``reference_model``, exact SIXO without ``base_batch``, malformed batches.
    """
    needs = validate_twist_setup(parameterization, loss_type)
    _check_model(model, parameterization)
    N = int(num_samples_per_prompt)
    B, T = _check_batch(batch, "batch", TWIST_BATCH_KEYS)
    if N < 1 or B % N:
        raise ValueError(
            f"The batch has {B} rows, which is not num_samples_per_prompt={N} samples for each of a whole number of "
            "prompts; keep every prompt's samples together (rows grouped prompt by prompt)."
        )
    if needs.all_vocab and reference_model is None:
        raise ValueError(
            f"loss_type={loss_type!r} needs the reference's log-probs over the whole vocabulary: pass "
            "reference_model (the frozen p_0, or the current p_θ)."
        )
    if needs.base_samples and base_batch is None:
        raise ValueError(
            f"loss_type={loss_type!r} (exact SIXO) needs fresh samples of the base model p for the same prompts: "
            "pass base_batch, or use loss_type='sixo_approx'."
        )
    if base_batch is not None and not needs.base_samples:
        raise ValueError(f"base_batch is only used by exact SIXO, not by loss_type={loss_type!r}; drop it.")
    base_keys = ("input_ids", "attention_mask", "response_mask")
    if base_batch is not None:
        if parameterization in POLICY_PARAMETERIZATIONS:
            base_keys = (*base_keys, "ref_logprobs")
        _check_batch(base_batch, "base_batch", base_keys)

    batches = [batch] if base_batch is None else [batch, base_batch]
    tokens, mask = batch["input_ids"][:, -T:], batch["response_mask"]
    keep = mask != 0
    logprobs_only = twist_uses_logprobs_only(parameterization, loss_type)
    if padding_free and not logprobs_only:
        raise ValueError(
            f"padding_free=True needs a twist read from token log-probs alone; parameterization={parameterization!r} "
            f"with loss_type={loss_type!r} needs q's logits. Use padding_free=False."
        )
    if response_outputs is not None and (logprobs_only or base_batch is not None):
        raise ValueError("response_outputs replaces q's logits forward: not with base_batch or a log-prob twist.")
    entropy = None
    if logprobs_only:
        scored = _response_logprobs(model, batches, temperature, chunk_size, return_entropy, padding_free)
        outputs = [(None, None)] * len(batches)
        q_logprobs, entropy = scored[0]
    else:
        outputs = [response_outputs] if response_outputs is not None else _response_outputs(model, batches)
        logits, modulation = outputs[0]
        q_logprobs = logprobs_from_logits(logits, tokens, temperature=temperature, chunk_size=chunk_size)
        q_logprobs = torch.where(keep, q_logprobs, torch.zeros_like(q_logprobs))
        if return_entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach(), mask, temperature=temperature, chunk_size=chunk_size)
    logits, modulation = outputs[0]
    p_logprobs = batch["ref_logprobs"]
    v = _token_twist(parameterization, logits, modulation, tokens, mask, q_logprobs, p_logprobs, temperature)

    P = B // N
    kwargs: dict = {"aggregation": aggregation, "normalizer": normalizer, "base_normalizer": base_normalizer}
    if needs.all_vocab:
        with torch.no_grad(), eval_mode(reference_model):
            ref_logits = _response_outputs(reference_model, [batch])[0][0]
            ref_all = full_logprobs(ref_logits, temperature)
        psi_all = _all_vocab_twist(
            parameterization, logits, modulation, v, q_logprobs, p_logprobs, ref_all, temperature
        )
        kwargs["log_psi_all"] = group_rows(psi_all, num_prompts=P, what="log_psi_all")
        kwargs["ref_logprobs_all"] = group_rows(ref_all, num_prompts=P, what="ref_logprobs_all")
    if base_batch is not None:
        base_logits, base_modulation = outputs[1]
        base_T = base_batch["response_mask"].shape[1]
        base_tokens, base_mask = base_batch["input_ids"][:, -base_T:], base_batch["response_mask"]
        base_q = None
        if logprobs_only:
            base_q = scored[1][0]
        elif parameterization in POLICY_PARAMETERIZATIONS:
            base_q = logprobs_from_logits(base_logits, base_tokens, temperature=temperature, chunk_size=chunk_size)
        base_v = _token_twist(
            parameterization, base_logits, base_modulation, base_tokens, base_mask, base_q,
            base_batch.get("ref_logprobs"), temperature,
        )  # fmt: skip
        kwargs["base_v"] = group_rows(base_v, num_prompts=P, what="base_batch")
        kwargs["base_mask"] = group_rows(base_mask, num_prompts=P, what="base_batch")

    fn = get_loss_spec(loss_type, "twist").fn
    params = _parameters(fn)
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: x for k, x in kwargs.items() if (takes_all or k in params) and x is not None}
    loss = fn(
        v.reshape(P, N, T),
        batch["log_phi"].reshape(P, N),
        mask.reshape(P, N, T),
        batch["old_logprobs"].reshape(P, N, T),
        p_logprobs.reshape(P, N, T),
        **kwargs,
    )
    return TwistLossOutput(loss=loss, q_logprobs=q_logprobs.detach(), entropy=entropy, v=v.detach())
