"""A registry of losses, so research code can add a loss by name without touching a trainer.

Usage::

    from trl_ext.losses import register_loss, get_loss, LossOutput

    @register_loss("my_ctl", kind="twist")
    def my_ctl(v, log_phi, mask, old_logprobs, ref_logprobs, **kwargs) -> LossOutput:
        ...

    loss_fn = get_loss("my_ctl")

Each loss has a ``kind`` that fixes the call signature a trainer uses for it (see :data:`LOSS_KINDS`). A trainer
option such as ``actor_loss_type`` or ``loss_type`` accepts any registered name of the right kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LOSS_KINDS", "LossSpec", "register_loss", "get_loss", "get_loss_spec", "available_losses"]

#: The kinds of loss and the arguments a trainer calls them with (positional order as listed; harmlessness losses
#: are called by keyword).
LOSS_KINDS: dict[str, str] = {
    "policy": "(logprobs, old_logprobs, advantages, mask, *, aggregation, ...) - clipped surrogate style actor losses",
    "value": "(values, old_values, returns, mask, *, aggregation, ...) - critic losses",
    "reinforce": "(logprobs, rewards, mask, *, baseline, aggregation, ...) - score-function losses on (P, N[, T])",
    "harmlessness": "keywords logprobs, rewards, mask, neg_logprobs, neg_weights, neg_mask[, neg_rewards], alpha, "
    "... - RePULSe-style p-losses (trainers call these by keyword)",
    "twist": "(v, log_phi, mask, old_logprobs, ref_logprobs, *, ...) on (P, N, T) - proposal (q) losses",
    "preference": "(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, ...) - paired losses",
    "unpaired": "(policy_chosen_logps, policy_rejected_logps, policy_kl_logps, ref_chosen_logps, "
    "ref_rejected_logps, ref_kl_logps, *, beta, ...) - KTO-style losses on unpaired data",
    "reward": "(chosen_rewards, rejected_rewards, *, margin, ...) - reward-model losses",
    "supervised": "(logits or logprobs, labels, ...) - LM, distillation and process-reward losses",
}


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its name, kind, the callable and a one-line description (first docstring line)."""

    name: str
    kind: str
    fn: Callable
    description: str


_REGISTRY: dict[str, LossSpec] = {}


def register_loss(name: str, kind: str, *, aliases: tuple[str, ...] = (), overwrite: bool = False) -> Callable:
    """Decorator registering ``fn`` under ``name`` (and ``aliases``) with the given ``kind``.

    Raises ``ValueError`` for an unknown kind or a name that is already taken (unless ``overwrite=True``).
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"Unknown loss kind {kind!r}; choose one of {', '.join(sorted(LOSS_KINDS))}.")

    def decorator(fn: Callable) -> Callable:
        doc = (fn.__doc__ or "").strip().splitlines()
        for key in (name, *aliases):
            if key in _REGISTRY and not overwrite and _REGISTRY[key].fn is not fn:
                raise ValueError(
                    f"A loss named {key!r} is already registered ({_REGISTRY[key].fn.__module__}."
                    f"{_REGISTRY[key].fn.__qualname__}); pass overwrite=True to replace it or pick another name."
                )
            _REGISTRY[key] = LossSpec(name=key, kind=kind, fn=fn, description=doc[0] if doc else "")
        return fn

    return decorator


def get_loss_spec(name: str, kind: str | None = None) -> LossSpec:
    """Return the :class:`LossSpec` of ``name``; with ``kind``, also check that the loss is of that kind."""
    _ensure_builtin_losses()
    if name not in _REGISTRY:
        names = available_losses(kind)
        raise KeyError(f"No loss named {name!r}. Registered{f' {kind}' if kind else ''} losses: {', '.join(names)}.")
    spec = _REGISTRY[name]
    if kind is not None and spec.kind != kind:
        raise ValueError(
            f"Loss {name!r} is a {spec.kind!r} loss, but a {kind!r} loss is needed here. "
            f"Registered {kind} losses: {', '.join(available_losses(kind))}."
        )
    return spec


def get_loss(name: str, kind: str | None = None) -> Callable:
    """Return the loss callable registered as ``name`` (see :func:`get_loss_spec`)."""
    return get_loss_spec(name, kind).fn


def available_losses(kind: str | None = None) -> list[str]:
    """Sorted names (aliases included) of the registered losses, optionally only those of one ``kind``."""
    _ensure_builtin_losses()
    return sorted(k for k, spec in _REGISTRY.items() if kind is None or spec.kind == kind)


def _ensure_builtin_losses() -> None:
    # Importing the package registers the built-in losses; done lazily so `registry` has no import cycle.
    from .. import losses  # noqa: F401
