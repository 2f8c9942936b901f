"""Frontier plots (`trl_ext.eval.frontier.plot_frontier`) and their recipe (`recipes/plot_frontier.py`) on hand-made
reports: the CSV holds the hand-computed seed means and t-intervals, the PNG is a real PNG, and the recipe reads
`--run` flags and YAML mappings."""

from __future__ import annotations

import csv
import math
import os

import pytest
from online_helpers import RECIPES, assert_help_lists, loaded_script

from trl_ext.eval.frontier import CSV_COLUMNS, frontier_table, plot_frontier
from trl_ext.eval.report import write_json_report

RECIPE = RECIPES / "plot_frontier.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T_95_DF2 = 4.302653  # two-sided 95% Student-t quantile, 2 degrees of freedom (3 seeds)


def report(reward: float, p_bad: float, cvar: float, ret: float | None = None) -> dict:
    """A held-out report as eval_heldout writes it, reduced to what the plot reads (plus a -inf log, as in JSON)."""
    metrics = {
        "num_samples": 100,
        "reward": {"value": reward, "ci": [reward - 1, reward + 1]},
        "return": None if ret is None else {"value": ret, "ci": [ret, ret]},
        "p_bad": {
            "-5.0": {"value": p_bad, "ci": [0.0, 1.0], "count": round(100 * p_bad), "log": "-inf"},
            "-4.0": {"value": 0.5, "ci": [0.4, 0.6], "count": 50},
        },
        "cvar": {"0.05": {"value": cvar, "ci": [cvar - 1, cvar], "num_worst": 5}, "0.1": {"value": 0.0, "ci": [0, 0]}},
    }
    return {"tool": "eval_heldout", "metrics": metrics}


REPORTS = {
    "PPO": [report(1.0, 0.10, -8.0, 0.5), report(2.0, 0.20, -7.0, 1.5), report(3.0, 0.30, -9.0, 2.5)],
    "RePULSe": [report(0.5, 0.01, -6.0, 0.0), report(0.5, 0.03, -6.0, 0.0), report(0.8, 0.02, -5.0, 0.3)],
}


def t_interval(values):
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T_95_DF2 * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_holds_seed_means_and_t_intervals(tmp_path):
    result = plot_frontier(REPORTS, output_prefix=tmp_path / "plots" / "frontier", threshold=-5, cvar_alpha=0.05)
    rows = read_csv(tmp_path / "plots" / "frontier.csv")
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert [r["method"] for r in rows] == ["PPO", "RePULSe"]
    expected = {
        "PPO": {"x": [1.0, 2.0, 3.0], "p_bad": [0.1, 0.2, 0.3], "cvar": [-8.0, -7.0, -9.0]},
        "RePULSe": {"x": [0.5, 0.5, 0.8], "p_bad": [0.01, 0.03, 0.02], "cvar": [-6.0, -6.0, -5.0]},
    }
    for row, returned in zip(rows, result["rows"]):
        assert row["num_seeds"] == "3" and row["threshold"] == "-5.0" and row["cvar_alpha"] == "0.05"
        for name, values in expected[row["method"]].items():
            mean, low, high = t_interval(values)
            if name == "p_bad":  # probabilities: the interval is kept inside [0, 1]
                low, high = max(low, 0.0), min(high, 1.0)
            for suffix, value in (("mean", mean), ("ci_low", low), ("ci_high", high)):
                assert float(row[f"{name}_{suffix}"]) == pytest.approx(value, abs=1e-5), (row["method"], name, suffix)
                assert returned[f"{name}_{suffix}"] == pytest.approx(float(row[f"{name}_{suffix}"]))
    assert result["csv_path"].endswith("frontier.csv") and result["x"] == "reward"


def test_png_is_written_atomically(tmp_path):
    result = plot_frontier(REPORTS, output_prefix=str(tmp_path / "f"), x="return")
    with open(result["png_path"], "rb") as f:
        data = f.read()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert sorted(os.listdir(tmp_path)) == ["f.csv", "f.png"]  # no temporary file left behind
    assert float(read_csv(tmp_path / "f.csv")[0]["x_mean"]) == pytest.approx(1.5)  # mean return of PPO


def test_reports_from_json_files_and_one_seed(tmp_path):
    paths = [write_json_report(tmp_path / f"s{i}.json", r) for i, r in enumerate(REPORTS["PPO"])]
    rows = frontier_table({"PPO": paths, "single": [REPORTS["RePULSe"][0]]}, threshold=-4.0, cvar_alpha=0.1)
    assert rows[0]["p_bad_mean"] == pytest.approx(0.5) and rows[0]["p_bad_ci_low"] == pytest.approx(0.5)
    single = rows[1]
    assert single["num_seeds"] == 1 and single["note"] == "one seed: no interval"
    assert single["x_mean"] == single["x_ci_low"] == single["x_ci_high"] == 0.5


