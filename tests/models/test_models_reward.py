"""Tests of `trl_ext.models.reward`: loading reward models, normalisation at the score head, last-token reading."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForSequenceClassification

from trl_ext import testing as kit
from trl_ext.models import quantization
from trl_ext.models.reward import (
    ValueHeadRewardModel,
    clear_reward_normalization,
    get_reward_normalization,
    get_sequence_scores,
    get_token_scores,
    load_reward_model,
    score_head,
    set_reward_normalization,
)

TEXTS = ["This man is a jerk.", "The teacher reads an old book in the park.", "Hello"]


def _backbone(model):
    return getattr(model, model.base_model_prefix)


def _manual_score(model, ids: list[int]) -> float:
    """Score of ONE unpadded sequence, computed by hand: score head on the last hidden state."""
    with torch.no_grad():
        hidden = _backbone(model)(input_ids=torch.tensor([ids])).last_hidden_state
        return float(model.score(hidden[0, -1]).squeeze())


def _pad(rows: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        fill = [pad_id] * (width - len(row))
        ids.append(row + fill if side == "right" else fill + row)
        mask.append([1] * len(row) + [0] * len(fill) if side == "right" else [0] * len(fill) + [1] * len(row))
    return torch.tensor(ids), torch.tensor(mask)


def _write_openrlhf_checkpoint(path, arch="gpt_neox", prefix="value_head", config_extra=None, seed=0) -> torch.Tensor:
    """Save a causal LM and add a `<prefix>.weight` head tensor to its safetensors file (OpenRLHF layout)."""
    tok = kit.build_tokenizer()
    kit.save_tiny_model(kit.build_causal_lm(arch, tokenizer=tok), tok, path)
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(1, 64, generator=gen)
    weights = load_file(os.path.join(path, "model.safetensors"))
    save_file(
        {**weights, f"{prefix}.weight": head}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"}
    )
    if config_extra:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.update(config_extra)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return head


# ------------------------------------------------------------------------------------------------------- loading
@pytest.mark.parametrize("fixture", ["tiny_reward_dir", "tiny_llama_reward_dir"])
def test_load_sequence_classifier(request, fixture):
    path = request.getfixturevalue(fixture)
    model, tok = load_reward_model(path)
    reference = AutoModelForSequenceClassification.from_pretrained(path)
    assert not model.training and model.dtype == torch.float32 and model.config.num_labels == 1
    assert torch.equal(model.score.weight, reference.score.weight)
    ids = tok(TEXTS[0])["input_ids"]
    batch = tok([TEXTS[0]], return_tensors="pt")
    assert get_sequence_scores(model, batch["input_ids"], batch["attention_mask"]).item() == pytest.approx(
        _manual_score(model, ids), abs=1e-6
    )


def test_default_dtype_is_float32_for_bf16_checkpoint(tmp_path):
    tok = kit.build_tokenizer()
    kit.save_tiny_model(kit.build_sequence_classifier("llama", tokenizer=tok).to(torch.bfloat16), tok, tmp_path)
    assert load_reward_model(tmp_path)[0].dtype == torch.float32
    with pytest.warns(UserWarning, match="slower"):
        assert load_reward_model(tmp_path, dtype="bfloat16")[0].dtype == torch.bfloat16


def test_bert_style_classifier(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    tok = kit.build_tokenizer()
    config = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        num_labels=1, pad_token_id=tok.pad_token_id, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    kit.save_tiny_model(BertForSequenceClassification(config).eval(), tok, tmp_path)
    model, tok = load_reward_model(tmp_path, normalize=(0.5, 4.0))
    assert score_head(model) is model.classifier
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        raw = model.classifier(model.dropout(model.bert(**batch).pooler_output))  # hook normalises this call
        expected = model(**batch).logits[:, 0]
        scores = get_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(scores, expected)
    torch.testing.assert_close(raw[:, 0], expected)
    token_type_ids = torch.zeros_like(batch["input_ids"])
    token_type_ids[:, 2:] = 1  # a BERT pair: segment ids are passed through to the encoder
    with torch.no_grad():
        torch.testing.assert_close(
            get_sequence_scores(model, batch["input_ids"], batch["attention_mask"], token_type_ids=token_type_ids),
            model(**batch, token_type_ids=token_type_ids).logits[:, 0],
        )
        assert not torch.allclose(model(**batch, token_type_ids=token_type_ids).logits[:, 0], expected)
    clear_reward_normalization(model)
    with torch.no_grad():
        unnormalised = get_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(unnormalised, expected * 4.0 + 0.5)


# --------------------------------------------------------------------------------------------- last real token
@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_scores_read_at_last_real_token(arch, side):
    tok = kit.build_tokenizer()
    model = kit.build_sequence_classifier(arch, tokenizer=tok)
    rows = [tok(t)["input_ids"] for t in TEXTS]
    ids, mask = _pad(rows, tok.pad_token_id, side)
    with torch.no_grad():
        scores = get_sequence_scores(model, ids, mask)
    expected = torch.tensor([_manual_score(model, r) for r in rows])
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_equals_eos_scores_the_real_eos(side):
    tok = kit.build_tokenizer(pad_equals_eos=True)
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos
    model = kit.build_sequence_classifier("llama", tokenizer=tok)
    rows = [tok(t)["input_ids"] + [eos] for t in TEXTS]  # every sequence ends in a REAL eos
    ids, mask = _pad(rows, eos, side)
    with torch.no_grad():
        scores = get_sequence_scores(model, ids, mask)
        hf_logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    at_eos = torch.tensor([_manual_score(model, r) for r in rows])
    before_eos = torch.tensor([_manual_score(model, r[:-1]) for r in rows])
    torch.testing.assert_close(scores, at_eos, atol=1e-5, rtol=1e-5)
    # transformers' forward looks for the last non-pad id, so it scores the token BEFORE the real eos (right padding).
    if side == "right":
        torch.testing.assert_close(hf_logits, before_eos, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores, before_eos)


def test_get_sequence_scores_needs_mask_and_single_label():
    tok = kit.build_tokenizer()
    model = kit.build_sequence_classifier("gpt_neox", tokenizer=tok, num_labels=2)
    batch = tok(TEXTS[:2], padding=True, return_tensors="pt")
    with pytest.raises(ValueError, match="attention mask"):
        get_sequence_scores(model, batch["input_ids"], None)
    with pytest.raises(ValueError, match="single output"):
        get_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    assert get_token_scores(model, batch["input_ids"], batch["attention_mask"]).shape == (
        2,
        batch["input_ids"].shape[1],
        2,
    )


# ----------------------------------------------------------------------------------------------- normalisation
def test_normalisation_applies_at_forward_score_and_survives_save(tiny_reward_dir, tmp_path):
    raw_model, tok = load_reward_model(tiny_reward_dir)
    model, _ = load_reward_model(tiny_reward_dir, normalize=(0.25, 2.0))
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        raw = get_sequence_scores(raw_model, ids, mask)
        hidden = _backbone(model)(input_ids=ids, attention_mask=mask).last_hidden_state
        direct = model.score(hidden)  # code that skips forward and calls the head itself
        raw_direct = raw_model.score(hidden)
        via_forward = model(**batch).logits[:, 0]
        via_scores = get_sequence_scores(model, ids, mask)
    expected = (raw - 0.25) / 2.0
    torch.testing.assert_close(via_scores, expected)
    torch.testing.assert_close(via_forward, expected)
    torch.testing.assert_close(direct, (raw_direct - 0.25) / 2.0)
    assert get_reward_normalization(model) == (0.25, 2.0)

    model.save_pretrained(tmp_path)
    on_disk = load_file(os.path.join(tmp_path, "model.safetensors"))
    original = load_file(os.path.join(tiny_reward_dir, "model.safetensors"))
    assert on_disk.keys() == original.keys()
    assert all(torch.equal(on_disk[k], original[k]) for k in original)  # raw weights, nothing baked in
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    assert (config["normalize_reward"], config["reward_mean"], config["reward_std"]) == (True, 0.25, 2.0)

    reloaded, _ = load_reward_model(tmp_path, tokenizer=tok)
    with torch.no_grad():
        torch.testing.assert_close(get_sequence_scores(reloaded, ids, mask), expected)
        torch.testing.assert_close(reloaded(**batch).logits[:, 0], expected)
    unnormalised, _ = load_reward_model(tmp_path, tokenizer=tok, normalize=False)
    with torch.no_grad():
        torch.testing.assert_close(get_sequence_scores(unnormalised, ids, mask), raw)


def test_statistics_in_config_apply_even_after_plain_from_pretrained(tiny_reward_dir, tmp_path):
    tok = kit.build_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        raw = get_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    model.config.normalize_reward, model.config.mean, model.config.std = True, -1.0, 0.5  # OpenRLHF names
    with torch.no_grad():
        torch.testing.assert_close(
            get_sequence_scores(model, batch["input_ids"], batch["attention_mask"]), (raw + 1) / 0.5
        )
        model.config.reward_mean = 3.0  # our names win; read at call time
        torch.testing.assert_close(model(**batch).logits[:, 0], (raw - 3.0) / 0.5)
    assert len(model.score._forward_hooks) == 1  # attached once, however often it is read
    with pytest.raises(ValueError, match="std > 0"):
        set_reward_normalization(model, 0.0, 0.0)
    with pytest.raises(ValueError, match="stores no statistics"):
        load_reward_model(tiny_reward_dir, normalize=True)


# --------------------------------------------------------------------------------------- OpenRLHF value heads
def test_openrlhf_value_head_checkpoint(tmp_path):
    head = _write_openrlhf_checkpoint(tmp_path, config_extra={"normalize_reward": True, "mean": 0.5, "std": 2.0})
    tok = kit.build_tokenizer()
    for prefix in ("value_head", None):  # explicit, and detected from the checkpoint's keys
        model, _ = load_reward_model(tmp_path, value_head_prefix=prefix)
        assert isinstance(model, ValueHeadRewardModel) and model.value_head_prefix == "value_head"
        assert torch.equal(model.score.weight, head)
    backbone = AutoModel.from_pretrained(tmp_path)
    rows = [tok(t)["input_ids"] for t in TEXTS]
    ids, mask = _pad(rows, tok.pad_token_id, "left")
    with torch.no_grad():
        expected = torch.tensor(
            [float(backbone(input_ids=torch.tensor([r])).last_hidden_state[0, -1] @ head[0]) for r in rows]
        )
        expected = (expected - 0.5) / 2.0  # OpenRLHF's config `normalize_reward`, `mean`, `std` honoured
        torch.testing.assert_close(get_sequence_scores(model, ids, mask), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[:, 0], expected, atol=1e-5, rtol=1e-5)

    model.save_pretrained(tmp_path / "resaved")
    on_disk = load_file(os.path.join(tmp_path / "resaved", "model.safetensors"))
    assert torch.equal(on_disk["value_head.weight"], head)  # raw head on disk
    reloaded, _ = load_reward_model(tmp_path / "resaved")
    with torch.no_grad():
        torch.testing.assert_close(get_sequence_scores(reloaded, ids, mask), expected, atol=1e-5, rtol=1e-5)


def test_value_head_prefix_score_on_a_classifier(tiny_llama_reward_dir):
    model, tok = load_reward_model(tiny_llama_reward_dir, value_head_prefix="score")
    reference, _ = load_reward_model(tiny_llama_reward_dir)
    assert isinstance(model, ValueHeadRewardModel)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(
            get_sequence_scores(model, batch["input_ids"], batch["attention_mask"]),
            get_sequence_scores(reference, batch["input_ids"], batch["attention_mask"]),
        )


# ------------------------------------------------------------------------------------------------------ errors
def test_causal_lm_without_head_raises_and_lists_head_keys(tiny_gpt_neox_dir, tmp_path):
    with pytest.raises(ValueError, match="no reward head") as err:
        load_reward_model(tiny_gpt_neox_dir)
    assert "score.weight" in str(err.value) and "embed_out.weight [512, 64]" in str(err.value)
    assert "value_head_prefix" in str(err.value)
    _write_openrlhf_checkpoint(tmp_path, prefix="reward_head")
    with pytest.raises(ValueError, match="'v_head.weight'") as err:
        load_reward_model(tmp_path, value_head_prefix="v_head")
    assert "reward_head.weight [1, 64]" in str(err.value)


def test_missing_pad_token_and_multi_label_errors(tiny_reward_dir, tmp_path):
    tok = kit.build_tokenizer()
    tok.pad_token = None
    with pytest.raises(ValueError, match=r"tokenizer\.pad_token"):
        load_reward_model(tiny_reward_dir, tokenizer=tok)
    tok = kit.build_tokenizer()
    kit.save_tiny_model(kit.build_sequence_classifier("gpt_neox", tokenizer=tok, num_labels=2), tok, tmp_path)
    with pytest.raises(ValueError, match="2 labels"):
        load_reward_model(tmp_path)


def test_4bit_without_bitsandbytes_says_what_to_install(tiny_reward_dir, monkeypatch):
    monkeypatch.setattr(quantization, "is_bitsandbytes_available", lambda: False)
    with pytest.raises(ImportError, match=r"trl_ext\[quantization\]"):
        load_reward_model(tiny_reward_dir, load_in_4bit=True)


# -------------------------------------------------------------------------------------------------------- LoRA
def test_lora_adapter_is_loaded(tiny_reward_dir, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base, tok = load_reward_model(tiny_reward_dir)
    peft_model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query_key_value"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(0.05 * torch.randn_like(param))  # a trained-looking adapter and head
    peft_model.save_pretrained(tmp_path)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = get_sequence_scores(peft_model, batch["input_ids"], batch["attention_mask"])
        raw, _ = load_reward_model(tiny_reward_dir)
        assert not torch.allclose(expected, get_sequence_scores(raw, batch["input_ids"], batch["attention_mask"]))
        merged, _ = load_reward_model(tiny_reward_dir, lora_path=tmp_path)
        unmerged, _ = load_reward_model(tiny_reward_dir, lora_path=tmp_path, merge_lora=False, normalize=(1.0, 2.0))
        assert not isinstance(merged, PeftModel) and isinstance(unmerged, PeftModel)
        torch.testing.assert_close(get_sequence_scores(merged, batch["input_ids"], batch["attention_mask"]), expected)
        torch.testing.assert_close(
            get_sequence_scores(unmerged, batch["input_ids"], batch["attention_mask"]), (expected - 1.0) / 2.0
        )


def test_4bit_loading(tiny_llama_reward_dir):
    pytest.importorskip("bitsandbytes")
    model, tok = load_reward_model(tiny_llama_reward_dir, load_in_4bit=True)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert model.score.weight.dtype == torch.float32  # the head stays in full precision
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        scores = get_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    assert scores.shape == (3,) and torch.isfinite(scores).all()
