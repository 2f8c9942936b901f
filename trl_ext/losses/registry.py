"""A registry of losses, so research code can add a loss by name without touching a trainer.

Usage::

    from trl_ext.losses import register_loss, get_loss, LossOutput

    @register_loss("my_ctl", kind="twist")
    def my_ctl(v, log_phi, mask, old_logprobs, ref_logprobs, **kwargs) -> LossOutput:
        ...

    loss_fn = get_loss("my_ctl")

Each loss has a ``kind`` that fixes the call a trainer makes (see :data:`LOSS_PROTOCOLS`): the inputs it passes and
the options it always passes. :func:`register_loss` checks the signature against that protocol, so a loss that
cannot take an option (say a policy loss without ``normalizer``, which would silently lose its gradient-accumulation
scaling) is an error at registration, not a silently dropped argument. Trainers call ``spec.call(...)`` directly.
A trainer option such as ``actor_loss_type`` or ``loss_type`` accepts any registered name of the right kind.

The built-in losses register themselves when `trl_ext.losses` is imported, which Python always does before it
imports this module, so the registry never imports its package back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "LOSS_KINDS",
    "LOSS_PROTOCOLS",
    "LossProtocol",
    "LossSpec",
    "available_losses",
    "get_loss",
    "get_loss_spec",
    "register_loss",
]

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
class LossProtocol:
    """The call a trainer makes to every loss of one kind.

    ``inputs`` are passed positionally in this order (by keyword, with these names, when ``by_keyword``); ``options``
    are keywords passed on every call, which the loss must take (by name, or through ``**kwargs``). Keywords outside
    both are loss-specific: a trainer passes them only to a loss that names them (:meth:`LossSpec.accepts`).
    """

    inputs: tuple[str, ...]
    options: tuple[str, ...] = ()
    by_keyword: bool = False

    def check(self, fn: Callable, name: str, kind: str) -> None:
        """Raise ``TypeError`` naming what ``fn`` must add to its signature to follow this protocol."""
        params = inspect.signature(fn).parameters
        values = list(params.values())
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in values)
        var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in values)
        positional = [p.name for p in values if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        problems = []
        if self.by_keyword:
            missing = [n for n in self.inputs if n not in params and not var_kw]
            if missing:
                problems.append(f"the inputs {missing} (passed by keyword)")
        elif len(positional) < len(self.inputs) and not var_pos:
            problems.append(f"{len(self.inputs)} positional inputs {list(self.inputs)} (it takes {len(positional)})")
        missing = [n for n in self.options if n not in params and not var_kw]
        if missing:
            problems.append(f"the keyword(s) {missing}")
        if problems:
            raise TypeError(
                f"Loss {name!r} ({fn.__module__}.{fn.__qualname__}) cannot be a {kind!r} loss: trainers call every "
                f"{kind} loss with {' and '.join(problems)}, which its signature does not take. Add them to the "
                f"signature (or take **kwargs); see trl_ext.losses.LOSS_PROTOCOLS[{kind!r}]."
            )


#: The protocol of each kind (what :data:`LOSS_KINDS` describes), checked by :func:`register_loss`.
LOSS_PROTOCOLS: dict[str, LossProtocol] = {
    "policy": LossProtocol(
        ("logprobs", "old_logprobs", "advantages", "mask"), ("cliprange", "dual_clip", "aggregation", "normalizer")
    ),
    "value": LossProtocol(
        ("values", "old_values", "returns", "mask"), ("cliprange_value", "aggregation", "normalizer")
    ),
    "reinforce": LossProtocol(
        ("logprobs", "rewards", "mask"), ("baseline", "baseline_value", "aggregation", "normalizer")
    ),
    "harmlessness": LossProtocol(
        ("logprobs", "rewards", "mask", "neg_logprobs", "neg_weights", "neg_mask", "alpha"),
        ("alpha_convention", "baseline", "baseline_value", "aggregation"),
        by_keyword=True,
    ),
    "twist": LossProtocol(("v", "log_phi", "mask", "old_logprobs", "ref_logprobs"), ("aggregation", "normalizer")),
    "preference": LossProtocol(("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")),
    "unpaired": LossProtocol(
        (
            "policy_chosen_logps",
            "policy_rejected_logps",
            "policy_kl_logps",
            "ref_chosen_logps",
            "ref_rejected_logps",
            "ref_kl_logps",
        )
    ),
    "reward": LossProtocol(("chosen_rewards", "rejected_rewards")),
    "supervised": LossProtocol(()),  # logits or log-probs and labels; each supervised trainer names its loss
}


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its name, kind, the callable and a one-line description (first docstring line)."""

    name: str
    kind: str
    fn: Callable
    description: str

    @property
    def protocol(self) -> LossProtocol:
        return LOSS_PROTOCOLS[self.kind]

    def call(self, *inputs, **options):
        """Call the loss: the kind's inputs and options, plus loss-specific keywords the caller checked with
        :meth:`accepts`. Nothing is filtered, so a keyword the loss does not take is the loss's own `TypeError`."""
        return self.fn(*inputs, **options)

    def accepts(self, keyword: str) -> bool:
        """Whether the loss takes ``keyword`` (by name, or through ``**kwargs``)."""
        params = inspect.signature(self.fn).parameters
        return keyword in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


_REGISTRY: dict[str, LossSpec] = {}


def register_loss(name: str, kind: str, *, aliases: tuple[str, ...] = (), overwrite: bool = False) -> Callable:
    """Decorator registering ``fn`` under ``name`` (and ``aliases``) with the given ``kind``.

    Raises ``ValueError`` for an unknown kind or a name that is already taken (unless ``overwrite=True``), and
    ``TypeError`` when ``fn``'s signature does not follow the kind's :data:`LOSS_PROTOCOLS` entry.
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"Unknown loss kind {kind!r}; choose one of {', '.join(sorted(LOSS_KINDS))}.")

    def decorator(fn: Callable) -> Callable:
        LOSS_PROTOCOLS[kind].check(fn, name, kind)
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
    return sorted(k for k, spec in _REGISTRY.items() if kind is None or spec.kind == kind)
