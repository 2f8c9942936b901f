"""BEAST on a tiny model: the returned loss is the real loss of the returned suffix, the beam search scores
k1·k2 candidates per step and keeps the best suffix seen, runs are seeded, the sampling helpers, the report and the
recipe."""

from __future__ import annotations

import json

import pytest
import torch
from online_helpers import EXAMPLES, RECIPES, assert_help_lists, load_script, loaded_script

from trl_ext.eval.attacks import beast, build_attack_prompt, eval_beast, suffix_target_losses, target_logprobs
from trl_ext.eval.attacks.beast import beast_attack, sample_distinct_tokens, top_p_filter
from trl_ext.testing import build_causal_lm, build_tokenizer

GOAL, TARGET = "What is a good name for a cat?", "Sure, here is"
SMALL = dict(beam_width=3, candidates=4, suffix_length=5, show_progress=False)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_causal_lm("llama", tok).eval()


@pytest.fixture
def spy(monkeypatch):
    """Records the candidate suffixes each scoring call receives."""
    calls = []

    def recording(model, prompt, suffix_ids, target_ids, batch_size=64):
        calls.append(suffix_ids.clone())
        return suffix_target_losses(model, prompt, suffix_ids, target_ids, batch_size)

    monkeypatch.setattr(beast, "suffix_target_losses", recording)
    return calls


def test_returned_loss_is_the_loss_of_the_returned_suffix(model, tok):
    result = beast_attack(model, tok, GOAL, TARGET, **SMALL)
    prompt = build_attack_prompt(tok, GOAL)
    direct = -target_logprobs(model, tok, prompt.with_suffix(result.suffix_ids), TARGET)["mean"]
    assert result.loss == pytest.approx(direct, abs=1e-5)
    assert result.suffix == tok.decode(result.suffix_ids.tolist())
    assert 1 <= result.suffix_ids.numel() <= 5 and not set(tok.all_special_ids) & set(result.suffix_ids.tolist())


def test_beam_search_scores_k1_k2_candidates_and_keeps_the_best_seen(model, tok, spy):
    result = beast_attack(model, tok, GOAL, TARGET, **SMALL)
    assert [tuple(c.shape) for c in spy] == [(3, 1), (12, 2), (12, 3), (12, 4), (12, 5)]
    assert result.num_candidates_scored == 3 + 4 * 12
    first = spy[0][:, 0]
    assert first.unique().numel() == 3  # k1 distinct first tokens
    for step in spy[1:]:
        for beam in step.reshape(3, 4, -1):  # each beam's k2 candidates: same prefix, distinct new tokens
            assert (beam[:, :-1] == beam[0, :-1]).all() and beam[:, -1].unique().numel() == 4
    prompt = build_attack_prompt(tok, GOAL)
    target_ids = torch.tensor(tok(TARGET, add_special_tokens=False)["input_ids"])
    step_losses = [suffix_target_losses(model, prompt, c, target_ids) for c in spy]
    assert result.loss_history == pytest.approx([float(x.min()) for x in step_losses], abs=1e-6)
    first_beams = float(step_losses[0].min())
    assert result.loss <= first_beams + 1e-7 and result.loss == pytest.approx(min(result.loss_history))
    running = result.best_so_far
    assert all(b <= a for a, b in zip(running, running[1:])) and running[-1] == result.loss
    # the beams of step t+1 extend the k1 lowest-loss candidates of step t
    kept = spy[1][:, :1].unique()
    best_first = spy[0][step_losses[0].argsort()[:3], 0]
    assert set(kept.tolist()) == set(best_first.tolist())


def test_tokens_per_step_appends_several_sampled_tokens(model, tok, spy):
    result = beast_attack(model, tok, GOAL, TARGET, beam_width=2, candidates=3, suffix_length=5, tokens_per_step=2,
                          show_progress=False)  # fmt: skip
    assert [tuple(c.shape) for c in spy] == [(2, 2), (6, 4), (6, 5)]  # 5 tokens: 2 + 2 + 1
    assert len(result.loss_history) == 3


def test_seeded_and_deterministic(model, tok):
    a = beast_attack(model, tok, GOAL, TARGET, seed=7, **SMALL)
    b = beast_attack(model, tok, GOAL, TARGET, seed=7, **SMALL)
    c = beast_attack(model, tok, GOAL, TARGET, seed=8, **SMALL)
    assert torch.equal(a.suffix_ids, b.suffix_ids) and a.loss_history == b.loss_history
    assert a.loss_history != c.loss_history


def test_top_p_filter_keeps_the_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    assert torch.equal(top_p_filter(probs, 0.7), torch.tensor([[0.0, 0.5, 0.0, 0.3]]))  # 0.5 < 0.7, crossed at 0.3
    assert torch.equal(top_p_filter(probs, 0.5), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 0.96), torch.tensor([[0.05, 0.5, 0.15, 0.3]]))


