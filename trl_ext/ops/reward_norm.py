"""Running normalisation of rewards (``normalize_reward=True`` of `PPOConfig` and `HarmlessnessConfig`).

:class:`RunningMoments` keeps the count ``n``, the mean ``μ`` and the sum of squared deviations ``M2`` of every score
seen so far (in float64), across all processes: the trainer gathers each rollout's scores from every process and
feeds the concatenation to :meth:`RunningMoments.update`, so every process holds the same statistics. A batch is
merged with Chan et al.'s parallel rule (the batch's own ``n_b``, ``μ_b``, ``M2_b`` are computed first)::

    δ  = μ_b − μ
    n' = n + n_b
    μ' = μ + δ · n_b / n'
    M2' = M2 + M2_b + δ² · n · n_b / n'

so updating with batches one by one, or merging the statistics of several processes (:meth:`RunningMoments.merge`),
gives the mean and variance of all the scores together. The reward is then

    normalised = (score − μ) / max(σ, eps),    σ = sqrt(M2 / (n − 1))  (unbiased; 0 while n < 2)

with the statistics *after* this rollout's update (the first rollout is normalised with its own mean and std, as in
OpenRLHF and TRL ≤ 0.11's ``use_score_norm``). ``eps = 1e-8``: identical scores give 0, never a division by 0.

``state_dict()`` / ``load_state_dict()`` carry the statistics through checkpoints (``reward_normalizer.json``, see
`trl_ext.trainers.common.checkpoint`); JSON keeps Python floats exactly, so a resumed run normalises exactly as an
uninterrupted one.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RunningMoments"]

DEFAULT_EPS = 1e-8


class RunningMoments:
    """Running count, mean and variance of scalar scores (see the module docs for the rules).

    Args:
        eps: floor of the standard deviation in :meth:`normalize`.
    """

    def __init__(self, eps: float = DEFAULT_EPS) -> None:
        if not eps > 0:
            raise ValueError(f"eps={eps}: the floor of the standard deviation must be > 0.")
        self.eps = float(eps)
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    # ------------------------------------------------------------------------------------------ statistics
    @property
    def var(self) -> float:
        """Unbiased variance ``M2 / (n − 1)`` (``0.0`` while fewer than two scores were seen)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        """Unbiased standard deviation ``sqrt(var)``."""
        return math.sqrt(max(self.var, 0.0))

    def _merge(self, count: int, mean: float, m2: float) -> None:
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total

    def update(self, scores: torch.Tensor) -> None:
        """Add the scores ``(...)`` (any shape; flattened, computed in float64). Non-finite scores are refused."""
        values = scores.detach().reshape(-1).to(dtype=torch.float64)
        if values.numel() == 0:
            return
        if not bool(torch.isfinite(values).all()):
            raise ValueError(
                "normalize_reward: a score is NaN or infinite; the running mean/std would be lost for the rest of the "
                "run. Check the reward model (or reward function) for non-finite outputs."
            )
        mean = values.mean()
        self._merge(values.numel(), float(mean), float(((values - mean) ** 2).sum()))

    def merge(self, other: RunningMoments) -> None:
        """Add the statistics of ``other`` (e.g. another process's), as if its scores had been passed to
        :meth:`update`."""
        self._merge(other.count, other.mean, other.m2)

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """``(scores − mean) / max(std, eps)`` with the current statistics, in ``scores``' dtype and device (computed
        in float64)."""
        scale = max(self.std, self.eps)
        return ((scores.to(torch.float64) - self.mean) / scale).to(scores.dtype)

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "eps": self.eps}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
        self.eps = float(state.get("eps", self.eps))

    def __repr__(self) -> str:
        return f"RunningMoments(count={self.count}, mean={self.mean:.6g}, std={self.std:.6g})"
