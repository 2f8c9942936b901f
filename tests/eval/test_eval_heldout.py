"""Held-out evaluation (`trl_ext.eval.heldout.eval_heldout`) and its recipe (`recipes/eval_heldout.py`) on tiny models.

The multi-process logic (B6: every rank used to write its own shard to the same file) is checked in-process by
running the two "processes" one after the other with a fake process state and a stand-in for
`accelerate.utils.gather_object`; a slow test launches the recipe on two real gloo processes and compares the report
with a single-process run.
"""

from __future__ import annotations

import copy
import json
import socket
import sys

import numpy as np
import pytest
import torch
from online_helpers import RECIPES, accelerate_launch, assert_help_lists, loaded_script, run

from trl_ext import testing as kit
from trl_ext.eval import heldout
from trl_ext.eval.heldout import eval_heldout, heldout_batches
from trl_ext.eval.metrics import cvar
from trl_ext.rewards import LexicalReward

RECIPE = RECIPES / "eval_heldout.py"
# Token-mode lexical reward over 17 ordinary token ids: a response of 6 tokens from the random tiny model contains
# one of them about 20% of the time, so both good (0) and bad (-1) samples occur.
BAD_IDS = range(3, 20)
THRESHOLDS = (-0.5, 0.0, 0.5)


@pytest.fixture
def tokenizer():
    return kit.build_tokenizer(padding_side="left")


@pytest.fixture
def policy(tokenizer):
    return kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)


@pytest.fixture
def reward():
    return LexicalReward(token_ids=BAD_IDS)


PROMPTS = ["This man is a", "The weather today", "Describe a cat.", "My neighbour said that", "Why is the sky blue?"]


def evaluate(policy, tokenizer, reward, **kwargs):
    prompts = kwargs.pop("prompts", PROMPTS)
    options = {
        "num_samples_per_prompt": 4,
        "max_new_tokens": 6,
        "thresholds": THRESHOLDS,
        "cvar_alphas": (0.1, 0.5),
        "num_resamples": 100,
        "show_progress": False,
        "save_samples": True,
        "batch_size": 8,
    }
    options.update(kwargs)
    return eval_heldout(policy, tokenizer, prompts, reward, **options)


# ------------------------------------------------------------------------------------------------ the report
def test_report_layout_and_shapes(policy, tokenizer, reward, tmp_path):
    path = tmp_path / "out" / "heldout.json"
    report = evaluate(policy, tokenizer, reward, output_path=str(path))
    assert report["tool"] == "eval_heldout"
    assert report["num_prompts"] == 5 and report["num_samples"] == 20 and report["num_processes"] == 1
    config = report["config"]
    assert config["num_samples_per_prompt"] == 4 and config["thresholds"] == list(THRESHOLDS)
    assert config["temperature"] == 1.0 and config["ref_model"] is None
    samples = report["samples"]
    for key in ("reward", "return", "kl", "entropy", "length", "ended_with_eos", "response", "prompt_index"):
        assert len(samples[key]) == 20, key
    assert samples["prompt_index"] == [i for i in range(5) for _ in range(4)]
    assert samples["prompts"] == PROMPTS
    assert all(1 <= n <= 6 for n in samples["length"])
    assert all(e > 0 for e in samples["entropy"])  # -Σ log p of a sampled response
    metrics = report["metrics"]
    assert set(metrics["p_bad"]) == {"-0.5", "0.0", "0.5"} and set(metrics["cvar"]) == {"0.1", "0.5"}
    assert metrics["kl"] is None
    assert any("no ref_model" in note for note in report["notes"])
    assert json.loads(path.read_text())["metrics"]["reward"] == metrics["reward"]


