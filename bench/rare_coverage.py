"""Coverage of the rare-output estimators' nominal 95% intervals, measured against the exact value.

For every setting, estimator and sample size the script runs the estimator with many seeds on a tiny one-layer
GPT-NeoX whose exact ``p*`` is known by enumerating all inputs (:func:`trl_ext.eval.rare.exact_probability`), and
counts how often the interval contains ``p*``. Two intervals are scored: ``estimate ± 1.96·SE`` (clipped to
``[0, 1]``) and :meth:`Estimate.interval` (the Wilson-type default). It also reports how often the estimator flagged
its own run as unreliable, and the coverage among the runs it did *not* flag — the runs a user would trust.

Settings (vocabulary 24, inputs of 3 uniform tokens: 13,824 possible inputs):

- ``moderate``: LM head scaled by 5, target token 17 (``p*`` about 2%; the tests' setting);
- ``rare``: LM head scaled by 50, the target token with the smallest ``p*`` (about 0.2%; ``P(y|x)`` is concentrated on
  a few inputs, so plain sampling sees it rarely).

Estimator settings: brute force in batches of up to 256; ITGIS with batches of 64, temperature 2, decay 0.9; MHIS
with 32 chains, temperature 2, 20 burn-in steps. The coverage column's ``[lo, hi]`` is the Wilson 95% interval of
the coverage itself (it is a proportion over the seeds).

    python bench/rare_coverage.py            # defaults (100 seeds): ~4 min on 2 CPU cores
    python bench/rare_coverage.py --seeds 20 --sizes 64 256 --methods itgis   # quick look
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import statistics
import time
import warnings
from pathlib import Path

import torch

from trl_ext.eval.rare import brute_force, exact_probability, itgis, mhis, uniform
from trl_ext.testing import build_rare_output_lm

VOCAB, LENGTH = 24, 3
Z95 = 1.959963984540054


def tiny_lm(head_scale: float):
    """The tests' one-layer GPT-NeoX over 24 tokens (seed 0) with its LM head multiplied by ``head_scale``."""
    return build_rare_output_lm(head_scale, vocab_size=VOCAB)


SETTINGS = {
    # name: (LM head scale, target token ids, temperature of ITGIS and MHIS)
    "moderate": (5.0, [17], 1.0),
    "rare": (100.0, [8], 5.0),
    "very_rare": (100.0, [8, 8], 5.0),
}


def make_setting(name: str) -> tuple[torch.nn.Module, object, list[int], float, float]:
    """``(model, distribution, target_ids, temperature, exact p*)`` of a named setting (:data:`SETTINGS`)."""
    head_scale, target, temperature = SETTINGS[name]
    model, dist = tiny_lm(head_scale), uniform(VOCAB, LENGTH)
    p = exact_probability(model, dist, target, batch_size=4096, show_progress=False).estimate
    return model, dist, target, temperature, p


def run_one(method: str, model, dist, target, temperature: float, n: int, seed: int):
    """One run of ``method`` with the bench's settings (module docstring)."""
    common = {"seed": seed, "show_progress": False}
    if method == "brute_force":
        return brute_force(model, dist, target, n, batch_size=min(n, 256), **common)
    if method == "itgis":
        return itgis(model, dist, target, n, batch_size=64, temperature=temperature, decay_rate=0.9, **common)
    if method == "mhis":
        return mhis(model, dist, target, n, batch_size=32, temperature=temperature, burn_in=20, **common)
    raise ValueError(f"unknown method {method!r}")


