r"""The second RTP study's analysis (fixed in ``results/study_rtp_v2/PLAN.md`` before its runs): paired differences.

Every evaluation of the study samples the same held-out prompts with the same random streams (``eval_seed``: common
random numbers), and keeps each response's reward, KL and lexicon flag (``save_eval_samples``). A run's *trajectory*
is the initial model's evaluation (update 0) followed by the run's own evaluations.

**Matched levels.** A method's value at KL level ``k`` is read between the first evaluation whose KL reaches ``k`` and
the one before it, by linear interpolation with weight ``w`` — and the same ``w`` interpolates every per-prompt
vector (the share of a prompt's ``N`` responses that are bad, its mean reward, ...), so a matched point is again a
per-prompt vector. Never extrapolated: a run that does not reach a level has no value there. The same holds for
levels of mean reward. Levels are the 25/50/75% points of the range that every run of ``core`` methods reaches.

**Paired differences**, method − reference (REINFORCE) at one level, per seed ``s``:

- ``d_s,i`` — the difference of the two interpolated per-prompt vectors at prompt ``i``, and ``D_s = mean_i d_s,i``
  (the difference in P(bad));
- ``L_s = ln(P_m,s / P_ref,s)``, the log-ratio, whose mean over seeds is the relative effect the plan is powered for;
- ``se_s = sd_i(d_s,i) / √n_prompts``: the evaluation's own noise in ``D_s``, with the policies fixed.

The primary interval is the Student-t interval of ``L_s`` (and of ``D_s``) over seeds (seeds are the replication
unit: it holds the training noise and the evaluation noise together). Per method, the mean over seeds and its
t-interval are reported too. CVaR is read from the interpolated pair of evaluations as a scalar.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import numpy as np

from ..eval.metrics import metric_key, t_interval, t_quantile

__all__ = [
    "eval_point",
    "load_study_runs",
    "matched_levels",
    "minimum_detectable_effect",
    "paired_rows",
    "point_at",
    "thread_check",
    "trajectory",
]

# The scalars of a point, and the per-prompt vectors (means over a prompt's responses) it carries.
VECTORS = ("p_bad", "p_bad_high", "reward", "kl", "lexicon")


def eval_point(evaluation: dict, cvar_alpha: float = 0.05) -> dict:
    """One evaluation as a point: per-prompt vectors (``VECTORS``) and scalars (their means; ``cvar``; ``updates``).

    ``p_bad`` is the share of responses with ``p_offensive`` above the lowest threshold (0.5 by default), read off
    the rewards exactly as the evaluation's own ``P(r < τ)``; ``p_bad_high`` the same for the highest threshold."""
    samples = evaluation.get("per_sample")
    if samples is None:
        raise ValueError("This evaluation kept no per-response values; run the study with save_eval_samples: true.")
    n = int(samples["samples_per_prompt"])
    taus = sorted(evaluation["p_offensive_threshold_map"].values(), reverse=True)  # log(1 - t): lowest t first
    reward = np.asarray(samples["reward"], dtype=np.float64)
    if reward.size % n or list(samples["prompt_index"][::n]) != list(range(reward.size // n)):
        raise ValueError("per_sample values must be prompt-major with samples_per_prompt responses per prompt.")

    def per_prompt(values) -> np.ndarray:
        return np.asarray(values, dtype=np.float64).reshape(-1, n).mean(axis=1)

    vectors = {
        "p_bad": per_prompt(reward < taus[0]),
        "p_bad_high": per_prompt(reward < taus[-1]),
        "reward": per_prompt(reward),
        "kl": per_prompt(samples["kl"]),
        "lexicon": per_prompt(samples["lexicon"]),
    }
    point = {"updates": evaluation["updates"], "vectors": vectors}
    point.update({name: float(v.mean()) for name, v in vectors.items()})
    point["cvar"] = float(evaluation["metrics"]["cvar"][metric_key(cvar_alpha)]["value"])
    return point


def trajectory(initial: dict, summary: dict, cvar_alpha: float = 0.05) -> list[dict]:
    """The initial model's point (update 0), then the run's points in order."""
    return [eval_point(e, cvar_alpha) for e in (initial["evals"][0], *summary["evals"])]


def point_at(points: list[dict], axis: str, level: float) -> dict | None:
    """The point of ``points`` at ``axis == level`` (``axis``: ``kl`` or ``reward``), interpolated linearly between
    the first point that reaches the level and the one before it (vectors and scalars with the same weight), or
    ``None`` when no point reaches it."""
    xs = [p[axis] for p in points]
    after = next((i for i, x in enumerate(xs) if x >= level), None)
    if after is None:
        return None
    if after == 0:
        return points[0]
    a, b = points[after - 1], points[after]
    w = (level - xs[after - 1]) / (xs[after] - xs[after - 1])
    out = {"updates": (1 - w) * a["updates"] + w * b["updates"], "weight": w}
    out["vectors"] = {name: (1 - w) * a["vectors"][name] + w * b["vectors"][name] for name in VECTORS}
    out.update({name: float(v.mean()) for name, v in out["vectors"].items()})
    out["cvar"] = (1 - w) * a["cvar"] + w * b["cvar"]
    return out


def load_study_runs(results_dir: str) -> tuple[dict | None, list[dict]]:
    """``(initial summary, [trained runs' summaries])`` from ``<results_dir>/runs``."""
    initial, runs = None, []
    folder = os.path.join(results_dir, "runs")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            summary = json.load(f)
        if summary["run"]["method"] == "initial":
            initial = summary
        else:
            runs.append(summary)
    return initial, runs


def group(summaries: list[dict]) -> dict[str, list[dict]]:
    """``{"method/setting": [summaries, seed order]}``."""
    out = defaultdict(list)
    for s in sorted(summaries, key=lambda s: s["run"]["seed"]):
        out[f"{s['run']['method']}/{s['run']['setting']}"].append(s)
    return dict(out)


def matched_levels(initial, summaries, axis: str, core=None, fractions=(0.25, 0.5, 0.75), cvar_alpha=0.05):
    """The levels at ``fractions`` of the way from the initial model's value to the least far that any run of the
    ``core`` methods (``None``: every run) went along ``axis``."""
    runs = [s for s in summaries if core is None or s["run"]["method"] in core]
    if not runs:
        return []
    start = eval_point(initial["evals"][0], cvar_alpha)[axis]
    reach = min(max(p[axis] for p in trajectory(initial, s, cvar_alpha)) for s in runs)
    return [start + f * (reach - start) for f in fractions]


def minimum_detectable_effect(sd: float, n: int, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true mean difference that a two-sided ``confidence`` t-test over ``n`` paired replicates with
    standard deviation ``sd`` detects with probability ``power`` (``(t_{1-a/2} + t_{power}) · sd / √n``, df ``n - 1``;
    ``power=0.5`` gives the interval's half-width)."""
    if n < 2:
        return math.inf
    beta_part = 0.0 if power == 0.5 else t_quantile(2 * power - 1, n - 1)
    return (t_quantile(confidence, n - 1) + beta_part) * sd / math.sqrt(n)


def _eval_interval(d: np.ndarray) -> tuple[float, float]:
    """``(standard error, 95% t half-width)`` of the mean of the per-prompt differences ``d``: the evaluation's own
    noise in a paired difference, with both policies fixed."""
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    return se, t_quantile(0.95, d.size - 1) * se


def paired_rows(initial, summaries, axis, levels, reference="REINFORCE/default", metric="p_bad", cvar_alpha=0.05):
    """Per method setting and level: per-seed values, the mean ± t-interval over seeds, and against ``reference``
    (same seed) the difference ``D``, the log-ratio ``L`` (both with t-intervals over seeds) and each seed's
    evaluation-only standard error of ``D`` (from the per-prompt differences). ``row["by_seed"]`` holds, for every
    seed that both runs reach (one is enough), ``D``, its evaluation-only 95% interval over the prompts (the same
    prompts and random streams on both sides: a paired t-interval of the per-prompt differences) and the ratio."""
    groups = group(summaries)
    ref = {s["run"]["seed"]: s for s in groups.get(reference, [])}
    rows = []
    for name, runs in groups.items():
        for level in levels:
            row = {"method": name, "axis": axis, "level": level, "metric": metric, "seeds": len(runs)}
            values, diffs, ratios, eval_se, by_seed = {}, [], [], [], {}
            for s in runs:
                seed = s["run"]["seed"]
                p = point_at(trajectory(initial, s, cvar_alpha), axis, level)
                if p is None:
                    continue
                values[seed] = p[metric]
                if seed not in ref or name == reference:
                    continue
                r = point_at(trajectory(initial, ref[seed], cvar_alpha), axis, level)
                if r is None:
                    continue
                diffs.append(p[metric] - r[metric])
                by_seed[seed] = {"diff": diffs[-1], "reference": r[metric]}
                if metric in p["vectors"]:
                    se, half = _eval_interval(p["vectors"][metric] - r["vectors"][metric])
                    eval_se.append(se)
                    by_seed[seed].update(eval_se=se, low=diffs[-1] - half, high=diffs[-1] + half)
                if p[metric] > 0 and r[metric] > 0:
                    ratios.append(math.log(p[metric] / r[metric]))
                    by_seed[seed]["ratio"] = p[metric] / r[metric]
            row["reached"], row["per_seed"], row["by_seed"] = len(values), values, by_seed
            if values:
                row["mean"], row["low"], row["high"] = t_interval(list(values.values()))
            if len(diffs) >= 2:
                row["diff"] = dict(zip(("mean", "low", "high"), t_interval(diffs)), sd=float(np.std(diffs, ddof=1)),
                                   pairs=len(diffs), per_seed=diffs)  # fmt: skip
                row["eval_se"] = eval_se
            if len(ratios) >= 2:
                row["log_ratio"] = dict(zip(("mean", "low", "high"), t_interval(ratios)),
                                        sd=float(np.std(ratios, ddof=1)), pairs=len(ratios))  # fmt: skip
            rows.append(row)
    return rows


def _paired_difference(a: dict, b: dict, metric: str = "p_bad") -> dict:
    """``b − a`` in ``metric`` between two points of the same prompts and random streams, with the evaluation-only
    95% t-interval of the per-prompt differences."""
    _, half = _eval_interval(b["vectors"][metric] - a["vectors"][metric])
    diff = b[metric] - a[metric]
    return {metric: [a[metric], b[metric]], "kl": [a["kl"], b["kl"]], "diff": diff, "low": diff - half,
            "high": diff + half}  # fmt: skip


def thread_check(initial, summaries, other_initial, others, level, reference, primary, cvar_alpha=0.05) -> dict:
    """Runs made again with another torch thread count (``others``, with their own initial evaluation
    ``other_initial`` or ``None``) against the runs of ``summaries`` with the same method, setting and seed.

    Returns ``{"initial", "runs", "primary", "primary_main"}``: the two initial evaluations' P(bad) difference;
    per rerun, P(bad) at the KL ``level`` under each thread count (each run on its own study's initial point) and
    its last evaluation's P(bad) and KL under each, with the evaluation-only interval of the difference (the same
    prompts and random streams); and the ``primary`` row against ``reference`` at ``level`` (:func:`paired_rows`),
    once as run and once with the rerun seeds taken from ``others`` (on ``initial``'s start point, which the
    interpolation reads only below the first evaluation's KL). The conclusion holds across thread counts when both
    primary rows say the same."""

    def key(s):
        return s["run"]["method"], s["run"]["setting"], s["run"]["seed"]

    main = {key(s): s for s in summaries}
    out = {"initial": None, "runs": []}
    if other_initial is not None:
        a, b = (eval_point(i["evals"][0], cvar_alpha) for i in (initial, other_initial))
        out["initial"] = _paired_difference(a, b)
    for o in sorted(others, key=key):
        s = main.get(key(o))
        if s is None:
            continue
        ta, tb = trajectory(initial, s, cvar_alpha), trajectory(other_initial or initial, o, cvar_alpha)
        at = [point_at(t, "kl", level) for t in (ta, tb)]
        out["runs"].append({
            "method": f"{o['run']['method']}/{o['run']['setting']}", "seed": o["run"]["seed"],
            "threads": [s.get("threads"), o.get("threads")], "updates": tb[-1]["updates"],
            "p_bad_at_level": [p["p_bad"] if p is not None else None for p in at],
            "final": _paired_difference(ta[-1], tb[-1]),
        })  # fmt: skip
    swapped = {key(o) for o in others if key(o) in main}
    mixed = [s for s in summaries if key(s) not in swapped] + [o for o in others if key(o) in swapped]
    for name, runs in (("primary_main", summaries), ("primary", mixed)):
        rows = paired_rows(initial, runs, "kl", [level], reference, "p_bad", cvar_alpha)
        out[name] = next((r for r in rows if r["method"] == primary), None)
    return out