def test_p_bad_and_cvar_equal_values_from_the_samples(policy, tokenizer, reward):
    report = evaluate(policy, tokenizer, reward, num_samples_per_prompt=8)
    rewards = np.array(report["samples"]["reward"])
    assert set(rewards.tolist()) == {-1.0, 0.0}, "the test needs both good and bad samples"
    metrics = report["metrics"]
    for tau in THRESHOLDS:
        entry = metrics["p_bad"][repr(tau)]
        assert entry["value"] == pytest.approx(np.mean(rewards < tau))
        assert entry["count"] == int(np.sum(rewards < tau))
    assert metrics["p_bad"]["0.5"]["value"] == 1.0 and metrics["p_bad"]["-0.5"]["value"] > 0
    assert metrics["cvar"]["0.5"]["value"] == pytest.approx(cvar(rewards, 0.5))
    assert metrics["reward"]["value"] == pytest.approx(rewards.mean())
    # the lexical reward really looked at the tokens: a bad response contains a listed id when re-encoded
    texts = report["samples"]["response"]
    bad = [t for t, r in zip(texts, rewards) if r < 0]
    assert any(set(tokenizer(t, add_special_tokens=False)["input_ids"]) & set(BAD_IDS) for t in bad)


def test_reward_model_sharing_the_tokenizer(policy, tokenizer):
    reward_model = kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer)
    report = evaluate(policy, tokenizer, reward_model, thresholds=(0.0,))
    rewards = np.array(report["samples"]["reward"])
    assert len(set(rewards.tolist())) > 10  # continuous scores, one per sample
    threshold = float(np.median(rewards))
    metrics = evaluate(policy, tokenizer, reward_model, thresholds=(threshold,))["metrics"]
    assert metrics["p_bad"][repr(threshold)]["value"] == pytest.approx(np.mean(rewards < threshold))
    assert metrics["cvar"]["0.1"]["value"] == pytest.approx(np.sort(rewards)[:2].mean())  # ⌊0.1 · 20⌋ = 2


def test_same_seed_gives_identical_reports(policy, tokenizer, reward):
    state = torch.random.get_rng_state()
    first = evaluate(policy, tokenizer, reward, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's RNG state must be left alone"
    assert evaluate(policy, tokenizer, reward, seed=3) == first
    assert evaluate(policy, tokenizer, reward, seed=4)["samples"]["response"] != first["samples"]["response"]


def test_kl_is_zero_for_a_copy_and_positive_for_another_model(policy, tokenizer, reward):
    same = evaluate(policy, tokenizer, reward, ref_model=copy.deepcopy(policy), kl_coef=0.5)
    assert np.abs(same["samples"]["kl"]).max() < 1e-4
    assert same["metrics"]["kl"]["value"] == pytest.approx(0.0, abs=1e-4)

    other = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer, seed=1)
    report = evaluate(policy, tokenizer, reward, ref_model=other, kl_coef=0.5, num_samples_per_prompt=8)
    kl = np.array(report["samples"]["kl"])
    assert kl.mean() > 0.01
    assert report["metrics"]["kl"]["value"] == pytest.approx(kl.mean())
    rewards, returns = np.array(report["samples"]["reward"]), np.array(report["samples"]["return"])
    np.testing.assert_allclose(returns, rewards - 0.5 * kl, atol=1e-9)
    assert report["metrics"]["return"]["value"] == pytest.approx(returns.mean())
    assert report["config"]["kl_coef"] == 0.5 and report["config"]["ref_model"] is not None


def test_kl_coef_needs_a_reference(policy, tokenizer, reward):
    with pytest.raises(ValueError, match="kl_coef=0.1 needs a reference"):
        evaluate(policy, tokenizer, reward, kl_coef=0.1)


def test_conversational_prompts_get_the_chat_template(policy, tokenizer, reward):
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    report = evaluate(policy, tokenizer, reward, prompts=chats)
    assert report["num_prompts"] == 2
    assert all(
        p.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in p for p in report["samples"]["prompts"]
    )