def wilson_counts(k: int, n: int) -> tuple[float, float]:
    """Wilson 95% interval of a proportion ``k / n``."""
    if n == 0:
        return math.nan, math.nan
    p, r = k / n, Z95 * Z95 / n
    centre = (p + r / 2) / (1 + r)
    half = Z95 * math.sqrt(p * (1 - p) / n + r / (4 * n)) / (1 + r)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarise(rows: list[dict]) -> dict:
    """Coverage figures of the runs of one (setting, method, n)."""
    runs = len(rows)
    ok = [r for r in rows if r["reliable"]]
    out = {"runs": runs, "p_exact": rows[0]["p_exact"]}
    for label, subset in (("all", rows), ("reliable", ok)):
        for kind in ("normal", "wilson"):
            k = sum(r[f"covered_{kind}"] for r in subset)
            out[f"cov_{kind}_{label}"] = k / len(subset) if subset else math.nan
            out[f"cov_{kind}_{label}_ci"] = wilson_counts(k, len(subset))
    out["num_reliable"] = len(ok)
    out["flagged"] = 1 - len(ok) / runs
    ratios = [r["abs_err_over_se"] for r in rows]
    out["median_err_over_se"] = statistics.median(ratios)
    out["max_err_over_se"] = max(ratios)
    out["median_rel_se"] = statistics.median(r["std_error"] / r["p_exact"] for r in rows)
    return out


def fmt_cov(value: float, ci: tuple[float, float]) -> str:
    if math.isnan(value):
        return "–"
    return f"{value:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def markdown(summary: dict) -> str:
    lines = [
        "| setting | method | n | runs | ±1.96·SE covers | `interval()` covers | median \\|err\\|/SE "
        "| max \\|err\\|/SE | flagged | unflagged: ±1.96·SE covers (runs) | unflagged: `interval()` covers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        setting, method, n = key.split("/")
        lines.append(
            f"| {setting} | {method} | {n} | {s['runs']} | {fmt_cov(s['cov_normal_all'], s['cov_normal_all_ci'])} "
            f"| {fmt_cov(s['cov_wilson_all'], s['cov_wilson_all_ci'])} | {s['median_err_over_se']:.2f} "
            f"| {s['max_err_over_se']:.1f} | {s['flagged']:.0%} "
            f"| {fmt_cov(s['cov_normal_reliable'], s['cov_normal_reliable_ci'])} ({s['num_reliable']}) "
            f"| {fmt_cov(s['cov_wilson_reliable'], s['cov_wilson_reliable_ci'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--methods", nargs="+", default=["brute_force", "itgis", "mhis"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256, 1024, 2048])
    parser.add_argument("--seeds", type=int, default=100, help="runs per (setting, method, n), seeds 0..seeds-1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--output", default="outputs/rare_coverage", help="writes <output>.csv and <output>.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("trl_ext.eval.rare").setLevel(logging.ERROR)  # the flags are recorded, not printed per run
    start = time.perf_counter()
    rows, summary = [], {}
    for setting in args.settings:
        model, dist, target, temperature, p = make_setting(setting)
        print(f"{setting}: target {target}, exact p* = {p:.4g}", flush=True)
        for method in args.methods:
            for n in args.sizes:
                t0, group = time.perf_counter(), []
                for seed in range(args.seeds):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        est = run_one(method, model, dist, target, temperature, n, seed)
                    lo_n, hi_n = est.confidence_interval(0.95)
                    lo_w, hi_w = est.interval(0.95)
                    group.append(
                        {
                            "setting": setting,
                            "method": method,
                            "n": n,
                            "seed": seed,
                            "p_exact": p,
                            "estimate": est.estimate,
                            "std_error": est.std_error,
                            "abs_err_over_se": abs(est.estimate - p) / est.std_error
                            if est.std_error > 0
                            else math.inf,
                            "covered_normal": lo_n <= p <= hi_n,
                            "covered_wilson": lo_w <= p <= hi_w,
                            "reliable": est.reliable,
                            "reasons": " | ".join(est.unreliable_reasons),
                            **{k: v for k, v in est.diagnostics.items() if isinstance(v, (int, float))},
                        }
                    )
                rows += group
                key = f"{setting}/{method}/{n}"
                summary[key] = summarise(group)
                s = summary[key]
                print(
                    f"  {key}: cover {s['cov_normal_all']:.2f} / {s['cov_wilson_all']:.2f}, "
                    f"flagged {s['flagged']:.0%}, unflagged cover {s['cov_normal_reliable']:.2f} "
                    f"({s['num_reliable']}), "
                    f"{time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
    table = markdown(summary)
    print(f"\n{table}\n\ntotal {time.perf_counter() - start:.0f}s")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({"args": vars(args), "summary": summary, "seconds": time.perf_counter() - start}, f, indent=1)
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
