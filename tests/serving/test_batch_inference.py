"""Batch inference (`trl_ext.inference.batch`, `recipes/batch_inference.py`): generation rows, best-of-N, scoring
mode, resuming (after a torn last line or a SIGKILL: the file of an uninterrupted run, every row once), the refusals
(a file it did not write, other settings, another run or dataset: the file is left untouched) and the recipe with its
tiny example YAML."""

from __future__ import annotations

import json
import logging
import os
import shutil

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
from trl_ext.inference.batch import metadata_path, read_metadata
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


def test_max_new_tokens_past_the_context_is_refused_before_anything_is_written(policy, tmp_path):
    """Issue 34: --max_new_tokens 600 on a 512-position model returned rc 0 with rows longer than the model can
    attend to (60 of 64); the trainers refuse the same setting. Now: the trainers' check, before any file exists."""
    model, tokenizer = policy
    assert model.config.max_position_embeddings == 512
    args = args_for(tmp_path, max_new_tokens=600)
    with pytest.raises(
        ValueError, match=r"with --max_new_tokens=600 new tokens .* the policy's context is 512"
    ) as err:
        run_batch_inference(kit.prompt_dataset(n=64), args, model=model, tokenizer=tokenizer)
    assert "64 of 64 prompts do not fit" in str(err.value) and "Lower --max_new_tokens below 512" in str(err.value)
    assert not os.path.exists(args.output_file) and not os.path.exists(metadata_path(args.output_file))


def test_a_prompt_longer_than_the_context_is_refused_naming_the_limit(policy, tmp_path):
    """Issue 34: a 2999-token prompt on a 512-position model was generated from (rc 0). Now it is refused, with the
    prompt length the model allows for this --max_new_tokens."""
    model, tokenizer = policy
    long_prompt = " ".join(["the"] * 2998)  # 2999 tokens with the tiny tokenizer
    assert len(tokenizer(long_prompt).input_ids) == 2999
    dataset = Dataset.from_dict({"prompt": ["Hello there", long_prompt, "Good morning"]})
    args = args_for(tmp_path, max_new_tokens=6)
    with pytest.raises(ValueError, match=r"longest prompt has 2999 tokens") as err:
        run_batch_inference(dataset, args, model=model, tokenizer=tokenizer)
    assert "1 of 3 prompts do not fit" in str(err.value) and "at most 506 tokens" in str(err.value)
    assert not os.path.exists(args.output_file)


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


def best_of_2(tmp_path, name="out.jsonl", **kwargs) -> BatchInferenceArguments:
    """Sampled best-of-2 (so every row depends on the random numbers), 3 prompts per chunk."""
    return args_for(tmp_path, **{"output_file": str(tmp_path / name), "num_samples": 2, "temperature": 1.0, **kwargs})