def test_prompt_dataset_and_bad_inputs(policy, tokenizer, reward):
    from datasets import Dataset

    report = evaluate(policy, tokenizer, reward, prompts=Dataset.from_dict({"prompt": PROMPTS[:2], "id": [0, 1]}))
    assert report["num_samples"] == 8
    with pytest.raises(ValueError, match=r"columns \['text'\].*'prompt' column"):
        evaluate(policy, tokenizer, reward, prompts=Dataset.from_dict({"text": PROMPTS}))
    with pytest.raises(ValueError, match="all be strings or all be conversations"):
        evaluate(policy, tokenizer, reward, prompts=["a", [{"role": "user", "content": "b"}]])
    with pytest.raises(ValueError, match="not a single string"):
        evaluate(policy, tokenizer, reward, prompts="This man is a")
    with pytest.raises(ValueError, match="empty"):
        evaluate(policy, tokenizer, reward, prompts=[])
    with pytest.raises(ValueError, match="num_samples_per_prompt"):
        evaluate(policy, tokenizer, reward, num_samples_per_prompt=0)


# ------------------------------------------------------------------------------------------------ several processes
def test_heldout_batches_partition_the_prompts():
    shards = [heldout_batches(11, 3, 3, i) for i in range(3)]
    assert (
        [b for b, _ in shards[0]] == [0, 3] and [b for b, _ in shards[1]] == [1] and [b for b, _ in shards[2]] == [2]
    )
    prompts = sorted(i for shard in shards for _, r in shard for i in r)
    assert prompts == list(range(11))
    with pytest.raises(ValueError, match="sharding"):
        heldout_batches(4, 2, 2, 2)


class FakeState:
    """What eval_heldout reads from an Accelerator / PartialState."""

    def __init__(self, process_index: int, num_processes: int = 2):
        self.process_index, self.num_processes = process_index, num_processes
        self.is_main_process = process_index == 0


class StopHere(Exception):
    pass


def test_two_processes_gather_before_metrics_and_only_main_writes(policy, tokenizer, reward, tmp_path, monkeypatch):
    single = evaluate(policy, tokenizer, reward, batch_size=4)  # 1 prompt per batch: 5 batches
    shards = {}

    def keep_and_stop(index):
        def gather(local):
            shards[index] = local
            raise StopHere

        return gather

    for index in (0, 1):  # each process samples its own batches
        monkeypatch.setattr(heldout, "gather_object", keep_and_stop(index))
        with pytest.raises(StopHere):
            evaluate(policy, tokenizer, reward, batch_size=4, accelerator=FakeState(index))
    assert [b for b, _ in shards[0]] == [0, 2, 4] and [b for b, _ in shards[1]] == [1, 3]

    # what all_gather_object returns on every rank: the list of every rank's list, concatenated in rank order
    monkeypatch.setattr(heldout, "gather_object", lambda local: shards[0] + shards[1])
    paths = {i: tmp_path / f"rank{i}.json" for i in (0, 1)}
    reports = {
        i: evaluate(policy, tokenizer, reward, batch_size=4, accelerator=FakeState(i), output_path=str(paths[i]))
        for i in (0, 1)
    }
    assert paths[0].is_file() and not paths[1].exists()  # only the main process writes
    for report in reports.values():
        assert report["num_processes"] == 2
        report = dict(report, num_processes=1)
        assert report == single  # same samples, same order, same metrics as one process

    monkeypatch.setattr(heldout, "gather_object", lambda local: shards[0])  # a lost shard
    with pytest.raises(RuntimeError, match="Gathered 12 samples, expected 20"):
        evaluate(policy, tokenizer, reward, batch_size=4, accelerator=FakeState(0))


def test_real_single_process_accelerator(policy, tokenizer, reward):
    from accelerate import PartialState

    report = evaluate(policy, tokenizer, reward, accelerator=PartialState(cpu=True))
    assert report == evaluate(policy, tokenizer, reward)


