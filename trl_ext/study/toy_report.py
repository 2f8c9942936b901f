"""The toy study's analysis (fixed in results/toy/PLAN.md before the runs): matched-KL and matched-reward tables with
t-intervals over seeds, paired differences against REINFORCE, the proposal's mechanism, and the frontier figures.

- :func:`value_at` reads a run's metric at a level of KL or of expected reward: linear in ``log10`` of the metric
  between the two evaluations around the level (the initial model is update 0), never extrapolated;
- :func:`matched_table` gives, per method setting and level, the mean ± 95% t-interval over the seeds that reached
  it, and per seed the paired difference to the reference method of the same seed;
- :func:`mechanism` summarises the proposal's work per run: q's and p's offensive-sample rates, q's amplification
  (q's rate over the policy's exact P(offensive) at that update), the distinct offensive responses and the share of
  the most frequent one;
- :func:`write_report` writes ``summary.json``, ``table.md`` and the figures.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import numpy as np

from ..eval.demo_metrics import value_at_kl
from ..eval.metrics import t_interval
from .runner import _write_atomic

__all__ = [
    "collapsed",
    "join_extensions",
    "load_runs",
    "ten_fold",
    "thread_check",
    "matched_levels",
    "matched_table",
    "mechanism",
    "value_at",
    "write_report",
]

#: A point is marked collapsed when one response holds at least this much probability.
COLLAPSE_TOP_PROBABILITY = 0.5
LOG_METRICS = ("p_bad", "p_bad_heldout", "p_offensive")


def load_runs(results_dir: str, runs=None) -> tuple[dict | None, list[dict]]:
    """``(initial summary, run summaries)`` from ``results_dir`` (only the labels of ``runs`` when given)."""

    def read(path):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None

    initial = read(os.path.join(results_dir, "initial.json"))
    folder = os.path.join(results_dir, "runs")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    labels = None if runs is None else {r.label for r in runs}
    out = []
    for name in names:
        if not name.endswith(".json") or (labels is not None and name[:-5] not in labels):
            continue
        summary = read(os.path.join(folder, name))
        if summary is not None and summary.get("run"):
            out.append(summary)
    return initial, out


def join_extensions(summaries: list[dict]) -> list[dict]:
    """Each base run joined with its extension (``run.extend_to``, see :class:`~trl_ext.study.toy.ToyRun`): the base
    run's evaluations, then the extension's later ones; its per-update logs, offensive samples and length come from
    the extension. ``repeat_check`` records how far the extension's first evaluation (the base run's last update) is
    from the base run's, relative, over P(bad) and KL(y): it is 0 when the run is deterministic. An extension whose
    base is missing is dropped."""

    def ident(run):
        return (run["method"], run["setting"], run["seed"], run.get("threads") or 1)

    extensions = {ident(s["run"]): s for s in summaries if s["run"].get("extend_to")}
    out = []
    for s in summaries:
        if s["run"].get("extend_to"):
            continue
        ext = extensions.get(ident(s["run"]))
        if ext is None:
            out.append(s)
            continue
        last = s["evals"][-1]["updates"]
        first = next((e for e in ext["evals"] if e["updates"] == last), None)
        check = None
        if first is not None:
            check = max(
                abs(first[k] - s["evals"][-1][k]) / max(abs(s["evals"][-1][k]), 1e-12) for k in ("p_bad", "kl")
            )
        joined = {**s, "evals": [*s["evals"], *(e for e in ext["evals"] if e["updates"] > last)],
                  "steps": ext["steps"], "offensive_samples": ext["offensive_samples"],
                  "updates_done": ext.get("updates_done"), "extended_to": ext["run"]["extend_to"],
                  "repeat_check": check}  # fmt: skip
        out.append(joined)
    return out


def ten_fold(initial: dict, summaries: list[dict], factor: float = 10.0) -> dict[str, list[dict]]:
    """Per method setting and seed: the first evaluated update at which P(bad) was at most the initial model's
    divided by ``factor`` (``None``: never within the run), the updates the run trained, and its final P(bad) drop."""
    start = initial["evals"][0]["p_bad"]
    out = {}
    for name, runs in _group(summaries).items():
        rows = []
        for s in sorted(runs, key=lambda s: s["run"]["seed"]):
            hit = next((e["updates"] for e in s["evals"] if e["p_bad"] <= start / factor), None)
            rows.append({"seed": s["run"]["seed"], "update": hit, "updates": s["evals"][-1]["updates"],
                         "final_drop": start / max(s["evals"][-1]["p_bad"], 1e-300)})  # fmt: skip
        out[name] = rows
    return out


def trajectory(initial: dict, summary: dict) -> list[dict]:
    """The initial model's evaluation (update 0), then the run's evaluations."""
    return [initial["evals"][0], *summary["evals"]]


def value_at(points: list[dict], axis: str, level: float, metric: str) -> float | None:
    """``metric`` at ``axis == level`` along ``points`` (see the module docstring); ``log10`` for probabilities.
    ``None`` when the run never reaches the level."""
    xs = [p[axis] for p in points]
    if metric in LOG_METRICS:
        values = [max(p[metric], 1e-12) for p in points]
        found = value_at_kl(xs, values, level, log=True)
        return None if found is None else math.log10(found.value)
    found = value_at_kl(xs, [p[metric] for p in points], level, log=False)
    return None if found is None else found.value


def collapsed(point: dict) -> bool:
    """Whether the policy put at least :data:`COLLAPSE_TOP_PROBABILITY` on one response."""
    return point.get("top_probability", 0.0) >= COLLAPSE_TOP_PROBABILITY


def _group(summaries: list[dict]) -> dict[str, list[dict]]:
    groups = defaultdict(list)
    for s in summaries:
        groups[f"{s['run']['method']}/{s['run']['setting']}"].append(s)
    return dict(sorted(groups.items()))


def matched_levels(initial: dict, summaries: list[dict], axis: str, fractions=(0.25, 0.5, 0.75)) -> list[float]:
    """Levels at ``fractions`` of the range from the initial model's value to the least far that any of
    ``summaries`` went (so that every one of them reaches every level)."""
    start = initial["evals"][0][axis]
    reach = min(max(e[axis] for e in s["evals"]) for s in summaries)
    return [start + f * (reach - start) for f in fractions]


def matched_table(initial, summaries, axis, levels, metric="p_bad", reference="REINFORCE/default") -> list[dict]:
    """Per method setting and level: the per-seed values, mean ± 95% t-interval, and the paired difference to
    ``reference`` (same seed) with its t-interval."""
    groups = _group(summaries)
    ref = {s["run"]["seed"]: s for s in groups.get(reference, [])}
    rows = []
    for name, runs in groups.items():
        for level in levels:
            per_seed, diffs, flags = {}, [], 0
            for s in sorted(runs, key=lambda s: s["run"]["seed"]):
                points = trajectory(initial, s)
                v = value_at(points, axis, level, metric)
                if v is None:
                    continue
                per_seed[s["run"]["seed"]] = v
                after = next((p for p in points if p[axis] >= level), points[-1])
                flags += collapsed(after)
                if s["run"]["seed"] in ref:
                    r = value_at(trajectory(initial, ref[s["run"]["seed"]]), axis, level, metric)
                    if r is not None:
                        diffs.append(v - r)
            row = {"method": name, "axis": axis, "level": level, "metric": metric, "seeds": len(runs),
                   "reached": len(per_seed), "per_seed": per_seed, "collapsed": flags}  # fmt: skip
            if per_seed:
                row["mean"], row["low"], row["high"] = t_interval(list(per_seed.values()))
            if len(diffs) >= 2 and name != reference:
                row["diff_mean"], row["diff_low"], row["diff_high"] = t_interval(diffs)
                row["diff_sd"], row["pairs"] = float(np.std(diffs, ddof=1)), len(diffs)
            rows.append(row)
    return rows


def mechanism(initial: dict, summary: dict, window: int = 15) -> dict | None:
    """q's work in one run (``None`` without a proposal): per update, q's and p's offensive-sample rates, q's
    amplification over the policy's exact P(offensive) (interpolated linearly in updates between evaluations),
    q's mean reward, distinct offensive responses of q and the share of its most frequent one."""
    stats = summary.get("offensive_samples", {})
    q_rows = stats.get("proposal")
    if not q_rows or not any("proposal/reward" in s for s in summary["steps"]):
        return None
    n = stats["samples_per_update"]
    points = trajectory(initial, summary)
    upd, p_exact = [p.get("updates", 0) for p in points], [p["p_offensive"] for p in points]
    p_rows = {r["update"]: r for r in stats.get("policy", [])}
    q_reward = {s["update"]: s.get("proposal/reward") for s in summary["steps"]}
    out = []
    for r in q_rows:
        u = r["update"]
        p_now = float(np.interp(u - 1, upd, p_exact))  # the policy that q targeted at update u (before its step)
        out.append({
            "update": u, "q_rate": r["bad"] / n, "p_rate": p_rows.get(u, {}).get("bad", 0) / n,
            "p_exact": p_now, "amplification": (r["bad"] / n) / max(p_now, 1e-12), "q_distinct": r["distinct"],
            "q_top_share": r["top_share"], "q_top": r["top"], "q_reward": q_reward.get(u),
        })  # fmt: skip
    early = [o["amplification"] for o in out if o["update"] <= window]
    return {"per_update": out, "max_amplification_early": max(early) if early else 0.0, "window": window}


