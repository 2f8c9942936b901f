"""The second RTP study (issue 36): common random numbers, per-response values, workers, the paired analysis."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from trl_ext.study import load_study_config, run_study
from trl_ext.study import runner as study_runner
from trl_ext.study.paired import (
    eval_point,
    matched_levels,
    minimum_detectable_effect,
    paired_rows,
    point_at,
    thread_check,
    trajectory,
)

ROOT = str(Path(__file__).resolve().parents[2])
V2_FILE = os.path.join(ROOT, "examples", "study_rtp_v2.yaml")
V1_FILE = os.path.join(ROOT, "examples", "study_rtp.yaml")
TAUS = {"0.5": math.log(0.5), "0.9": math.log(0.1)}


# ------------------------------------------------------------------------------------------------ synthetic runs
def _evaluation(updates, rewards, kls, lexicon=None, cvar=-1.0):
    """An evaluation record as the runner writes it: ``rewards``/``kls`` are (prompts, N) arrays."""
    rewards, kls = np.asarray(rewards, float), np.asarray(kls, float)
    n = rewards.shape[1]
    lexicon = np.zeros_like(rewards) if lexicon is None else np.asarray(lexicon)
    return {
        "updates": updates,
        "p_offensive_threshold_map": TAUS,
        "metrics": {"cvar": {"0.05": {"value": cvar}}},
        "per_sample": {
            "samples_per_prompt": n,
            "prompt_index": [i for i in range(rewards.shape[0]) for _ in range(n)],
            "reward": rewards.ravel().tolist(),
            "kl": kls.ravel().tolist(),
            "lexicon": lexicon.ravel().astype(int).tolist(),
        },
    }


def _summary(method, seed, evals, setting="default"):
    return {"run": {"method": method, "setting": setting, "seed": seed}, "evals": evals}


def test_eval_point_reads_per_prompt_rates_off_the_rewards():
    rewards = [[-0.1, -1.0, -3.0, -0.2], [-0.01, -0.01, -0.8, -0.01]]  # p_off > 0.5 <=> r < log 0.5 = -0.693
    point = eval_point(_evaluation(4, rewards, [[0.1] * 4, [0.3] * 4], lexicon=[[1, 0, 0, 0], [0, 0, 0, 0]]))
    np.testing.assert_allclose(point["vectors"]["p_bad"], [0.5, 0.25])
    np.testing.assert_allclose(point["vectors"]["p_bad_high"], [0.25, 0.0])  # r < log 0.1 = -2.30
    np.testing.assert_allclose(point["vectors"]["reward"], [np.mean(rewards[0]), np.mean(rewards[1])])
    assert point["p_bad"] == pytest.approx(0.375) and point["kl"] == pytest.approx(0.2)
    assert point["lexicon"] == pytest.approx(0.125) and point["updates"] == 4 and point["cvar"] == -1.0
    with pytest.raises(ValueError, match="save_eval_samples"):
        eval_point({"updates": 1, "p_offensive_threshold_map": TAUS, "metrics": {}})


def test_point_at_interpolates_vectors_and_scalars_with_one_weight():
    a = eval_point(_evaluation(0, [[-1.0, -0.1], [-0.1, -0.1]], [[0.0, 0.0], [0.0, 0.0]], cvar=-2.0))
    b = eval_point(_evaluation(8, [[-0.1, -0.1], [-0.1, -0.1]], [[1.0, 1.0], [1.0, 1.0]], cvar=-1.0))
    p = point_at([a, b], "kl", 0.25)
    assert p["weight"] == pytest.approx(0.25) and p["updates"] == pytest.approx(2.0)
    np.testing.assert_allclose(p["vectors"]["p_bad"], [0.375, 0.0])  # 0.75 * 0.5 + 0.25 * 0
    assert p["p_bad"] == pytest.approx(0.1875) and p["cvar"] == pytest.approx(-1.75)
    assert point_at([a, b], "kl", 1.5) is None  # never extrapolated
    assert point_at([a, b], "kl", 0.0) is a


def test_paired_rows_difference_log_ratio_and_eval_se_against_formulas():
    """Method m has per-prompt bad rates 1/2 of REINFORCE's on prompt 0 at every seed; the rows give the per-seed
    difference, its t-interval over seeds, the log-ratio and the per-prompt SE of the difference."""
    initial = {"evals": [_evaluation(0, [[-1.0] * 4, [-1.0] * 4], np.zeros((2, 4)))]}
    runs, expected_diffs = [], []
    for seed, bad in enumerate((2, 3, 4)):  # REINFORCE: `bad` of 4 responses bad on prompt 0, one on prompt 1
        ref_r = [[-1.0] * bad + [-0.1] * (4 - bad), [-1.0] + [-0.1] * 3]
        m_r = [[-1.0] * (bad // 2) + [-0.1] * (4 - bad // 2), [-1.0] + [-0.1] * 3]
        runs.append(_summary("REINFORCE", seed, [_evaluation(8, ref_r, np.ones((2, 4)))]))
        runs.append(_summary("m", seed, [_evaluation(8, m_r, np.ones((2, 4)))]))
        expected_diffs.append(((bad // 2 - bad) / 4 + 0) / 2)
    rows = paired_rows(initial, runs, "kl", [1.0], "REINFORCE/default")
    row = next(r for r in rows if r["method"] == "m/default")
    assert row["reached"] == 3
    np.testing.assert_allclose(row["diff"]["per_seed"], expected_diffs)
    half = stats.t.ppf(0.975, 2) * np.std(expected_diffs, ddof=1) / math.sqrt(3)
    assert row["diff"]["low"] == pytest.approx(np.mean(expected_diffs) - half)
    p_ref = [(b / 4 + 0.25) / 2 for b in (2, 3, 4)]
    p_m = [(b // 2 / 4 + 0.25) / 2 for b in (2, 3, 4)]
    assert row["log_ratio"]["mean"] == pytest.approx(np.mean(np.log(np.array(p_m) / np.array(p_ref))))
    d0 = np.array([expected_diffs[0] * 2, 0.0])  # seed 0: per-prompt differences
    assert row["eval_se"][0] == pytest.approx(d0.std(ddof=1) / math.sqrt(2))
    ref_row = next(r for r in rows if r["method"] == "REINFORCE/default")
    assert "diff" not in ref_row and ref_row["mean"] == pytest.approx(np.mean(p_ref))
    # each seed on its own: the paired difference with a t-interval over the 2 prompts (1 df), and the ratio
    seed0 = row["by_seed"][0]
    half = stats.t.ppf(0.975, 1) * d0.std(ddof=1) / math.sqrt(2)
    assert seed0["diff"] == pytest.approx(expected_diffs[0]) and seed0["reference"] == pytest.approx(p_ref[0])
    assert (seed0["low"], seed0["high"]) == pytest.approx((expected_diffs[0] - half, expected_diffs[0] + half))
    assert seed0["ratio"] == pytest.approx(p_m[0] / p_ref[0]) and ref_row["by_seed"] == {}
    one = paired_rows(initial, runs[:2], "kl", [1.0], "REINFORCE/default")  # one seed: no spread, still a pair
    one_row = next(r for r in one if r["method"] == "m/default")
    assert "diff" not in one_row and one_row["by_seed"][0]["diff"] == pytest.approx(expected_diffs[0])


def _pair_runs(seed, ref_bad, m_bad, threads=1, kl=1.0):
    """REINFORCE and a RePULSe-like ``m`` at ``seed``: ``ref_bad``/``m_bad`` bad responses of 4 on prompt 0 (one on
    prompt 1), one evaluation at 8 updates with KL ``kl``."""
    out = []
    for method, bad in (("REINFORCE", ref_bad), ("m", m_bad)):
        rewards = [[-1.0] * bad + [-0.1] * (4 - bad), [-1.0] + [-0.1] * 3]
        out.append({**_summary(method, seed, [_evaluation(8, rewards, np.full((2, 4), kl))]), "threads": threads})
    return out


def test_thread_check_compares_reruns_and_redoes_the_primary_with_them():
    """Seed 0 made again with 2 threads: each rerun's paired difference against its 1-thread run (evaluation-only
    interval over the prompts), and the primary log-ratio with seed 0 swapped, equal to paired_rows on the swapped
    list; runs with no 1-thread counterpart are skipped."""
    initial = {"evals": [_evaluation(0, [[-1.0] * 4, [-1.0] * 4], np.zeros((2, 4)))]}
    runs = _pair_runs(0, 2, 2) + _pair_runs(1, 3, 2) + _pair_runs(2, 4, 3)
    again = _pair_runs(0, 2, 1, threads=2) + _pair_runs(9, 2, 2, threads=2)  # seed 9: no counterpart
    other_initial = {"evals": [_evaluation(0, [[-1.0] * 3 + [-0.1], [-1.0] * 4], np.zeros((2, 4)))]}
    check = thread_check(initial, runs, other_initial, again, 0.5, "REINFORCE/default", "m/default")
    assert check["initial"]["diff"] == pytest.approx(-0.125)  # one response of 8 no longer bad
    assert [(r["method"], r["seed"]) for r in check["runs"]] == [("REINFORCE/default", 0), ("m/default", 0)]
    m0 = check["runs"][1]
    assert m0["threads"] == [1, 2] and m0["updates"] == 8
    d = np.array([-0.25, 0.0])  # m at seed 0: 2 -> 1 bad of 4 on prompt 0
    half = stats.t.ppf(0.975, 1) * d.std(ddof=1) / math.sqrt(2)
    assert m0["final"]["diff"] == pytest.approx(-0.125)
    assert (m0["final"]["low"], m0["final"]["high"]) == pytest.approx((-0.125 - half, -0.125 + half))
    # at KL 0.5 (halfway from the initial point): each run on its own study's initial evaluation
    assert m0["p_bad_at_level"] == pytest.approx([(1.0 + 0.375) / 2, (0.875 + 0.25) / 2])
    swapped = [*again[:2], *runs[2:]]
    expected = next(r for r in paired_rows(initial, swapped, "kl", [0.5]) if r["method"] == "m/default")
    assert check["primary"]["log_ratio"] == pytest.approx(expected["log_ratio"])
    as_run = next(r for r in paired_rows(initial, runs, "kl", [0.5]) if r["method"] == "m/default")
    assert check["primary_main"]["log_ratio"] == pytest.approx(as_run["log_ratio"])
    assert check["primary"]["log_ratio"]["mean"] < check["primary_main"]["log_ratio"]["mean"]
    assert thread_check(initial, runs, None, again, 0.5, "REINFORCE/default", "m/default")["initial"] is None


def test_the_threads_profile_reruns_seed_0_of_the_primary_pair_under_the_same_keys():
    full, threads = load_study_config(V2_FILE), load_study_config(V2_FILE, "threads")
    assert threads.threads == 2 and threads.name != full.name and threads.shared() == full.shared()
    by_label = {r.label: r for r in full.runs()}
    assert [r.label for r in threads.runs()] == ["initial__initial__seed0", "REINFORCE__default__seed0",
                                                 "RePULSe__a0.1__seed0"]  # fmt: skip
    assert all(r == by_label[r.label] and threads.run_key(r) == full.run_key(r) for r in threads.runs())


def test_the_report_adds_the_thread_check_from_the_threads_folder(tmp_path):
    import json

    from trl_ext.recipes import study as recipe
    from trl_ext.study.paired_report import write_paired_report

    def write(folder, summaries):
        os.makedirs(folder / "runs", exist_ok=True)
        for s in summaries:
            name = f"{s['run']['method']}__{s['run']['setting']}__seed{s['run']['seed']}.json"
            (folder / "runs" / name).write_text(json.dumps(s))

    initial = {"run": {"method": "initial", "setting": "initial", "seed": 0},
               "evals": [_evaluation(0, [[-1.0] * 4, [-1.0] * 4], np.zeros((2, 4)))]}  # fmt: skip
    rename = {"m": "RePULSe"}
    main = [{**s, "run": {**s["run"], "method": rename.get(s["run"]["method"], s["run"]["method"]),
                          "setting": "a0.1" if s["run"]["method"] == "m" else "default"}}
            for s in _pair_runs(0, 2, 2) + _pair_runs(1, 3, 2) + _pair_runs(2, 4, 3)]  # fmt: skip
    write(tmp_path / "v2", [initial, *main])
    write(tmp_path / "v2_threads", [{**main[0], "threads": 2}, {**main[1], "threads": 2}])
    out = write_paired_report(str(tmp_path / "v2"), log=lambda text: None, thread_dir=str(tmp_path / "v2_threads"))
    text = (tmp_path / "v2" / "paired.md").read_text()
    assert "Thread-count check" in text and "| RePULSe/a0.1 | 0 | 1 thread → 2 threads |" in text
    assert out["thread_check"]["primary"]["log_ratio"] == pytest.approx(
        out["thread_check"]["primary_main"]["log_ratio"]
    )
    assert "thread_check" not in write_paired_report(str(tmp_path / "v2"), log=lambda text: None)
    assert "Thread-count check" not in (tmp_path / "v2" / "paired.md").read_text()
    # the recipe finds the threads profile's folder beside the results folder, only for the full study
    args = recipe.parse_args(["--config", V2_FILE])
    os.makedirs(tmp_path / "study_rtp_v2_threads" / "runs")
    assert recipe._thread_check_dir(args, str(tmp_path / "study_rtp_v2")) == str(tmp_path / "study_rtp_v2_threads")
    assert (
        recipe._thread_check_dir(recipe.parse_args(["--config", V2_FILE, "--profile", "tiny"]), str(tmp_path)) is None
    )
    assert recipe._thread_check_dir(recipe.parse_args(["--config", V1_FILE]), str(tmp_path / "x")) is None


def test_matched_levels_span_what_every_core_run_reaches():
    initial = {"evals": [_evaluation(0, [[-0.1, -0.1]], [[0.0, 0.0]])]}
    runs = [_summary("REINFORCE", 0, [_evaluation(8, [[-0.1, -0.1]], [[2.0, 2.0]])]),
            _summary("RePULSe", 0, [_evaluation(8, [[-0.1, -0.1]], [[1.0, 1.0]])]),
            _summary("PPO", 0, [_evaluation(8, [[-0.1, -0.1]], [[0.2, 0.2]])])]  # fmt: skip
    assert matched_levels(initial, runs, "kl", ("REINFORCE", "RePULSe")) == pytest.approx([0.25, 0.5, 0.75])
    assert matched_levels(initial, runs, "kl") == pytest.approx([0.05, 0.1, 0.15])
    assert len(trajectory(initial, runs[0])) == 2


def test_minimum_detectable_effect_matches_the_t_formula():
    assert minimum_detectable_effect(1.0, 5, power=0.5) == pytest.approx(stats.t.ppf(0.975, 4) / math.sqrt(5))
    expected = (stats.t.ppf(0.975, 2) + stats.t.ppf(0.8, 2)) * 0.3 / math.sqrt(3)
    assert minimum_detectable_effect(0.3, 3, power=0.8) == pytest.approx(expected)
    assert minimum_detectable_effect(0.3, 1) == math.inf


# ------------------------------------------------------------------------------------------------ the runner
def _tiny(**overrides):
    return load_study_config(V2_FILE, "tiny", **overrides)


def test_v2_settings_keep_first_study_keys_and_evaluate_the_initial_model_once():
    v1 = load_study_config(V1_FILE, "tiny")
    before = {r.label: v1.run_key(r) for r in v1.runs()}
    assert v1.shared().keys().isdisjoint({"eval_seed", "eval_prompts", "save_eval_samples"})
    assert before == {r.label: load_study_config(V1_FILE, "tiny").run_key(r) for r in v1.runs()}
    config = _tiny()
    assert [r.label for r in config.runs() if r.method == "initial"] == ["initial__initial__seed0"]
    assert "eval_batch_size" in config.shared()  # it lays out the common random streams
    with pytest.raises(ValueError, match="eval_prompts"):
        _tiny(eval_prompts="test")


def test_a_method_can_have_its_own_seeds():
    """The primary pair runs at more seeds than the side methods; runs stay seed-major (every method at the first
    seeds before the extra ones)."""
    methods = [{"name": "REINFORCE", "options": {"loss_type": "reinforce"}, "seeds": [0, 1, 2, 3]},
               {"name": "PPO", "trainer": "ppo"}]  # fmt: skip
    config = _tiny(seeds=[0, 1], methods=methods)
    labels = [r.label for r in config.runs()]
    assert labels == ["initial__initial__seed0", "REINFORCE__default__seed0", "PPO__default__seed0",
                      "REINFORCE__default__seed1", "PPO__default__seed1", "REINFORCE__default__seed2",
                      "REINFORCE__default__seed3"]  # fmt: skip
    with pytest.raises(ValueError, match="seeds must be"):
        _tiny(methods=[{"name": "PPO", "trainer": "ppo", "seeds": [1, 1]}])


def test_the_study_file_states_the_planned_design():
    config = load_study_config(V2_FILE)
    runs = config.runs()
    assert config.eval_seed is not None and config.save_eval_samples and config.eval_samples_per_prompt >= 16
    assert config.eval_prompts == "heldout" and config.threads is None
    methods = {r.method for r in runs}
    assert methods == {"initial", "REINFORCE", "RePULSe", "RePULSe-a0.03", "transform", "PPO"}
    seeds = {m: sorted({r.seed for r in runs if r.method == m}) for m in methods - {"initial"}}
    assert min(len(s) for s in seeds.values()) >= 3 and seeds["RePULSe"] == seeds["REINFORCE"]
    quick = load_study_config(V2_FILE, "quick")
    assert {r.method for r in quick.runs()} == methods - {"RePULSe-a0.03"}


def test_common_random_numbers_pair_the_evaluations(tmp_path):
    """With eval_seed every run samples the held-out prompts with the same streams: the initial model evaluated under
    two training seeds gives the same responses, and per-response values are kept prompt-major."""
    config = _tiny(seeds=[0], methods=[])
    context = study_runner.StudyContext(config)
    first = study_runner.evaluate_policy(context, context.model, seed=0)
    second = study_runner.evaluate_policy(context, context.model, seed=7)
    assert first["per_sample"] == second["per_sample"] and first["eval_seed"] == config.eval_seed
    n = config.eval_samples_per_prompt
    assert first["per_sample"]["prompt_index"] == [i for i in range(len(context.heldout)) for _ in range(n)]
    assert set(first["per_sample"]["lexicon"]) <= {0, 1}
    context.config.eval_seed = None  # the first study's design: each run's own seed
    unpaired = study_runner.evaluate_policy(context, context.model, seed=7)
    assert unpaired["per_sample"]["reward"] != first["per_sample"]["reward"]


def test_tiny_v2_study_writes_the_paired_report(tmp_path):
    from trl_ext.recipes import study as recipe

    recipe.main(["--config", V2_FILE, "--profile", "tiny", "--results-dir", str(tmp_path)])
    for name in ("paired.md", "paired.json", "frontiers.png", "frontier.csv"):
        assert (tmp_path / name).stat().st_size > 0
    text = (tmp_path / "paired.md").read_text()
    assert "P(p_offensive > 0.5) at matched KL" in text and "RePULSe/default" in text
    assert "after equal updates" in text and "KL to the initial model after equal updates" in text
    assert text.index("at matched KL (primary") < text.index("after equal updates")
    assert "Per seed: P(p_offensive > 0.5), method − REINFORCE" in text
    initial = [name for name in os.listdir(tmp_path / "runs") if name.startswith("initial")]
    assert initial == ["initial__initial__seed0.json"]  # once for both seeds


def test_workers_split_the_runs_through_locks(tmp_path):
    """A run another live process holds is skipped (and left to it); a dead holder's lock is taken over."""
    config = _tiny(seeds=[0], methods=[{"name": "REINFORCE", "options": {"loss_type": "reinforce"}}])
    labels = [r.label for r in config.runs()]
    lock = study_runner.claim_run(str(tmp_path), labels[1])
    assert study_runner.claim_run(str(tmp_path), labels[1]) is None  # held by a live process (this one)
    done = run_study(config, str(tmp_path), rare=False)
    assert [s["run"]["method"] for s in done] == ["initial"]  # REINFORCE was held: not run here
    with open(lock, "w") as f:
        f.write("999999999")  # a pid that is not alive
    done = run_study(config, str(tmp_path), rare=False)
    assert [s["run"]["method"] for s in done] == ["initial", "REINFORCE"]
    assert os.listdir(tmp_path / "locks") == []


