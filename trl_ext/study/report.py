r"""The study's results: one row per frontier point (method, setting, updates) with seed-level intervals, a CSV,
a four-panel frontier figure and a text table.

A *point* pools the runs of one method setting at one number of updates over the seeds. Each metric is summarised
by its mean over seeds and a Student-t interval ``mean ± t_{n−1} · s / √n`` over the seeds
(:func:`~trl_ext.eval.metrics.t_interval`): seeds are the unit of replication, so the interval includes the
training noise, not only the sampling noise of one evaluation. With one seed the interval is the point itself.
Intervals of probabilities (``p_bad_*``, ``p_offensive_mean``) are clipped to ``[0, 1]``, their support: with three
seeds a t-interval around a small probability would otherwise reach below zero.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections import defaultdict

from ..eval.metrics import metric_key, t_interval

__all__ = [
    "bad_name",
    "format_rare_table",
    "format_table",
    "frontier_rows",
    "plot_study",
    "rare_rows",
    "threshold_labels",
    "write_csv",
]

_METRICS = ("reward", "return", "kl", "cvar", "p_offensive_mean")


def _values(evaluation: dict, cvar_alpha: float) -> dict:
    metrics = evaluation["metrics"]
    out = {
        "reward": metrics["reward"]["value"],
        "return": (metrics.get("return") or {}).get("value", float("nan")),
        "kl": (metrics.get("kl") or {}).get("value", 0.0),
        "cvar": metrics["cvar"][metric_key(cvar_alpha)]["value"],
        "p_offensive_mean": evaluation.get("p_offensive_mean", float("nan")),  # offensiveness reward only
    }
    for name, tau in evaluation["p_offensive_threshold_map"].items():
        out[f"p_bad_{_label(name)}"] = metrics["p_bad"][metric_key(tau)]["value"]
    return out


def _label(name: str) -> str:
    """A threshold's column label: ``0.5`` for P(p_offensive > 0.5), ``r<-2`` for P(r < -2)."""
    try:
        return f"{float(name):g}"
    except ValueError:
        return name


def threshold_labels(summaries: list[dict]) -> list[str]:
    """The labels of the thresholds every evaluation reports (:func:`frontier_rows`' ``p_bad_<label>`` columns)."""
    return [_label(n) for n in summaries[0]["evals"][0]["p_offensive_threshold_map"]] if summaries else []


def frontier_rows(summaries: list[dict], confidence: float = 0.95) -> list[dict]:
    """One row per (method, setting, updates): ``<metric>_mean``, ``_ci_low``, ``_ci_high`` over the seeds."""
    if not summaries:
        return []
    alpha = summaries[0]["study"]["cvar_alpha"]
    labels = threshold_labels(summaries)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    seconds: dict[tuple, list[float]] = defaultdict(list)
    for summary in summaries:
        run = summary["run"]
        for evaluation in summary["evals"]:
            key = (run["method"], run["setting"], evaluation["updates"])
            groups[key].append(_values(evaluation, alpha))
            if "seconds_per_update" in summary:
                seconds[key].append(summary["seconds_per_update"])
    rows = []
    for (method, setting, updates), values in groups.items():
        row = {"method": method, "setting": setting, "updates": updates, "num_seeds": len(values)}
        names = [*_METRICS, *(f"p_bad_{label}" for label in labels)]
        for name in names:
            column = [v[name] for v in values]
            if any(math.isnan(x) for x in column):  # not measured (e.g. p_offensive under a reward model)
                row.update({f"{name}_mean": math.nan, f"{name}_ci_low": math.nan, f"{name}_ci_high": math.nan})
                continue
            mean, low, high = t_interval(column, confidence)
            if name.startswith("p_"):  # probabilities: keep the interval inside their support
                low, high = max(low, 0.0), min(high, 1.0)
            row.update({f"{name}_mean": mean, f"{name}_ci_low": low, f"{name}_ci_high": high})
        spu = seconds.get((method, setting, updates))
        row["seconds_per_update"] = sum(spu) / len(spu) if spu else float("nan")
        rows.append(row)
    return rows