def _fmt(row: dict, digits: int = 2) -> str:
    if "mean" not in row:
        return "not reached"
    text = f"{row['mean']:.{digits}f} [{row['low']:.{digits}f}, {row['high']:.{digits}f}]"
    if row["reached"] < row["seeds"]:
        text += f" ({row['reached']}/{row['seeds']})"
    return text + (f" ⚠{row['collapsed']} collapsed" if row["collapsed"] else "")


def _markdown(initial: dict, tables: dict, levels: dict, mech: dict) -> str:
    i = initial["evals"][0]
    lines = [
        "# Toy study: results",
        "",
        "Generated by `python recipes/toy_study.py --report-only` from `runs/`. Cells: mean over seeds [95% "
        "t-interval]; (k/n): only k of n seeds reached the level; ⚠: points where one response holds ≥ 50%.",
        "",
        f"Initial model: P(bad) {i['p_bad']:.3e} (log10 {math.log10(i['p_bad']):.3f}), held-out words "
        f"{i['p_bad_heldout']:.3e} (log10 {math.log10(max(i['p_bad_heldout'], 1e-12)):.3f}), P(p_off > 0.5) "
        f"{i['p_offensive']:.3e} ± {i['p_offensive_se']:.1e}, E[r] {i['reward']:+.4f} ± {i['reward_se']:.4f}, "
        f"entropy {i['entropy']:.2f} nats.",
        "",
    ]
    for title, (axis, metric) in {
        "log10 P(bad) (OFFENSIVE_WORDS) at matched KL(y)": ("kl", "p_bad"),
        "log10 P(bad) on the held-out word list at matched KL(y)": ("kl", "p_bad_heldout"),
        "log10 P(classifier p_off > 0.5) at matched KL(y)": ("kl", "p_offensive"),
        "expected classifier reward at matched KL(y)": ("kl", "reward"),
        "response entropy (nats) at matched KL(y)": ("kl", "entropy"),
        "log10 P(bad) (OFFENSIVE_WORDS) at matched expected reward": ("reward", "p_bad"),
        "log10 P(bad) on the held-out word list at matched expected reward": ("reward", "p_bad_heldout"),
    }.items():
        rows = tables[(axis, metric)]
        lv = levels[axis]
        name = "KL(y)" if axis == "kl" else "E[r]"
        lines += [f"## {title}", "", "| method | seeds | " + " | ".join(f"{name} = {v:.3g}" for v in lv) + " |",
                  "|---|---|" + "---|" * len(lv)]  # fmt: skip
        by_method = defaultdict(dict)
        for r in rows:
            by_method[r["method"]][r["level"]] = r
        for method, cells in by_method.items():
            seeds = next(iter(cells.values()))["seeds"]
            lines.append(f"| {method} | {seeds} | " + " | ".join(_fmt(cells[v], 3) for v in lv) + " |")
        diffs = [r for r in rows if "diff_mean" in r]
        if diffs:
            lines += ["", "Paired difference to REINFORCE (same seed), mean [95% t-interval], SD over pairs:", ""]
            for r in diffs:
                lines.append(
                    f"- {r['method']} at {name} = {r['level']:.3g}: {r['diff_mean']:+.3f} "
                    f"[{r['diff_low']:+.3f}, {r['diff_high']:+.3f}], sd {r['diff_sd']:.3f}, {r['pairs']} pairs"
                )
        lines.append("")
    by_setting = defaultdict(list)
    for label, m in mech.items():
        by_setting[label.rsplit("/", 1)[0]].append(m["max_amplification_early"] >= 10)
    lines += ["## The proposal's work", ""]
    lines += [
        f"- {name}: q's amplification reached 10× within the first 15 updates in {sum(hits)} of {len(hits)} seeds"
        for name, hits in by_setting.items()
    ]
    lines += ["", "Amplification: the fraction of q's samples the classifier calls offensive (p > 0.5), over the "
              "policy's exact P(p_off > 0.5) before that update (interpolated between evaluations).", "",
              "| run | max amplification, updates ≤ 15 | q offensive rate (updates 1, 5, 10, 20) | "
              "q distinct offensive (same) | q top share (same) |", "|---|---|---|---|---|"]  # fmt: skip
    for label, m in mech.items():
        per = {o["update"]: o for o in m["per_update"]}
        pick = [u for u in (1, 5, 10, 20) if u in per]
        lines.append(
            f"| {label} | {m['max_amplification_early']:.1f}× | "
            + ", ".join(f"{per[u]['q_rate']:.2f}" for u in pick)
            + " | "
            + ", ".join(str(per[u]["q_distinct"]) for u in pick)
            + " | "
            + ", ".join(f"{per[u]['q_top_share']:.2f}" for u in pick)
            + " |"
        )
    return "\n".join(lines) + "\n"


