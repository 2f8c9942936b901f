"""Merging LoRA adapters (`trl_ext.inference.merge`, `recipes/merge_lora.py`): the merged checkpoint, loaded without
PEFT, computes what the adapted model computed, for a causal LM and for a reward model."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from online_helpers import RECIPES, assert_help_lists, run

from trl_ext.inference import detect_model_kind, merge_lora
from trl_ext.models import apply_lora, get_sequence_scores

RECIPE = RECIPES / "merge_lora.py"


def perturb_adapter(peft_model, scale: float = 0.2) -> None:
    """Give every LoRA matrix (and the trained head copy) non-zero random values: a fresh adapter is the identity."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.add_(scale * torch.randn(param.shape, generator=generator))


def batch(tokenizer):
    tokenizer.padding_side = "right"
    return tokenizer(["Question: hi Answer: hello there", "a b"], return_tensors="pt", padding=True)


@pytest.fixture
def causal_adapter(tiny_gpt_neox_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_gpt_neox_dir)
    peft_model = apply_lora(base, r=4)
    perturb_adapter(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    return peft_model.eval(), AutoTokenizer.from_pretrained(tiny_gpt_neox_dir), tmp_path / "adapter"


@pytest.fixture
def reward_adapter(tiny_reward_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir)
    peft_model = apply_lora(base, r=4)
    perturb_adapter(peft_model)
    peft_model.save_pretrained(tmp_path / "rm_adapter")
    return peft_model.eval(), AutoTokenizer.from_pretrained(tiny_reward_dir), tmp_path / "rm_adapter"


def test_merged_causal_lm_matches_the_adapted_model(causal_adapter, tiny_gpt_neox_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    peft_model, tokenizer, adapter = causal_adapter
    inputs = batch(tokenizer)
    with torch.no_grad():
        expected = peft_model(**inputs).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(**inputs).logits
    assert not torch.allclose(expected, base_logits, atol=1e-3)  # the adapter really changes the outputs

    merge_lora(adapter, tmp_path / "merged")  # base and kind read from the adapter config
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(**inputs).logits, expected, atol=1e-5, rtol=0)
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_merged_reward_model_matches_the_adapted_model(reward_adapter, tmp_path):
    from trl_ext.models import load_reward_model

    peft_model, tokenizer, adapter = reward_adapter
    inputs = batch(tokenizer)
    with torch.no_grad():
        expected = get_sequence_scores(peft_model, inputs["input_ids"], inputs["attention_mask"])
        with peft_model.disable_adapter():
            base_scores = get_sequence_scores(peft_model, inputs["input_ids"], inputs["attention_mask"])
    assert not torch.allclose(expected, base_scores, atol=1e-3)

    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    merge_lora(adapter, tmp_path / "merged_rm")
    merged, _ = load_reward_model(tmp_path / "merged_rm")  # a plain 1-label classifier now
    with torch.no_grad():
        got = get_sequence_scores(merged, inputs["input_ids"], inputs["attention_mask"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_reward_adapter_on_a_causal_lm_base_needs_a_saved_head(tiny_gpt_neox_dir, tmp_path):
    """A reward adapter trained from a causal LM carries its score head; one without a head is refused, since the
    merged model would score with a random head."""
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(tiny_gpt_neox_dir, num_labels=1)
    with_head = apply_lora(base, r=4, task_type="SEQ_CLS")
    with_head.save_pretrained(tmp_path / "with_head")  # SEQ_CLS: PEFT saves the score head
    merge_lora(tmp_path / "with_head", tmp_path / "ok", base_model_name_or_path=tiny_gpt_neox_dir)
    assert (tmp_path / "ok" / "config.json").is_file()

    from safetensors.torch import load_file, save_file

    weights = tmp_path / "with_head" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    assert any(".score." in k for k in tensors)
    save_file({k: v for k, v in tensors.items() if ".score." not in k}, str(weights))  # an adapter without its head
    with pytest.raises(ValueError, match="random head"):
        merge_lora(tmp_path / "with_head", tmp_path / "bad", base_model_name_or_path=tiny_gpt_neox_dir)


def test_model_kind_detection():
    assert detect_model_kind({"task_type": "CAUSAL_LM"}) == "causal_lm"
    assert detect_model_kind({"task_type": "SEQ_CLS"}) == "seq_cls"
    rm_config = type("C", (), {"architectures": ["LlamaForSequenceClassification"]})()
    assert detect_model_kind({}, rm_config) == "seq_cls"
    assert detect_model_kind({}, type("C", (), {"architectures": ["LlamaForCausalLM"]})()) == "causal_lm"
    with pytest.raises(ValueError, match="TOKEN_CLS"):
        detect_model_kind({"task_type": "TOKEN_CLS"})


def test_bad_inputs_are_refused(tmp_path, causal_adapter):
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        merge_lora(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="hub_model_id"):
        merge_lora(causal_adapter[2], tmp_path / "out", push_to_hub=True)
    config = json.loads((causal_adapter[2] / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (causal_adapter[2] / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--base_model_name_or_path"):
        merge_lora(causal_adapter[2], tmp_path / "out")


def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--adapter_path", "--base_model_name_or_path", "--output_dir", "--model_kind", "--dtype",
        "--push_to_hub", "--hub_model_id",
    ))  # fmt: skip


def test_recipe_merges_an_adapter(causal_adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    peft_model, tokenizer, adapter = causal_adapter
    proc = run([sys.executable, str(RECIPE), "--adapter_path", str(adapter), "--output_dir", str(tmp_path / "m")])
    assert "saved to" in proc.stdout
    inputs = batch(tokenizer)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        torch.testing.assert_close(merged(**inputs).logits, peft_model(**inputs).logits, atol=1e-5, rtol=0)