def write_csv(rows: list[dict], path: str) -> str:
    """Write the rows (atomically: a temporary file, then ``os.replace``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(buffer.getvalue())
    os.replace(tmp, path)
    return path


def _err(row: dict, name: str) -> list[list[float]]:
    mean = row[f"{name}_mean"]
    return [[mean - row[f"{name}_ci_low"]], [row[f"{name}_ci_high"] - mean]]


def bad_name(label: str) -> str:
    """The words for a threshold label: ``P(p_offensive > 0.5)``, ``P(r < -2)``."""
    return f"P({label.replace('<', ' < ')})" if label.startswith("r<") else f"P(p_offensive > {label})"


def plot_study(rows: list[dict], path: str, *, label: str, cvar_alpha: float, title: str = "") -> str:
    """Four panels — mean reward vs P(bad) at the threshold ``label``, vs CVaR, vs KL, and P(bad) vs KL — one colour
    per method, its points joined in knob order, the initial model as a black star; error bars: seed-level
    intervals."""
    import matplotlib
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 9.5), layout="constrained")
    axes = figure.subplots(2, 2)
    panels = [
        (axes[0, 0], f"p_bad_{label}", "reward", bad_name(label), "mean reward"),
        (axes[0, 1], "cvar", "reward", f"CVaR$_{{{cvar_alpha:g}}}$ of the reward", "mean reward"),
        (axes[1, 0], "kl", "reward", "KL(π ‖ π_0) per response", "mean reward"),
        (axes[1, 1], "kl", f"p_bad_{label}", "KL(π ‖ π_0) per response", bad_name(label)),
    ]
    colours = matplotlib.colormaps["tab10"]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "initial"]
    for axis, x_name, y_name, x_label, y_label in panels:
        for row in (r for r in rows if r["method"] == "initial"):
            axis.errorbar(row[f"{x_name}_mean"], row[f"{y_name}_mean"], xerr=_err(row, x_name),
                          yerr=_err(row, y_name), fmt="*", color="black", markersize=12, capsize=3,
                          label="initial")  # fmt: skip
        for i, method in enumerate(methods):
            points = sorted((r for r in rows if r["method"] == method), key=lambda r: r[f"{x_name}_mean"])
            colour = colours(i % 10)
            axis.plot([r[f"{x_name}_mean"] for r in points], [r[f"{y_name}_mean"] for r in points], color=colour,
                      alpha=0.35)  # fmt: skip
            for j, row in enumerate(points):
                axis.errorbar(row[f"{x_name}_mean"], row[f"{y_name}_mean"], xerr=_err(row, x_name),
                              yerr=_err(row, y_name), fmt="o", color=colour, capsize=3,
                              label=method if j == 0 else None)  # fmt: skip
        axis.set_xlabel(x_label)
        axis.set_ylabel(y_label)
        axis.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    figure.suptitle((title + "\n" if title else "") + "error bars: 95% t-intervals over seeds", fontsize="medium")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    figure.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)
    return path


def format_table(rows: list[dict], label: str):
    """A `rich` table of the rows (mean [CI] per metric)."""
    from rich.table import Table

    def cell(row, name, fmt):
        return f"{row[f'{name}_mean']:{fmt}} [{row[f'{name}_ci_low']:{fmt}}, {row[f'{name}_ci_high']:{fmt}}]"

    table = Table(title="Held-out frontier points (mean over seeds [95% t-interval])")
    for column in ("method", "setting", "upd", "seeds", "mean reward", bad_name(label), "CVaR", "KL",
                   "s/update"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("method", "setting") else "right")
    for row in rows:
        table.add_row(
            row["method"], row["setting"], str(row["updates"]), str(row["num_seeds"]), cell(row, "reward", ".3f"),
            cell(row, f"p_bad_{label}", ".3f"), cell(row, "cvar", ".2f"), cell(row, "kl", ".2f"),
            f"{row['seconds_per_update']:.1f}",
        )  # fmt: skip
    return table


def rare_rows(results: list[dict]) -> list[dict]:
    """One row per (method, setting, prompt) of the rare stage's results (:mod:`trl_ext.study.rare`)."""
    rows = []
    for result in results:
        for entry in result["prompts"]:
            rows.append({
                "method": result["run"]["method"], "setting": result["run"]["setting"], "seed": result["run"]["seed"],
                "category": entry["category"], "estimate": entry["estimate"], "std_error": entry["std_error"],
                "reliable": entry["reliable"], "prompt": entry["prompt"],
            })  # fmt: skip
    return rows


def format_rare_table(rows: list[dict], question: str):
    """A `rich` table of :func:`rare_rows` (estimate ± standard error; unreliable intervals marked)."""
    from rich.table import Table

    table = Table(title=question)
    for column in ("method", "setting", "seed", "category", "estimate ± SE", "reliable"):
        table.add_column(column, justify="left" if column in ("method", "setting", "category") else "right")
    for row in rows:
        estimate = f"{row['estimate']:.3e} ± {row['std_error']:.1e}"
        reliable = "yes" if row["reliable"] else "NO"
        table.add_row(row["method"], row["setting"], str(row["seed"]), row["category"], estimate, reliable)
    return table