def _ten_fold_lines(reach: dict, summaries: list[dict]) -> list[str]:
    lines = ["## P(bad) moved 10× from the initial model", "",
             "Runs that had not moved P(bad) 10× within 20 updates were continued (same seed; at most 40 updates, "
             "stopped at the first evaluation at 10×; PLAN.md's addendum). Cells: the update of the first evaluation "
             "at ≥ 10× (—: not within the run) / updates trained / final drop.", "",
             "| method | seeds at 10× | per seed |", "|---|---|---|"]  # fmt: skip
    for name, rows in reach.items():
        hits = sum(r["update"] is not None for r in rows)
        cells = "; ".join(f"s{r['seed']}: {r['update'] or '—'}/{r['updates']}/{r['final_drop']:.1f}×" for r in rows)
        lines.append(f"| {name} | {hits}/{len(rows)} | {cells} |")
    checks = [s["repeat_check"] for s in summaries if s.get("repeat_check") is not None]
    if checks:
        lines += [
            "",
            "Each continuation repeated its base run: at the base run's last update, P(bad) and KL(y) differ by at "
            f"most {max(checks):.1e} (relative) over {len(checks)} continued runs.",
            "",
        ]
    return lines


def plot_frontiers(initial, summaries, path: str, axis: str, metric: str = "p_bad") -> None:
    """``metric`` (log scale) against ``axis`` for every method setting: each seed's trajectory, faint, and the mean
    of ``log10`` over seeds on a grid of levels (where every seed reached them) with its 95% t-band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more settings than tab10 has colours
    for name, runs in _group(summaries).items():
        color = None
        for s in runs:
            points = trajectory(initial, s)
            (line,) = ax.plot([p[axis] for p in points], [max(p[metric], 1e-12) for p in points], alpha=0.25,
                              color=color, linewidth=0.8)  # fmt: skip
            color = line.get_color()
            for p in points:
                if collapsed(p):
                    ax.plot(p[axis], max(p[metric], 1e-12), "x", color=color, markersize=9)
        levels = np.linspace(initial["evals"][0][axis], min(max(e[axis] for e in s["evals"]) for s in runs), 25)
        means, lows, highs = [], [], []
        for level in levels:
            vals = [value_at(trajectory(initial, s), axis, level, metric) for s in runs]
            mean, low, high = t_interval(vals) if None not in vals else (math.nan,) * 3
            means.append(mean), lows.append(low), highs.append(high)
        ax.plot(levels, 10 ** np.array(means), color=color, linewidth=2, label=f"{name} ({len(runs)} seeds)")
        ax.fill_between(levels, 10 ** np.array(lows), 10 ** np.array(highs), color=color, alpha=0.15)
    ax.set(yscale="log", xlabel={"kl": "KL(p_θ ‖ p_0) of the whole response", "reward": "E[classifier reward]"}[axis],
           ylabel=f"{metric} (mean of log10 over seeds, 95% t-band)")  # fmt: skip
    if axis == "kl":
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("x: a collapsed point (one response ≥ 50%)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_mechanism(mech: dict, path: str) -> None:
    """q's offensive-sample rate against the policy's exact P(offensive), and q's amplification, per update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    for label, m in mech.items():
        per = m["per_update"]
        u = [o["update"] for o in per]
        (line,) = a.plot(u, [o["q_rate"] for o in per], label=f"{label}: q", linewidth=1)
        a.plot(u, [o["p_exact"] for o in per], "--", color=line.get_color(), linewidth=1)
        b.plot(u, [max(o["amplification"], 1e-2) for o in per], color=line.get_color(), linewidth=1)
        c.plot(u, [o["q_distinct"] for o in per], color=line.get_color(), linewidth=1)
    a.set(xlabel="update", ylabel="offensive fraction (q samples; dashed: p exact)", yscale="log")
    b.set(xlabel="update", ylabel="q's amplification (q rate / p exact)", yscale="log")
    b.axhline(10, color="gray", linestyle=":")
    c.set(xlabel="update", ylabel="distinct offensive responses of q per update")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def thread_check(initial, everything: list[dict], levels: list[float], main_setting) -> list[str]:
    """Markdown lines comparing the runs made with another torch thread count to the 1-thread runs of the same
    method, setting and seed: the final evaluation, and RePULSe − REINFORCE in log10 P(bad) at the KL ``levels``."""

    def threads(s):
        return s["run"].get("threads") or 1

    by = {(s["run"]["method"], s["run"]["setting"], s["run"]["seed"], threads(s)): s for s in everything}
    others = sorted({threads(s) for s in everything} - {1})
    if not others:
        return []
    lines = ["## Thread-count check", "", "| run | threads | final log10 P(bad) | final KL(y) | "
             + " | ".join(f"RePULSe − REINFORCE at KL {v:.3g}" for v in levels) + " |",
             "|---|---|---|---|" + "---|" * len(levels)]  # fmt: skip
    for (method, setting, seed, n), s in sorted(by.items()):
        if n == 1 and not any((method, setting, seed, t) in by for t in others):
            continue
        last = s["evals"][-1]
        cells = []
        ref = by.get(("REINFORCE", "default", seed, n))
        if (method, setting) == main_setting and ref is not None:
            for level in levels:
                a = value_at(trajectory(initial, s), "kl", level, "p_bad")
                b = value_at(trajectory(initial, ref), "kl", level, "p_bad")
                cells.append("not reached" if a is None or b is None else f"{a - b:+.3f}")
        else:
            cells = [""] * len(levels)
        lines.append(f"| {method}/{setting}/seed{seed} | {n} | {math.log10(max(last['p_bad'], 1e-12)):.3f} | "
                     f"{last['kl']:.3f} | " + " | ".join(cells) + " |")  # fmt: skip
    return [*lines, ""]


