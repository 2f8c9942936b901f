"""The toy study (`trl_ext.study.toy`, `recipes/toy_study.py`) and the continuous-reward demo (`make demo`): exact
classifier expectations against brute force, matched-KL / matched-reward interpolation, the proposal's mechanism
statistics, the resumable queue, and the demo's whole path on the kit's tiny model."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trl_ext import testing as kit
from trl_ext.eval.response_scores import response_score_expectations
from trl_ext.rewards import HELDOUT_OFFENSIVE_WORDS, OFFENSIVE_WORDS
from trl_ext.study import toy_report
from trl_ext.study.toy import ToyConfig, ToyRun, _claim, offensive_sample_stats, run_toy_queue, toy_runs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = kit.build_tokenizer(pad_equals_eos=True, padding_side="left")
    model = kit.build_causal_lm("llama", tokenizer=tokenizer, seed=0).eval()
    return model, tokenizer


def _brute_force(model, prompt, eos, f, temperature):
    """Every response of ≤ 2 tokens with its probability (EOS ends a response), by direct forwards."""
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        vocab = first.shape[0]
        rows = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.log_softmax(model(rows).logits[:, -1].double() / temperature, -1)
    responses, logp = [[eos]], [float(first[eos])]
    for t in range(vocab):
        if t == eos:
            continue
        responses += [[t, u] for u in range(vocab)]
        logp += (first[t] + second[t]).tolist()
    values = f(responses)
    p = np.exp(np.asarray(logp))
    return {k: float((p * np.asarray(v)).sum()) for k, v in values.items()}, float((p * -np.asarray(logp)).sum()), p


def _score(responses):
    return {"a": [(r[0] % 7) / 7 for r in responses], "b": [float(r[-1] % 3 == 0) for r in responses]}


@pytest.mark.parametrize("temperature", [0.1, 1.0])
def test_response_score_expectations_match_brute_force(tiny, temperature):
    model, tok = tiny
    prompt, eos = tok("hello there")["input_ids"], tok.eos_token_id
    truth, entropy, probs = _brute_force(model, prompt, eos, _score, temperature)
    exact = response_score_expectations(model, prompt, _score, eos_token_id=eos, temperature=temperature,
                                        prune_below=1e-300, remainder_samples=2)  # fmt: skip
    assert exact.pruned_mass == 0.0 and exact.remainder_samples == 0
    assert exact.enumerated_mass == pytest.approx(1.0, abs=1e-9)
    # fp32 probabilities from two different batchings: at T = 0.1 the logits are scaled by 10, and so is their
    # rounding (1.4e-6 relative with one torch thread), hence 1e-5
    for name, value in truth.items():
        assert exact.scores[name].estimate == pytest.approx(value, rel=1e-5) and exact.scores[name].stderr == 0
    assert exact.entropy == pytest.approx(entropy, rel=1e-5)
    assert exact.top_probability == pytest.approx(probs.max(), rel=1e-5)
    # pruned: unbiased, with a calibrated standard error, always inside the certified interval
    estimates, ses = [], []
    for seed in range(30):
        r = response_score_expectations(model, prompt, _score, eos_token_id=eos, temperature=temperature,
                                        prune_below=2e-3, remainder_samples=32, generator=seed)  # fmt: skip
        assert 0 < r.pruned_mass < 1 and r.remainder_samples == 32
        low, high = r.scores["a"].interval(0.0, 6 / 7, r.pruned_mass)
        assert low - 1e-12 <= r.scores["a"].estimate <= high + 1e-12
        estimates.append(r.scores["a"].estimate)
        ses.append(r.scores["a"].stderr)
    mean_se = float(np.mean(ses)) / math.sqrt(len(estimates))
    assert abs(np.mean(estimates) - truth["a"]) < 4 * mean_se
    assert 0.5 < np.std(estimates) / np.mean(ses) < 1.6  # the reported SE matches the spread over seeds


def test_response_score_expectations_errors(tiny):
    model, tok = tiny
    prompt = tok("hello")["input_ids"]
    with pytest.raises(ValueError, match="prune_below"):
        response_score_expectations(model, prompt, _score, prune_below=0.0)
    with pytest.raises(ValueError, match="remainder_samples"):
        response_score_expectations(model, prompt, _score, remainder_samples=1)
    with pytest.raises(ValueError, match="values for"):
        response_score_expectations(model, prompt, lambda r: {"x": [0.0]}, prune_below=1e-2)
    with pytest.raises(ValueError, match="non-finite"):
        response_score_expectations(model, prompt, lambda r: {"x": [math.nan] * len(r)}, prune_below=1e-2)
    with pytest.raises(TypeError, match="mapping"):
        response_score_expectations(model, prompt, lambda r: [0.0] * len(r), prune_below=1e-2)


def test_heldout_words_are_disjoint_and_not_trained_on():
    assert not set(OFFENSIVE_WORDS) & set(HELDOUT_OFFENSIVE_WORDS)
    assert len(HELDOUT_OFFENSIVE_WORDS) >= 30
    source = (REPO / "trl_ext" / "study" / "toy.py").read_text()
    assert source.count("HELDOUT_OFFENSIVE_WORDS") == source.count("heldout_ids =") + 2  # docstring + import


# ------------------------------------------------------------------------------------------------ the analysis
def _point(updates, kl, reward, p_bad, top=0.01):
    return {"updates": updates, "kl": kl, "reward": reward, "p_bad": p_bad, "p_bad_heldout": p_bad / 2,
            "p_offensive": p_bad * 2, "entropy": 5.0, "top_probability": top}  # fmt: skip


def _summary(method, setting, seed, points, **extra):
    return {"run": {"method": method, "setting": setting, "seed": seed, "threads": 1}, "evals": points,
            "steps": [], **extra}  # fmt: skip


def test_value_at_interpolates_log_linearly_and_never_extrapolates():
    points = [_point(0, 0.0, -0.2, 1e-2), _point(5, 1.0, -0.1, 1e-3), _point(10, 2.0, -0.05, 1e-4)]
    assert toy_report.value_at(points, "kl", 0.5, "p_bad") == pytest.approx(-2.5)  # halfway in log10
    assert toy_report.value_at(points, "kl", 1.5, "p_bad") == pytest.approx(-3.5)
    assert toy_report.value_at(points, "kl", 2.5, "p_bad") is None
    # matched reward: the reward rises from -0.2; -0.15 lies halfway between the first two evaluations
    assert toy_report.value_at(points, "reward", -0.15, "p_bad") == pytest.approx(-2.5)
    assert toy_report.value_at(points, "reward", -0.075, "p_bad") == pytest.approx(-3.5)
    assert toy_report.value_at(points, "reward", 0.0, "p_bad") is None
    assert toy_report.value_at(points, "kl", 1.5, "entropy") == pytest.approx(5.0)  # not a probability: linear


def test_matched_table_paired_differences():
    initial = {"evals": [_point(0, 0.0, -0.2, 1e-2)]}
    runs = []
    for seed, shift in enumerate([0.0, 0.1, -0.1]):
        runs.append(_summary("REINFORCE", "default", seed, [_point(5, 1.0, -0.1, 10 ** (-3 + shift))]))
        runs.append(_summary("RePULSe", "a", seed, [_point(5, 1.0, -0.1, 10 ** (-4 + shift + 0.1 * seed))]))
    levels = toy_report.matched_levels(initial, runs, "kl")
    assert levels == pytest.approx([0.25, 0.5, 0.75])
    rows = toy_report.matched_table(initial, runs, "kl", [1.0])
    by = {r["method"]: r for r in rows}
    assert by["REINFORCE/default"]["mean"] == pytest.approx(-3.0) and "diff_mean" not in by["REINFORCE/default"]
    diffs = [-1.0, -0.9, -0.8]
    assert by["RePULSe/a"]["diff_mean"] == pytest.approx(np.mean(diffs))
    assert by["RePULSe/a"]["diff_sd"] == pytest.approx(np.std(diffs, ddof=1))
    assert by["RePULSe/a"]["diff_low"] < np.mean(diffs) < by["RePULSe/a"]["diff_high"] < 0
    assert by["RePULSe/a"]["reached"] == 3 and by["RePULSe/a"]["collapsed"] == 0
    # a level beyond a run's reach is reported as not reached
    short = toy_report.matched_table(initial, runs, "kl", [2.0])
    assert all(r["reached"] == 0 and "mean" not in r for r in short)


def test_collapse_is_flagged():
    initial = {"evals": [_point(0, 0.0, -0.2, 1e-2)]}
    runs = [_summary("REINFORCE", "default", 0, [_point(5, 1.0, -0.1, 1e-5, top=0.9)])]
    (row,) = toy_report.matched_table(initial, runs, "kl", [0.8])
    assert row["collapsed"] == 1 and toy_report.collapsed({"top_probability": 0.5})


def test_mechanism_amplification(tmp_path):
    path = tmp_path / "neg.jsonl"
    rows = [{"step": 0, "source": "proposal", "response": " idiot"}] * 3 + [
        {"step": 0, "source": "proposal", "response": " moron"},
        {"step": 1, "source": "policy", "response": " idiot"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = offensive_sample_stats(str(path), updates=2, samples=8)
    assert stats["proposal"][0] == {"update": 1, "bad": 4, "distinct": 2, "top_share": 0.75, "top": " idiot"}
    assert stats["policy"][1]["bad"] == 1 and stats["proposal"][1]["bad"] == 0
    initial = {"evals": [{"updates": 0, "p_offensive": 0.02}]}
    summary = {"evals": [{"updates": 2, "p_offensive": 0.01}], "offensive_samples": stats,
               "steps": [{"update": 1, "proposal/reward": -1.0}, {"update": 2, "proposal/reward": -0.5}]}  # fmt: skip
    m = toy_report.mechanism(initial, summary)
    first = m["per_update"][0]
    assert first["q_rate"] == 0.5 and first["p_exact"] == pytest.approx(0.02)  # the policy before update 1
    assert first["amplification"] == pytest.approx(25.0) and m["max_amplification_early"] == pytest.approx(25.0)
    assert m["per_update"][1]["p_exact"] == pytest.approx(0.015) and first["q_reward"] == -1.0
    assert toy_report.mechanism(initial, {**summary, "steps": []}) is None  # no proposal: nothing to report


# ------------------------------------------------------------------------------------------------ runs and demo
def test_plan_and_keys():
    config = ToyConfig(model="tiny")
    from trl_ext.recipes import toy_study

    runs = toy_runs(config, toy_study.PLANS["main"])
    labels = [r.label for r in runs]
    assert len(labels) == len(set(labels))
    count = {m: sum(r.method == m and not r.extend_to for r in runs) for m in ("REINFORCE", "RePULSe", "transform")}
    assert count["REINFORCE"] == 5 and count["RePULSe"] >= 5 + 3 * 2 and count["transform"] == 9
    # every run of the main settings may be continued to 40 updates, after the base runs it continues
    extended = [r for r in runs if r.extend_to]
    assert {r.extend_to for r in extended} == {40} and len(extended) == 5 + 5 + 3 + 3 + 3
    assert all(labels.index(r.base.label) < labels.index(r.label) for r in extended)
    assert labels[:2] == ["REINFORCE__default__seed0", "RePULSe__a0.1_b-10__seed0"]
    repulse = runs[1].options
    assert repulse["rm_type"] == "rlhf" and repulse["target_dist_beta"] == -10.0 and repulse["alpha"] == 0.1
    # the key changes with what changes the result, not with the worker's thread count
    assert runs[0].key(config) != runs[0].key(ToyConfig(model="tiny", learning_rate=3e-4))
    assert runs[0].key(config) == runs[0].key(ToyConfig(model="tiny", threads=2))
    assert ToyRun("REINFORCE", "default", 0, threads=2).label.endswith("__t2")
    with pytest.raises(ValueError, match="no setting"):
        toy_runs(config, [("RePULSe", "nope", [0])])
    with pytest.raises(ValueError, match="eval_at"):
        ToyConfig(updates=4, eval_at=[5])


def test_lock_of_a_dead_worker_is_taken_over(tmp_path):
    run = ToyRun("REINFORCE", "default", 0)
    lock = _claim(str(tmp_path), run)
    assert lock is not None and _claim(str(tmp_path), run) is None  # held by this (live) process
    Path(lock).write_text("999999999")  # a pid that does not exist
    assert _claim(str(tmp_path), run) == lock


@pytest.fixture(scope="module")
def demo_module():
    module = importlib.import_module("trl_ext.recipes.demo_repulse")
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


def test_continuous_reward_demo_end_to_end(demo_module, tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["--tiny", "--updates", "2", "--eval-every", "1", "--samples", "8", "--output-dir", str(out)]
    results = demo_module.main(argv)
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads((out / "results.json").read_text())
    assert set(on_disk["runs"]) == {"REINFORCE", "RePULSe"}
    repulse = results["runs"]["RePULSe"]
    options = repulse["trainer_options"]
    assert options["loss_type"] == "neg_training" and options["rm_type"] == "rlhf"
    assert options["target_dist_beta"] == -10.0 and options["alpha"] == 0.1
    assert [e["updates"] for e in repulse["evals"]] == [1, 2]
    for e in repulse["evals"]:
        assert e["p_bad_lower"] <= e["p_bad"] + 1e-12 and -9.3 <= e["reward"] <= 0 and 0 <= e["p_offensive"] <= 1
        assert e["kl"] >= 0 and e["entropy"] > 0 and 0 < e["top_probability"] <= 1
    # the policy moved, and the proposal was trained and logged
    assert repulse["evals"][-1]["kl"] > 0
    assert [s["update"] for s in repulse["steps"]] == [1, 2] and "proposal/reward" in repulse["steps"][0]
    assert "proposal/reward" not in results["runs"]["REINFORCE"]["steps"][0]
    mech = results["mechanism"]["RePULSe"]["per_update"]
    assert [m["update"] for m in mech] == [1, 2] and all(m["amplification"] >= 0 for m in mech)
    printed = capsys.readouterr().out
    assert "matched KL(y)" in printed and "amplification" in printed
    # rerunning resumes: nothing is trained again
    again = demo_module.main(argv)
    assert again["runs"]["RePULSe"]["wall_seconds"] == repulse["wall_seconds"]


def test_demo_flags(demo_module):
    with pytest.raises(SystemExit):
        demo_module.parse_args(["--beta", "1"])
    with pytest.raises(SystemExit):
        demo_module.parse_args(["--steps", "4"])  # an option of the indicator design only
    args, rest = demo_module.parse_args(["--design", "indicator", "--steps", "4"])
    assert args.design == "indicator" and rest == ["--steps", "4"]
    args, _ = demo_module.parse_args([])
    assert args.updates == 16 and args.samples == 128 and args.alpha == 0.1 and args.beta == -10.0


def test_toy_context_scores_like_the_training_reward():
    pytest.importorskip("profanity_check")
    from trl_ext.study.toy import PROMPT, ToyContext

    context = ToyContext(ToyConfig(model="tiny"))
    responses = [context.tokenizer(" idiot")["input_ids"][:2], [context.eos]]
    scores = context.score(responses)
    texts = context.tokenizer.batch_decode(responses, skip_special_tokens=True)
    expected = context.reward([PROMPT] * 2, texts)
    assert np.allclose(scores["reward"], expected)
    assert list(scores["p_offensive"]) == [float(r < math.log(0.5)) for r in expected]


def test_queue_skips_done_runs(tmp_path):
    config = ToyConfig(model="tiny", updates=1, eval_at=[1], samples_per_update=4, trainable_layers=0,
                       remainder_samples=4, kl_samples=4, prune_below=1e-2)  # fmt: skip
    runs = [ToyRun("REINFORCE", "default", 0, options={"loss_type": "reinforce"})]
    first = run_toy_queue(config, runs, str(tmp_path), log=lambda m: None)
    assert first == ["initial", "REINFORCE__default__seed0"]
    assert run_toy_queue(config, runs, str(tmp_path), log=lambda m: None) == []
    assert not os.listdir(tmp_path / "locks")


def test_thread_check_compares_thread_counts():
    initial = {"evals": [_point(0, 0.0, -0.2, 1e-2)]}
    runs = []
    for threads, shift in ((1, 0.0), (2, 0.05)):
        for method, setting, p in (("REINFORCE", "default", 1e-3), ("RePULSe", "a", 1e-4)):
            s = _summary(method, setting, 0, [_point(5, 1.0, -0.1, p * 10**shift)])
            s["run"]["threads"] = threads
            runs.append(s)
    lines = toy_report.thread_check(initial, runs, [1.0], ("RePULSe", "a"))
    rows = [line for line in lines if line.startswith("| RePULSe")]
    assert len(rows) == 2 and all(row.endswith("| -1.000 |") for row in rows)  # the gap holds at both counts
    assert toy_report.thread_check(initial, runs[:2], [1.0], ("RePULSe", "a")) == []  # one thread count only


def test_extension_continues_a_run_repeats_it_and_stops_at_the_target(tmp_path):
    config = ToyConfig(model="tiny", updates=1, eval_at=[1], samples_per_update=4, trainable_layers=0,
                       remainder_samples=4, kl_samples=4, prune_below=1e-2)  # fmt: skip
    base = ToyRun("REINFORCE", "default", 0, options={"loss_type": "reinforce", "learning_rate": 1e-2})
    ext = ToyRun(**{**base.__dict__, "extend_to": 7})
    assert ext.label == "REINFORCE__default__seed0__x7" and ext.base == base
    assert ext.eval_at(config) == [1, 6, 7] and ext.updates(config) == 7 and base.eval_at(config) == [1]
    assert ext.key(config) != base.key(config)
    with pytest.raises(ValueError, match="extend_to"):
        toy_runs(config, [("REINFORCE", "default", [0], 1)])
    # without its base run the extension waits
    assert run_toy_queue(config, [ext], str(tmp_path), log=lambda m: None) == ["initial"]
    done = run_toy_queue(config, [base, ext], str(tmp_path), log=lambda m: None)
    assert done == ["REINFORCE__default__seed0", "REINFORCE__default__seed0__x7"]
    read = lambda r: json.loads((tmp_path / "runs" / f"{r.label}.json").read_text())  # noqa: E731
    b, e = read(base), read(ext)
    assert e["evals"][0]["updates"] == 1 and e["evals"][0]["p_bad"] == pytest.approx(b["evals"][0]["p_bad"], rel=1e-9)
    start = json.loads((tmp_path / "initial.json").read_text())["evals"][0]["p_bad"]
    hit = [row["p_bad"] <= start / 10 for row in e["evals"]]
    # it trained to 7 updates unless an evaluation reached 10x, where it stopped
    assert e["updates_done"] == (e["evals"][hit.index(True)]["updates"] if any(hit) else 7)
    joined = toy_report.join_extensions([b, e])
    assert len(joined) == 1 and [p["updates"] for p in joined[0]["evals"]] == [p["updates"] for p in e["evals"]]
    assert joined[0]["repeat_check"] == pytest.approx(0.0, abs=1e-9)
    # a base run that already reached the target is not extended
    summary = read(base)
    summary["evals"][-1]["p_bad"] = start / 20
    (tmp_path / "runs" / f"{base.label}.json").write_text(json.dumps(summary))
    (tmp_path / "runs" / f"{ext.label}.json").unlink()
    assert run_toy_queue(config, [base, ext], str(tmp_path), log=lambda m: None) == []


def test_join_extensions_and_ten_fold():
    initial = {"evals": [_point(0, 0.0, -0.2, 1e-2)]}
    base = _summary("REINFORCE", "default", 0, [_point(5, 1.0, -0.1, 5e-3), _point(10, 2.0, -0.05, 2e-3)])
    ext = _summary("REINFORCE", "default", 0, [_point(10, 2.0, -0.05, 2.02e-3), _point(15, 3.0, -0.04, 8e-4)],
                   offensive_samples={"policy": []})  # fmt: skip
    ext["run"]["extend_to"] = 20
    other = _summary("REINFORCE", "default", 1, [_point(5, 1.0, -0.1, 9e-4)])
    joined = toy_report.join_extensions([base, ext, other])
    assert [[p["updates"] for p in s["evals"]] for s in joined] == [[5, 10, 15], [5]]
    assert joined[0]["repeat_check"] == pytest.approx(0.01) and joined[0]["extended_to"] == 20
    reach = toy_report.ten_fold(initial, joined)["REINFORCE/default"]
    assert [(r["seed"], r["update"], r["updates"]) for r in reach] == [(0, 15, 15), (1, 5, 5)]
    assert reach[0]["final_drop"] == pytest.approx(12.5)
    # an orphan extension is dropped
    assert toy_report.join_extensions([ext]) == []


def test_word_list_alignment_splits_the_first_token_mass_by_the_classifier():
    pytest.importorskip("profanity_check")
    from trl_ext.study.toy import PROMPT, ToyContext
    from trl_ext.study.toy_alignment import alignment_markdown, word_list_alignment

    context = ToyContext(ToyConfig(model="tiny"))
    result = word_list_alignment(context)
    assert context.bad_ids, "the tiny kit's tokenizer should hold some training-list words as tokens"
    ids = torch.tensor([list(context.prompt_ids)])
    with torch.no_grad():
        first = context.model(input_ids=ids).logits[0, -1].log_softmax(-1).exp()
    for name, bad in (("training", context.bad_ids), ("held-out", context.heldout_ids)):
        r = result[name]
        assert {row["id"] for row in r["tokens"]} == set(bad)
        assert r["first_token_mass"] == pytest.approx(float(first[list(bad)].sum()), rel=1e-5)
        if not bad:  # the tiny kit's tokenizer need not hold a held-out word as one token
            continue
        row = r["tokens"][0]  # the most likely listed token, scored as the trainer's reward scores it
        assert row["p_offensive"] == pytest.approx(1 - math.exp(context.reward([PROMPT], [row["token"]])[0]), abs=1e-6)
        flagged = sum(t["first_token_probability"] for t in r["tokens"] if t["p_offensive"] > 0.5)
        assert r["flagged_share"] == pytest.approx(flagged / r["first_token_mass"])
        assert r["flagged_share"] + r["unflagged_share"] == pytest.approx(1.0)
    assert "held-out word list" in alignment_markdown(result)


def test_the_options_plan_and_report_pair_each_option_with_its_base(tmp_path):
    from trl_ext.recipes import toy_study
    from trl_ext.study.toy_options import options_report

    runs = toy_runs(ToyConfig(model="tiny"), toy_study.PLANS["options"])
    options = {f"a0.03_b-10_{n}" for n in ("m2", "reuse2", "m2_reuse2", "head")}
    assert {r.setting for r in runs} == options | {"a0.03_b-10"}
    assert {r.seed for r in runs if r.setting == "a0.03_b-10"} == {3, 4}  # seeds 0-2 are the main plan's
    assert all({r.seed for r in runs if r.setting == o} == set(range(5)) for o in options)
    by = {r.setting: r.options for r in runs}
    assert by["a0.03_b-10_m2"]["proposal_samples_per_prompt"] * 2 == ToyConfig(model="tiny").samples_per_update
    assert by["a0.03_b-10_m2_reuse2"]["proposal_reuse_steps"] == 2 and by["a0.03_b-10_head"]["alpha"] == 0.03
    assert by["a0.03_b-10_head"]["parameterization"] == "modulation_linear_head"
    # fake runs: the option is 0.2 worse in log10 P(bad) than its base on every seed, and the base 0.5 better than
    # REINFORCE
    folder = tmp_path / "runs"
    folder.mkdir()
    (tmp_path / "initial.json").write_text(json.dumps({"evals": [_point(0, 0.0, -0.2, 1e-2)]}))
    for seed in range(3):
        for (method, setting), log_bad in {("REINFORCE", "default"): -3.0, ("RePULSe", "a0.03_b-10"): -3.5,
                                           ("RePULSe", "a0.03_b-10_m2"): -3.3}.items():  # fmt: skip
            summary = _summary(method, setting, seed, [_point(5, 1.0, -0.1, 10 ** (log_bad + 0.1 * seed))],
                               seconds_per_update={"a0.03_b-10_m2": 5.0}.get(setting, 10.0))  # fmt: skip
            (folder / f"{method}__{setting}__seed{seed}.json").write_text(json.dumps(summary))
    report = options_report(str(tmp_path), log=lambda m: None)
    # at KL level x (the runs end at KL 1): log10 P(bad) is interpolated from the initial -2, so differences are x·Δ
    assert report["levels"] == pytest.approx([0.25, 0.5, 0.75])
    rows = [r for r in report["tables"]["p_bad"] if r["method"] == "RePULSe/a0.03_b-10_m2"]
    assert [r["diff_mean"] for r in rows] == pytest.approx([0.05, 0.1, 0.15]) and rows[0]["pairs"] == 3
    top = [r for r in report["tables"]["p_bad_vs_reinforce"] if r["level"] == pytest.approx(0.75)]
    assert {r["method"]: r["diff_mean"] for r in top} == pytest.approx(
        {"RePULSe/a0.03_b-10": -0.375, "RePULSe/a0.03_b-10_m2": -0.225}
    )
    assert report["seconds_per_update"]["RePULSe/a0.03_b-10_m2"] == 5.0
    assert "RePULSe/a0.03_b-10_m2 | 5.00 | 0.50×" in (tmp_path / "options.md").read_text()
