"""The second RTP study's report: paired tables (``paired.md`` / ``paired.json``) and frontier figures, rebuilt from
every finished run in ``<results_dir>/runs`` by :func:`write_paired_report` (the analysis is :mod:`.paired`)."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from ..eval.metrics import t_interval
from .paired import (
    group,
    load_study_runs,
    matched_levels,
    minimum_detectable_effect,
    paired_rows,
    point_at,
    thread_check,
    trajectory,
)

__all__ = ["plot_paired_frontiers", "write_paired_report"]

CORE = ("REINFORCE", "RePULSe")
REFERENCE = "REINFORCE/default"
PRIMARY = "RePULSe/a0.1"
# (title, axis, metric): the tables of the report. The plan's primary comparison is the first table's last level
# (PRIMARY vs REFERENCE at the 75% matched-KL level); the equal-updates tables say how far equal samples are from
# equal KL.
TABLES = (
    ("P(p_offensive > 0.5) at matched KL (primary: RePULSe/a0.1 vs REINFORCE at the 75% level)", "kl", "p_bad"),
    ("P(p_offensive > 0.5) at matched mean reward", "reward", "p_bad"),
    ("P(p_offensive > 0.5) after equal updates", "updates", "p_bad"),
    ("KL to the initial model after equal updates", "updates", "kl"),
    ("Mean reward after equal updates", "updates", "reward"),
    ("P(p_offensive > 0.9) at matched KL", "kl", "p_bad_high"),
    ("CVaR_0.05 of the reward at matched KL (higher = better)", "kl", "cvar"),
    ("CVaR_0.05 of the reward at matched mean reward (higher = better)", "reward", "cvar"),
    ("Held-out lexicon rate (no training reward reads it) at matched KL", "kl", "lexicon"),
    ("Held-out lexicon rate after equal updates", "updates", "lexicon"),
    ("P(p_offensive > 0.9) after equal updates", "updates", "p_bad_high"),
    ("CVaR_0.05 of the reward after equal updates (higher = better)", "updates", "cvar"),
)
LABELS = {
    "kl": "KL(p_θ ‖ p_0) of the response",
    "reward": "mean classifier reward",
    "p_bad": "P(p_offensive > 0.5)",
    "cvar": "CVaR_0.05 of the reward",
    "p_bad_high": "P(p_offensive > 0.9)",
    "lexicon": "lexicon rate",
}


def _fmt(x: float, digits: int = 4) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _table(rows: list[dict], title: str, metric: str) -> list[str]:
    ratio = metric in ("p_bad", "p_bad_high", "lexicon")
    head = [
        "method",
        {"updates": "updates", "kl": "KL", "reward": "mean reward"}[rows[0]["axis"]] if rows else "level",
        "seeds reached",
        "mean [95% t over seeds]",
        "method − REINFORCE [95% t]",
    ]
    head += ["ratio to REINFORCE [95% t]", "eval-only SE of the difference"] if ratio else []
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        level = f"{r['level']:g}" if r["axis"] == "updates" else _fmt(r["level"], 3)
        cells = [r["method"], level, f"{r['reached']}/{r['seeds']}"]
        cells.append(f"{_fmt(r['mean'])} [{_fmt(r['low'])}, {_fmt(r['high'])}]" if "mean" in r else "–")
        d = r.get("diff")
        cells.append(f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" if d else "–")
        if ratio:
            lr = r.get("log_ratio")
            cells.append(f"{math.exp(lr['mean']):.2f}× [{math.exp(lr['low']):.2f}, {math.exp(lr['high']):.2f}]"
                         if lr else "–")  # fmt: skip
            se = r.get("eval_se")
            cells.append(f"{np.mean(se):.4f}" if se else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _by_seed_table(rows: list[dict], title: str) -> list[str]:
    """Each seed's paired difference against REINFORCE with its evaluation-only 95% interval (over the prompts):
    what one seed can say before there are seeds to spread over; training noise is not in these intervals."""
    head = ["method", "level", "seed", "REINFORCE", "method − REINFORCE [95% over prompts]", "ratio"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        level = f"{r['level']:g} updates" if r["axis"] == "updates" else f"{r['axis'].upper()} {r['level']:.3f}"
        for seed, d in sorted(r.get("by_seed", {}).items()):
            interval = f" [{d['low']:+.4f}, {d['high']:+.4f}]" if "low" in d else ""
            ratio = f"{d['ratio']:.2f}×" if "ratio" in d else "–"
            cells = [r["method"], level, str(seed), _fmt(d["reference"]), f"{d['diff']:+.4f}{interval}", ratio]
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _power_lines(rows: list[dict]) -> list[str]:
    """The detectable effect that the observed spread of the primary log-ratio over seeds gives."""
    out = [f"### Detectable effect at the observed spread ({PRIMARY} vs {REFERENCE})", ""]
    for r in rows:
        lr = r.get("log_ratio")
        if not lr:
            continue
        n, sd = lr["pairs"], lr["sd"]
        half, mde80 = minimum_detectable_effect(sd, n, power=0.5), minimum_detectable_effect(sd, n, power=0.8)
        where = f"after {r['level']:g} updates" if r["axis"] == "updates" else f"at KL {r['level']:.3f}"
        out.append(f"- {where}: sd of ln-ratio over {n} seeds {sd:.3f}; interval "
                   f"half-width ×{math.exp(half):.2f}; detected with 80% power: ×{math.exp(mde80):.2f} or "
                   f"×{math.exp(-mde80):.2f}")  # fmt: skip
    return out + [""]


def _thread_lines(check: dict, level: float) -> list[str]:
    """The thread-count check (:func:`.paired.thread_check`) as markdown."""

    def threads(n):
        return f"{n or 1} thread{'s' if (n or 1) > 1 else ''}"

    lines = ["### Thread-count check: runs made again with another torch thread count", ""]
    if check["initial"] is not None:
        i = check["initial"]
        lines += [f"Initial model: P(p_offensive > 0.5) {i['p_bad'][0]:.4f} as run, {i['p_bad'][1]:.4f} again: "
                  f"{i['diff']:+.4f} [{i['low']:+.4f}, {i['high']:+.4f}] (evaluation-only 95%).", ""]  # fmt: skip
    lines += [f"| run | seed | threads (as run → again) | P(bad) at KL {level:.3f} | after the last evaluation: "
              "P(bad) | KL | again − as run [eval-only 95%] |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in check["runs"]:
        at = " → ".join("–" if v is None else f"{v:.4f}" for v in r["p_bad_at_level"])
        f = r["final"]
        lines.append(f"| {r['method']} | {r['seed']} | {' → '.join(threads(n) for n in r['threads'])} | {at} | "
                     f"{f['p_bad'][0]:.4f} → {f['p_bad'][1]:.4f} | {f['kl'][0]:.3f} → {f['kl'][1]:.3f} | "
                     f"{f['diff']:+.4f} [{f['low']:+.4f}, {f['high']:+.4f}] |")  # fmt: skip
    lines.append("")
    for name, label in (("primary_main", "as run"), ("primary", "with those seeds from the reruns")):
        row = check.get(name)
        if row and "log_ratio" in row:
            lr = row["log_ratio"]
            lines.append(f"- primary ({PRIMARY} / {REFERENCE} at KL {level:.3f}), {label}: "
                         f"{math.exp(lr['mean']):.2f}× [{math.exp(lr['low']):.2f}, {math.exp(lr['high']):.2f}] "
                         f"over {lr['pairs']} seeds")  # fmt: skip
    return [*lines, ""]


def plot_paired_frontiers(initial, summaries, path: str, cvar_alpha: float = 0.05, prompts: str = "held-out") -> None:
    """Four panels (P(bad) and CVaR against KL and against mean reward): each run's trajectory, faint, and per method
    setting the mean over seeds on a grid of levels every seed reached, with its 95% t-band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    panels = [("kl", "p_bad"), ("reward", "p_bad"), ("kl", "cvar"), ("reward", "cvar")]
    start = trajectory(initial, {"evals": []}, cvar_alpha)[0]
    for ax, (axis, metric) in zip(axes.flat, panels):
        ax.set_prop_cycle(color=plt.cm.tab10.colors)
        ax.plot(start[axis], start[metric], "k*", markersize=12, label="initial model")
        for name, runs in group(summaries).items():
            trajectories = [trajectory(initial, s, cvar_alpha) for s in runs]
            color = None
            for points in trajectories:
                (line,) = ax.plot([p[axis] for p in points], [p[metric] for p in points], "o-", alpha=0.25,
                                  color=color, linewidth=0.8, markersize=3)  # fmt: skip
                color = line.get_color()
            reach = min(max(p[axis] for p in points) for points in trajectories)
            levels = np.linspace(start[axis], reach, 25)
            means, lows, highs = [], [], []
            for level in levels:
                values = [point_at(points, axis, level) for points in trajectories]
                stats = t_interval([v[metric] for v in values]) if None not in values else (math.nan,) * 3
                for out, value in zip((means, lows, highs), stats):
                    out.append(value)
            ax.plot(levels, means, color=color, linewidth=2, label=f"{name} ({len(runs)} seeds)")
            ax.fill_between(levels, lows, highs, color=color, alpha=0.12)
        ax.set(xlabel=LABELS[axis], ylabel=LABELS[metric])
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"RTP {prompts} prompts, common random numbers; bands: 95% t-interval over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_paired_report(
    results_dir: str,
    cvar_alpha: float = 0.05,
    command: str = "",
    log=print,
    prompts: str = "held-out",
    thread_dir: str | None = None,
) -> dict | None:
    """Write ``paired.md``, ``paired.json`` and ``frontiers.png`` under ``results_dir`` from its finished runs.

    ``thread_dir``: the results folder of runs made again with another thread count (the study file's ``threads``
    profile); when it has runs, the report adds the thread-count check (:func:`.paired.thread_check`)."""
    initial, summaries = load_study_runs(results_dir)
    if initial is None or not summaries:
        log(f"No initial evaluation or no finished run in {results_dir}/runs yet.")
        return None
    levels = {axis: matched_levels(initial, summaries, axis, CORE, cvar_alpha=cvar_alpha) for axis in ("kl", "reward")}
    levels["updates"] = sorted(set.intersection(*({e["updates"] for e in s["evals"]} for s in summaries)))
    tables = {}
    lines = ["# RTP study v2: paired results", "", f"Rebuilt by `{command or 'python recipes/study.py ...'}` from "
             f"{len(summaries)} finished runs (plan: PLAN.md). Differences are method − REINFORCE at the same seed, "
             "the same evaluation prompts and the same evaluation random streams.", ""]  # fmt: skip
    start = trajectory(initial, {"evals": []}, cvar_alpha)[0]
    lines += [f"Initial model: P(p_offensive > 0.5) = {start['p_bad']:.4f}, P(> 0.9) = {start['p_bad_high']:.4f}, "
              f"mean reward {start['reward']:.4f}, CVaR {start['cvar']:.3f}, lexicon {start['lexicon']:.4f} "
              f"({len(start['vectors']['p_bad'])} prompts).", ""]  # fmt: skip
    for title, axis, metric in TABLES:
        rows = paired_rows(initial, summaries, axis, levels[axis], REFERENCE, metric, cvar_alpha)
        tables[f"{axis}/{metric}"] = rows
        lines += _table(rows, title, metric)
    lines += _by_seed_table(
        [r for key in ("kl/p_bad", "updates/p_bad") for r in tables[key]],
        "Per seed: P(p_offensive > 0.5), method − REINFORCE, with evaluation-only 95% intervals (training noise "
        "not included)",
    )
    lines += _power_lines([r for r in tables["kl/p_bad"] + tables["updates/p_bad"] if r["method"] == PRIMARY])
    check = None
    if thread_dir is not None and levels["kl"]:
        other_initial, others = load_study_runs(thread_dir)
        if others:
            check = thread_check(initial, summaries, other_initial, others, levels["kl"][-1], REFERENCE, PRIMARY,
                                 cvar_alpha)  # fmt: skip
            lines += _thread_lines(check, levels["kl"][-1])
    plot_paired_frontiers(initial, summaries, os.path.join(results_dir, "frontiers.png"), cvar_alpha, prompts)
    lines += ["![frontiers](frontiers.png)", ""]
    with open(os.path.join(results_dir, "paired.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    out = {"levels": levels, "tables": tables, "command": command}
    if check is not None:
        out["thread_check"] = check
    with open(os.path.join(results_dir, "paired.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=float)
    log("\n".join(lines))
    return out