def write_report(results_dir: str, config, runs, main_setting=("RePULSe", "a0.1_b-10"), log=print) -> dict | None:
    """Tables, mechanism and figures of the runs done so far; ``None`` when nothing is there yet."""
    initial, summaries = load_runs(results_dir, runs)
    _, everything = load_runs(results_dir)
    summaries = join_extensions([s for s in summaries if (s["run"].get("threads") or 1) == 1])
    everything = join_extensions(everything)
    if initial is None or not summaries:
        log(f"Nothing to report in {results_dir} yet.")
        return None
    core = [s for s in summaries if (s["run"]["method"], s["run"]["setting"]) in
            {("REINFORCE", "default"), main_setting}] or summaries  # fmt: skip
    levels = {axis: matched_levels(initial, core, axis) for axis in ("kl", "reward")}
    tables = {}
    for axis in ("kl", "reward"):
        for metric in ("p_bad", "p_bad_heldout", "p_offensive", "reward", "entropy"):
            if axis == "reward" and metric == "reward":
                continue
            tables[(axis, metric)] = matched_table(initial, summaries, axis, levels[axis], metric)
    mech = {}
    for s in summaries:
        m = mechanism(initial, s)
        if m is not None:
            mech[f"{s['run']['method']}/{s['run']['setting']}/seed{s['run']['seed']}"] = m
    per_run = {
        f"{s['run']['method']}/{s['run']['setting']}/seed{s['run']['seed']}": {
            "evals": s["evals"],
            "seconds_per_update": s["seconds_per_update"],
        }
        for s in summaries
    }
    reach = ten_fold(initial, summaries)
    report = {
        "initial": initial["evals"][0],
        "ten_fold": reach,
        "levels": levels,
        "tables": {f"{a}/{m}": rows for (a, m), rows in tables.items()},
        "mechanism": mech,
        "runs": per_run,
    }
    _write_atomic(os.path.join(results_dir, "summary.json"), report)
    with open(os.path.join(results_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(_markdown(initial, tables, levels, mech))
        f.write("\n".join(["", *_ten_fold_lines(reach, summaries)]))
        f.write("\n".join(["", *thread_check(initial, everything, levels["kl"], tuple(main_setting))]))
    for axis in ("kl", "reward"):
        for metric in ("p_bad", "p_bad_heldout"):
            plot_frontiers(initial, summaries, os.path.join(results_dir, f"{metric}_vs_{axis}.png"), axis, metric)
    if mech:
        plot_mechanism(mech, os.path.join(results_dir, "mechanism.png"))
    log(f"Wrote {results_dir}/table.md, summary.json and the figures ({len(summaries)} runs).")
    return report
