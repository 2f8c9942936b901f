"""The online trainers' logged metrics (PPO's under TRL's names) and the sample-completion tables.

- :class:`OnlineMetrics` (PPO, RePULSe, the proposal trainer): collects rollout and micro-batch metrics between two
  logs and hands their averages to `Trainer.log` (``val/ratio_var`` is the variance of the micro-batch ratios,
  ``loss/*_avg`` the mean minibatch loss, i.e. the sum of its micro-batch losses, so it does not depend on the
  accumulation split), averaged over processes; :meth:`OnlineMetrics.add_reward_components` adds
  ``rewards/<name>/mean`` and ``/std`` of each function of a reward list;
- :func:`rollout_metrics`: PPO's values of one rollout (``objective/*``, ``val/num_eos_tokens``);
- :func:`print_completions_table` / :func:`log_completions_table`: rich table; wandb / trackio / comet tables.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict

import torch

from ..._deprecation import moved_names
from ...losses import LossOutput
from ...ops import masked_mean, masked_sum
from ...rollout.reward_list import reward_component_metrics

__all__ = [
    "OnlineMetrics",
    "log_completions_table",
    "log_reward_components",
    "print_completions_table",
    "rollout_metrics",
]

logger = logging.getLogger(__name__)


def rollout_metrics(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    kl: torch.Tensor | None,
    non_score_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    contains_stop: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Scalar tensors of one rollout: per-sequence sums averaged over sequences (TRL's definitions). ``kl=None``
    (no reference scored, ``kl_coef == 0``): ``objective/kl`` and ``objective/kl_token_mean`` are left out."""
    mask = response_mask
    non_score = masked_sum(non_score_rewards, mask, dim=-1).mean()
    kl_metrics = {}
    if kl is not None:
        kl_metrics = {
            "objective/kl": masked_sum(kl, mask, dim=-1).mean(),
            "objective/kl_token_mean": masked_mean(kl, mask),
        }
    return {
        **kl_metrics,
        "objective/entropy": masked_sum(-logprobs, mask, dim=-1).mean(),
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": non_score + scores.mean(),
        "objective/scores": scores.mean(),
        "val/num_eos_tokens": contains_stop.float().sum(),
    }


class OnlineMetrics:
    """Metrics collected between two `Trainer` logs."""

    def __init__(self):
        self.values: dict[str, list[float]] = defaultdict(list)
        self.scalars: dict[str, float] = {}
        self._minibatch: dict[str, float] = defaultdict(float)

    def add(self, key: str, value: float) -> None:
        self.values[key].append(float(value))

    def add_rollout(self, values: dict[str, torch.Tensor], timings: dict[str, float], generated_tokens: int, gather):
        """Record :func:`rollout_metrics` averaged over processes (``val/num_eos_tokens`` summed; ``gather`` is
        ``accelerator.gather``), the rollout's timings and the generation throughput ``tokens_per_second``."""
        stacked = gather(torch.stack([v.float() for v in values.values()]).unsqueeze(0))
        for key, column in zip(values, stacked.T):
            self.add(key, column.sum() if key == "val/num_eos_tokens" else column.mean())
        generation = timings.get("generation", 0.0)
        self.add("timing/generation", generation)
        self.add("timing/scoring", timings.get("scoring", 0.0))
        self.add("tokens_per_second", generated_tokens / max(generation, 1e-9))

    def add_micro_batch(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        entropy: torch.Tensor,
        mask: torch.Tensor,
        policy: LossOutput,
        value: LossOutput | None,
        first_minibatch: bool,
        last_micro_batch: bool,
    ) -> None:
        """Record one micro-step. ``first_minibatch``: the first minibatch of the rollout's first epoch (no update
        yet, so recomputed log-probs must equal the sampling ones: ``objective/logprob_diff_first_step`` is their
        largest absolute difference). ``last_micro_batch``: the minibatch is complete."""
        with torch.no_grad():
            log_ratio = logprobs.detach() - old_logprobs
            self.add("policy/approxkl_avg", 0.5 * masked_mean(log_ratio.square(), mask))
            self.add("val/ratio", masked_mean(log_ratio.exp(), mask))
            self.add("policy/clipfrac_avg", policy.metrics.get("clipfrac", 0.0))
            self.add("policy/entropy_avg", masked_mean(entropy, mask))
            self._minibatch["loss/policy_avg"] += float(policy.loss.detach())
            if value is not None:
                self._minibatch["loss/value_avg"] += float(value.loss.detach())
                self.add("val/clipfrac_avg", value.metrics["clipfrac"])
            if first_minibatch:
                diff = float(torch.where(mask != 0, log_ratio.abs(), torch.zeros_like(log_ratio)).max())
                key = "objective/logprob_diff_first_step"
                self._minibatch[key] = max(self._minibatch[key], diff)
        if last_micro_batch:
            for key, total in self._minibatch.items():
                self.add(key, total)
            self._minibatch.clear()

    def pop(self, gather_object=None) -> dict[str, float]:
        """Averages since the last call (plus ``val/ratio_var`` and the latest scalars such as ``episode``).

        ``gather_object`` (e.g. `accelerate.utils.gather_object`, with several processes): every process's averages
        are combined, so the log describes the whole run and not the main process's share of it: the mean over
        processes (the largest value for ``*logprob_diff*``), ``val/ratio_var`` over every process's micro-batches.
        It is a collective call: every process must call :meth:`pop` at the same logs."""
        logs = {key: sum(v) / len(v) for key, v in self.values.items() if v}
        ratios = list(self.values.get("val/ratio", []))
        if gather_object is not None:
            shares = gather_object([(logs, ratios)])
            logs, ratios = {}, [r for _, share in shares for r in share]
            for key in sorted({key for share, _ in shares for key in share}):
                values = [share[key] for share, _ in shares if key in share]
                logs[key] = max(values) if "logprob_diff" in key else sum(values) / len(values)
        if not logs:
            return logs
        if ratios:
            logs["val/ratio_var"] = statistics.pvariance(ratios)
        logs.update(self.scalars)
        self.values.clear()
        return logs

    def add_reward_components(self, rollout, gather=None, prefix: str = "rewards/") -> None:
        """``{prefix}<name>/mean`` and ``/std`` of each reward function of ``rollout`` (over every process's rows,
        ``gather``); nothing for a single reward."""
        log_reward_components(self, rollout, gather, prefix)


