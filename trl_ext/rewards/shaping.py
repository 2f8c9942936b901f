"""Reward shaping, written once for every trainer: the ``rm_type`` map, the reward cap and the reward transforms.

docs/algorithms.md §3.1–§3.3. A reward model (or reward function) gives a raw score ``r(s)``, higher = better. Trainers
never use ``r`` directly; they use one of

- ``R(s) = map_reward(r)`` — the ``rm_type`` map (cap, indicator, toxicity-class log-prob), §3.2;
- ``log φ(s) = β·R(s)`` — the log-potential of the twisted target ``σ(s) ∝ p(s)·φ(s) = p(s)·exp(β·R(s))``, §3.1;
- ``R'(s) = map_reward(transform_reward(r))`` — a *transformed* reward for the "reward-transform" baselines (the
  transform acts on the raw ``r``, before the map and the cap), §3.3.

Sign convention of β: **β < 0** puts the target's mass on the *low-reward* (bad) outputs of ``p`` — the proposal
``q`` of RePULSe is trained towards them; **β > 0** puts it on high-reward outputs (the RL ⇔ inference view, where
the KL-regularised RL optimum is ``σ`` with ``β = 1/λ``); ``β = 0`` gives ``σ = p``.

Everything here is a pure tensor function returning fp32; :class:`RewardShaping` bundles the options (trainer
configs carry the same fields and build one).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "INDICATOR_REWARD_EPS",
    "REWARD_TRANSFORMS",
    "RM_TYPES",
    "RewardShaping",
    "log_target_weight",
    "map_reward",
    "transform_reward",
]

logger = logging.getLogger(__name__)

#: The ``rm_type`` values :func:`map_reward` implements.
RM_TYPES: tuple[str, ...] = ("rlhf", "indicator_below_threshold", "toxicity_class_logprob")
#: Added inside the log of the indicator reward so that "not bad" maps to a finite ``log(eps) ≈ −36.84``.
INDICATOR_REWARD_EPS: float = 1e-16
#: The reward transforms :func:`transform_reward` implements.
REWARD_TRANSFORMS: tuple[str, ...] = ("minus_alpha_exp_beta_r", "minus_alpha_indicator")


def _as_float_tensor(raw, name: str = "raw") -> torch.Tensor:
    """``raw`` as an fp32 tensor (a copy, never a view of the caller's tensor); NaN and ±inf are refused."""
    if isinstance(raw, torch.Tensor):
        tensor = raw.detach().to(torch.float32).clone()
    else:
        try:
            tensor = torch.as_tensor(raw, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"`{name}` must be a tensor or a list of numbers, got {type(raw).__name__}: {err}"
            ) from None
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        flat = tensor.reshape(-1)
        rows = torch.nonzero(~torch.isfinite(flat)).reshape(-1)
        shown = ", ".join(f"{int(i)}: {float(flat[i])}" for i in rows[:5])
        more = ", ..." if len(rows) > 5 else ""
        raise ValueError(
            f"`{name}` holds {len(rows)} non-finite (NaN or ±inf) score(s) (flat position: value {shown}{more}); fix "
            "the reward model or function that produced them before shaping (a NaN or infinite reward would silently "
            "corrupt training: exp(β·R) and the importance weights become NaN)."
        )
    return tensor


def _check_rm_type(rm_type: str) -> None:
    if rm_type not in RM_TYPES:
        raise ValueError(f"Unknown rm_type {rm_type!r}; choose one of {RM_TYPES}.")


def map_reward(
    raw: torch.Tensor,
    rm_type: str = "rlhf",
    *,
    reward_cap: float | None = None,
    threshold: float | None = None,
    toxicity_class: int = 0,
) -> torch.Tensor:
    r"""Map raw scores ``r`` (higher = better) to the reward ``R`` used by the target and the losses (§3.2).

    - ``"rlhf"``: ``R = min(r, reward_cap)`` (``reward_cap=None``: no cap).
    - ``"indicator_below_threshold"``: ``R = log(1[r < threshold] + ε)`` with ``ε = INDICATOR_REWARD_EPS = 1e-16``,
      i.e. ``0`` for a bad output (``r < threshold``) and ``log(1e-16) ≈ −36.84`` otherwise. With β = 1,
      ``φ = exp(R)`` is (up to ε) the indicator of a bad output, so ``σ`` is ``p`` restricted to bad outputs.
      ``threshold`` is required.
    - ``"toxicity_class_logprob"``: ``r`` is the logit of the *non-toxic* class of a binary classifier (higher = less
      toxic) and ``R = log P(toxic) = log(1 − sigmoid(r)) = −softplus(r)``; with ``toxicity_class=1``,
      ``R = log sigmoid(r)`` (the log-probability of the class whose logit ``r`` is).

    The target built from ``R`` is ``σ(s) ∝ p(s)·exp(β·R(s))`` with ``log φ = β·R`` (:func:`log_target_weight`):
    β < 0 targets the low-reward (bad) outputs of ``p``, β > 0 the high-reward ones.

    Args:
        raw: raw scores, any shape (usually ``(B,)``); a list of numbers is accepted.
        rm_type: one of :data:`RM_TYPES`.
        reward_cap: upper cap of ``"rlhf"`` rewards (only valid with ``"rlhf"``).
        threshold: the "bad" threshold of ``"indicator_below_threshold"`` (only valid there).
        toxicity_class: ``0`` or ``1``, see above (only used by ``"toxicity_class_logprob"``).

    Returns:
        ``R``, fp32, the shape of ``raw``. The input is never modified.
    """
    _check_rm_type(rm_type)
    r = _as_float_tensor(raw)
    if reward_cap is not None and rm_type != "rlhf":
        raise ValueError(f"reward_cap only applies to rm_type='rlhf'; drop it for rm_type={rm_type!r}.")
    if threshold is not None and rm_type != "indicator_below_threshold":
        raise ValueError(
            f"threshold only applies to rm_type='indicator_below_threshold'; drop it for rm_type={rm_type!r}."
        )
    if rm_type == "rlhf":
        if reward_cap is None:
            return r
        if math.isnan(float(reward_cap)):
            raise ValueError("reward_cap is NaN; pass a number or None for no cap.")
        return r.clamp(max=float(reward_cap))
    if rm_type == "indicator_below_threshold":
        if threshold is None:
            raise ValueError(
                "rm_type='indicator_below_threshold' needs `threshold` (raw scores below it count as bad), e.g. -5.0."
            )
        bad = (r < float(threshold)).to(torch.float32)
        return torch.log(bad + INDICATOR_REWARD_EPS)
    if toxicity_class not in (0, 1):
        raise ValueError(f"toxicity_class must be 0 or 1, got {toxicity_class!r}.")
    return -F.softplus(r) if toxicity_class == 0 else F.logsigmoid(r)


def log_target_weight(reward: torch.Tensor, beta: float) -> torch.Tensor:
    """``log φ = β·R``: the log-potential of the target ``σ(s) ∝ p(s)·exp(β·R(s))`` (§3.1), fp32.

    ``reward`` is the mapped reward ``R`` (:func:`map_reward`). β < 0 targets low-reward outputs, β > 0 high-reward
    ones.
    """
    beta = float(beta)
    if not math.isfinite(beta):
        raise ValueError(f"beta must be a finite number, got {beta}.")
    return _as_float_tensor(reward, "reward") * beta


def transform_reward(
    raw: torch.Tensor,
    transform: str | None,
    *,
    alpha: float,
    beta: float | None = None,
    threshold: float = -5.0,
) -> torch.Tensor:
    r"""A reward transform of the "transformed reward" baselines, applied to the **raw** score ``r`` (§3.3).

    - ``None``: ``r`` unchanged (an fp32 copy).
    - ``"minus_alpha_exp_beta_r"``: ``r' = r − α·exp(β·r)`` (``beta`` required). With β < 0 this penalises low
      rewards steeply; ``E_p[r'] = E_p[r] − α·Z_σ`` with ``Z_σ = E_p[exp(β r)]`` (a soft P(bad)).
    - ``"minus_alpha_indicator"``: ``r' = r − α·1[r < threshold]`` (a fixed penalty on bad outputs).

    The ``rm_type`` map and cap (:func:`map_reward`) are applied *after* the transform.

    Args:
        raw: raw scores, any shape.
        transform: ``None`` or one of :data:`REWARD_TRANSFORMS`.
        alpha: the penalty strength α (≥ 0).
        beta: the exponent β of ``"minus_alpha_exp_beta_r"``.
        threshold: the "bad" threshold of ``"minus_alpha_indicator"`` (default −5, as in the original code).

    Returns:
        ``r'``, fp32, the shape of ``raw``.
    """
    r = _as_float_tensor(raw)
    if transform is None:
        return r
    if transform not in REWARD_TRANSFORMS:
        raise ValueError(f"Unknown reward transform {transform!r}; choose one of {REWARD_TRANSFORMS} or None.")
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"The transform strength alpha must be a finite number >= 0, got {alpha}.")
    if transform == "minus_alpha_exp_beta_r":
        if beta is None:
            raise ValueError("transform='minus_alpha_exp_beta_r' needs `beta` (r' = r - alpha * exp(beta * r)).")
        return r - alpha * torch.exp(float(beta) * r)
    return r - alpha * (r < float(threshold)).to(torch.float32)


