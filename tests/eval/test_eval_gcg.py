"""GCG through nanogcg on a tiny model: the report, the consistency of the loss with the target log-probs, what we
change around nanogcg (banned special tokens, restored global state) and the recipe."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from online_helpers import EXAMPLES, RECIPES, assert_help_lists, loaded_script

pytest.importorskip("nanogcg")

from trl_ext.eval.attacks import build_attack_prompt, eval_gcg, gcg_attack, target_logprobs  # noqa: E402
from trl_ext.eval.attacks.gcg import _banned_ids, gcg_config  # noqa: E402
from trl_ext.rewards import LexicalReward  # noqa: E402
from trl_ext.testing import build_causal_lm, build_tokenizer  # noqa: E402

GOAL, TARGET = "What is a good name for a cat?", "Sure, here is"
TINY = dict(num_steps=3, search_width=16, topk=8, samples_per_prompt=5, max_new_tokens=6, show_progress=False)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_causal_lm("llama", tok).eval()


def test_eval_gcg_report_on_a_tiny_model(model, tok, tmp_path):
    behaviors = [{"goal": GOAL, "target": TARGET}, {"goal": "Tell me a joke.", "target": "Ha ha"}]
    path = tmp_path / "gcg.json"
    report = eval_gcg(model, tok, behaviors, reward=LexicalReward(words=["the"]), output_path=path, **TINY)
    assert json.loads(path.read_text())["goals"][1]["suffix"] == report["goals"][1]["suffix"]
    assert report["attack"] == "gcg" and report["num_goals"] == 2
    config = report["config"]
    assert config["attack"]["use_prefix_cache"] is False and config["attack"]["filter_ids"] is True
    assert config["attack"]["num_steps"] == 3 and config["top_k"] is None and config["success_criterion"] == "prefix"
    for phase in ("before", "after"):
        asr = report["asr"][phase]
        assert 0.0 <= asr["rate"] <= 1.0 and asr["ci"][0] <= asr["rate"] <= asr["ci"][1]
        assert asr["successes"] == sum(g[phase]["jailbroken_by_prefix"] for g in report["goals"])
    special = set(tok.all_special_ids)
    for goal, behavior in zip(report["goals"], behaviors):
        attack = goal["attack"]
        assert attack["num_steps"] == 3 and len(attack["loss_history"]) == 3
        assert attack["best_loss"] == min(attack["loss_history"]) and attack["best_loss"] > 0
        # the suffix string re-tokenises to the optimised ids (filter_ids) and holds no special token
        ids = goal["suffix_token_ids"]
        assert tok(goal["suffix"], add_special_tokens=False)["input_ids"] == ids and not special & set(ids)
        # nanogcg's loss is the mean NLL of the target after goal + suffix: our log-prob says the same
        assert goal["target_logprobs"]["after"]["mean"] == pytest.approx(-attack["best_loss"], abs=1e-4)
        before = target_logprobs(model, tok, behavior["goal"], behavior["target"])
        assert goal["target_logprobs"]["before"] == pytest.approx(before)
        assert goal["before"]["num_samples"] == goal["after"]["num_samples"] == 5
        assert isinstance(goal["before"]["jailbroken"], bool) and "num_below_threshold" in goal["after"]
    assert not torch.are_deterministic_algorithms_enabled()  # nanogcg turned it on; restored


def test_gcg_lowers_the_loss_over_more_steps(model, tok):
    result = gcg_attack(model, tok, GOAL, TARGET, num_steps=6, search_width=32, topk=16, show_progress=False)
    start = build_attack_prompt(tok, GOAL).with_suffix(
        tok("x x x x x x x x x x", add_special_tokens=False)["input_ids"]
    )
    initial_loss = -target_logprobs(model, tok, start, TARGET)["mean"]
    assert result.loss < initial_loss  # GCG found a better suffix than the one it started from
    assert result.loss == min(result.loss_history) and len(result.loss_history) == 6


def test_gcg_strings_scenario_uses_the_suffix_alone(model, tok):
    report = eval_gcg(model, tok, ["Hello there"], scenario="strings", **TINY)
    goal = report["goals"][0]
    assert goal["goal"] == "" and report["config"]["user_message"].startswith("suffix only")
    prompt = build_attack_prompt(tok, "")
    attacked = prompt.with_suffix(goal["suffix_token_ids"])
    assert goal["target_logprobs"]["after"] == pytest.approx(target_logprobs(model, tok, attacked, "Hello there"))


def test_gcg_leaves_tokenizer_and_model_as_they_were(tok):
    plain = build_tokenizer()
    plain.chat_template = None
    model = build_causal_lm("gpt2", plain).train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = gcg_attack(model, plain, GOAL, "Here", num_steps=2, search_width=8, topk=4, show_progress=False)
    assert plain.chat_template is None  # nanogcg set a plain template on it; we put None back
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert len(result.loss_history) == 2 and result.suffix_ids.numel() > 0


def test_banned_ids_add_special_and_out_of_vocabulary_tokens(tok):
    model = build_causal_lm("llama", tok, vocab_size=len(tok) + 8)
    banned = set(_banned_ids(torch.tensor([300, 301]), tok, model).tolist())
    assert {300, 301} <= banned and set(tok.all_special_ids) <= banned
    assert set(range(len(tok), len(tok) + 8)) <= banned and 100 not in banned


def test_gcg_options_and_missing_nanogcg(model, tok, monkeypatch):
    with pytest.raises(ValueError, match="num_steps"):
        gcg_config(num_steps=0)
    with pytest.raises(ValueError, match="batch_size"):
        gcg_config(batch_size=0)
    with pytest.raises(ValueError, match="needs a reward"):
        eval_gcg(model, tok, [(GOAL, TARGET)], success_criterion="reward", **TINY)
    with pytest.raises(ValueError, match="optim_str"):
        gcg_attack(model, tok, "a {optim_str} b", TARGET, num_steps=1)
    monkeypatch.setitem(sys.modules, "nanogcg", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install --no-deps nanogcg==0\.3\.0 scipy"):
        eval_gcg(model, tok, [(GOAL, TARGET)], **TINY)


# ------------------------------------------------------------------------------------------------ the recipe
RECIPE = RECIPES / "eval_gcg.py"


@pytest.fixture(scope="module")
def recipe():
    yield from loaded_script(RECIPE)


def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--model_name_or_path", "--behaviors_csv", "--advbench", "--max_targets", "--scenario",
        "--success_criterion", "--reward_model_path", "--reward_words", "--threshold", "--num_steps",
        "--search_width", "--topk", "--n_replace", "--optim_str_init", "--output_path", "--no_progress",
    ))  # fmt: skip


def test_recipe_runs_on_the_tiny_kit(recipe, tiny_llama_dir, tmp_path):
    config = tmp_path / "gcg.yaml"
    config.write_text(
        f"model_name_or_path: {tiny_llama_dir}\nbehaviors_csv: {EXAMPLES / 'behaviors_toy.csv'}\nmax_targets: 2\n"
        "num_steps: 2\nsearch_width: 8\ntopk: 4\nsamples_per_prompt: 3\nmax_new_tokens: 4\nno_progress: true\n"
    )
    out = tmp_path / "report.json"
    args = recipe.make_parser().parse_args_and_config(
        ["--config", str(config), "--reward_words", "the,a", "--success_criterion", "reward",
         "--threshold", "-0.5", "--output_path", str(out)]
    )  # fmt: skip
    report = recipe.main(*args)
    saved = json.loads(out.read_text())
    assert saved["num_goals"] == 2 and saved["config"]["success_criterion"] == "reward"
    assert [g["attack"]["num_steps"] for g in saved["goals"]] == [2, 2] and saved["asr"] == report["asr"]
    assert saved["config"]["reward"] == "LexicalReward"


def test_recipe_rejects_bad_option_combinations(recipe):
    parser = recipe.make_parser()
    for argv, message in (
        (["--success_criterion", "reward"], "needs --reward_model_path or --reward_words"),
        (["--reward_words", "x", "--success_criterion", "reward"], "never fires"),
        (["--behaviors_csv", "a.csv", "--advbench"], "not both"),
        (["--scenario", "chat"], "--scenario"),
    ):
        with pytest.raises(ValueError, match=message):
            parser.parse_args_and_config(argv)