def test_sample_distinct_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.zeros(4, 10)
    tokens = sample_distinct_tokens(logits, 6, banned_ids=torch.tensor([0, 1, 2]), generator=g)
    assert tokens.shape == (4, 6)
    assert all(row.unique().numel() == 6 for row in tokens) and tokens.min() >= 3
    peaked = torch.tensor([[5.0, 4.0, -10, -10, -10]])
    assert sorted(sample_distinct_tokens(peaked, 3, top_p=0.9, generator=g)[0].tolist()) == [0, 1]  # only 2 left
    cold = sample_distinct_tokens(torch.tensor([[0.0, 3.0, 0.0]]), 1, temperature=0.01, generator=g)
    assert cold.item() == 1
    with pytest.raises(ValueError, match="No token is left"):
        sample_distinct_tokens(torch.zeros(1, 3), 1, banned_ids=torch.tensor([0, 1, 2]))


def test_option_errors(model, tok):
    cases = (
        (dict(beam_width=0), "beam_width"),
        (dict(candidates=0), "candidates"),
        (dict(attack_top_p=0.0), "top_p"),
        (dict(attack_temperature=0.0), "temperature"),
    )
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            eval_beast(model, tok, [(GOAL, TARGET)], **kwargs)


def test_eval_beast_report(model, tok, tmp_path):
    behaviors = [{"goal": GOAL, "target": TARGET}, {"goal": "Tell me a joke.", "target": "Ha ha"}]
    report = eval_beast(model, tok, behaviors, beam_width=2, candidates=3, suffix_length=3, samples_per_prompt=4,
                        max_new_tokens=5, show_progress=False, output_path=tmp_path / "b.json")  # fmt: skip
    assert json.loads((tmp_path / "b.json").read_text())["asr"] == report["asr"]
    assert report["attack"] == "beast" and report["config"]["attack"]["beam_width"] == 2
    for phase in ("before", "after"):
        asr = report["asr"][phase]
        assert 0.0 <= asr["rate"] <= 1.0 and asr["ci"][0] <= asr["rate"] <= asr["ci"][1] and asr["trials"] == 2
    for goal in report["goals"]:
        attack = goal["attack"]
        assert attack["num_steps"] == 3 and attack["best_loss"] == pytest.approx(min(attack["loss_history"]))
        assert goal["target_logprobs"]["after"]["mean"] == pytest.approx(-attack["best_loss"], abs=1e-5)
        assert goal["after"]["num_samples"] == 4


# ------------------------------------------------------------------------------------------------ the recipe
RECIPE = RECIPES / "eval_beast.py"


@pytest.fixture(scope="module")
def recipe():
    yield from loaded_script(RECIPE)


def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--model_name_or_path", "--behaviors_csv", "--advbench", "--scenario", "--success_criterion",
        "--reward_model_path", "--reward_words", "--threshold", "--beam_width", "--candidates", "--suffix_length",
        "--tokens_per_step", "--attack_top_p", "--output_path",
    ))  # fmt: skip


def test_recipe_runs_on_the_tiny_kit(recipe, tiny_llama_dir, tiny_llama_reward_dir, tmp_path):
    out = tmp_path / "beast.json"
    args = recipe.make_parser().parse_args_and_config([
        "--model_name_or_path", tiny_llama_dir, "--behaviors_csv", str(EXAMPLES / "behaviors_toy.csv"),
        "--max_targets", "2", "--beam_width", "2", "--candidates", "2", "--suffix_length", "2",
        "--samples_per_prompt", "3", "--max_new_tokens", "4", "--reward_model_path", tiny_llama_reward_dir,
        "--success_criterion", "reward", "--threshold", "0.0", "--exclude_adv_suffix", "--no_progress",
        "--output_path", str(out),
    ])  # fmt: skip
    recipe.main(*args)
    saved = json.loads(out.read_text())
    assert saved["num_goals"] == 2 and saved["config"]["exclude_adv_suffix"] is True
    assert saved["config"]["reward"].startswith("LlamaForSequenceClassification")  # same vocabulary: token ids
    assert all(len(g["suffix_token_ids"]) <= 2 and "reward_mean" in g["after"] for g in saved["goals"])


def test_beast_options_are_one_dataclass_for_the_attack_its_evaluation_and_the_recipe(model, tok):
    """`BeastOptions` (and `GCGOptions`) are declared once: the attack takes the object or its fields as keywords
    (beast_attack's own `temperature` / `top_p` names included), and the recipes' argument classes are them."""
    from trl_ext.eval.attacks import BeastOptions, GCGOptions

    options = BeastOptions(beam_width=3, candidates=4, suffix_length=5, attack_temperature=0.7)
    by_object = beast_attack(model, tok, GOAL, TARGET, options=options, seed=3, show_progress=False)
    by_keywords = beast_attack(model, tok, GOAL, TARGET, seed=3, temperature=0.7, **SMALL)
    assert by_object.suffix_ids.tolist() == by_keywords.suffix_ids.tolist()
    assert by_object.loss_history == by_keywords.loss_history
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['beams'\]"):
        beast_attack(model, tok, GOAL, TARGET, beams=2)
    with pytest.raises(ValueError, match="BEAST's beam_width must be >= 1"):
        eval_beast(model, tok, [(GOAL, TARGET)], beast=BeastOptions(beam_width=0), show_progress=False)
    assert load_script(RECIPES / "eval_beast.py").BeastArguments is BeastOptions
    assert load_script(RECIPES / "eval_gcg.py").GCGArguments is GCGOptions
