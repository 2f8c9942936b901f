"""KL-coefficient controllers: a fixed coefficient, or Ziegler et al. (2019)'s adaptive proportional controller.

Both are small pure classes (no model, no `Trainer`): ``.value`` is the coefficient the next update uses, and
``.update(kl, n_steps)`` is called once after each update with that update's measured mean per-sequence KL and its
number of responses. The adaptive rule (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", §2.2) is

    error   = clip(kl / kl_target − 1, −0.2, 0.2)
    kl_coef = kl_coef · (1 + error · n_steps / kl_horizon)

so the coefficient rises while the KL is above ``kl_target`` and falls while it is below, by at most
``0.2 · n_steps / kl_horizon`` of itself per update. ``state_dict()`` / ``load_state_dict()`` carry the current
value through checkpoints (``kl_controller.json``, see `trl_ext.trainers.common.checkpoint`).
"""

from __future__ import annotations

import math

__all__ = ["AdaptiveKLController", "FixedKLController", "build_kl_controller"]


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
        if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
            raise ValueError(f"kl_target={target}: set a positive KL target, or None for a fixed kl_coef.")
        if not horizon >= 1:
            raise ValueError(f"kl_horizon={horizon}: set kl_horizon >= 1 (responses).")
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


def build_kl_controller(args) -> FixedKLController:
    """The controller of a config with ``kl_coef``, ``kl_target`` and ``kl_horizon``."""
    if args.kl_target is None:
        return FixedKLController(args.kl_coef)
    return AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon)