@dataclass
class RewardShaping:
    r"""All reward-shaping options in one place; build one from a trainer config and call its methods.

    Parameters:
        rm_type (`str`, defaults to `"rlhf"`): the raw score → ``R`` map, one of :data:`RM_TYPES`
            (see :func:`map_reward`).
        reward_cap (`float` or `None`, defaults to `None`): cap of ``"rlhf"`` rewards, ``R = min(r, cap)``.
        threshold (`float` or `None`, defaults to `None`): the "bad" threshold of ``"indicator_below_threshold"``.
        beta (`float`, defaults to `-1.0`): the target's β in ``σ ∝ p·exp(β·R)``; β < 0 targets bad outputs.
        transform (`str` or `None`, defaults to `None`): reward transform of the raw score, one of
            :data:`REWARD_TRANSFORMS` (see :func:`transform_reward`).
        transform_alpha (`float` or `None`, defaults to `None`): its α; required when ``transform`` is set.
        transform_beta (`float` or `None`, defaults to `None`): the β of ``"minus_alpha_exp_beta_r"``; defaults to
            ``beta``.
        transform_threshold (`float`, defaults to `-5.0`): the threshold of ``"minus_alpha_indicator"``.
        toxicity_class (`int`, defaults to `0`): which class's log-probability ``"toxicity_class_logprob"`` returns
            (0: ``−softplus(r)``, 1: ``logsigmoid(r)``).

    Methods: :meth:`mapped` (``R``), :meth:`log_phi` (``β·R``, always of the untransformed score) and
    :meth:`transformed` (``R'``: transform, then map).
    """

    rm_type: str = "rlhf"
    reward_cap: float | None = None
    threshold: float | None = None
    beta: float = -1.0
    transform: str | None = None
    transform_alpha: float | None = None
    transform_beta: float | None = None
    transform_threshold: float = -5.0
    toxicity_class: int = 0

    def __post_init__(self):
        _check_rm_type(self.rm_type)
        if not math.isfinite(float(self.beta)):
            raise ValueError(f"beta must be a finite number, got {self.beta}.")
        if self.reward_cap is not None and self.rm_type != "rlhf":
            raise ValueError(
                f"reward_cap only applies to rm_type='rlhf'; set reward_cap=None for rm_type={self.rm_type!r}."
            )
        if self.rm_type == "indicator_below_threshold":
            if self.threshold is None:
                raise ValueError("rm_type='indicator_below_threshold' needs `threshold` (e.g. threshold=-5.0).")
            if self.beta <= 0:
                raise ValueError(
                    f"rm_type='indicator_below_threshold' needs beta > 0 (beta=1 makes exp(beta*R) the indicator of "
                    f"a bad output); got beta={self.beta}. Set beta=1.0."
                )
            if self.beta != 1:
                logger.warning(
                    "rm_type='indicator_below_threshold' with beta=%s: exp(beta*R) is then (1[bad] + 1e-16)^beta, "
                    "not the indicator itself; the original code requires beta=1.",
                    self.beta,
                )
        elif self.threshold is not None:
            raise ValueError(
                f"threshold only applies to rm_type='indicator_below_threshold'; set threshold=None for "
                f"rm_type={self.rm_type!r} (the transform's threshold is `transform_threshold`)."
            )
        if self.toxicity_class not in (0, 1):
            raise ValueError(f"toxicity_class must be 0 or 1, got {self.toxicity_class!r}.")
        if self.transform is None:
            if self.transform_alpha is not None or self.transform_beta is not None:
                raise ValueError(
                    "transform_alpha / transform_beta are set but transform is None; set transform to one of "
                    f"{REWARD_TRANSFORMS} or drop them."
                )
            return
        if self.transform not in REWARD_TRANSFORMS:
            raise ValueError(
                f"Unknown reward transform {self.transform!r}; choose one of {REWARD_TRANSFORMS} or None."
            )
        if self.transform_alpha is None:
            raise ValueError(f"transform={self.transform!r} needs transform_alpha (the penalty strength alpha >= 0).")
        if not math.isfinite(float(self.transform_alpha)) or self.transform_alpha < 0:
            raise ValueError(f"transform_alpha must be a finite number >= 0, got {self.transform_alpha}.")
        if self.transform_beta is not None and self.transform != "minus_alpha_exp_beta_r":
            raise ValueError(
                f"transform_beta only applies to transform='minus_alpha_exp_beta_r'; drop it for {self.transform!r}."
            )

    @property
    def effective_transform_beta(self) -> float:
        """The β of ``"minus_alpha_exp_beta_r"``: ``transform_beta``, or ``beta`` when it is unset."""
        return float(self.beta if self.transform_beta is None else self.transform_beta)

    def mapped(self, raw: torch.Tensor) -> torch.Tensor:
        """``R = map_reward(r)`` with this object's ``rm_type``, cap and threshold (fp32)."""
        return map_reward(
            raw,
            self.rm_type,
            reward_cap=self.reward_cap,
            threshold=self.threshold,
            toxicity_class=self.toxicity_class,
        )

    def log_phi(self, raw: torch.Tensor) -> torch.Tensor:
        """``log φ = β·R`` of the **untransformed** raw score: the target ``σ`` never sees the transform (§3.3)."""
        return log_target_weight(self.mapped(raw), self.beta)

    def transformed(self, raw: torch.Tensor) -> torch.Tensor:
        """``R' = map_reward(transform_reward(r))``: the transform on the raw score, then the map and cap (§3.3).

        Without a transform this equals :meth:`mapped`.
        """
        shaped = transform_reward(
            raw,
            self.transform,
            alpha=0.0 if self.transform_alpha is None else self.transform_alpha,
            beta=self.effective_transform_beta,
            threshold=self.transform_threshold,
        )
        return self.mapped(shaped)
