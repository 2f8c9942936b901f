"""Tests of `trl_ext.models.critic`: value models from causal LMs / reward models, and per-token values."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trl_ext import testing as kit
from trl_ext.models.critic import default_value_head_std, get_token_values, init_value_head, load_critic
from trl_ext.models.reward import ValueHeadRewardModel

TEXTS = ["This man is a jerk.", "The teacher reads an old book in the park.", "Hello"]


def _trunk_state(model) -> dict[str, torch.Tensor]:
    return getattr(model, model.base_model_prefix).state_dict()


@pytest.mark.parametrize("fixture", ["tiny_gpt_neox_dir", "tiny_llama_dir"])
def test_critic_from_causal_lm_folder(request, fixture, caplog):
    path = request.getfixturevalue(fixture)
    with caplog.at_level(logging.INFO, logger="trl_ext.models.critic"):
        critic = load_critic(path)
    assert "is NEW" in caplog.text  # the user is told the head is fresh
    lm = AutoModelForCausalLM.from_pretrained(path)
    lm_trunk, critic_trunk = _trunk_state(lm), _trunk_state(critic)
    assert lm_trunk.keys() == critic_trunk.keys()
    assert all(torch.equal(lm_trunk[k], critic_trunk[k]) for k in lm_trunk)
    assert critic.training and critic.dtype == torch.float32
    weight = critic.score.weight
    hidden = weight.shape[-1]
    assert weight.shape == (1, hidden) and critic.score.bias is None
    # 64 draws of N(0, 1/(h+1)): the sample std is within ±40% of 1/sqrt(65) ≈ 0.124 with overwhelming probability.
    assert 0.6 < weight.std().item() / (1 / math.sqrt(hidden + 1)) < 1.4
    assert abs(weight.mean().item()) < 3 * (1 / math.sqrt(hidden + 1)) / math.sqrt(hidden)


def test_init_value_head_statistics_and_override(tiny_gpt_neox_dir):
    head = nn.Linear(4095, 1)
    assert init_value_head(head) == pytest.approx(1 / 64)
    assert head.weight.std().item() == pytest.approx(1 / 64, rel=0.05)  # 4095 draws: ~1% standard error
    assert torch.all(head.bias == 0)
    assert default_value_head_std(63) == pytest.approx(0.125)
    critic = load_critic(tiny_gpt_neox_dir, value_head_init_std=1.0)
    assert critic.score.weight.std().item() > 0.6  # the override is used, not 1/sqrt(65)
    with pytest.raises(ValueError, match="> 0"):
        init_value_head(head, std=0.0)


def test_critic_from_reward_folder_keeps_head(tiny_reward_dir, tiny_llama_reward_dir):
    for path in (tiny_reward_dir, tiny_llama_reward_dir):
        critic = load_critic(path)
        on_disk = load_file(os.path.join(path, "model.safetensors"))["score.weight"]
        assert torch.equal(critic.score.weight, on_disk)


def test_critic_from_model_objects():
    tok = kit.build_tokenizer()
    lm = kit.build_causal_lm("llama", tokenizer=tok)
    critic = load_critic(lm, value_head_init_std=0.5)
    assert type(critic).__name__ == "LlamaForSequenceClassification"
    assert all(torch.equal(a, b) for a, b in zip(_trunk_state(lm).values(), _trunk_state(critic).values()))
    critic.model.embed_tokens.weight.data.add_(1.0)  # a copy: training the critic does not touch the policy
    assert not torch.equal(critic.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    rm = kit.build_sequence_classifier("gpt_neox", tokenizer=tok)
    assert load_critic(rm) is rm
    with pytest.raises(ValueError, match="single-output"):
        load_critic(kit.build_sequence_classifier("gpt_neox", tokenizer=tok, num_labels=2))


def test_critic_default_dtype_float32_and_value_head_checkpoint(tmp_path):
    tok = kit.build_tokenizer()
    kit.save_tiny_model(kit.build_causal_lm("gpt_neox", tokenizer=tok).to(torch.bfloat16), tok, tmp_path / "bf16")
    assert load_critic(tmp_path / "bf16").dtype == torch.float32
    # OpenRLHF critic layout: backbone + `value_head.weight`.
    kit.save_tiny_model(kit.build_causal_lm("gpt_neox", tokenizer=tok), tok, tmp_path / "orlhf")
    file = os.path.join(tmp_path / "orlhf", "model.safetensors")
    head = torch.full((1, 64), 0.01)
    save_file({**load_file(file), "value_head.weight": head}, file, metadata={"format": "pt"})
    critic = load_critic(tmp_path / "orlhf", value_head_prefix="value_head")
    assert isinstance(critic, ValueHeadRewardModel) and torch.equal(critic.score.weight, head)


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_get_token_values(arch):
    tok = kit.build_tokenizer()
    critic = load_critic(kit.build_causal_lm(arch, tokenizer=tok))
    rows = [tok(t)["input_ids"] for t in TEXTS]
    width = max(map(len, rows))
    right = tok(TEXTS, padding=True, return_tensors="pt")
    tok.padding_side = "left"
    left = tok(TEXTS, padding=True, return_tensors="pt")
    values_right = get_token_values(critic, right["input_ids"], right["attention_mask"])
    values_left = get_token_values(critic, left["input_ids"], left["attention_mask"])
    assert values_right.shape == (3, width) and values_right.dtype == torch.float32
    trunk = getattr(critic, critic.base_model_prefix)
    for b, row in enumerate(rows):
        n = len(row)
        with torch.no_grad():  # hand expectation: the head on every hidden state of the unpadded row
            expected = critic.score(trunk(input_ids=torch.tensor([row])).last_hidden_state)[0, :, 0]
        torch.testing.assert_close(values_right[b, :n].detach(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values_left[b, width - n :].detach(), expected, atol=1e-5, rtol=1e-5)
        assert torch.all(values_right[b, n:] == 0) and torch.all(values_left[b, : width - n] == 0)
    values_right.sum().backward()  # the critic is trainable through its values
    assert critic.score.weight.grad is not None and critic.score.weight.grad.abs().sum() > 0


def test_token_values_from_a_reward_model_match_its_sequence_score(tiny_reward_dir):
    from trl_ext.models.reward import get_sequence_scores

    critic = load_critic(tiny_reward_dir)
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir)
    tok = kit.build_tokenizer()
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        values = get_token_values(critic, batch["input_ids"], batch["attention_mask"])
        scores = get_sequence_scores(reference, batch["input_ids"], batch["attention_mask"])
    last = batch["attention_mask"].sum(-1) - 1
    torch.testing.assert_close(values[torch.arange(3), last], scores, atol=1e-5, rtol=1e-5)