def killed_copy(tmp_path, done, rows: int, torn: bool, name="killed.jsonl"):
    """A copy of the finished output ``done`` (and its metadata) as a kill would leave it: the first ``rows`` rows,
    then (``torn``) half of the next line."""
    killed = tmp_path / name
    shutil.copy(metadata_path(done), metadata_path(killed))
    lines = done.read_bytes().splitlines(keepends=True)
    killed.write_bytes(b"".join(lines[:rows]) + (lines[rows][: len(lines[rows]) // 2] if torn else b""))
    return killed


@pytest.mark.parametrize(("rows", "torn"), [(0, True), (3, True), (4, True), (4, False), (6, False)])
def test_resume_after_a_kill_reproduces_the_uninterrupted_run(policy, reward, tmp_path, caplog, rows, torn):
    """Killed after ``rows`` rows (at a chunk boundary or inside a chunk, mid-line or not): the resumed file is byte
    for byte the uninterrupted run's, every row once, and the caller's random state is left alone."""
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=8)
    run_batch_inference(dataset, best_of_2(tmp_path), model=model, tokenizer=tokenizer, reward_fn=reward)
    done = tmp_path / "out.jsonl"
    killed = killed_copy(tmp_path, done, rows, torn)

    torch.manual_seed(1234)  # a new process: whatever random state the caller has
    state = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="trl_ext.inference.batch"):
        summary = run_batch_inference(
            dataset, best_of_2(tmp_path, "killed.jsonl"), model=model, tokenizer=tokenizer, reward_fn=reward
        )
    assert torch.equal(torch.get_rng_state(), state)
    assert summary == {"total": 8, "already_done": rows, "written": 8 - rows, "output_file": str(killed)}
    assert ("removing a torn last line" in caplog.text) == torn
    assert killed.read_bytes() == done.read_bytes()
    assert [r["key"] for r in read_rows(killed)] == [str(i) for i in range(8)]
    assert any(r["completions"][0] != r["completions"][1] for r in read_rows(killed))  # rows were sampled


@pytest.mark.slow
def test_recipe_resumed_after_sigkill_equals_an_uninterrupted_run(tiny_workdir):
    """The recipe killed with SIGKILL mid-run, then run again: every prompt exactly once, and the rows (less the run
    id) are those of an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    from online_helpers import subprocess_env

    def command(name):
        return [sys.executable, str(RECIPE), "--config", str(TINY_YAML), "--progress", "false",
                "--batch_size", "2", "--max_new_tokens", "32", "--output_file", f"outputs/{name}.jsonl"]  # fmt: skip

    killed = tiny_workdir / "outputs" / "killed.jsonl"
    log = tiny_workdir / "killed.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(command("killed"), cwd=tiny_workdir, env=subprocess_env(), stderr=stderr)
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if killed.exists() and killed.read_bytes().count(b"\n") >= 3:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert 3 <= killed.read_bytes().count(b"\n") < 64
    resumed = run(command("killed"), cwd=tiny_workdir)
    assert "were already done" in resumed.stdout
    run(command("straight"), cwd=tiny_workdir)

    def rows(name):
        found = read_rows(tiny_workdir / "outputs" / f"{name}.jsonl")
        return [{k: v for k, v in r.items() if k != "run_id"} for r in found]

    assert [r["key"] for r in rows("killed")] == [str(i) for i in range(64)]
    assert rows("killed") == rows("straight")


def test_load_finished_rows_reads_only(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"key": "0"}\n{"key": "1"}\n{"key": "2", "compl')
    assert sorted(load_finished_rows(path)) == ["0", "1"]
    assert path.read_text() == '{"key": "0"}\n{"key": "1"}\n{"key": "2", "compl'  # the torn line is still there


@pytest.mark.parametrize(
    "content",
    [b'{"key": "0", "prompt": "my own notes"}\n', b'{"key": "0", "prompt": "no newline"}', b"plain text\n"],
)
def test_a_file_it_did_not_write_is_refused_untouched(policy, tmp_path, content):
    model, tokenizer = policy
    path = tmp_path / "out.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="was not written by batch inference.*--overwrite"):
        run_batch_inference(kit.prompt_dataset(n=2), args_for(tmp_path), model=model, tokenizer=tokenizer)
    assert path.read_bytes() == content and not os.path.exists(metadata_path(path))
    # --overwrite replaces it, as the message says
    run_batch_inference(kit.prompt_dataset(n=2), args_for(tmp_path, overwrite=True), model=model, tokenizer=tokenizer)
    assert len(read_rows(path)) == 2 and read_metadata(path)["run_id"] == read_rows(path)[0]["run_id"]


def test_an_empty_file_without_metadata_is_a_fresh_start(policy, tmp_path):
    model, tokenizer = policy
    (tmp_path / "out.jsonl").write_bytes(b"")
    summary = run_batch_inference(kit.prompt_dataset(n=2), args_for(tmp_path), model=model, tokenizer=tokenizer)
    assert summary["written"] == 2


@pytest.mark.parametrize(
    ("change", "flag"),
    [({"num_samples": 1}, "--num_samples"), ({"temperature": 0.0}, "--temperature"), ({"seed": 3}, "--seed")],
)
def test_resume_with_other_settings_is_refused_untouched(policy, tmp_path, change, flag):
    """A job of 40 best-of-2 rows must not be finished with greedy rows (or another seed): the run stops and names the
    setting; the file and its metadata are unchanged (a torn last line included)."""
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=4)
    run_batch_inference(dataset, best_of_2(tmp_path, "done.jsonl"), model=model, tokenizer=tokenizer)
    path = killed_copy(tmp_path, tmp_path / "done.jsonl", rows=2, torn=True, name="out.jsonl")
    before, meta = path.read_bytes(), open(metadata_path(path), "rb").read()
    with pytest.raises(ValueError, match=f"other settings.*{flag} \\(file: "):
        run_batch_inference(dataset, best_of_2(tmp_path, **change), model=model, tokenizer=tokenizer)
    assert path.read_bytes() == before and open(metadata_path(path), "rb").read() == meta


def test_greedy_resume_ignores_sampling_only_settings(policy, tmp_path):
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=4)
    run_batch_inference(
        dataset.select(range(2)), args_for(tmp_path, temperature=0.0), model=model, tokenizer=tokenizer
    )
    args = args_for(tmp_path, temperature=0.0, seed=7, top_p=0.5)
    assert run_batch_inference(dataset, args, model=model, tokenizer=tokenizer)["written"] == 2


def test_rows_of_another_run_are_refused_untouched(policy, tmp_path):
    """Metadata and rows belong together: a row with another run id (the file was replaced or appended to by someone
    else) stops the run, even as an unterminated last line."""
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=4)
    args = args_for(tmp_path)
    run_batch_inference(dataset.select(range(2)), args, model=model, tokenizer=tokenizer)
    path = tmp_path / "out.jsonl"
    first = path.read_bytes()
    for extra in (b'{"key": "2", "run_id": "someone-else"}\n', b'{"key": "2", "run_id": "someone-else"}'):
        path.write_bytes(first + extra)
        with pytest.raises(ValueError, match="not written by the run recorded in"):
            run_batch_inference(dataset, args, model=model, tokenizer=tokenizer)
        assert path.read_bytes() == first + extra


def test_batch_size_may_change_on_resume(policy, tmp_path, caplog):
    model, tokenizer = policy
    dataset = kit.prompt_dataset(n=6)
    run_batch_inference(dataset, best_of_2(tmp_path, "done.jsonl"), model=model, tokenizer=tokenizer)
    path = killed_copy(tmp_path, tmp_path / "done.jsonl", rows=4, torn=True, name="out.jsonl")
    with caplog.at_level(logging.WARNING, logger="trl_ext.inference.batch"):
        summary = run_batch_inference(dataset, best_of_2(tmp_path, batch_size=2), model=model, tokenizer=tokenizer)
    assert summary["written"] == 2 and "not be byte-identical" in caplog.text
    assert [r["key"] for r in read_rows(path)] == [str(i) for i in range(6)]


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
