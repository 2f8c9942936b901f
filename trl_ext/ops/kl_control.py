"""KL control in one place: the fixed and the adaptive KL coefficient, the three config fields that choose between
them (:class:`KLControlConfigMixin`: ``kl_coef``, ``kl_target``, ``kl_horizon``) and their one check.

The controllers are Ziegler et al. (2019)'s adaptive proportional controller and a fixed coefficient; both are small
pure classes (no model, no `Trainer`): ``.value`` is the coefficient the next update uses, and
``.update(kl, n_steps)`` is called once after each update with that update's measured mean per-sequence KL and its
number of responses. The adaptive rule (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", §2.2) is

    error   = clip(kl / kl_target − 1, −0.2, 0.2)
    kl_coef = kl_coef · (1 + error · n_steps / kl_horizon)

so the coefficient rises while the KL is above ``kl_target`` and falls while it is below, by at most
``0.2 · n_steps / kl_horizon`` of itself per update. ``state_dict()`` / ``load_state_dict()`` carry the current
value through checkpoints (``kl_controller.json``, see `trl_ext.trainers.common.checkpoint`).

A trainer whose config has the mixin builds its controller with :func:`build_kl_controller`; PPO feeds it the mean
per-sequence KL of each rollout (``objective/kl``, ``batch_size`` responses), RePULSe that of each policy update
(``base/kl``, its policy samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLControlConfigMixin",
    "build_kl_controller",
    "kl_coef_field",
    "kl_control_error",
]

KL_COEF_HELP = (
    "KL coefficient (the adaptive controller's start value when kl_target is set); 0 without kl_target: the "
    "reference model is not run and no KL is logged."
)


def kl_control_error(kl_coef: float, kl_target: float | None, kl_horizon: int) -> str | None:
    """What is wrong with these KL settings (the message names the option to change), or ``None``."""
    if not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef) and kl_coef >= 0):
        return f"kl_coef={kl_coef}: set a KL coefficient >= 0."
    finite = isinstance(kl_target, (int, float)) and math.isfinite(kl_target)
    if kl_target is not None and not (finite and kl_target > 0):
        return f"kl_target={kl_target}: set a positive KL target, or None for a fixed kl_coef."
    if not kl_horizon >= 1:
        return f"kl_horizon={kl_horizon}: set kl_horizon >= 1 (samples)."
    return None


def kl_coef_field(default: float):
    """The ``kl_coef`` field with its help, for a config whose default differs from :class:`KLControlConfigMixin`'s."""
    return field(default=default, metadata={"help": KL_COEF_HELP})


@dataclass
class KLControlConfigMixin:
    """The KL-control options of an online config (PPO, RePULSe); :meth:`check_kl_control` is their check."""

    kl_coef: float = kl_coef_field(0.05)
    kl_target: float | None = field(
        default=None,
        metadata={
            "help": "Target KL of Ziegler et al. (2019)'s adaptive KL controller; None: kl_coef stays fixed. After "
            "each update with mean per-sequence KL `kl` over its n samples: "
            "kl_coef *= 1 + clip(kl / kl_target - 1, -0.2, 0.2) * n / kl_horizon, used by the next update (logged; "
            "saved in checkpoints). Must be > 0."
        },
    )
    kl_horizon: int = field(
        default=10000,
        metadata={
            "help": "Horizon of the adaptive KL controller, in samples (>= 1; keep it well above the samples of one "
            "update: each update moves kl_coef by at most 0.2 * n / kl_horizon of itself)."
        },
    )

    def check_kl_control(self, fail) -> None:
        """Call ``fail(message)`` when the KL settings are wrong (see :func:`kl_control_error`)."""
        error = kl_control_error(self.kl_coef, self.kl_target, self.kl_horizon)
        if error is not None:
            fail(error)


class FixedKLController:
    """A constant KL coefficient (``kl_target=None``): :meth:`update` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, kl: float, n_steps: int) -> None:
        """Nothing to do: the coefficient stays ``kl_coef``."""
        return None

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019)'s proportional controller (see the module docstring for the rule).

    Args:
        init_kl_coef: the starting coefficient (``kl_coef``).
        target: the KL the controller aims at (``kl_target``, > 0), in the units of the measured KL (a
            per-sequence sum of the per-token estimate).
        horizon: ``kl_horizon`` (>= 1), in responses: the larger, the slower the coefficient moves.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target is None:
            raise ValueError("kl_target=None: set a positive KL target (a fixed coefficient is FixedKLController).")
        error = kl_control_error(init_kl_coef, target, horizon)
        if error is not None:
            raise ValueError(error)
        super().__init__(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, kl: float, n_steps: int) -> None:
        """After an update of ``n_steps`` responses with mean per-sequence KL ``kl``:
        ``value *= 1 + clip(kl / target − 1, −0.2, 0.2) · n_steps / horizon``."""
        if n_steps > self.horizon:
            raise ValueError(
                f"An update of {n_steps} responses with kl_horizon={self.horizon}: the coefficient could change by "
                f"more than 20% in one update (or turn negative); set kl_horizon well above the responses per update."
            )
        error = min(max(float(kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(args) -> FixedKLController | None:
    """The controller of a config with the KL-control options (:class:`KLControlConfigMixin`), or ``None`` for a
    config without them."""
    if not isinstance(args, KLControlConfigMixin):
        return None
    if args.kl_target is None:
        return FixedKLController(args.kl_coef)
    return AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
