r"""Power analysis for the paired RTP study (``results/study_rtp_v2/PLAN.md``): what a budget can detect.

The statistic is the per-seed log-ratio ``L_s = ln(P_m,s / P_ref,s)`` of two methods' P(bad) at a matched level,
averaged over ``S`` seeds with a Student-t interval. Its spread over seeds has two parts:

- **training noise**: two seeds of one method give different policies; measured from pilot runs of the same setting
  at two seeds (:func:`seed_spread`);
- **evaluation noise**: with the policies fixed, ``P̂`` is a mean over ``n`` prompts × ``N`` responses. With common
  random numbers the two methods' responses to one prompt share their random streams, so the per-response
  differences ``z_ij = x_ij − y_ij`` (bad indicators of the two policies) are what matter:
  ``Var(D̂) = (σ²_between + σ²_within / N) / n``, where ``σ²_within`` is the mean within-prompt variance of ``z`` and
  ``σ²_between`` the variance over prompts of the prompt means of ``z`` beyond what ``σ²_within`` explains
  (:func:`paired_eval_noise`). The unpaired variance (independent streams) is reported beside it.

Relative noise is ``SE / P`` (the delta method: ``SD(ln P̂) ≈ SE(P̂) / P``), which is what the log-ratio carries.
:func:`detectable_ratio` turns the total spread into the smallest ratio a design detects.
"""

from __future__ import annotations

import math

import numpy as np

from .paired import minimum_detectable_effect

__all__ = ["bad_indicators", "detectable_ratio", "paired_eval_noise", "seed_spread"]


def bad_indicators(evaluation: dict) -> np.ndarray:
    """``(prompts, N)`` 0/1 array: the response's ``p_offensive`` above the lowest threshold (0.5)."""
    samples = evaluation["per_sample"]
    tau = max(evaluation["p_offensive_threshold_map"].values())  # log(1 - t) of the lowest t
    reward = np.asarray(samples["reward"], dtype=np.float64)
    return (reward < tau).astype(np.float64).reshape(-1, int(samples["samples_per_prompt"]))


def _components(z: np.ndarray) -> tuple[float, float]:
    """``(σ²_between, σ²_within)`` of a ``(prompts, N)`` array: the within-prompt variance (mean over prompts of the
    unbiased variance over responses) and the between-prompt variance of the prompt means beyond it (floored at 0)."""
    n = z.shape[1]
    within = float(z.var(axis=1, ddof=1).mean())
    between = max(float(z.mean(axis=1).var(ddof=1)) - within / n, 0.0)
    return between, within


def paired_eval_noise(eval_a: dict, eval_b: dict) -> dict:
    """The evaluation noise of ``P̂_a − P̂_b`` for two evaluations on the same prompts (``N >= 2`` each), paired (same
    random streams: differences per response) and unpaired (independent: the two variances add)."""
    x, y = bad_indicators(eval_a), bad_indicators(eval_b)
    if x.shape != y.shape or x.shape[1] < 2:
        raise ValueError(f"Need the same prompts and >= 2 responses each; got {x.shape} and {y.shape}.")
    paired = _components(x - y)
    a, b = _components(x), _components(y)
    return {
        "prompts": x.shape[0],
        "responses": x.shape[1],
        "p_a": float(x.mean()),
        "p_b": float(y.mean()),
        "identical_responses": float((x == y).mean()),
        "paired": {"between": paired[0], "within": paired[1]},
        "unpaired": {"between": a[0] + b[0], "within": a[1] + b[1]},
    }


def design_se(components: dict, prompts: int, responses: int) -> float:
    """The standard error of ``D̂`` for ``prompts`` prompts × ``responses`` responses, from ``{between, within}``."""
    return math.sqrt((components["between"] + components["within"] / responses) / prompts)


def seed_spread(p_first: float, p_second: float, eval_sd_ln: float) -> float:
    """The training-noise SD of ``ln P`` of one method, from two seeds' P(bad): half the variance of their log-ratio
    less each evaluation's own share (``eval_sd_ln²`` each), floored at 0. One degree of freedom: a rough value."""
    d = math.log(p_first / p_second)
    return math.sqrt(max(d * d / 2 - eval_sd_ln**2, 0.0))