def print_completions_table(rows: list[dict], max_rows: int = 5, title: str | None = None) -> None:
    """Print the first ``max_rows`` rows (dicts with the same keys) as a rich table."""
    if not rows:
        return
    from rich.console import Console
    from rich.table import Table

    columns = list(rows[0])
    table = Table(show_lines=True, title=title)
    for column in columns:
        table.add_column(column)
    for row in rows[:max_rows]:
        table.add_row(*(f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    Console().print(table)


def log_completions_table(rows: list[dict], report_to: list[str]) -> None:
    """Log the rows as a ``completions`` table to the trackers in ``report_to`` (wandb, trackio, comet_ml)."""
    if not rows:
        return
    columns = list(rows[0])
    data = [[row[c] for c in columns] for row in rows]
    if "wandb" in report_to:
        try:
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(columns=columns, data=data)})
        except ImportError:
            logger.warning("report_to includes wandb but wandb is not installed: completions table not logged.")
    if "trackio" in report_to:
        try:
            import pandas as pd
            import trackio

            trackio.log({"completions": trackio.Table(dataframe=pd.DataFrame(data, columns=columns))})
        except ImportError:
            logger.warning("report_to includes trackio but trackio is not installed: completions table not logged.")
    if "comet_ml" in report_to:
        try:
            import pandas as pd
            from trl.trainer.utils import log_table_to_comet_experiment

            log_table_to_comet_experiment(name="completions.csv", table=pd.DataFrame(data, columns=columns))
        except ImportError:
            logger.warning("report_to includes comet_ml but it is not usable: completions table not logged.")


def log_reward_components(metrics, rollout, gather=None, prefix: str = "rewards/") -> None:
    """Add ``{prefix}<name>/mean`` and ``/std`` of each reward function of ``rollout`` (over every process's rows,
    ``gather``) to ``metrics`` (anything with ``add(key, value)``); nothing for a single reward."""
    for key, value in reward_component_metrics(rollout.reward_components, gather, prefix).items():
        metrics.add(key, value)


# PPOMetrics was PPO's; every online trainer uses it now, under its new name.
__getattr__ = moved_names(__name__, {"PPOMetrics": "trl_ext.trainers.common.metrics:OnlineMetrics"})