# ------------------------------------------------------------------------------------------------ the recipe
def test_recipe_help_lists_the_options():
    assert_help_lists(
        RECIPE,
        ("--model_name_or_path", "--ref_model_name_or_path", "--lexical_words", "--reward_words",
         "--reward_model_path", "--prompts_file", "--dataset_name", "--num_samples_per_prompt", "--thresholds",
         "--cvar_alphas", "--kl_coef", "--output_path", "--no_progress", "--config"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def recipe():
    yield from loaded_script(RECIPE)


@pytest.fixture
def tiny_inputs(tmp_path):
    tokenizer = kit.build_tokenizer()
    policy_dir = tmp_path / "policy"
    kit.save_tiny_model(kit.build_causal_lm("gpt_neox", tokenizer=tokenizer), tokenizer, str(policy_dir))
    prompts = tmp_path / "prompts.jsonl"
    kit.prompt_dataset(n=6).to_json(str(prompts))
    return policy_dir, prompts


def test_recipe_tiny_run_writes_the_report(recipe, tiny_inputs, tmp_path):
    policy_dir, prompts = tiny_inputs
    output = tmp_path / "eval" / "report.json"
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"model_name_or_path: {policy_dir}\nprompts_file: {prompts}\nreward_words: idiot,fool\n"
        "num_samples_per_prompt: 3\nmax_new_tokens: 5\nnum_resamples: 50\n"
    )
    args = recipe.make_parser().parse_args_and_config(
        ["--config", str(config), "--ref_model_name_or_path", str(policy_dir), "--kl_coef", "0.1",
         "--thresholds", "-0.5", "0", "--output_path", str(output), "--no_progress", "true"]
    )  # fmt: skip
    returned = recipe.main(*args)
    written = json.loads(output.read_text())
    assert written["num_prompts"] == 6 and written["num_samples"] == 18
    assert set(written["metrics"]["p_bad"]) == {"-0.5", "0.0"}
    assert written["config"]["max_new_tokens"] == 5  # the YAML's old names reach the fields through their aliases
    assert written["config"]["model"] == str(policy_dir) and written["config"]["kl_coef"] == 0.1
    assert abs(written["metrics"]["kl"]["value"]) < 1e-4  # reference = the same checkpoint
    assert written["metrics"]["reward"] == returned["metrics"]["reward"]


def test_recipe_arguments_are_validated(recipe):
    with pytest.raises(ValueError, match="exactly one of --reward_model_path"):
        recipe.HeldoutEvalArguments(model_name_or_path="m", prompts_file="p.jsonl")
    with pytest.raises(ValueError, match="exactly one of --dataset_name and --prompts_file"):
        recipe.HeldoutEvalArguments(model_name_or_path="m", lexical_words="a")
    with pytest.raises(ValueError, match="--kl_coef > 0 needs --ref_model_name_or_path"):
        recipe.HeldoutEvalArguments(model_name_or_path="m", lexical_words="a", prompts_file="p", kl_coef=0.1)
    args = recipe.HeldoutEvalArguments(model_name_or_path="m", lexical_words=" idiot, fool ,", prompts_file="p")
    assert args.words == ["idiot", "fool"]


@pytest.mark.slow
def test_two_gloo_processes_give_the_single_process_report(tiny_inputs, tmp_path):
    policy_dir, prompts = tiny_inputs
    common = [str(RECIPE), "--model_name_or_path", str(policy_dir), "--prompts_file", str(prompts),
              "--reward_words", "idiot,fool", "--num_samples_per_prompt", "3", "--batch_size", "3",
              "--max_new_tokens", "5", "--num_resamples", "50", "--save_samples", "true",
              "--no_progress", "true"]  # fmt: skip
    run([sys.executable, *common, "--output_path", str(tmp_path / "one.json")], timeout=300)
    with socket.socket() as s:  # a free port for the gloo rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(port)]
    run(accelerate_launch(*launch, *common, "--output_path", str(tmp_path / "two.json")), timeout=300)
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert one.pop("num_processes") == 1 and two.pop("num_processes") == 2
    assert two == one


def test_recipe_config_typos_fail_clearly(recipe, tmp_path):
    """TRL's parser drops unknown --config keys silently; ours names them, with the closest option."""
    config = tmp_path / "eval.yaml"
    config.write_text("model_name_or_path: m\nlexical_word: idiot\n")
    with pytest.raises(ValueError, match=r"'lexical_word' \(did you mean 'lexical_words'\?\)"):
        recipe.make_parser().parse_args_and_config(["--config", str(config)])
