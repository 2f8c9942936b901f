"""`recipes/sft.py` (TRL's SFTTrainer) and `recipes/reward.py` (TRL's RewardTrainer) with their tiny example YAMLs.

The documented runs go through a subprocess as a user runs them; the variants (LoRA, a BERT-style reward model) call
the recipe's `main` in-process, which runs the same code without paying the interpreter start-up again.
"""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest
import torch
from online_helpers import EXAMPLES, RECIPES, loaded_script, run

from trl_ext import testing as kit

SFT = RECIPES / "sft.py"
REWARD = RECIPES / "reward.py"
SFT_YAML = EXAMPLES / "sft_tiny.yaml"
REWARD_YAML = EXAMPLES / "reward_tiny.yaml"


@pytest.fixture(scope="module")
def sft_module():
    yield from loaded_script(SFT)


@pytest.fixture(scope="module")
def reward_module():
    yield from loaded_script(REWARD)


def run_in_process(module, *argv: str) -> None:
    """The recipe's `main` on parsed command-line arguments (as `python recipes/x.py argv...` would run it)."""
    module.main(*module.make_parser().parse_args_and_config(list(argv)))


def changed_parameters(model, initial) -> list[str]:
    return [
        name
        for (name, p), q in zip(model.named_parameters(), initial.parameters())
        if not torch.equal(p.float(), q.float())
    ]


def build_bert_reward_dir(path) -> str:
    """A tiny BERT-style reward model (1-label `BertForSequenceClassification`) with a word-level WordPiece
    tokenizer over the kit's preference texts. Like real BERT tokenizers it has sep/pad/cls tokens but no eos."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    data = kit.preference_dataset(n=64)
    texts = [t for row in data for t in (row["prompt"], row["chosen"], row["rejected"])]
    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]", t.lower())})
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tokenizer = BertTokenizer(vocab=vocab)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return kit.save_tiny_model(BertForSequenceClassification(config), tokenizer, path)


# ---------------------------------------------------------------------------------------------------------- SFT
def test_sft_help_lists_the_options(sft_module):
    text = sft_module.make_parser().format_help()
    for option in (
        "--config",
        "--model_name_or_path",
        "--dataset_name",
        "--completion_only_loss",
        "--max_length",
        "--packing",
        "--use_peft",
        "--lora_r",
        "--push_to_hub",
    ):
        assert option in text


def test_sft_recipe_trains_and_saves(tiny_workdir):
    """`python recipes/sft.py --config examples/sft_tiny.yaml` cut to 2 steps: a trained, loadable model."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_workdir / "outputs" / "tiny"
    kit.prompt_completion_dataset(n=16).to_json(str(tiny / "sft.jsonl"))
    proc = run([sys.executable, str(SFT), "--config", str(SFT_YAML), "--max_steps", "2"], cwd=tiny_workdir)
    assert "Trained 2 SFT steps on 1 process" in proc.stdout
    model, info = AutoModelForCausalLM.from_pretrained(tiny_workdir / "outputs" / "sft-tiny", output_loading_info=True)
    assert not info["missing_keys"]
    assert changed_parameters(model, AutoModelForCausalLM.from_pretrained(tiny / "policy"))


