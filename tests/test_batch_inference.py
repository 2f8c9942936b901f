"""Batch inference (`trl_ext.inference.batch`, `recipes/batch_inference.py`): generation rows, best-of-N, scoring
mode, resuming (also after a torn last line) and the recipe with its tiny example YAML."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from datasets import Dataset
from online_helpers import EXAMPLES, RECIPES, assert_help_lists, run

from trl_ext import testing as kit
from trl_ext.inference import (
    BatchInferenceArguments,
    load_finished_rows,
    resolve_backend,
    row_digest,
    run_batch_inference,
)
from trl_ext.models import CallableReward, ModelReward

RECIPE = RECIPES / "batch_inference.py"
TINY_YAML = EXAMPLES / "batch_inference_tiny.yaml"


@pytest.fixture
def policy():
    tokenizer = kit.build_tokenizer(padding_side="left")
    return kit.build_causal_lm("gpt_neox", tokenizer=tokenizer), tokenizer


@pytest.fixture
def reward():
    tokenizer = kit.build_tokenizer()
    model = kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer, seed=1)
    return ModelReward(model, tokenizer)


def read_rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def args_for(tmp_path, **kwargs) -> BatchInferenceArguments:
    defaults = {"output_file": str(tmp_path / "out.jsonl"), "max_new_tokens": 6, "batch_size": 3, "progress": False}
    return BatchInferenceArguments(**{**defaults, **kwargs})


class CountingReward(CallableReward):
    """A reward that counts the completions it scored: ``len(completion)`` in characters."""

    def __init__(self):
        self.calls = 0
        super().__init__(self._score, name="length")

    def _score(self, prompts, completions, **kwargs):
        self.calls += len(completions)
        return [float(len(c)) for c in completions]


# ---------------------------------------------------------------------------------------------------- generation
def test_generation_writes_one_row_per_prompt(policy, tmp_path):
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=7)
    summary = run_batch_inference(dataset, args_for(tmp_path), model=model, tokenizer=tokenizer)
    rows = read_rows(tmp_path / "out.jsonl")
    assert summary == {"total": 7, "already_done": 0, "written": 7, "output_file": str(tmp_path / "out.jsonl")}
    assert [r["key"] for r in rows] == [str(i) for i in range(7)]
    assert [r["prompt"] for r in rows] == dataset["prompt"]
    assert all(isinstance(r["completion"], str) and "completions" not in r for r in rows)
    assert all(r["digest"] == row_digest(p) for r, p in zip(rows, dataset["prompt"]))
    assert any(r["completion"] for r in rows)  # random weights, but something was generated


def test_conversational_prompts_get_the_chat_template(policy, tmp_path, monkeypatch):
    import trl_ext.inference.batch as batch

    model, tokenizer = policy
    seen = []
    original = batch._prompt_token_ids
    monkeypatch.setattr(batch, "_prompt_token_ids", lambda *a: seen.extend(original(*a)) or original(*a))
    dataset = kit.prompt_dataset(n=2, conversational=True)
    run_batch_inference(dataset, args_for(tmp_path), model=model, tokenizer=tokenizer)
    rendered = tokenizer.decode(seen[0])
    assert rendered.startswith("<|im_start|>user\n") and rendered.endswith("<|im_start|>assistant\n")
    assert read_rows(tmp_path / "out.jsonl")[0]["prompt"] == dataset[0]["prompt"]  # the messages, as given


def test_best_of_n_keeps_the_highest_scoring_sample(policy, reward, tmp_path):
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=5)
    args = args_for(tmp_path, num_samples=4, temperature=1.0)
    run_batch_inference(dataset, args, model=model, tokenizer=tokenizer, reward_fn=reward)
    rows = read_rows(tmp_path / "out.jsonl")
    assert len(rows) == 5
    for row in rows:
        assert len(row["completions"]) == len(row["scores"]) == 4
        # every recorded score is the reward of its sample, and the kept sample has the largest one
        rescored = reward([row["prompt"]] * 4, row["completions"])
        assert row["scores"] == pytest.approx(rescored.tolist(), abs=1e-5)
        assert row["best_index"] == max(range(4), key=row["scores"].__getitem__)
        assert row["completion"] == row["completions"][row["best_index"]]
        assert row["score"] == pytest.approx(max(row["scores"]))
    assert any(len(set(r["completions"])) > 1 for r in rows)  # the N samples differ, so the choice matters


def test_several_samples_without_a_reward_are_all_kept(policy, tmp_path):
    model, tokenizer = policy
    run_batch_inference(kit.prompt_dataset(n=2), args_for(tmp_path, num_samples=3), model=model, tokenizer=tokenizer)
    rows = read_rows(tmp_path / "out.jsonl")
    assert all(len(r["completions"]) == 3 and "completion" not in r and "score" not in r for r in rows)


# ------------------------------------------------------------------------------------------------------- scoring
def test_scoring_mode_equals_direct_scoring(reward, tmp_path):
    dataset = kit.prompt_completion_dataset(n=7).rename_column("completion", "response")
    args = args_for(tmp_path, mode="score", reward_model_path="unused-here")
    summary = run_batch_inference(dataset, args, reward_fn=reward)
    rows = read_rows(tmp_path / "out.jsonl")
    direct = reward(dataset["prompt"], dataset["response"])
    assert summary["written"] == 7
    assert [r["score"] for r in rows] == pytest.approx(direct.tolist(), abs=1e-5)
    assert [r["response"] for r in rows] == dataset["response"]
    assert len({r["score"] for r in rows}) > 1


def test_options_are_checked(tmp_path, policy):
    with pytest.raises(ValueError, match="--mode score needs --reward_model_path"):
        BatchInferenceArguments(mode="score")
    with pytest.raises(ValueError, match="--mode must be"):
        BatchInferenceArguments(mode="sample")
    with pytest.raises(ValueError, match="--num_samples must be >= 1"):
        BatchInferenceArguments(num_samples=0)
    args = args_for(tmp_path, mode="score", reward_model_path="x")
    with pytest.raises(ValueError, match="--response_column 'response'"):
        run_batch_inference(kit.prompt_dataset(n=2), args, reward_fn=CountingReward())
    with pytest.raises(ValueError, match="duplicate values"):
        dataset = Dataset.from_dict({"prompt": ["a", "b"], "id": [1, 1]})
        run_batch_inference(dataset, args_for(tmp_path, id_column="id"), model=policy[0], tokenizer=policy[1])


def test_vllm_backend_falls_back_to_hf_with_a_message(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_ext.inference.generation"):
        assert resolve_backend("vllm") == "hf"  # no vLLM and no GPU here
    assert "vLLM is not installed" in caplog.text and "Hugging Face generate instead" in caplog.text
    assert resolve_backend("auto") == "hf" and resolve_backend("hf") == "hf"


# -------------------------------------------------------------------------------------------------------- resume
def test_second_run_generates_nothing_new(policy, tmp_path):
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=6)
    reward = CountingReward()
    args = args_for(tmp_path, num_samples=2)
    run_batch_inference(dataset, args, model=model, tokenizer=tokenizer, reward_fn=reward)
    first = (tmp_path / "out.jsonl").read_text()
    assert reward.calls == 12

    generate = pytest.MonkeyPatch()
    import trl_ext.inference.batch as batch

    generate.setattr(batch, "generate_texts", lambda *a, **k: pytest.fail("generated again"))
    try:
        summary = run_batch_inference(dataset, args, model=model, tokenizer=tokenizer, reward_fn=reward)
    finally:
        generate.undo()
    assert summary["already_done"] == 6 and summary["written"] == 0
    assert (tmp_path / "out.jsonl").read_text() == first and reward.calls == 12


def test_resume_after_a_torn_last_line(policy, tmp_path, caplog):
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=6)
    path = tmp_path / "out.jsonl"
    run_batch_inference(dataset.select(range(4)), args_for(tmp_path), model=model, tokenizer=tokenizer)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])  # killed while writing row 3

    assert sorted(load_finished_rows(path)) == ["0", "1", "2"]  # the torn line is dropped from the file...
    assert path.read_text() == "".join(lines[:3])
    summary = run_batch_inference(dataset, args_for(tmp_path), model=model, tokenizer=tokenizer)
    assert summary == {"total": 6, "already_done": 3, "written": 3, "output_file": str(path)}
    rows = read_rows(path)  # ...and every line of the finished file parses
    assert [r["key"] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    assert "".join(path.read_text().splitlines(keepends=True)[:3]) == "".join(lines[:3])  # done rows untouched


def test_resume_refuses_a_file_of_another_dataset(policy, tmp_path):
    model, tokenizer = policy
    run_batch_inference(kit.prompt_dataset(n=2), args_for(tmp_path), model=model, tokenizer=tokenizer)
    other = Dataset.from_dict({"prompt": ["a different prompt", "and another"]})
    with pytest.raises(ValueError, match="different dataset"):
        run_batch_inference(other, args_for(tmp_path), model=model, tokenizer=tokenizer)
    summary = run_batch_inference(other, args_for(tmp_path, overwrite=True), model=model, tokenizer=tokenizer)
    assert summary["written"] == 2 and [r["prompt"] for r in read_rows(tmp_path / "out.jsonl")] == other["prompt"]


def test_a_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"key": "0"}\nnot json\n{"key": "2"}\n')
    with pytest.raises(ValueError, match="line 2 is not a row"):
        load_finished_rows(path)


def test_id_column_is_the_resume_key(policy, tmp_path):
    model, tokenizer = policy
    dataset = Dataset.from_dict({"prompt": ["one two", "three four", "five six"], "id": ["x", "y", "z"]})
    run_batch_inference(dataset.select([2, 0]), args_for(tmp_path, id_column="id"), model=model, tokenizer=tokenizer)
    summary = run_batch_inference(dataset, args_for(tmp_path, id_column="id"), model=model, tokenizer=tokenizer)
    assert (summary["already_done"], summary["written"]) == (2, 1)
    assert [r["key"] for r in read_rows(tmp_path / "out.jsonl")] == ["z", "x", "y"]


# -------------------------------------------------------------------------------------------------------- recipe
def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--model_name_or_path", "--dataset_name", "--output_file", "--mode", "--backend",
        "--num_samples", "--reward_model_path", "--response_column", "--id_column", "--overwrite",
    ))  # fmt: skip


def test_recipe_runs_the_tiny_example_and_resumes(tiny_workdir):
    """The documented tiny best-of-4 run (on 8 prompts) as a user runs it, then the same options again through the
    recipe's `main` in-process: everything is already done, so nothing new is generated."""
    import sys

    from online_helpers import load_script

    flags = ["--config", str(TINY_YAML), "--max_prompts", "8", "--progress", "false"]
    first = run([sys.executable, str(RECIPE), *flags], cwd=tiny_workdir)
    assert "8 rows written" in first.stdout
    out = tiny_workdir / "outputs" / "batch_inference_tiny.jsonl"
    rows = read_rows(out)
    assert len(rows) == 8 and all(len(r["scores"]) == 4 and r["score"] == max(r["scores"]) for r in rows)
    assert torch.tensor([r["score"] for r in rows]).isfinite().all()

    recipe = load_script(RECIPE)
    tiny = tiny_workdir / "outputs" / "tiny"
    again = recipe.make_parser().parse_args_and_config([
        *flags, "--output_file", str(out), "--model_name_or_path", str(tiny / "policy"),
        "--dataset_name", str(tiny / "prompts.jsonl"), "--reward_model_path", str(tiny / "reward"),
    ])  # fmt: skip
    try:
        assert recipe.main(*again) == {"total": 8, "already_done": 8, "written": 0, "output_file": str(out)}
    finally:
        sys.modules.pop(recipe.__name__, None)
    assert read_rows(out) == rows
