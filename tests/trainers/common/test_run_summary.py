"""The end of a run: the summary table (`trl_ext.trainers.common.run_summary`), `trl_ext.plot_log_history`, the
recipes' ``--plot``; and three small fixes that show at the end of a run: ``save_negdata`` under ``output_dir``, the
model card naming trl_ext with a plain-text quick start for tokenizers without a chat template.

The trainer runs use the offline tiny kit (PPO) and the exact toy of `test_harmlessness_trainer.py` (RePULSe), a
second or so each; the recipe runs in-process on the tiny inputs of `examples/build_tiny_inputs.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import pytest
from online_helpers import EXAMPLES, RECIPES, loaded_script
from test_harmlessness_trainer import toy_args, toy_trainer
from test_ppo_trainer import make_trainer, ppo_args

import trl_ext
from trl_ext.rollout.negdata import read_negative_data
from trl_ext.trainers.common import run_summary as rs
from trl_ext.trainers.common.model_card import PROJECT_URL, complete_card_text

LOG = [  # a hand-made log: training rows, an eval row, a row without the KL, and Trainer's final summary row
    {"loss": 1.5, "base/reward": -0.8, "base/kl": 1e-7, "p_bad": 0.25, "learning_rate": 1e-3, "step": 1},
    {"loss": 1.25, "base/reward": -0.5, "base/kl": 0.02, "p_bad": 0.125, "step": 2},
    {"eval_reward": -0.6, "eval_p_bad": 0.2, "eval_kl": 0.01, "step": 2},
    {"loss": 0.75, "base/reward": -0.25, "p_bad": 0.0, "step": 3},
    {"loss": 0.5, "base/reward": 0.125, "base/kl": -0.004, "p_bad": 0.0625, "step": 4},
    {"train_runtime": 2.0, "train_loss": 1.0, "total_flos": 0.0, "step": 4},
]


def _row(text: str, label: str) -> list[str]:
    """The cells of the table line whose first cell is ``label`` (split on runs of 2+ spaces)."""
    for line in text.splitlines():
        cells = [c for c in line.strip().split("  ") if c.strip()]
        if cells and cells[0].strip() == label:
            return [c.strip() for c in cells]
    raise AssertionError(f"no {label!r} row in\n{text}")


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


# ------------------------------------------------------------------------------------------- the pure table
def test_first_and_last_values_of_a_hand_made_log():
    rows = {r.label: r for r in rs.summarize_log_history(LOG)}
    assert list(rows) == ["reward", "KL", "p_bad", "loss", "eval reward", "eval KL", "eval p_bad"]
    reward = rows["reward"]
    assert (reward.key, reward.first_step, reward.first) == ("base/reward", 1, -0.8)
    assert (reward.last_step, reward.last) == (4, 0.125)
    assert reward.count == 4 and reward.change == pytest.approx(0.925)
    kl = rows["KL"]  # step 3 has no KL: 3 values; the last one is negative (k1 on a batch)
    assert (kl.first, kl.last, kl.count, kl.last_step) == (1e-7, -0.004, 3, 4)
    assert (rows["p_bad"].first, rows["p_bad"].last) == (0.25, 0.0625)
    assert (rows["loss"].first, rows["loss"].last) == (1.5, 0.5)  # not train_loss, Trainer's summary row
    assert (rows["eval p_bad"].first, rows["eval p_bad"].count) == (0.2, 1)

    text = rs.run_summary_text(LOG, title="a hand-made run")
    assert "a hand-made run" in text
    assert _row(text, "reward") == ["reward", "base/reward", "1 → 4", "-0.8", "0.125", "+0.925"]
    assert _row(text, "KL") == ["KL", "base/kl", "1 → 4", "1e-07", "-0.004", "-0.004"]
    assert _row(text, "p_bad") == ["p_bad", "p_bad", "1 → 4", "0.25", "0.0625", "-0.1875"]
    assert _row(text, "eval reward") == ["eval reward", "eval_reward", "2", "-0.6", "-0.6"]  # one value: no change

    # other trainers' keys: PPO's objective/*, DPO's rewards/*; `keys` picks log keys by name
    ppo = [{"objective/scores": 0.5, "objective/kl": 0.0, "step": 2}, {"objective/scores": 0.75, "step": 4}]
    assert [(r.label, r.key, r.last) for r in rs.summarize_log_history(ppo)] == [
        ("reward", "objective/scores", 0.75), ("KL", "objective/kl", 0.0),
    ]  # fmt: skip
    dpo = [{"loss": 0.69, "rewards/margins": 0.0, "rewards/accuracies": 0.5, "step": 1}]
    assert [r.label for r in rs.summarize_log_history(dpo)] == ["reward margin", "accuracy", "loss"]
    picked = rs.summarize_log_history(LOG, keys=["learning_rate", "no/such_key"])
    assert [(r.label, r.first, r.count) for r in picked] == [("learning_rate", 1e-3, 1)]


def test_missing_metrics_non_numbers_and_empty_logs():
    for empty in ([], None, [{}], [{"train_runtime": 1.0, "train_loss": 0.5, "step": 0}]):
        assert rs.summarize_log_history(empty) == []
        text = rs.run_summary_text(empty)
        assert "(no reward, KL, p_bad or loss logged)" in text and "s per" not in text
    # values that are not numbers (None, strings, booleans) are skipped; a NaN is shown as it is
    odd = [
        {"loss": None, "base/reward": "n/a", "p_bad": True, "step": 1},
        {"loss": float("nan"), "base/reward": 2, "step": 5},
        {"loss": 0.5, "step": 7},
    ]
    rows = {r.label: r for r in rs.summarize_log_history(odd)}
    assert set(rows) == {"reward", "loss"}
    assert (rows["reward"].first_step, rows["reward"].first, rows["reward"].count) == (5, 2.0, 1)
    assert rows["loss"].first_step == 5 and rows["loss"].last == 0.5
    assert _row(rs.run_summary_text(odd), "loss")[3:] == ["nan", "0.5", "nan"]
    rows_without_steps = [{"loss": 3.0}, {"loss": 2.0}]  # the row's index stands in for the step
    assert [(r.first_step, r.last_step) for r in rs.summarize_log_history(rows_without_steps)] == [(0, 1)]


def test_facts_seconds_per_update_and_where_the_model_went(tmp_path):
    text = rs.run_summary_text(
        LOG, unit="PPO update", updates=4, steps=8, seconds=10.0, output_dir="/runs/ppo",
        last_checkpoint="/runs/ppo/checkpoint-8", width=120,
    )  # fmt: skip
    assert "4 PPO updates (8 optimizer steps) in 10.0 s: 2.5 s per PPO update" in text
    assert "output_dir: /runs/ppo" in text and "last checkpoint: /runs/ppo/checkpoint-8" in text
    text = rs.run_summary_text(LOG, updates=3, steps=3, seconds=1.5, output_dir="/o")
    assert "3 steps in 1.5 s: 0.5 s per step" in text and "last checkpoint: none saved" in text
    assert "0 steps in 0.2 s" in rs.run_summary_text([], updates=0, steps=0, seconds=0.2)  # no division by zero

    class State:  # what the callback reads at the end of train()
        global_step, log_history, is_world_process_zero = 12, LOG, True

    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-12").mkdir()
    callback = rs.RunSummaryCallback("PPOTrainer", "PPO update", steps_per_unit=2)
    State.global_step = 4  # resumed at step 4
    callback.on_train_begin(None, State, None)
    State.global_step = 12
    facts = callback.facts(type("Args", (), {"output_dir": str(out)})(), State)
    assert (facts["steps"], facts["updates"], facts["unit"]) == (8, 4.0, "PPO update")
    assert facts["last_checkpoint"] == str(out / "checkpoint-12") and facts["output_dir"] == str(out)


# ---------------------------------------------------------------------------------------- printed by train()
def test_a_tiny_ppo_run_prints_the_table_with_its_first_and_last_reward(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "400")  # rich's width off a terminal: the paths stay on one line
    args = ppo_args(tmp_path, step_unit="update", num_ppo_epochs=2, total_episodes=16, save_strategy="steps",
                    save_steps=2)  # fmt: skip
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    trainer.train()
    printed = capsys.readouterr().out
    scores = [row["objective/scores"] for row in trainer.state.log_history if "objective/scores" in row]
    assert len(scores) == 4 and scores[0] != scores[-1]
    reward = _row(printed, "reward")
    assert reward[:3] == ["reward", "objective/scores", "2 → 8"]  # 4 updates of 2 optimizer steps
    assert (float(reward[3]), float(reward[4])) == (float(f"{scores[0]:.4g}"), float(f"{scores[-1]:.4g}"))
    assert _row(printed, "KL")[1] == "objective/kl" and _row(printed, "loss")[1] == "loss"
    assert "PPOTrainer" in printed and "4 PPO updates (8 optimizer steps) in " in printed
    assert " s per PPO update" in printed and f"output_dir: {os.path.abspath(args.output_dir)}" in printed
    assert f"last checkpoint: {os.path.abspath(args.output_dir)}/checkpoint-8" in printed
    assert sum(isinstance(c, rs.RunSummaryCallback) for c in trainer.callback_handler.callbacks) == 1

    # the kit's tokenizer has a chat template: the card keeps TRL's chat quick start, and names trl_ext
    trainer.create_model_card(model_name="tiny-ppo")
    card = open(os.path.join(args.output_dir, "README.md"), encoding="utf-8").read()
    assert f"[trl_ext]({PROJECT_URL})" in card and "trained using [TRL]" not in card
    assert 'generator([{"role": "user", "content": question}], ' in card and "generator(prompt, " not in card


def test_a_repulse_run_prints_p_bad_and_can_be_silenced(tmp_path, capsys):
    trainer = toy_trainer(toy_args(tmp_path, max_steps=3, kl_coef=0.1))
    trainer.train()
    printed = capsys.readouterr().out
    history = trainer.state.log_history
    assert _row(printed, "p_bad")[3:5] == [f"{history[0]['p_bad']:.4g}", f"{history[2]['p_bad']:.4g}"]
    assert _row(printed, "KL")[1] == "base/kl" and _row(printed, "reward")[1] == "base/reward"
    assert "HarmlessnessTrainer" in printed and "3 steps in " in printed

    quiet = toy_trainer(toy_args(tmp_path / "quiet", max_steps=1))
    quiet.print_run_summary = False
    quiet.train()
    assert "HarmlessnessTrainer" not in capsys.readouterr().out
    assert not any(isinstance(c, rs.RunSummaryCallback) for c in quiet.callback_handler.callbacks)

    # the toy tokenizer has no chat template: a plain-text quick start
    trainer.create_model_card(model_name="toy")
    card = (tmp_path / "out" / "README.md").read_text()
    assert 'prompt = "Once upon a time,"' in card and "generator(prompt, max_new_tokens=128" in card
    assert '"role": "user"' not in card and "question =" not in card and f"[trl_ext]({PROJECT_URL})" in card


def test_card_text_names_trl_ext_and_prompts_by_template():
    trl_card = (
        "It has been trained using [TRL](https://github.com/huggingface/trl).\n"
        'question = "If you had a time machine, but could only go to the past or the future once and never return, '
        'which would you choose and why?"\n'
        'generator = pipeline("text-generation", model="None", device_map="auto")\n'
        'output = generator([{"role": "user", "content": question}], max_new_tokens=128, return_full_text=False)[0]\n'
    )
    plain = complete_card_text(trl_card, "org/base", "out", chat=False)
    assert plain.splitlines() == [
        "It has been trained using [trl_ext](https://github.com/trl-ext/trl_ext), which extends "
        "[TRL](https://github.com/huggingface/trl).",
        'prompt = "Once upon a time,"',
        'generator = pipeline("text-generation", model="out", device_map="auto")',
        "output = generator(prompt, max_new_tokens=128, return_full_text=False)[0]",
    ]
    chat = complete_card_text(trl_card, "org/base", "out", chat=True)  # TRL's chat quick start, pointed at "out"
    assert chat.splitlines()[0] == plain.splitlines()[0]
    assert chat.splitlines()[1:] == trl_card.replace('model="None"', 'model="out"').splitlines()[1:]


# ------------------------------------------------------------------------------------------------ the curves
def test_plot_log_history_from_a_list_and_from_a_folder(tmp_path):
    assert trl_ext.plot_log_history is rs.plot_log_history  # the lazy export
    path = trl_ext.plot_log_history(LOG, tmp_path / "a" / "curves.png")
    assert path == str(tmp_path / "a" / "curves.png") and os.path.getsize(path) > 1000
    assert _png_size(path) == (1600, 320)  # 4 panels (reward, KL, p_bad, loss) of 4 x 3.2 inches at 100 dpi
    assert _png_size(rs.plot_log_history(LOG, tmp_path / "one.png", keys="p_bad")) == (400, 320)

    out = tmp_path / "out"  # an output_dir with two checkpoints: the newest state is read
    for step, log in ((2, LOG[:2]), (10, LOG)):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "log_history": log})
        )
    (out / "checkpoint-7-old").mkdir()  # not a checkpoint-N name: ignored
    assert rs.load_log_history(out) == LOG and rs.load_log_history(out / "checkpoint-2") == LOG[:2]
    assert rs.plot_log_history(out) == str(out / "training_curves.png")
    assert _png_size(out / "training_curves.png") == (1600, 320)
    state = out / "checkpoint-2" / "trainer_state.json"
    assert _png_size(rs.plot_log_history(state, keys=["loss", "base/reward"])) == (800, 320)
    assert (out / "checkpoint-2" / "training_curves.png").is_file()


def test_plot_log_history_bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "checkpoint-3").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No trainer_state.json in .*empty.*log_history"):
        rs.plot_log_history(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rs.plot_log_history(tmp_path / "missing")
    with pytest.raises(ValueError, match="none of the reward, KL, p_bad or loss"):
        rs.plot_log_history([], tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"no numeric values for \['objective/kl'\]"):
        rs.plot_log_history(LOG, tmp_path / "x.png", keys=["loss", "objective/kl"])
    with pytest.raises(TypeError, match="log_history"):
        rs.plot_log_history(42)
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------- save_negdata
def test_a_relative_save_negdata_is_under_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = toy_args(tmp_path, output_dir="runs/a", save_negdata="neg/bad.jsonl", save_negdata_threshold=10.0)
    assert args.save_negdata == str(tmp_path / "runs" / "a" / "neg" / "bad.jsonl")
    assert dataclasses.replace(args).save_negdata == args.save_negdata  # resolved once, not under output_dir twice
    absolute = str(tmp_path / "elsewhere.jsonl")
    assert toy_args(tmp_path, save_negdata=absolute).save_negdata == absolute
    assert toy_args(tmp_path).save_negdata is None
    toy_trainer(dataclasses.replace(args, max_steps=1)).train()  # threshold 10: every sample is written
    rows = read_negative_data(str(tmp_path / "runs" / "a" / "neg" / "bad.jsonl"))
    assert len(rows) == 8 * 2  # 8 policy + 8 proposal samples of the one step


@pytest.fixture
def harmlessness_recipe():
    yield from loaded_script(RECIPES / "harmlessness.py")


def test_recipe_plot_and_negdata_under_the_output_dir_given_on_the_command_line(
    harmlessness_recipe, tiny_workdir, monkeypatch, capsys
):
    """The toy YAML sets ``save_negdata: negdata.jsonl``; ``--output_dir`` moves it along with the model."""
    monkeypatch.chdir(tiny_workdir)
    monkeypatch.setenv("COLUMNS", "400")
    out = tiny_workdir / "elsewhere"
    argv = ["--config", str(EXAMPLES / "harmlessness_toy.yaml"), "--max_steps", "2", "--per_device_train_batch_size",
            "2", "--disable_tqdm", "true", "--output_dir", str(out), "--save_negdata_threshold", "10",
            "--plot", "true"]  # fmt: skip
    script_args, args, model_args = harmlessness_recipe.make_parser().parse_args_and_config(argv)
    assert script_args.plot and args.save_negdata == str(out / "negdata.jsonl")
    harmlessness_recipe.main(script_args, args, model_args)
    printed = capsys.readouterr().out
    rows = read_negative_data(str(out / "negdata.jsonl"))  # the rows after the file's header line
    assert len(rows) == 2 * 2 * 4 * 2  # 2 steps × 2 prompts × 4 samples × (policy + proposal)
    assert not (tiny_workdir / "outputs" / "harmlessness-tiny").exists()
    assert _png_size(out / "training_curves.png") == (1600, 320)  # reward, KL, p_bad, loss
    assert f"Training curves: {out / 'training_curves.png'}" in printed
    assert "HarmlessnessTrainer" in printed and _row(printed, "p_bad")[2] == "1 → 2"
    assert printed.index("HarmlessnessTrainer") < printed.index("Trained 2 neg_training steps")
