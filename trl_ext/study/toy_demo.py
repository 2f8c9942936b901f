"""What `make demo` prints and plots for one seed of the toy design: each evaluation, the comparison at matched KL(y)
and at matched expected reward, and the proposal's amplification per update (`recipes/demo_repulse.py`)."""

from __future__ import annotations

import math
import os

from .runner import _write_atomic
from .toy_report import (
    collapsed,
    load_runs,
    matched_levels,
    matched_table,
    mechanism,
    trajectory,
)

__all__ = ["print_demo"]


def _console():
    import sys

    from rich.console import Console

    return Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 130)


def _eval_table(initial, summaries):
    from rich import box
    from rich.table import Table

    table = Table(title="Evaluations (exact where enumerable, ± SE of the Monte Carlo remainder)", box=box.SIMPLE_HEAD)
    for c in ("method", "update", "P(bad) words", "held-out words", "P(p_off>0.5)", "E[r]", "KL(y)", "entropy",
              "top resp."):  # fmt: skip
        table.add_column(c, justify="left" if c == "method" else "right")
    rows = [("p_0", initial["evals"][0])] + [(s["run"]["method"], e) for s in summaries for e in s["evals"]]
    for name, e in rows:
        table.add_row(
            name, str(e.get("updates", 0)), f"{e['p_bad']:.2e}±{e['p_bad_se']:.0e}",
            f"{e['p_bad_heldout']:.2e}±{e['p_bad_heldout_se']:.0e}",
            f"{e['p_offensive']:.2e}±{e['p_offensive_se']:.0e}",
            f"{e['reward']:+.4f}±{e['reward_se']:.4f}", f"{e['kl']:.3f}±{e['kl_se']:.3f}", f"{e['entropy']:.2f}",
            f"{e['top_probability']:.2f}" + (" COLLAPSED" if collapsed(e) else ""),
        )  # fmt: skip
    return table


def _matched_lines(initial, summaries, levels) -> tuple[list[str], dict]:
    lines, out = [], {}
    for axis, label in (("kl", "KL(y)"), ("reward", "E[r]")):
        for metric in ("p_bad", "p_bad_heldout", "p_offensive"):
            rows = matched_table(initial, summaries, axis, levels[axis], metric)
            out[f"{axis}/{metric}"] = rows
            by = {(r["method"].split("/")[0], r["level"]): r for r in rows}
            for level in levels[axis]:
                a, b = by.get(("REINFORCE", level)), by.get(("RePULSe", level))
                if a is None or b is None or "mean" not in a or "mean" not in b:
                    continue
                ratio = 10 ** (a["mean"] - b["mean"])
                lines.append(f"  at {label} = {level:.3g}: {metric:14s} REINFORCE {10 ** a['mean']:.2e}  RePULSe "
                             f"{10 ** b['mean']:.2e}  → REINFORCE / RePULSe = {ratio:.2f}×")  # fmt: skip
    return lines, out


def print_demo(output_dir: str, config, runs, seconds: float = math.nan) -> dict:
    """Print the demo's tables, save ``demo.png`` and ``results.json`` in ``output_dir``; return the results."""
    console = _console()
    initial, summaries = load_runs(output_dir, runs)
    order = {r.label: i for i, r in enumerate(runs)}
    summaries.sort(key=lambda s: order.get(f"{s['run']['method']}__{s['run']['setting']}__seed{s['run']['seed']}", 0))
    console.print(_eval_table(initial, summaries))
    levels = {axis: matched_levels(initial, summaries, axis) for axis in ("kl", "reward")}
    lines, matched = _matched_lines(initial, summaries, levels)
    console.print("At matched KL(y) and at matched E[r] (log P interpolated between evaluations, never extrapolated):",
                  style="bold")  # fmt: skip
    for line in lines:
        console.print(line)
    mech = {s["run"]["method"]: mechanism(initial, s) for s in summaries}
    mech = {k: v for k, v in mech.items() if v is not None}
    for name, m in mech.items():
        console.print(
            f"{name}'s proposal q, per update: offensive fraction of q's {config.samples_per_update} samples vs the "
            "policy's exact P(p_off > 0.5), amplification, distinct offensive responses of q, share of the most "
            "frequent one, q's mean reward",
            style="bold",
        )
        for o in m["per_update"]:
            q_reward = o["q_reward"] if o["q_reward"] is not None else math.nan
            console.print(
                f"  update {o['update']:3d}: q {o['q_rate']:.3f}  p {o['p_exact']:.4f}  ×{o['amplification']:7.1f}"
                f"  distinct {o['q_distinct']:3d}  top share {o['q_top_share']:.2f}  E_q[r] {q_reward:+.3f}  "
                f"{o['q_top'] or ''!r}"
            )
        console.print(f"  max amplification over the first {m['window']} updates: {m['max_amplification_early']:.1f}×")
    path = os.path.join(output_dir, "demo.png")
    plot_demo(initial, summaries, mech, path)
    results = {"initial": initial["evals"][0], "runs": {s["run"]["method"]: s for s in summaries}, "levels": levels,
               "matched": matched, "mechanism": mech, "seconds": seconds}  # fmt: skip
    _write_atomic(os.path.join(output_dir, "results.json"), results)
    console.print(f"Total {seconds:.0f} s. Wrote {path} and {os.path.join(output_dir, 'results.json')}.")
    return results


def plot_demo(initial, summaries, mech, path: str) -> None:
    """P(bad) against KL(y) and against E[r]; q's offensive fraction against the policy's; q's amplification."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (a, b), (c, d) = axes
    colors = {}
    for s in summaries:
        points = trajectory(initial, s)
        name = s["run"]["method"]
        (line,) = a.plot([p["kl"] for p in points], [p["p_bad"] for p in points], marker="o", label=name)
        colors[name] = line.get_color()
        a.plot([p["kl"] for p in points], [p["p_bad_heldout"] for p in points], marker=".", linestyle="--",
               color=colors[name], label=f"{name}: held-out words")  # fmt: skip
        b.plot([p["reward"] for p in points], [p["p_bad"] for p in points], marker="o", color=colors[name], label=name)
    for name, m in mech.items():
        per = m["per_update"]
        u = [o["update"] for o in per]
        c.plot(u, [o["q_rate"] for o in per], color=colors.get(name), label=f"{name}: q's samples")
        c.plot(u, [o["p_exact"] for o in per], color=colors.get(name), linestyle="--", label="policy p (exact)")
        d.plot(u, [max(o["amplification"], 1e-2) for o in per], color=colors.get(name), label=name)
    d.axhline(10, color="gray", linestyle=":", label="10×")
    a.set(yscale="log", xlabel="KL(p_θ ‖ p_0) of the response", ylabel="P(bad word)", title="lower-left is better")
    b.set(yscale="log", xlabel="E[classifier reward]", ylabel="P(bad word)", title="lower-right is better")
    c.set(yscale="log", xlabel="update", ylabel="fraction offensive (classifier p > 0.5)")
    d.set(yscale="log", xlabel="update", ylabel="q's amplification (q fraction / p exact)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