def detectable_ratio(total_sd_ln: float, seeds: int, power: float = 0.8, confidence: float = 0.95) -> float:
    """The smallest ratio ``P_m / P_ref`` (> 1; its inverse is detected alike) that ``seeds`` paired seeds detect,
    given the SD over seeds of the per-seed log-ratio."""
    return math.exp(minimum_detectable_effect(total_sd_ln, seeds, confidence, power))


# ------------------------------------------------------------------------------------------------ the plan's numbers
def _runs(folder: str) -> dict[str, dict]:
    import json
    import os

    out = {}
    for name in sorted(os.listdir(os.path.join(folder, "runs"))):
        if name.endswith(".json"):
            with open(os.path.join(folder, "runs", name), encoding="utf-8") as f:
                out[name[: -len(".json")]] = json.load(f)
    return out


def _at(summary: dict, updates: int) -> dict:
    return next(e for e in summary["evals"] if e["updates"] == updates)


def pilot_numbers(folder: str, pairs: list[tuple[str, str]], seed_pairs: list[tuple[str, str]], updates: int) -> dict:
    """The pilot's measurements: evaluation noise components of each ``pairs`` difference (two trained policies,
    same evaluation streams) at ``updates``, the seed spread of each ``seed_pairs`` (one setting at two seeds) and the
    cost per update and per evaluated response."""
    runs = _runs(folder)
    noise = {}
    for a, b in pairs:
        if a in runs and b in runs:
            noise[f"{a} vs {b}"] = paired_eval_noise(_at(runs[a], updates), _at(runs[b], updates))
    spread = {}
    for a, b in seed_pairs:
        if a in runs and b in runs:
            ea, eb = _at(runs[a], updates), _at(runs[b], updates)
            pa, pb = bad_indicators(ea).mean(), bad_indicators(eb).mean()
            pn = paired_eval_noise(ea, eb)
            eval_sd = design_se(pn["paired"], pn["prompts"], pn["responses"]) / ((pa + pb) / 2) / math.sqrt(2)
            spread[f"{a} vs {b}"] = {
                "p": [float(pa), float(pb)],
                "ln_ratio": float(math.log(pa / pb)),
                "eval_sd_ln_each": eval_sd,
                "train_sd_ln": seed_spread(pa, pb, eval_sd),
            }
    cost = {}
    for label, s in runs.items():
        if s["run"]["method"] == "initial":
            e = s["evals"][0]
            cost["eval_seconds_per_response"] = e["eval_seconds"] / e["num_samples"]
        else:
            cost[f"{label} seconds_per_update"] = s["seconds_per_update"]
    return {"updates": updates, "eval_noise": noise, "seed_spread": spread, "cost": cost}


def design_table(eval_components: dict, p_bad: float, train_sd_ln: float, prompts: int, responses, seeds) -> list:
    """Per design (``responses`` per prompt × ``seeds``): the evaluation SD of the per-seed log-ratio, the total SD
    (evaluation + two methods' training noise) and the detectable ratios (95% interval half-width; 80% power)."""
    rows = []
    for n in responses:
        eval_sd = design_se(eval_components, prompts, n) / p_bad
        total = math.sqrt(eval_sd**2 + 2 * train_sd_ln**2)
        for s in seeds:
            rows.append({"responses": n, "seeds": s, "eval_sd_ln": eval_sd, "total_sd_ln": total,
                         "ratio_halfwidth": detectable_ratio(total, s, power=0.5),
                         "ratio_power80": detectable_ratio(total, s, power=0.8)})  # fmt: skip
    return rows


if __name__ == "__main__":  # python -m trl_ext.study.power <pilot folder> <out.json>: the numbers behind PLAN.md
    import json
    import sys

    folder, out_path = sys.argv[1], sys.argv[2]
    pairs = [("RePULSe__a0.1_lr3e-4__seed100", "REINFORCE__lr3e-4__seed100"),
             ("REINFORCE__lr1e-3__seed100", "REINFORCE__lr3e-4__seed100"),
             ("REINFORCE__lr3e-4__seed101", "REINFORCE__lr3e-4__seed100")]  # fmt: skip
    seed_pairs = [("REINFORCE__lr3e-4__seed101", "REINFORCE__lr3e-4__seed100"),
                  ("RePULSe__a0.1_lr3e-4__seed101", "RePULSe__a0.1_lr3e-4__seed100")]  # fmt: skip
    result = {str(u): pilot_numbers(folder, pairs, seed_pairs, u) for u in (16, 32, 48)}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
