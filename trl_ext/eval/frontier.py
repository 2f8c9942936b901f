r"""Frontier plots: mean reward (or return) against P(r < τ) and against CVaR_α, one point per method.

The RePULSe paper compares methods by where they sit on the reward-vs-P(bad) plane: a method is better when it
reaches the same reward with a lower probability of bad outputs. :func:`plot_frontier` takes, for each method, the
held-out reports of its seeds (as written by :func:`~trl_ext.eval.heldout.eval_heldout`) and:

1. reads from each seed's report the mean of the x metric (``reward`` or ``return``), ``P̂(r < τ)`` and ``CVaR_α``;
2. summarises each metric over the seeds by its mean and a **seed-level** Student-t interval
   ``mean ± t_{n−1} · s / √n`` (:func:`~trl_ext.eval.metrics.t_interval`; the sample-level intervals inside each
   report are not used: seeds are the unit of replication). With one seed the interval is the point itself (and the
   CSV says so in ``note``). The paper used a percentile bootstrap over seeds; with 3–10 seeds the t-interval is
   the standard, wider and better-calibrated choice. Each interval is then **clipped to the metric's support**
   (with few seeds a t-interval can leave it): ``P̂(r < τ)`` to ``[0, 1]``, the mean reward and CVaR to the range of
   rewards sampled in the reports (``reward_range``; reports written before that key only get the probability
   clipping). A threshold below every sampled reward in every report gets a warning: its panel shows only zeros;
3. draws two panels — x vs ``P̂(r < τ)`` (log y axis when every point is positive) and x vs ``CVaR_α`` — with
   error bars in both directions, and writes ``<output_prefix>.png`` and ``<output_prefix>.csv`` atomically
   (a temporary file in the same folder, then ``os.replace``).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence

from .metrics import FrontierMetrics, t_interval

logger = logging.getLogger(__name__)

__all__ = ["CSV_COLUMNS", "X_METRICS", "frontier_table", "load_report", "plot_frontier"]

X_METRICS = ("reward", "return")
CSV_COLUMNS = (
    "method",
    "num_seeds",
    "x_metric",
    "x_mean",
    "x_ci_low",
    "x_ci_high",
    "threshold",
    "p_bad_mean",
    "p_bad_ci_low",
    "p_bad_ci_high",
    "cvar_alpha",
    "cvar_mean",
    "cvar_ci_low",
    "cvar_ci_high",
    "note",
)


def load_report(report: str | os.PathLike | Mapping) -> FrontierMetrics:
    """The frontier metrics of one report: a path to a JSON report, a report dict, or a bare metrics dict."""
    if isinstance(report, (str, os.PathLike)):
        path = os.fspath(report)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No report at {path!r}; pass the JSON files written by eval_heldout.")
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    if not isinstance(report, Mapping):
        raise ValueError(f"A report must be a path or a dict; got {type(report).__name__}.")
    return FrontierMetrics.from_dict(report["metrics"] if "metrics" in report else report)


def _x_value(metrics: FrontierMetrics, x: str) -> float:
    if x == "reward":
        return metrics.reward.value
    if metrics.return_ is None:
        raise ValueError("it has no mean return; plot x='reward' or evaluate with returns.")
    return metrics.return_.value


def frontier_table(
    reports: Mapping[str, Sequence[str | os.PathLike | Mapping]],
    *,
    threshold: float = -5.0,
    cvar_alpha: float = 0.05,
    x: str = "reward",
    confidence: float = 0.95,
) -> list[dict]:
    """One row per method (columns :data:`CSV_COLUMNS`): seed means and seed-level t-intervals of the x metric,
    ``P̂(r < threshold)`` and ``CVaR_cvar_alpha``."""
    if x not in X_METRICS:
        raise ValueError(f"x must be one of {X_METRICS}; got {x!r}.")
    if not reports:
        raise ValueError("reports is empty; pass {method: [report paths or dicts, one per seed]}.")
    rows = []
    for method, seeds in reports.items():
        if isinstance(seeds, (str, os.PathLike, Mapping)):
            seeds = [seeds]
        if not seeds:
            raise ValueError(f"Method {method!r} has no report; pass at least one per method.")
        xs, ps, cs, lows, highs = [], [], [], [], []
        for i, report in enumerate(seeds):
            where = f"report {i} of method {method!r}"
            try:
                metrics = load_report(report)
                xs.append(_x_value(metrics, x))
                ps.append(metrics.tail(threshold).value)
                cs.append(metrics.cvar_at(cvar_alpha).value)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            low, high = metrics.reward_range or (-math.inf, math.inf)
            lows.append(low)
            highs.append(high)
        support = {"p_bad": (0.0, 1.0), "cvar": (min(lows), max(highs))}
        if x == "reward":  # a return also holds the KL penalty, outside the reward's range
            support["x"] = support["cvar"]
        row = {"method": str(method), "num_seeds": len(seeds), "x_metric": x}
        for name, values in (("x", xs), ("p_bad", ps), ("cvar", cs)):
            mean, low, high = t_interval(values, confidence)
            bottom, top = support.get(name, (-math.inf, math.inf))
            row.update({f"{name}_mean": mean, f"{name}_ci_low": max(low, bottom), f"{name}_ci_high": min(high, top)})
        row["threshold"], row["cvar_alpha"] = float(threshold), float(cvar_alpha)
        row["note"] = "one seed: no interval" if len(seeds) == 1 else f"{confidence:.0%} t-interval over seeds"
        rows.append({column: row[column] for column in CSV_COLUMNS})
    _warn_if_no_event(rows, threshold, reports)
    return rows


def _warn_if_no_event(rows: list[dict], threshold: float, reports) -> None:
    """Warn when no report saw a reward below ``threshold``: P̂(r < τ) is 0 everywhere and the panel is blank."""
    if rows and all(row["p_bad_mean"] == 0 for row in rows):
        ranges = []
        for seeds in reports.values():
            for report in [seeds] if isinstance(seeds, (str, os.PathLike, Mapping)) else seeds:
                if (found := load_report(report).reward_range) is not None:
                    ranges.append(found)
        seen = f" (the sampled rewards span [{min(r[0] for r in ranges):g}, {max(r[1] for r in ranges):g}])"
        logger.warning(
            "plot_frontier: no report has a reward below threshold=%g%s, so every P(r < %g) is 0 and that panel "
            "is blank; pick a threshold inside the rewards' range (e.g. -0.5 for a 0/-1 reward).",
            threshold, seen if ranges else "", threshold,
        )  # fmt: skip


def _atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then move it onto ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    suffix = os.path.splitext(path)[1]
    fd, tmp = tempfile.mkstemp(prefix=".frontier-", suffix=suffix + ".tmp", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _write_csv(rows: list[dict], path: str) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(buffer.getvalue())

    return _atomic_write(path, write)


def _errors(row: dict, name: str) -> list[list[float]]:
    mean = row[f"{name}_mean"]
    return [[mean - row[f"{name}_ci_low"]], [row[f"{name}_ci_high"] - mean]]


def _plot(rows: list[dict], path: str, *, threshold: float, cvar_alpha: float, x: str, confidence: float) -> str:
    try:
        import matplotlib
        from matplotlib.figure import Figure  # a bare Figure renders with Agg; pyplot's backend is left alone
    except ImportError as err:
        raise ImportError("plot_frontier draws with matplotlib: `pip install matplotlib`.") from err

    figure = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = figure.subplots(1, 2)
    markers = "osD^vP*Xh<>p"
    colours = matplotlib.colormaps["tab10"]
    for i, row in enumerate(rows):
        style = {"fmt": markers[i % len(markers)], "color": colours(i % 10), "capsize": 3, "label": row["method"]}
        left.errorbar(row["x_mean"], row["p_bad_mean"], xerr=_errors(row, "x"), yerr=_errors(row, "p_bad"), **style)
        right.errorbar(row["x_mean"], row["cvar_mean"], xerr=_errors(row, "x"), yerr=_errors(row, "cvar"), **style)
    if all(row["p_bad_ci_low"] > 0 for row in rows):  # a log axis would drop whiskers that reach 0
        left.set_yscale("log")
    x_label = "mean reward" if x == "reward" else "mean return (reward − KL penalty)"
    left.set_xlabel(x_label)
    right.set_xlabel(x_label)
    left.set_ylabel(f"P(r < {threshold:g})")
    right.set_ylabel(f"CVaR$_{{{cvar_alpha:g}}}$ (mean of the worst {100 * cvar_alpha:g}% of rewards)")
    left.set_title(f"{x_label} vs P(r < {threshold:g})")
    right.set_title(f"{x_label} vs CVaR$_{{{cvar_alpha:g}}}$")
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
    left.legend(title="method", fontsize="small")
    figure.suptitle(f"Error bars: {confidence:.0%} t-interval over seeds", fontsize="small")
    return _atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))


def plot_frontier(
    reports: Mapping[str, Sequence[str | os.PathLike | Mapping]],
    *,
    output_prefix: str | os.PathLike,
    threshold: float = -5.0,
    cvar_alpha: float = 0.05,
    x: str = "reward",
    confidence: float = 0.95,
) -> dict:
    """Plot each method's seed-averaged x metric against ``P̂(r < threshold)`` and ``CVaR_cvar_alpha``.

    Args:
        reports: ``{method: [report, ...]}``, one report per seed: a path to a JSON report written by
            :func:`~trl_ext.eval.heldout.eval_heldout`, the report dict it returned, or a bare metrics dict.
        output_prefix: writes ``<output_prefix>.png`` and ``<output_prefix>.csv`` (folders are created).
        threshold: the ``τ`` of ``P̂(r < τ)``; every report must hold it.
        cvar_alpha: the ``α`` of ``CVaR_α``; every report must hold it.
        x: ``"reward"`` (mean raw reward) or ``"return"`` (mean reward minus the KL penalty).
        confidence: the seed-level intervals' confidence level.

    Returns:
        ``{"rows": [...], "png_path", "csv_path", "threshold", "cvar_alpha", "x", "confidence", "interval"}``; the
        rows are those of the CSV (:func:`frontier_table`).
    """
    rows = frontier_table(reports, threshold=threshold, cvar_alpha=cvar_alpha, x=x, confidence=confidence)
    prefix = os.fspath(output_prefix)
    csv_path = _write_csv(rows, prefix + ".csv")
    png_path = _plot(rows, prefix + ".png", threshold=threshold, cvar_alpha=cvar_alpha, x=x, confidence=confidence)
    return {
        "rows": rows,
        "png_path": png_path,
        "csv_path": csv_path,
        "threshold": float(threshold),
        "cvar_alpha": float(cvar_alpha),
        "x": x,
        "confidence": float(confidence),
        "interval": "Student-t interval of the mean over seeds (the point itself with one seed)",
    }
