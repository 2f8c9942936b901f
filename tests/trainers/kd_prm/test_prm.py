"""Process reward models: step tokenisation, collation, `PRMTrainer` (token classifier and causal LM with reward
tokens) and `recipes/prm.py` with `examples/prm_tiny.yaml`."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from online_helpers import EXAMPLES, RECIPES, loaded_script, placeholder_model_folders, run

from trl_ext import testing as kit
from trl_ext.trainers.prm import (
    PRMConfig,
    PRMDataCollator,
    PRMTrainer,
    prepare_prm_dataset,
    tokenize_prm_example,
)

RECIPE = RECIPES / "prm.py"
TINY_YAML = EXAMPLES / "prm_tiny.yaml"


class CharTokenizer:
    """One id per character (its code point); calling it on a prompt prepends a BOS id 1."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def __call__(self, text):
        return {"input_ids": [1] + self.encode(text)}


def prm_args(tmp_path, **overrides) -> PRMConfig:
    values = dict(
        output_dir=str(tmp_path / "out"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        activation_checkpointing=False,
        disable_tqdm=True,
    )
    values.update(overrides)
    return PRMConfig(**values)


@pytest.fixture
def token_classifier(tiny_gpt_neox_dir):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(tiny_gpt_neox_dir, num_labels=2)


# ------------------------------------------------------------------------------------------------ tokenisation
def test_labels_sit_on_the_separator_closing_each_step():
    row = tokenize_prm_example("Q", ["ab", "c"], [True, False], CharTokenizer(), step_separator="\n")
    #                         BOS  Q   a   b   \n  c   \n
    assert row["input_ids"] == [1, 81, 97, 98, 10, 99, 10]
    assert row["labels"] == [-100, -100, -100, -100, 1, -100, 0]


def test_labels_sit_on_the_placeholder_then_the_separator_follows():
    row = tokenize_prm_example(
        "Q", ["ab", "c"], [False, True], CharTokenizer(), placeholder_token_id=7, step_label_ids=(43, 45)
    )
    assert row["input_ids"] == [1, 81, 97, 98, 7, 10, 99, 7, 10]
    assert row["labels"] == [-100, -100, -100, -100, 45, -100, -100, 43, -100]


def test_last_step_only_and_truncation():
    tok = CharTokenizer()
    row = tokenize_prm_example("Q", ["ab", "c"], [True, False], tok, train_on_last_step_only=True)
    assert row["labels"] == [-100, -100, -100, -100, -100, -100, 0]
    row = tokenize_prm_example("QRS", ["ab", "c"], [True, False], tok, max_prompt_length=2, max_length=5)
    assert row["input_ids"] == [82, 83, 97, 98, 10]  # prompt keeps its end, the row its start
    assert row["labels"] == [-100, -100, -100, -100, 1]
    row = tokenize_prm_example("Q", ["ab", "c"], [True, False], tok, max_completion_length=4)
    assert row["input_ids"] == [1, 81, 97, 98, 10, 99]


def test_real_tokenizer_places_labels_on_the_newlines(tiny_tokenizer):
    prompt, steps = "What is 1 + 2?", ["1 + 2 = 3", "The answer is 3."]
    row = tokenize_prm_example(prompt, steps, [True, False], tiny_tokenizer)
    assert tiny_tokenizer.decode(row["input_ids"]) == prompt + "1 + 2 = 3\nThe answer is 3.\n"
    positions = [i for i, label in enumerate(row["labels"]) if label != -100]
    assert [row["labels"][i] for i in positions] == [1, 0]
    assert tiny_tokenizer.decode(row["input_ids"][: positions[0] + 1]).endswith("1 + 2 = 3\n")
    assert positions[1] == len(row["input_ids"]) - 1
    assert all(tiny_tokenizer.decode([row["input_ids"][i]]) == "\n" for i in positions)


def test_bad_rows_are_rejected(tiny_tokenizer):
    with pytest.raises(ValueError, match="one label per step"):
        tokenize_prm_example("Q", ["a", "b"], [True], tiny_tokenizer)
    with pytest.raises(ValueError, match="booleans"):
        tokenize_prm_example("Q", ["a"], [0.3], tiny_tokenizer)


def test_prepare_drops_rows_without_a_labelled_step_and_checks_columns(tiny_tokenizer, tmp_path):
    from datasets import Dataset

    data = Dataset.from_dict(
        {"prompt": ["Hi", "A much longer prompt"], "completions": [["1 + 1 = 2"], ["2 + 2 = 4"]], "labels": [[1], [0]]}
    )
    short = len(tokenize_prm_example("Hi", ["1 + 1 = 2"], [True], tiny_tokenizer)["input_ids"])
    assert (
        len(tokenize_prm_example("A much longer prompt", ["2 + 2 = 4"], [True], tiny_tokenizer)["input_ids"]) > short
    )
    args = prm_args(tmp_path, max_length=short, max_prompt_length=None)  # cuts the second row's only marker
    with pytest.warns(UserWarning, match="1 of 2 train rows"):
        out = prepare_prm_dataset(data, tiny_tokenizer, args, placeholder_token_id=None, step_label_ids=(1, 0))
    assert len(out) == 1 and out.column_names == ["input_ids", "labels"]
    assert [label for label in out[0]["labels"] if label != -100] == [1]
    with pytest.raises(ValueError, match="completions"):
        prepare_prm_dataset(
            data.remove_columns("completions"), tiny_tokenizer, args, placeholder_token_id=None, step_label_ids=(1, 0)
        )


def test_collator_pads_right():
    batch = PRMDataCollator(pad_token_id=1)(
        [{"input_ids": [5, 6], "labels": [-100, 1]}, {"input_ids": [7], "labels": [0]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6], [7, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert batch["labels"].tolist() == [[-100, 1], [0, -100]]


def test_toy_dataset_labels_follow_the_first_wrong_step():
    data = kit.prm_dataset(n=64, seed=3)
    for prompt, steps, labels in zip(data["prompt"], data["completions"], data["labels"]):
        a, b, c = (int(x) for x in prompt.removeprefix("What is ").removesuffix("?").split(" + "))
        first = int(steps[0].split(" = ")[1])
        second = int(steps[1].split(" = ")[1])
        answer = int(steps[2].removeprefix("The answer is ").removesuffix("."))
        ok = [first == a + b, second == first + c and labels[0], answer == a + b + c and labels[1]]
        assert labels == [bool(x) for x in ok]
    assert 0 < sum(all(row) for row in data["labels"]) < 64


# ------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"reward_tokens": ["+"]}, "two different tokens"),
        ({"reward_tokens": ["+", "+"]}, "two different tokens"),
        ({"step_separator": ""}, "marker"),
        ({"max_length": 0}, "max_length"),
    ],
)
def test_config_rejects_bad_options(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        prm_args(tmp_path, **overrides)


def test_trainer_rejects_mismatched_models(tmp_path, tiny_tokenizer, tiny_gpt_neox_dir):
    from transformers import AutoModelForTokenClassification

    data = kit.prm_dataset(n=4)
    lm = kit.build_causal_lm(tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match="reward_tokens"):
        PRMTrainer(lm, args=prm_args(tmp_path), train_dataset=data, processing_class=tiny_tokenizer)
    three = AutoModelForTokenClassification.from_pretrained(tiny_gpt_neox_dir, num_labels=3)
    with pytest.raises(ValueError, match="num_labels=2"):
        PRMTrainer(three, args=prm_args(tmp_path), train_dataset=data, processing_class=tiny_tokenizer)
    with pytest.raises(ValueError, match="exactly one"):
        PRMTrainer(
            lm,
            args=prm_args(tmp_path, reward_tokens=[" + -", "-"]),
            train_dataset=data,
            processing_class=tiny_tokenizer,
        )


# ------------------------------------------------------------------------------------------------------ trainer
def test_token_classifier_loss_equals_cross_entropy_at_the_step_markers(tmp_path, tiny_tokenizer, token_classifier):
    trainer = PRMTrainer(
        token_classifier, args=prm_args(tmp_path), train_dataset=kit.prm_dataset(n=8), processing_class=tiny_tokenizer
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss = trainer.compute_loss(trainer.model, batch)

    logits = token_classifier(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    counted = batch["labels"] != -100
    assert counted.sum() == 12  # 4 solutions × 3 steps
    assert (batch["input_ids"][counted] == tiny_tokenizer.encode("\n")[0]).all()
    expected = F.cross_entropy(logits[counted], batch["labels"][counted])
    torch.testing.assert_close(loss, expected)


def test_causal_lm_loss_reads_the_reward_tokens_at_the_placeholder(tmp_path):
    tokenizer = kit.build_tokenizer()
    tokenizer.add_tokens(["<step>"], special_tokens=True)
    model = kit.build_causal_lm(tokenizer=tokenizer)  # vocabulary includes <step>
    args = prm_args(tmp_path, reward_tokens=["+", "-"], placeholder_token="<step>")
    trainer = PRMTrainer(model, args=args, train_dataset=kit.prm_dataset(n=8), processing_class=tokenizer)
    plus, minus, step = (tokenizer.convert_tokens_to_ids(t) for t in ("+", "-", "<step>"))
    assert trainer.reward_token_ids == [plus, minus] and trainer.placeholder_token_id == step

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    counted = batch["labels"] != -100
    assert (batch["input_ids"][counted] == step).all() and counted.sum() == (batch["input_ids"] == step).sum()
    assert set(batch["labels"][counted].tolist()) <= {plus, minus}
    loss = trainer.compute_loss(trainer.model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    target = (batch["labels"][counted] == minus).long()  # index 0 = "+" (correct), 1 = "-"
    expected = F.cross_entropy(logits[counted][:, [plus, minus]], target)
    torch.testing.assert_close(loss, expected)

    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_evaluate_reports_step_accuracy_and_loss_of_a_fixed_classifier(tmp_path, tiny_tokenizer, token_classifier):
    """A head that always says "correct" with logits (0, 1): accuracy = share of correct steps, loss by hand."""
    from datasets import Dataset

    with torch.no_grad():
        token_classifier.classifier.weight.zero_()
        token_classifier.classifier.bias.copy_(torch.tensor([0.0, 1.0]))
    data = Dataset.from_dict(
        {
            "prompt": ["What is 1 + 1?", "What is 2 + 2?"],
            "completions": [["1 + 1 = 2", "2 + 0 = 2", "The answer is 3."], ["2 + 2 = 5", "5 + 0 = 5", "So 5."]],
            "labels": [[True, True, False], [False, False, False]],
        }
    )
    trainer = PRMTrainer(
        token_classifier, args=prm_args(tmp_path), train_dataset=data, processing_class=tiny_tokenizer
    )
    metrics = trainer.evaluate(eval_dataset=data)
    assert metrics["eval_num_steps"] == 6
    assert metrics["eval_accuracy"] == pytest.approx(2 / 6)
    loss_correct, loss_wrong = math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0))
    assert metrics["eval_loss"] == pytest.approx((2 * loss_correct + 4 * loss_wrong) / 6, rel=1e-5)


def test_training_changes_the_classifier_and_saves_a_loadable_model(tmp_path, tiny_tokenizer, token_classifier):
    from transformers import AutoModelForTokenClassification

    args = prm_args(tmp_path, max_steps=4)
    trainer = PRMTrainer(
        token_classifier, args=args, train_dataset=kit.prm_dataset(n=16), processing_class=tiny_tokenizer
    )
    before = {name: p.detach().clone() for name, p in token_classifier.named_parameters()}
    trainer.train()
    changed = [name for name, p in token_classifier.named_parameters() if not torch.equal(p, before[name])]
    assert "classifier.weight" in changed and any(name.startswith("gpt_neox.") for name in changed)
    logged = [h for h in trainer.state.log_history if "accuracy" in h]
    assert len(logged) == 4 and all(0 <= h["accuracy"] <= 1 and h["num_steps"] == 12 for h in logged)

    trainer.save_model(str(tmp_path / "saved"))
    loaded, info = AutoModelForTokenClassification.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and loaded.config.num_labels == 2
    ids = torch.tensor([tiny_tokenizer.encode("1 + 2 = 3\n")])
    torch.testing.assert_close(loaded(input_ids=ids).logits, token_classifier.eval()(input_ids=ids).logits)


# ------------------------------------------------------------------------------------------------------- recipe
@pytest.fixture(scope="module")
def recipe_module():
    yield from loaded_script(RECIPE)


def test_recipe_help_lists_the_options(recipe_module):
    text = recipe_module.make_parser().format_help()
    for option in (
        "--config",
        "--model_name_or_path",
        "--dataset_name",
        "--step_separator",
        "--placeholder_token",
        "--reward_tokens",
        "--train_on_last_step_only",
        "--max_completion_length",
        "--use_peft",
    ):
        assert option in text


def test_recipe_yaml_parses_with_overrides(recipe_module, tmp_path, monkeypatch):
    monkeypatch.chdir(placeholder_model_folders(tmp_path, "outputs/tiny/policy"))
    _, args, model_args = recipe_module.make_parser().parse_args_and_config(
        ["--config", str(TINY_YAML), "--output_dir", str(tmp_path), "--reward_tokens", "+", "-"]
    )
    assert args.reward_tokens == ["+", "-"] and args.step_separator == "\n" and args.bf16 is False
    assert model_args.model_name_or_path == "outputs/tiny/policy" and args.output_dir == str(tmp_path)


def test_recipe_trains_and_saves(tiny_workdir):
    """`python recipes/prm.py --config examples/prm_tiny.yaml` (2 steps) on the tiny kit's policy backbone."""
    from transformers import AutoModelForTokenClassification

    kit.prm_dataset(n=16).to_json(str(tiny_workdir / "outputs" / "tiny" / "prm.jsonl"))
    proc = run([sys.executable, str(RECIPE), "--config", str(TINY_YAML), "--max_steps", "2"], cwd=tiny_workdir)
    assert "Trained 2 PRM steps on 1 process" in proc.stdout
    model = AutoModelForTokenClassification.from_pretrained(tiny_workdir / "outputs" / "prm-tiny")
    assert model.config.num_labels == 2


def test_recipe_trains_a_causal_lm_prm_with_a_new_placeholder(recipe_module, tiny_gpt_neox_dir, tmp_path, capsys):
    """`--reward_tokens + - --placeholder_token <step>` in-process: the placeholder is added to the tokenizer (the
    embeddings resized) and the saved causal LM and tokenizer know it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "prm.jsonl"
    kit.prm_dataset(n=8).to_json(str(data))
    out = tmp_path / "prm-lm"
    argv = [
        "--config",
        str(TINY_YAML),
        "--model_name_or_path",
        tiny_gpt_neox_dir,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--reward_tokens",
        "+",
        "-",
        "--placeholder_token",
        "<step>",
        "--disable_tqdm",
        "true",
    ]
    recipe_module.main(*recipe_module.make_parser().parse_args_and_config(argv))
    assert "Added the placeholder '<step>'" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(tokenizer.encode("<step>", add_special_tokens=False)) == 1
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == len(kit.build_tokenizer()) + 1
