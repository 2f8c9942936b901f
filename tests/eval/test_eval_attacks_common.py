"""The shared part of the jailbreak evaluations: success rules, data loaders, prompts, target log-probs, sampling
before/after (seeded, explicit top-k), reward scoring with and without the suffix, and the report."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trl_ext.eval.attacks import data
from trl_ext.eval.attacks.common import (
    REFUSAL_SUBSTRINGS,
    AttackResult,
    attack_success_rate,
    build_attack_prompt,
    is_refusal,
    jailbroken_by_prefix,
    jailbroken_by_reward,
    load_advbench_goals,
    load_behaviors_csv,
    normalize_behaviors,
    run_attack_evaluation,
    suffix_target_losses,
    summarize_samples,
    target_logprobs,
)
from trl_ext.eval.report import binomial_ci
from trl_ext.testing import build_causal_lm, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
GOAL, TARGET, SUFFIX = "What is a good name for a cat?", "Sure, here is", " zebra zebra"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_causal_lm("llama", tok).eval()


def fixed_attack(tok, suffix=SUFFIX):
    """An "attack" that always returns the same suffix (the evaluation around it is what is tested)."""
    ids = torch.tensor(tok(suffix, add_special_tokens=False)["input_ids"])

    def attack(goal, target, prompt, seed):
        return AttackResult(suffix_ids=ids, suffix=suffix, loss=1.5, loss_history=[2.0, 1.5])

    return attack


def evaluate(model, tok, **kwargs):
    options = dict(attack_name="fixed", attack_config={}, samples_per_prompt=6, max_new_tokens=6, show_progress=False)
    options.update(kwargs)
    behaviors = options.pop(
        "behaviors", [{"goal": GOAL, "target": TARGET}, {"goal": "Tell me a joke.", "target": "Ha"}]
    )
    return run_attack_evaluation(model, tok, behaviors, fixed_attack(tok), **options)


# ------------------------------------------------------------------------------------------------ success rules
def test_refusal_list_is_long_and_matching_ignores_case_and_curly_apostrophes():
    assert len(REFUSAL_SUBSTRINGS) >= 25
    assert is_refusal("i'M SoRrY, that is not something I do")
    assert is_refusal("I\u2019m sorry, but no.")  # typographic apostrophe
    assert is_refusal("Well... as an ai I must say")
    assert not is_refusal("Sure, here is a name: Whiskers")
    assert is_refusal("nope", substrings=["NOPE"]) and not is_refusal("I cannot", substrings=["nope"])


def test_jailbroken_by_prefix_needs_one_non_refusal_non_empty_sample():
    assert not jailbroken_by_prefix(["I'm sorry, I cannot help.", "As an AI, I refuse."])
    assert jailbroken_by_prefix(["I'm sorry.", "Sure, here is how."])
    assert not jailbroken_by_prefix(["", "   ", "I can't assist with that."])  # empty answers are not jailbreaks
    assert not jailbroken_by_prefix([])


def test_jailbroken_by_reward_is_strictly_below_threshold():
    assert not jailbroken_by_reward([0.5, -3.9, -4.0], -4.0)
    assert jailbroken_by_reward([0.5, -4.01], -4.0)
    assert not jailbroken_by_reward(torch.tensor([-4.5]), -5.0) and jailbroken_by_reward(torch.tensor([-4.5]), -4.0)
    assert not jailbroken_by_reward([], -4.0)


def test_summarize_samples_counts_at_tau_and_tau_minus_1():
    texts = ["I'm sorry.", "Sure thing", "", "OK then", "I cannot"]
    rewards = torch.tensor([-6.0, -4.5, 0.0, -5.0, 1.0])
    s = summarize_samples(texts, rewards, threshold=-4.0, success_criterion="reward", num_examples=2)
    assert s["num_samples"] == 5 and s["num_non_refusals"] == 2
    assert (s["num_below_threshold"], s["num_below_threshold_minus_1"]) == (3, 1)  # r<-4: -6,-4.5,-5; r<-5: -6 only
    assert s["reward_mean"] == pytest.approx(-14.5 / 5) and s["reward_min"] == -6.0
    assert s["jailbroken"] and s["jailbroken_minus_1"] and s["jailbroken_by_prefix"]
    assert s["examples"] == texts[:2]
    s = summarize_samples(["I'm sorry."], torch.tensor([-4.5]), threshold=-4.0, success_criterion="prefix")
    assert not s["jailbroken"] and s["jailbroken_by_reward"] and not s["jailbroken_by_reward_minus_1"]
    assert "jailbroken_minus_1" not in s
    with pytest.raises(ValueError, match="needs rewards"):
        summarize_samples(["x"], None, threshold=-4.0, success_criterion="reward")
    with pytest.raises(ValueError, match="success_criterion"):
        summarize_samples(["x"], None, threshold=-4.0, success_criterion="regex")


def test_attack_success_rate_has_the_wilson_interval():
    asr = attack_success_rate([True, False, False, True])
    assert (asr["rate"], asr["successes"], asr["trials"]) == (0.5, 2, 4)
    assert asr["ci"] == list(binomial_ci(2, 4)) and asr["ci"][0] < 0.5 < asr["ci"][1]
    assert attack_success_rate([False] * 3)["ci"][0] == 0.0
    with pytest.raises(ValueError, match="at least one goal"):
        attack_success_rate([])


# ------------------------------------------------------------------------------------------------ data
def test_load_behaviors_csv(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text('goal,target,extra\n"Hi, there?","Sure, hi",1\nSecond,Two,2\nThird,Three,3\n')
    rows = load_behaviors_csv(path)
    assert rows == [
        {"goal": "Hi, there?", "target": "Sure, hi"},
        {"goal": "Second", "target": "Two"},
        {"goal": "Third", "target": "Three"},
    ]
    assert load_behaviors_csv(path, max_targets=2) == rows[:2]
    assert load_behaviors_csv(path, max_targets=100) == rows
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfgoal,target\nHi,Sure\n")  # saved by a spreadsheet
    assert load_behaviors_csv(bom) == [{"goal": "Hi", "target": "Sure"}]
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,answer\na,b\n")
    with pytest.raises(ValueError, match=r"'prompt', 'answer'"):
        load_behaviors_csv(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_behaviors_csv(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="max_targets"):
        load_behaviors_csv(path, max_targets=0)


def test_toy_behaviors_csv_ships_a_few_goal_target_pairs():
    rows = load_behaviors_csv(REPO / "examples" / "behaviors_toy.csv")
    assert len(rows) >= 3 and all(r["goal"] and r["target"] for r in rows)


ADVBENCH_YAML = textwrap.dedent(
    """\
    dataset_name: adv_bench
    source: https://example.org/advbench
    description: 'A made-up stand-in in the real file format.'
    seed_type: objective
    {key}:
    - value: First made-up goal
      data_type: text
      harm_categories:
      - Category A
      - Category B
    - value: Second made-up goal
      data_type: text
      harm_categories:
      - Category C
    - value: Third made-up goal
      data_type: text
    """
)


def fake_pyrit(root: Path, monkeypatch, key: str = "seeds") -> None:
    """A fake ``pyrit`` package under ``root`` holding adv_bench.prompt, first on sys.path."""
    package = root / "pyrit"
    folder = package / "datasets" / "seed_datasets" / "local"
    folder.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (folder / "adv_bench.prompt").write_text(ADVBENCH_YAML.format(key=key))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "pyrit", raising=False)


@pytest.mark.parametrize("key", ["seeds", "prompts"])
def test_load_advbench_goals_from_an_installed_pyrit(tmp_path, monkeypatch, key):
    fake_pyrit(tmp_path, monkeypatch, key)
    assert load_advbench_goals() == ["First made-up goal", "Second made-up goal", "Third made-up goal"]
    assert load_advbench_goals(max_goals=2) == ["First made-up goal", "Second made-up goal"]
    with_categories = load_advbench_goals(with_categories=True)
    assert with_categories[0] == {"goal": "First made-up goal", "harm_categories": ["Category A", "Category B"]}
    assert with_categories[2]["harm_categories"] == []


def test_load_advbench_goals_errors(tmp_path, monkeypatch):
    real_find_spec = data.importlib.util.find_spec

    def no_pyrit(name, *args):
        return None if name == "pyrit" else real_find_spec(name, *args)

    with monkeypatch.context() as m:
        m.setattr(data.importlib.util, "find_spec", no_pyrit)
        with pytest.raises(ValueError, match="needs the `pyrit` package"):
            load_advbench_goals()
    fake_pyrit(tmp_path, monkeypatch)
    (tmp_path / "pyrit" / "datasets" / "seed_datasets" / "local" / "adv_bench.prompt").write_text("just: text\n")
    with pytest.raises(ValueError, match="not in the expected format"):
        load_advbench_goals()


def test_normalize_behaviors():
    assert normalize_behaviors([{"goal": "g", "target": "t"}, ("g2", "t2")], "behaviors") == [("g", "t"), ("g2", "t2")]
    assert normalize_behaviors(["t1", {"goal": "ignored", "target": "t2"}], "strings") == [("", "t1"), ("", "t2")]
    with pytest.raises(ValueError, match="scenario='strings'"):
        normalize_behaviors(["t"], "behaviors")
    with pytest.raises(ValueError, match="'goal' and 'target'"):
        normalize_behaviors([{"target": "t"}], "behaviors")
    with pytest.raises(ValueError, match="empty or non-text target"):
        normalize_behaviors([("g", "")], "behaviors")
    with pytest.raises(ValueError, match="No behaviors"):
        normalize_behaviors([], "behaviors")
    with pytest.raises(ValueError, match="scenario"):
        normalize_behaviors([("g", "t")], "jailbreak")


# ------------------------------------------------------------------------------------------------ prompts, log-probs
def test_attack_prompt_cuts_the_chat_template_at_the_suffix(tok):
    prompt = build_attack_prompt(tok, GOAL)
    assert prompt.chat_template
    assert tok.decode(prompt.before_ids) == f"<|im_start|>user\n{GOAL}"
    assert tok.decode(prompt.after_ids) == "<|im_end|>\n<|im_start|>assistant\n"
    rendered = tok.apply_chat_template([{"role": "user", "content": GOAL}], tokenize=False, add_generation_prompt=True)
    assert prompt.clean_ids.tolist() == tok(rendered)["input_ids"]
    assert prompt.with_suffix([]).tolist() == prompt.clean_ids.tolist()  # no merge across the cut for this goal
    suffix = tok(SUFFIX, add_special_tokens=False)["input_ids"]
    assert tok.decode(prompt.with_suffix(suffix)) == rendered.replace(GOAL, GOAL + SUFFIX)
    # strings scenario: the user message is the suffix alone
    empty = build_attack_prompt(tok, "")
    assert tok.decode(empty.before_ids) == "<|im_start|>user\n"


def test_attack_prompt_without_chat_template(tok):
    plain = build_tokenizer()
    plain.chat_template = None
    prompt = build_attack_prompt(plain, GOAL)
    assert not prompt.chat_template and prompt.after_ids.numel() == 0
    assert plain.decode(prompt.before_ids) == GOAL
    with pytest.raises(ValueError, match="prompt before the suffix is empty"):
        build_attack_prompt(plain, "")


def test_target_logprobs_equal_a_direct_computation(model, tok):
    prompt = build_attack_prompt(tok, GOAL)
    target_ids = tok(TARGET, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt.clean_ids.tolist() + target_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    P = prompt.clean_ids.numel()
    expected = torch.stack([logp[P - 1 + t, tid] for t, tid in enumerate(target_ids)])
    got = target_logprobs(model, tok, GOAL, TARGET)  # text: chat-templated here
    assert got["num_tokens"] == len(target_ids)
    assert got["first"] == pytest.approx(float(expected[0]), abs=1e-5)
    assert got["mean"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert got["sum"] == pytest.approx(float(expected.sum()), abs=1e-4)
    assert target_logprobs(model, tok, prompt.clean_ids, TARGET) == pytest.approx(got)
    with pytest.raises(ValueError, match="no tokens"):
        target_logprobs(model, tok, GOAL, "")


def test_suffix_target_losses_are_minus_the_mean_target_logprob(model, tok):
    prompt = build_attack_prompt(tok, GOAL)
    target_ids = torch.tensor(tok(TARGET, add_special_tokens=False)["input_ids"])
    suffixes = torch.randint(10, 400, (5, 3), generator=torch.Generator().manual_seed(0))
    losses = suffix_target_losses(model, prompt, suffixes, target_ids, batch_size=2)
    assert losses.shape == (5,)
    for i in range(5):
        direct = target_logprobs(model, tok, prompt.with_suffix(suffixes[i]), TARGET)["mean"]
        assert float(losses[i]) == pytest.approx(-direct, abs=1e-5)
    assert torch.allclose(losses, suffix_target_losses(model, prompt, suffixes, target_ids, batch_size=64), atol=1e-6)
    with pytest.raises(ValueError, match=r"\(n, L\)"):
        suffix_target_losses(model, prompt, suffixes[0], target_ids)


# ------------------------------------------------------------------------------------------------ the evaluation
class RecordingReward:
    """A reward callable that records the prompts it is shown and scores minus the prompt length."""

    def __init__(self):
        self.prompts: list[str] = []

    def __call__(self, prompts, completions):
        self.prompts.extend(prompts)
        return [-float(len(p)) for p in prompts]


def test_exclude_adv_suffix_scores_the_suffix_free_prompt(model, tok):
    behaviors = [{"goal": GOAL, "target": TARGET}]
    scores = {}
    for exclude in (False, True):
        reward = RecordingReward()
        report = evaluate(model, tok, behaviors=behaviors, reward=reward, exclude_adv_suffix=exclude)
        before, after = reward.prompts[:6], reward.prompts[6:]
        assert len(after) == 6 and all(SUFFIX not in p and GOAL in p for p in before)
        assert all((SUFFIX in p) != exclude for p in after)
        if exclude:
            assert after == before  # the very prompt the goal had before the attack
        scores[exclude] = report["goals"][0]["after"]["reward_mean"]
        assert report["config"]["exclude_adv_suffix"] is exclude
    assert scores[True] == pytest.approx(scores[False] + len(SUFFIX))  # shorter prompt -> higher score here


def test_sampling_is_seeded_and_top_k_is_explicit(model, tok):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = evaluate(model, tok, seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
    second = evaluate(model, tok, seed=3)
    strip = lambda r: [{k: g[k] for k in ("before", "after", "target_logprobs")} for g in r["goals"]]  # noqa: E731
    assert strip(first) == strip(second)
    assert first["config"]["top_k"] is None
    free = evaluate(model, tok, samples_per_prompt=8, max_new_tokens=4)
    assert len(set(free["goals"][0]["after"]["examples"] + free["goals"][1]["after"]["examples"])) > 2
    greedy = evaluate(model, tok, top_k=1, samples_per_prompt=4)
    assert greedy["config"]["top_k"] == 1
    for goal in greedy["goals"]:  # top_k=1 leaves one token per step: every sample is the same
        assert len(set(goal["before"]["examples"])) == 1 and len(set(goal["after"]["examples"])) == 1


def test_report_layout_and_json_file(model, tok, tmp_path):
    from trl_ext.rewards import LexicalReward

    path = tmp_path / "out" / "attack.json"
    report = evaluate(
        model, tok, reward=LexicalReward(words=["the"]), success_criterion="reward", threshold=-0.5,
        output_path=path,
    )  # fmt: skip
    assert json.loads(path.read_text())["asr"] == report["asr"] and report["output_path"] == str(path)
    assert report["num_goals"] == 2 and report["config"]["threshold_minus_1"] == -1.5
    for phase in ("before", "after"):
        asr = report["asr"][phase]
        flags = [g[phase]["jailbroken"] for g in report["goals"]]
        assert asr["successes"] == sum(flags) and asr["trials"] == 2 and 0 <= asr["rate"] <= 1
        assert asr["ci"][0] <= asr["rate"] <= asr["ci"][1]
        minus_1 = report["asr_threshold_minus_1"][phase]
        assert minus_1["successes"] == sum(g[phase]["jailbroken_minus_1"] for g in report["goals"])
    goal = report["goals"][0]
    assert goal["suffix"] == SUFFIX and goal["attack"]["loss_history"] == [2.0, 1.5]
    assert goal["attack"]["num_steps"] == 2 and goal["attack"]["best_loss"] == 1.5
    for phase in ("before", "after"):
        counts = goal[phase]
        assert counts["jailbroken"] == (counts["num_below_threshold"] > 0)
        assert set(goal["target_logprobs"][phase]) == {"first", "mean", "sum", "num_tokens"}
    # the attacked prompt's target log-probs are computed on goal + suffix
    prompt = build_attack_prompt(tok, GOAL)
    suffix = tok(SUFFIX, add_special_tokens=False)["input_ids"]
    assert goal["target_logprobs"]["after"] == target_logprobs(model, tok, prompt.with_suffix(suffix), TARGET)
    assert evaluate(model, tok)["asr_threshold_minus_1"] is None  # prefix criterion


def test_evaluation_option_errors(model, tok):
    cases = [
        (dict(success_criterion="reward"), "needs a reward"),
        (dict(exclude_adv_suffix=True), "only changes reward scoring"),
        (dict(scenario="chat"), "scenario"),
        (dict(top_k=0), "top_k"),
        (dict(temperature=0.0), "temperature"),
        (dict(samples_per_prompt=0), "samples_per_prompt"),
        (dict(threshold=float("nan")), "threshold"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            evaluate(model, tok, **kwargs)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['samples'\].*AttackEvalOptions"):
        evaluate(model, tok, samples=3)


def test_one_options_object_or_its_keywords_give_the_same_report(model, tok):
    """`AttackEvalOptions` is the one declaration of the evaluation's options: passed whole, or field by field as
    keywords (which override the object's fields), the evaluation is the same; the recipes' arguments extend it."""
    from dataclasses import fields

    from trl_ext.eval.attacks import AttackEvalOptions
    from trl_ext.eval.attacks.cli import AttackScriptArguments, eval_kwargs

    by_keywords = evaluate(model, tok, seed=3, top_k=5)
    by_object = evaluate(
        model, tok, options=AttackEvalOptions(seed=3, top_k=5, samples_per_prompt=6, max_new_tokens=6)
    )
    overridden = evaluate(model, tok, options=AttackEvalOptions(seed=9, top_k=5), seed=3)
    for report in (by_object, overridden):
        assert report["config"] == by_keywords["config"]
        assert [g["after"] for g in report["goals"]] == [g["after"] for g in by_keywords["goals"]]
    script = AttackScriptArguments(model_name_or_path="m", behaviors_csv="b.csv", seed=4, samples_per_prompt=7)
    assert {f.name for f in fields(AttackEvalOptions)} <= {f.name for f in fields(AttackScriptArguments)}
    options = eval_kwargs(script, "gcg")["options"]
    assert options == AttackEvalOptions(seed=4, samples_per_prompt=7) and type(options) is AttackEvalOptions
