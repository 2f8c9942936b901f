"""The dataset options every recipe shares (`trl_ext.data.mixture`, `trl_ext.cli.train_and_eval_splits`) and
conditional SFT (`recipes/sft.py --csft_prompt`)."""

from __future__ import annotations

import json
import logging
import math

import pytest
from datasets import Dataset
from online_helpers import EXAMPLES, RECIPES, loaded_script

from trl_ext import cli
from trl_ext import testing as kit
from trl_ext.data import (
    apply_input_template,
    mix_datasets,
    normalize_probs,
    prefix_inputs,
    select_first,
    to_conversational,
)


def rows(tag: str, n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{tag}{i}" for i in range(n)], "completion": ["x"] * n})


def write_jsonl(path, tag: str, n: int) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{tag}{i}", "completion": f" answer {i}."}) + "\n")
    return str(path)


class TrainingArgs:
    """What `train_and_eval_splits` reads of a training config."""

    def __init__(self, seed: int = 0, eval_strategy: str = "no"):
        self.seed, self.eval_strategy = seed, eval_strategy


# ------------------------------------------------------------------------------------------------------ mixtures
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixture_proportions_within_a_binomial_tolerance(seed):
    n, p = 2000, 0.8
    mixed = mix_datasets([rows("a", 3000), rows("b", 3000)], [p, 1 - p], seed=seed, max_samples=n)
    assert len(mixed) == n
    from_a = sum(prompt.startswith("a") for prompt in mixed["prompt"])
    assert abs(from_a - n * p) <= 4 * math.sqrt(n * p * (1 - p)), from_a  # ±4 sd: fails with probability < 1e-4


def test_mixture_keeps_each_dataset_in_order_and_is_seeded():
    first = mix_datasets([rows("a", 50), rows("b", 50)], [0.5, 0.5], seed=3)
    again = mix_datasets([rows("a", 50), rows("b", 50)], [0.5, 0.5], seed=3)
    other = mix_datasets([rows("a", 50), rows("b", 50)], [0.5, 0.5], seed=4)
    assert first["prompt"] == again["prompt"] and first["prompt"] != other["prompt"]
    a_rows = [int(p[1:]) for p in first["prompt"] if p.startswith("a")]
    assert a_rows == list(range(len(a_rows)))


def test_stopping_strategies():
    short, long = rows("a", 5), rows("b", 40)
    first = mix_datasets([short, long], [0.5, 0.5], seed=0)  # ends when "a" runs out: no repeats
    assert sum(p.startswith("a") for p in first["prompt"]) == 5 and len(set(first["prompt"])) == len(first)
    every = mix_datasets([short, long], [0.5, 0.5], seed=0, stopping_strategy="all_exhausted")
    assert {f"b{i}" for i in range(40)} <= set(every["prompt"])  # "a" repeats until "b" is used up


def test_probs_are_normalised_with_a_note_and_zero_leaves_a_dataset_out(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_ext.data.mixture"):
        assert normalize_probs([4, 1], 2) == [0.8, 0.2]
    assert "normalised" in caplog.text
    assert normalize_probs(None, 4) == [0.25] * 4
    only_b = mix_datasets([rows("a", 10), rows("b", 10)], [0.0, 1.0], max_samples=4)
    assert only_b["prompt"] == ["b0", "b1", "b2", "b3"]


@pytest.mark.parametrize(
    ("probs", "match"),
    [
        ([0.5], "1 values for 2 datasets"),
        ([0.5, -0.1], "non-negative"),
        ([0, 0], "all zero"),
        ([1, math.nan], "finite"),
    ],
)
def test_bad_probabilities_are_refused(probs, match):
    with pytest.raises(ValueError, match=match):
        mix_datasets([rows("a", 3), rows("b", 3)], probs)


def test_datasets_with_different_columns_are_refused_naming_them():
    other = Dataset.from_dict({"text": ["t"]})
    with pytest.raises(ValueError, match=r"same columns.*dataset 1: \['text'\]"):
        mix_datasets([rows("a", 3), other])
    with pytest.raises(ValueError, match="stopping_strategy"):
        mix_datasets([rows("a", 3), rows("b", 3)], stopping_strategy="never")
    with pytest.raises(ValueError, match="at least one"):
        mix_datasets([])


def test_max_samples_keeps_the_first_rows():
    data = rows("a", 10)
    assert select_first(data, 3)["prompt"] == ["a0", "a1", "a2"]
    assert len(select_first(data, 100)) == 10 and select_first(data, None) is data
    assert len(mix_datasets([data], max_samples=4)) == 4
    with pytest.raises(ValueError, match="at least 1"):
        select_first(data, 0)


# ------------------------------------------------------------------------------------------ templates and chats
def test_input_template_formats_the_column():
    out = apply_input_template(rows("a", 2), "User: {}\nAssistant: ", "prompt")
    assert out["prompt"] == ["User: a0\nAssistant: ", "User: a1\nAssistant: "] and out["completion"] == ["x", "x"]


@pytest.mark.parametrize("template", ["no placeholder", "{} and {}", "{name}", "{0}", "unclosed {"])
def test_input_template_needs_exactly_one_placeholder(template):
    with pytest.raises(ValueError, match="input_template"):
        apply_input_template(rows("a", 1), template)


def test_input_template_names_the_columns_found_and_refuses_chats():
    with pytest.raises(ValueError, match=r"has the columns \['prompt', 'completion'\]"):
        apply_input_template(rows("a", 1), "Q: {}", "question")
    with pytest.raises(ValueError, match="chat"):
        apply_input_template(kit.prompt_dataset(conversational=True, n=2), "Q: {}")


def test_to_conversational_wraps_prompts_and_completions():
    chats = to_conversational(rows("a", 2))
    assert chats[0]["prompt"] == [{"role": "user", "content": "a0"}]
    assert chats[0]["completion"] == [{"role": "assistant", "content": "x"}]
    pairs = to_conversational(Dataset.from_dict({"prompt": ["q"], "chosen": ["good"], "rejected": ["bad"]}))
    assert pairs[0]["rejected"] == [{"role": "assistant", "content": "bad"}]
    already = kit.prompt_dataset(conversational=True, n=2)
    assert to_conversational(already)["prompt"] == already["prompt"]
    with pytest.raises(ValueError, match=r"columns \['text'\]"):
        to_conversational(Dataset.from_dict({"text": ["plain language modelling"]}))


def test_prefix_inputs_on_every_format():
    assert prefix_inputs(rows("a", 1), "<good> ")["prompt"] == ["<good> a0"]
    assert prefix_inputs(Dataset.from_dict({"text": ["hi"]}), "<good> ")["text"] == ["<good> hi"]
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    out = prefix_inputs(Dataset.from_dict({"messages": [messages]}), "<good> ")["messages"][0]
    assert [m["content"] for m in out] == ["Be kind.", "<good> hi"]
    chat_prompts = prefix_inputs(kit.prompt_dataset(conversational=True, n=1), "<good> ")
    assert chat_prompts[0]["prompt"][0]["content"].startswith("<good> ")
    with pytest.raises(ValueError, match=r"'prompt', 'text' or 'messages'.*\['question'\]"):
        prefix_inputs(Dataset.from_dict({"question": ["q"]}), "<good> ")


# ------------------------------------------------------------------------------------------------ script options
def test_script_arguments_validate_the_options():
    Args = cli.DatasetScriptArguments
    with pytest.raises(ValueError, match="not both"):
        Args(dataset_name="a.jsonl", dataset_mixture=["b.jsonl"])
    with pytest.raises(ValueError, match="--dataset_mixture"):
        Args(dataset_name="a.jsonl", dataset_probs=[1.0])
    with pytest.raises(ValueError, match="2 values for 3 datasets"):
        Args(dataset_mixture=["a", "b", "c"], dataset_probs=[0.5, 0.5])
    with pytest.raises(ValueError, match="max_samples"):
        Args(dataset_name="a.jsonl", max_samples=0)
    with pytest.raises(ValueError, match="placeholder"):
        Args(dataset_name="a.jsonl", input_template="User: ")
    assert Args(dataset_name="a", input_template="User: {}\\nAssistant: ").input_template == "User: {}\nAssistant: "
    assert issubclass(cli.RewardScriptArguments, Args)


def test_train_and_eval_splits_mixes_files_and_applies_the_template(tmp_path, tiny_tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", "a", 400)
    b = write_jsonl(tmp_path / "b.jsonl", "b", 400)
    args = cli.DatasetScriptArguments(
        dataset_mixture=[a, b], dataset_probs=[3, 1], max_samples=200, input_template="Q: {} A:"
    )
    train, evaluation = cli.train_and_eval_splits(args, TrainingArgs(seed=0))
    assert len(train) == 200 and evaluation is None
    assert all(p.startswith(("Q: a", "Q: b")) and p.endswith(" A:") for p in train["prompt"])
    from_a = sum(p.startswith("Q: a") for p in train["prompt"])
    assert abs(from_a - 150) <= 4 * math.sqrt(200 * 0.75 * 0.25)

    chat_args = cli.DatasetScriptArguments(dataset_name=a, max_samples=3, apply_chat_template=True)
    train, _ = cli.train_and_eval_splits(chat_args, TrainingArgs(), tiny_tokenizer)
    assert (
        train[0]["prompt"] == [{"role": "user", "content": "a0"}] and train[0]["completion"][0]["role"] == "assistant"
    )
    with pytest.raises(ValueError, match="tokenizer"):
        cli.train_and_eval_splits(chat_args, TrainingArgs())
    tiny_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        cli.train_and_eval_splits(chat_args, TrainingArgs(), tiny_tokenizer)


def test_train_and_eval_splits_concatenates_the_mixtures_test_splits(tmp_path):
    folders = []
    for tag in ("a", "b"):
        folder = tmp_path / tag
        from datasets import DatasetDict

        DatasetDict({"train": rows(tag, 20), "test": rows(f"{tag}-test", 3)}).save_to_disk(str(folder))
        folders.append(str(folder))
    args = cli.DatasetScriptArguments(dataset_mixture=folders, input_template="> {}")
    train, evaluation = cli.train_and_eval_splits(args, TrainingArgs(eval_strategy="steps"))
    assert sorted(evaluation["prompt"]) == sorted(f"> {t}-test{i}" for t in "ab" for i in range(3))
    assert len(train) >= 20


# ---------------------------------------------------------------------------------------------------- recipes
@pytest.fixture(scope="module")
def sft_recipe():
    yield from loaded_script(RECIPES / "sft.py")


MIXTURE_ARGV = "--dataset_mixture a.jsonl b.jsonl --dataset_probs 0.5 0.5 --max_samples 8".split() + [
    "--input_template",
    "User: {}\\nAssistant: ",  # as a shell passes it: backslash + n
]


@pytest.mark.parametrize("recipe_name", ["sft.py", "dpo.py", "harmlessness.py", "ppo.py", "reward.py"])
def test_recipes_parse_a_dataset_mixture(recipe_name, tmp_path):
    for module in loaded_script(RECIPES / recipe_name):
        script_args, *_ = module.make_parser().parse_args_and_config(
            [*MIXTURE_ARGV, "--output_dir", str(tmp_path), "--bf16", "false"]
        )
        assert script_args.dataset_mixture == ["a.jsonl", "b.jsonl"] and script_args.dataset_probs == [0.5, 0.5]
        assert script_args.max_samples == 8 and script_args.input_template == "User: {}\nAssistant: "
        assert script_args.dataset_name is None


def test_a_yaml_config_sets_the_mixture(sft_recipe, tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text("dataset_mixture: [a.jsonl, b.jsonl]\ndataset_probs: [0.9, 0.1]\ncsft_prompt: '<good> '\n")
    script_args, *_ = sft_recipe.make_parser().parse_args_and_config(
        ["--config", str(config), "--output_dir", str(tmp_path), "--bf16", "false"]
    )
    assert script_args.dataset_mixture == ["a.jsonl", "b.jsonl"] and script_args.dataset_probs == [0.9, 0.1]
    assert script_args.csft_prompt == "<good> "


def test_sft_help_lists_the_dataset_options(sft_recipe):
    text = sft_recipe.make_parser().format_help()
    for option in ("--dataset_mixture", "--dataset_probs", "--max_samples", "--input_template", "--input_key",
                   "--apply_chat_template", "--mixture_stopping_strategy", "--csft_prompt"):  # fmt: skip
        assert option in text, option


@pytest.mark.parametrize("conversational", [False, True], ids=["prompt_completion", "chat"])
def test_csft_prompts_appear_in_the_tokenised_inputs(sft_recipe, tiny_gpt_neox_dir, tmp_path, conversational):
    from trl import SFTTrainer

    from trl_ext.models import load_causal_lm

    data = tmp_path / "sft.jsonl"
    kit.prompt_completion_dataset(conversational=conversational, n=6).to_json(str(data))
    script_args, training_args, model_args = sft_recipe.make_parser().parse_args_and_config(
        [
            "--config",
            str(EXAMPLES / "sft_tiny.yaml"),
            "--model_name_or_path",
            tiny_gpt_neox_dir,
            "--dataset_name",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
            "--csft_prompt",
            "<good> ",
        ]  # fmt: skip
    )
    tokenizer = cli.load_tokenizer(tiny_gpt_neox_dir, model_args)
    train_dataset, _ = sft_recipe.sft_datasets(script_args, training_args, tokenizer)
    trainer = SFTTrainer(
        model=load_causal_lm(tiny_gpt_neox_dir),
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )
    texts = [tokenizer.decode(ids) for ids in trainer.train_dataset["input_ids"]]
    assert len(texts) == 6
    expected = "<|im_start|>user\n<good> " if conversational else "<good> "
    assert all(expected in text for text in texts), texts[0]
    if not conversational:
        assert all(text.startswith("<good> ") for text in texts)
        labels = trainer.train_dataset[0]["labels"]  # the prefix is part of the prompt: no loss on it
        assert labels[0] == -100


def test_sft_recipe_trains_on_a_templated_csft_mixture(sft_recipe, tiny_gpt_neox_dir, tmp_path):
    """`recipes/sft.py` end to end (1 step) with every shared option and a CSFT prefix."""
    a = write_jsonl(tmp_path / "a.jsonl", "a", 40)
    b = write_jsonl(tmp_path / "b.jsonl", "b", 40)
    out = tmp_path / "out"
    config = tmp_path / "sft.yaml"  # examples/sft_tiny.yaml without its dataset_name
    lines = (EXAMPLES / "sft_tiny.yaml").read_text().splitlines()
    config.write_text("\n".join(line for line in lines if not line.startswith("dataset_name")))
    argv = ["--config", str(config), "--model_name_or_path", tiny_gpt_neox_dir,
            "--dataset_mixture", a, b, "--dataset_probs", "0.7", "0.3",
            "--max_samples", "16", "--input_template", "User: {}\\nAssistant:", "--apply_chat_template",
            "--csft_prompt", "<good> ", "--output_dir", str(out), "--max_steps", "1"]  # fmt: skip
    sft_recipe.main(*sft_recipe.make_parser().parse_args_and_config(argv))
    assert (out / "model.safetensors").is_file()