def test_sft_recipe_with_lora_saves_an_adapter(sft_module, tiny_gpt_neox_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    kit.prompt_completion_dataset(n=8).to_json(str(data))
    out = tmp_path / "sft-lora"
    run_in_process(
        sft_module,
        "--config",
        str(SFT_YAML),
        "--model_name_or_path",
        tiny_gpt_neox_dir,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--use_peft",
        "--lora_r",
        "4",
        "--disable_tqdm",
        "true",
    )
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["task_type"] == "CAUSAL_LM"


def test_sft_recipe_requires_a_model(sft_module, tmp_path):
    with pytest.raises(ValueError, match="--model_name_or_path"):
        run_in_process(
            sft_module, "--config", str(SFT_YAML), "--model_name_or_path", "", "--output_dir", str(tmp_path)
        )


# ------------------------------------------------------------------------------------------------------- reward
def test_reward_help_lists_the_options(reward_module):
    text = reward_module.make_parser().format_help()
    for option in (
        "--config",
        "--model_name_or_path",
        "--dataset_name",
        "--center_rewards_coefficient",
        "--eos_token",
        "--max_length",
        "--use_peft",
    ):
        assert option in text


def test_reward_recipe_trains_a_decoder_and_saves_a_loadable_reward_model(tiny_workdir):
    """`python recipes/reward.py --config examples/reward_tiny.yaml` cut to 2 steps, then `load_reward_model`."""
    from transformers import AutoModelForSequenceClassification

    from trl_ext.models import load_reward_model
    from trl_ext.models.reward import get_sequence_scores

    tiny = tiny_workdir / "outputs" / "tiny"
    kit.preference_dataset(n=16).to_json(str(tiny / "preferences.jsonl"))
    proc = run([sys.executable, str(REWARD), "--config", str(REWARD_YAML), "--max_steps", "2"], cwd=tiny_workdir)
    assert "Trained 2 reward-model steps on 1 process" in proc.stdout
    assert "Reward recipe:" not in proc.stderr  # a decoder tokenizer with eos and pad needs no change

    model, tokenizer = load_reward_model(tiny_workdir / "outputs" / "reward-tiny")
    changed = changed_parameters(model, AutoModelForSequenceClassification.from_pretrained(tiny / "reward"))
    assert "score.weight" in changed
    batch = tokenizer(["This man is a friend.", "This man is a"], return_tensors="pt", padding=True)
    with torch.no_grad():
        scores = get_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_reward_recipe_sets_eos_from_sep_for_a_bert_encoder(reward_module, tmp_path, caplog):
    from transformers import AutoModelForSequenceClassification

    from trl_ext.models import load_reward_model
    from trl_ext.models.reward import get_sequence_scores

    bert = build_bert_reward_dir(tmp_path / "bert")
    data = tmp_path / "preferences.jsonl"
    kit.preference_dataset(n=16).to_json(str(data))
    out = tmp_path / "bert-rm"
    with caplog.at_level(logging.WARNING, logger="trl_ext.recipes.reward"):
        run_in_process(
            reward_module,
            "--config",
            str(REWARD_YAML),
            "--model_name_or_path",
            bert,
            "--dataset_name",
            str(data),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--learning_rate",
            "1e-2",
            "--disable_tqdm",
            "true",
        )
    assert "eos_token set to the sep token '[SEP]'" in caplog.text
    assert "pad_token" not in caplog.text  # BERT already has [PAD]

    model, tokenizer = load_reward_model(out)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert tokenizer.eos_token == "[SEP]" and tokenizer.pad_token == "[PAD]"
    assert "classifier.weight" in changed_parameters(model, AutoModelForSequenceClassification.from_pretrained(bert))
    batch = tokenizer(["this man is a friend.", "this man is a fool."], return_tensors="pt", padding=True)
    with torch.no_grad():
        scores = get_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    assert scores.shape == (2,) and torch.isfinite(scores).all() and scores[0] != scores[1]


def test_fill_special_tokens(reward_module, tmp_path, tiny_tokenizer):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    bert_dir = build_bert_reward_dir(tmp_path / "bert")
    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    tokenizer.pad_token = None
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            intermediate_size=8,
            num_labels=1,
        )
    )
    changes = reward_module.fill_special_tokens(tokenizer, model)
    assert len(changes) == 2
    assert tokenizer.eos_token == tokenizer.pad_token == "[SEP]"
    assert model.config.eos_token_id == model.config.pad_token_id == tokenizer.sep_token_id

    decoder = kit.build_sequence_classifier(tokenizer=tiny_tokenizer)
    assert reward_module.fill_special_tokens(tiny_tokenizer, decoder) == []  # eos and pad present: untouched

    tokenizer.eos_token = tokenizer.sep_token = None
    with pytest.raises(ValueError, match="--eos_token"):
        reward_module.fill_special_tokens(tokenizer, model)


def test_reward_recipe_trains_the_score_head_under_lora(reward_module, tiny_gpt_neox_reward_dir, tmp_path):
    data = tmp_path / "preferences.jsonl"
    kit.preference_dataset(n=8).to_json(str(data))
    out = tmp_path / "rm-lora"
    run_in_process(
        reward_module,
        "--config",
        str(REWARD_YAML),
        "--model_name_or_path",
        tiny_gpt_neox_reward_dir,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--use_peft",
        "--disable_tqdm",
        "true",
    )
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS"
    assert "score" in (adapter.get("modules_to_save") or [])