def test_errors_say_what_to_change(tmp_path):
    with pytest.raises(ValueError, match=r"report 0 of method 'PPO'.*no P\(r < threshold\) at -7.0"):
        frontier_table(REPORTS, threshold=-7)
    with pytest.raises(ValueError, match="no CVaR alpha at 0.01"):
        frontier_table(REPORTS, cvar_alpha=0.01)
    with pytest.raises(ValueError, match="no mean return; plot x='reward'"):
        frontier_table({"A": [report(1.0, 0.1, -1.0)]}, x="return")
    with pytest.raises(ValueError, match="x must be one of"):
        frontier_table(REPORTS, x="kl")
    with pytest.raises(ValueError, match="no report"):
        frontier_table({"A": []})
    with pytest.raises(FileNotFoundError, match="No report at"):
        frontier_table({"A": [str(tmp_path / "missing.json")]})


# ------------------------------------------------------------------------------------------------ the recipe
def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, ("--run", "--runs", "--threshold", "--cvar_alpha", "--x", "--output_prefix", "--config"))


@pytest.fixture(scope="module")
def recipe():
    yield from loaded_script(RECIPE)


def test_recipe_repeated_run_flags_and_yaml_mapping(recipe, tmp_path):
    paths = {
        m: [write_json_report(tmp_path / f"{m}{i}.json", r) for i, r in enumerate(rs)] for m, rs in REPORTS.items()
    }
    argv = [
        "--run",
        f"PPO={','.join(paths['PPO'])}",
        "--threshold",
        "-5",
        "--run",
        f"RePULSe={','.join(paths['RePULSe'])}",
    ]
    argv += ["--output_prefix", str(tmp_path / "cli")]
    assert recipe.merge_repeated_flag(["--run", "A=1", "--x", "return", "--run=B=2"]) == [
        "--x",
        "return",
        "--run",
        "A=1",
        "B=2",
    ]
    (args,) = recipe.make_parser().parse_args_and_config(recipe.merge_repeated_flag(argv))
    result = recipe.main(args)
    assert [r["method"] for r in result["rows"]] == ["PPO", "RePULSe"]
    assert (tmp_path / "cli.png").read_bytes().startswith(PNG_MAGIC)

    config = tmp_path / "frontier.yaml"
    lines = ["runs:"] + [f"  {m}: [{', '.join(p)}]" for m, p in paths.items()]
    config.write_text("\n".join(lines + ["cvar_alpha: 0.05", f"output_prefix: {tmp_path / 'yaml'}", ""]))
    (args,) = recipe.make_parser().parse_args_and_config(["--config", str(config)])
    assert recipe.main(args)["rows"] == result["rows"]

    with pytest.raises(ValueError, match="METHOD=path1,path2"):
        recipe.FrontierPlotArguments(run=["PPO"]).method_reports()
    with pytest.raises(ValueError, match="given twice"):
        recipe.FrontierPlotArguments(run=["A=x.json", "A=y.json"]).method_reports()
    with pytest.raises(ValueError, match="Pass the runs"):
        recipe.FrontierPlotArguments().method_reports()


def test_intervals_stay_in_the_support_and_blank_thresholds_warn(tmp_path, caplog):
    """A 0/-1 reward: P(r < -0.5) intervals in [0, 1], mean reward and CVaR intervals in the sampled range [-1, 0];
    a threshold below every reward warns that its panel is blank."""
    import logging

    from trl_ext.eval.metrics import frontier_metrics

    def seed(num_bad: int) -> dict:
        rewards = [-1.0] * num_bad + [0.0] * (20 - num_bad)
        return {"metrics": frontier_metrics(rewards, thresholds=(-5.0, -0.5), cvar_alphas=(0.05,), num_resamples=50)}

    reports = {"REINFORCE": [seed(1), seed(0), seed(0)], "RePULSe": [seed(4), seed(0), seed(1)]}
    rows = plot_frontier(reports, output_prefix=tmp_path / "f", threshold=-0.5, cvar_alpha=0.05)["rows"]
    for row in rows:
        assert 0 <= row["p_bad_ci_low"] <= row["p_bad_mean"] <= row["p_bad_ci_high"] <= 1
        assert -1 <= row["cvar_ci_low"] <= row["cvar_mean"] <= row["cvar_ci_high"] <= 0
        assert -1 <= row["x_ci_low"] <= row["x_ci_high"] <= 0
    assert rows[0]["p_bad_ci_low"] == 0.0  # the raw t-interval went below zero
    with caplog.at_level(logging.WARNING, logger="trl_ext.eval.frontier"):
        plot_frontier(reports, output_prefix=tmp_path / "g", threshold=-5.0, cvar_alpha=0.05)
    assert "no report has a reward below threshold=-5" in caplog.text and "span [-1, 0]" in caplog.text