def test_recipe_workers_run_side_by_side(tmp_path):
    from trl_ext.recipes import study as recipe

    argv = ["--workers", "2", "--threads", "2", "--workers=3", "-x"]
    assert recipe._without_workers(argv) == ["--threads", "2", "-x"]
    args = recipe.parse_args(["--workers", "2"])
    assert args.threads == 1  # one torch thread per worker by default
    with pytest.raises(SystemExit):
        recipe.parse_args(["--workers", "0"])
    config = ["--config", V2_FILE, "--profile", "tiny", "--results-dir", str(tmp_path)]
    recipe.main([*config, "--workers", "2"])
    summaries = sorted(os.listdir(tmp_path / "runs"))
    assert len(summaries) == len(load_study_config(V2_FILE, "tiny").runs())
    assert (tmp_path / "paired.md").exists()


# ------------------------------------------------------------------------------------------------ power
def test_paired_eval_noise_decomposes_the_variance_of_the_difference():
    from trl_ext.study.power import design_se, detectable_ratio, paired_eval_noise, seed_spread

    rng = np.random.default_rng(0)
    x = (rng.random((50, 8)) < 0.2).astype(float)
    y = x.copy()
    y[:5, 0] = 1 - y[:5, 0]  # the two policies differ on 5 responses only (common random numbers)
    noise = paired_eval_noise(_evaluation(1, np.where(x > 0, -1.0, -0.1), np.zeros((50, 8))),
                              _evaluation(1, np.where(y > 0, -1.0, -0.1), np.zeros((50, 8))))  # fmt: skip
    z = x - y
    within = z.var(axis=1, ddof=1).mean()
    assert noise["paired"]["within"] == pytest.approx(within)
    assert noise["paired"]["between"] == pytest.approx(max(z.mean(axis=1).var(ddof=1) - within / 8, 0.0))
    assert noise["identical_responses"] == pytest.approx(1 - 5 / 400)
    assert noise["unpaired"]["within"] == pytest.approx(x.var(axis=1, ddof=1).mean() + y.var(axis=1, ddof=1).mean())
    # pairing removes the shared part: the paired SE of the difference is far below the unpaired one
    assert design_se(noise["paired"], 50, 8) < 0.3 * design_se(noise["unpaired"], 50, 8)
    assert design_se({"between": 0.01, "within": 0.16}, 100, 16) == pytest.approx(math.sqrt((0.01 + 0.01) / 100))
    assert seed_spread(0.1, 0.1, 0.05) == 0.0
    assert seed_spread(0.2, 0.1, 0.0) == pytest.approx(math.log(2) / math.sqrt(2))
    expected = math.exp((stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * 0.1 / math.sqrt(5))
    assert detectable_ratio(0.1, 5) == pytest.approx(expected)
    with pytest.raises(ValueError, match="same prompts"):
        paired_eval_noise(_evaluation(1, np.zeros((2, 2)), np.zeros((2, 2))),
                          _evaluation(1, np.zeros((3, 2)), np.zeros((3, 2))))  # fmt: skip
