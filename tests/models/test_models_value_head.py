"""Tests of `trl_ext.models.value_head`: the causal LM with a value head (shared actor-critic)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from trl_ext import testing as kit
from trl_ext.models import value_head as vh
from trl_ext.models.value_head import (
    AutoModelForCausalLMWithValueHead,
    CausalLMWithValueHeadConfig,
    prepare_value_head_for_peft,
)

ARCHS = ("gpt_neox", "llama", "gpt2")


def _batch(tokenizer, texts=("hello there my friend", "a"), padding_side="right"):
    tokenizer.padding_side = padding_side
    return tokenizer(list(texts), return_tensors="pt", padding=True)


def _wrapped(arch="llama", tokenizer=None, **kwargs):
    return AutoModelForCausalLMWithValueHead.from_model(kit.build_causal_lm(arch, tokenizer), **kwargs)


def _reference_fields(logits, labels, temperature=1.0):
    """Per-token fields of the next-token labels from full logits, the slow and obvious way."""
    z = logits[:, :-1].float() / temperature
    targets = labels[:, 1:]
    mask = targets != -100
    logp = torch.log_softmax(z, dim=-1)
    safe = targets.clamp(min=0).unsqueeze(-1)
    fields = {
        "log_probs": logp.gather(-1, safe).squeeze(-1),
        "entropy": -(logp.exp() * logp).sum(-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == targets,
        "log_sum_sq_probs": torch.log((logp.exp() ** 2).sum(-1)),
    }
    return {k: torch.where(mask, v, torch.zeros_like(v)) for k, v in fields.items()}, mask


# ------------------------------------------------------------------------------------------------ save / load
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_exact(arch, tiny_model_dir_factory, tiny_tokenizer, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_model_dir_factory(arch)).eval()
    batch = _batch(tiny_tokenizer)
    with torch.no_grad():
        before = model(**batch)
    model.save_pretrained(tmp_path)

    saved = load_file(tmp_path / "model.safetensors")  # one file holds the LM and the value head
    assert {"v_head.weight", "v_head.bias"} <= saved.keys()
    assert all(k.startswith(("pretrained_model.", "v_head.")) for k in saved)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "causal_lm_with_value_head"

    loaded, info = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(loaded.pretrained_model) is type(model.pretrained_model)
    with torch.no_grad():
        after = loaded(**batch)
    assert torch.equal(before.logits, after.logits)
    assert torch.equal(before.value, after.value)
    assert loaded.generation_config.pad_token_id == tiny_tokenizer.pad_token_id
    # The Auto classes know the type too: TRL may reload a checkpoint with AutoModelForCausalLM.
    assert isinstance(AutoConfig.from_pretrained(tmp_path), CausalLMWithValueHeadConfig)
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), AutoModelForCausalLMWithValueHead)


def test_gpt_neox_checkpoint_conversion_applies_to_nested_model(tiny_gpt_neox_dir, tiny_tokenizer, tmp_path):
    """transformers 5 renames GPT-NeoX `embed_out` to `lm_head`: both spellings must load into the nested model."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_gpt_neox_dir).eval()
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    assert "pretrained_model.embed_out.weight" in state  # saved in the checkpoint spelling, like the plain model
    state["pretrained_model.lm_head.weight"] = state.pop("pretrained_model.embed_out.weight")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})

    loaded, info = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = _batch(tiny_tokenizer)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_lm_folder_keeps_lm_gets_fresh_value_head(
    arch, tiny_model_dir_factory, tiny_tokenizer, caplog, monkeypatch
):
    monkeypatch.setattr(vh, "_LOGGED", set())
    path = tiny_model_dir_factory(arch)
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    with caplog.at_level(logging.INFO, logger=vh.__name__):
        model, info = AutoModelForCausalLMWithValueHead.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == {"v_head.weight", "v_head.bias"} and not info["unexpected_keys"]
    assert any("freshly initialised" in r.getMessage() for r in caplog.records)
    batch = _batch(tiny_tokenizer)
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, model.eval()(**batch).logits)  # LM head not re-initialised
    hidden = plain.config.get_text_config().hidden_size
    assert model.v_head.weight.shape == (1, hidden)
    assert torch.all(model.v_head.bias == 0)
    assert model.v_head.weight.std().item() == pytest.approx(1 / math.sqrt(hidden + 1), rel=0.3)


def test_value_head_options_and_dtype(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        tiny_llama_dir, value_head_init_std=2.0, value_head_dropout=0.25, dtype=torch.bfloat16
    )
    assert model.v_head.weight.std().item() == pytest.approx(2.0, rel=0.3)
    assert model.value_dropout.p == 0.25 and model.config.value_head_dropout == 0.25
    assert model.v_head.weight.dtype == model.pretrained_model.dtype == torch.bfloat16
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path, value_head_dropout=0.0)
    assert loaded.dtype == torch.bfloat16 and loaded.value_dropout.p == 0.0
    assert torch.equal(loaded.v_head.weight, model.v_head.weight)
    with pytest.raises(ValueError, match="value_head_dropout"):
        CausalLMWithValueHeadConfig(text_config=model.config.text_config, value_head_dropout=1.0)


def test_from_model_shares_weights_and_does_not_reinitialise(tiny_tokenizer):
    lm = kit.build_causal_lm("gpt2", tiny_tokenizer)
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    config = CausalLMWithValueHeadConfig(text_config=lm.config)
    model = AutoModelForCausalLMWithValueHead(config, pretrained_model=lm)  # the plain constructor, too
    assert model.pretrained_model is lm
    assert all(torch.equal(state[k], v) for k, v in lm.state_dict().items())
    assert model.get_output_embeddings() is lm.get_output_embeddings()
    assert model.get_input_embeddings() is lm.get_input_embeddings()


def test_clear_errors(tiny_llama_dir, tiny_tokenizer):
    with pytest.raises(ValueError, match="no output embeddings"):
        AutoModelForCausalLMWithValueHead.from_model(AutoModel.from_pretrained(tiny_llama_dir))
    model = _wrapped("llama", tiny_tokenizer)
    with pytest.raises(TypeError, match="already has a value head"):
        AutoModelForCausalLMWithValueHead.from_model(model)
    with pytest.raises(ValueError, match="needs `labels`"):
        model(torch.tensor([[5, 6, 7]]), fused_lm_head=True)
    with pytest.raises(ValueError, match="Unknown fused outputs"):
        model.configure_fused_lm_head(outputs=("log_probs", "perplexity"))


def test_config_behaves_like_the_wrapped_config(tiny_tokenizer):
    model = _wrapped("gpt_neox", tiny_tokenizer)
    config = model.config
    assert config.get_text_config() is model.pretrained_model.config
    assert config.vocab_size == len(tiny_tokenizer) and config.pad_token_id == tiny_tokenizer.pad_token_id
    config.use_cache = False  # what `transformers.Trainer` does: it must reach the wrapped model
    assert model.pretrained_model.config.use_cache is False and "use_cache" not in config.to_dict()
    assert config.text_config._attn_implementation == "sdpa"  # kept, not reset by the wrapper config
    assert model.can_generate() and model.generation_config is model.pretrained_model.generation_config


# ---------------------------------------------------------------------------------------------------- forward
def test_values_shape_dtype_and_readers(tiny_tokenizer):
    model = _wrapped("llama", tiny_tokenizer).eval()
    batch = _batch(tiny_tokenizer)
    B, T = batch["input_ids"].shape
    out = model(**batch, labels=batch["input_ids"])
    reference = model.pretrained_model(**batch, labels=batch["input_ids"])
    assert torch.equal(out.logits, reference.logits) and torch.equal(out.loss, reference.loss)
    assert out.value.shape == (B, T) and out.value.dtype == torch.float32 and out.hidden_states is None
    assert torch.allclose(model.get_values(**batch), out.value, atol=1e-6)
    hidden = model(**batch, output_hidden_states=True).hidden_states[-1]
    assert model.score(hidden).shape == (B, T, 1)
    assert torch.allclose(model.score(hidden).squeeze(-1), out.value)
    assert model(**batch, return_values=False).value is None

    half = _wrapped("llama", tiny_tokenizer).to(torch.bfloat16)
    value = half(**batch).value
    assert value.dtype == torch.float32 and value.shape == (B, T)


def test_generate_with_left_padding_matches_wrapped_model(tiny_tokenizer_left):
    model = _wrapped("gpt_neox", tiny_tokenizer_left).eval()
    batch = _batch(tiny_tokenizer_left, padding_side="left")
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tiny_tokenizer_left.pad_token_id}
    out = model.generate(**batch, **kwargs)
    assert out.shape == (2, batch["input_ids"].shape[1] + 6)
    assert torch.equal(out, model.pretrained_model.generate(**batch, **kwargs))


def test_activation_checkpointing_reaches_the_trunk(tiny_tokenizer):
    model = _wrapped("llama", tiny_tokenizer).train()
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing and model.pretrained_model.is_activation_checkpointing
    batch = _batch(tiny_tokenizer)
    out = model(**batch, labels=batch["input_ids"])
    (out.loss + out.value.square().mean()).backward()
    assert model.v_head.weight.grad is not None and model.get_input_embeddings().weight.grad is not None


# ------------------------------------------------------------------------------------------ fused LM head
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_forward_matches_full_logits(arch, tiny_tokenizer):
    model = _wrapped(arch, tiny_tokenizer).eval()
    model.configure_fused_lm_head(outputs=vh.FUSED_OUTPUT_FIELDS)
    batch = _batch(tiny_tokenizer, texts=("the cat sat on the mat", "hello", "a b c"))
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[0, :2] = -100  # prompt tokens
    out = model(**batch, labels=labels)
    fused = model(**batch, labels=labels, fused_lm_head=True)
    expected, mask = _reference_fields(out.logits, labels)
    assert torch.equal(fused.label_mask, mask)
    for name in ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs"):
        assert getattr(fused, name).shape == labels[:, 1:].shape
        torch.testing.assert_close(getattr(fused, name), expected[name], atol=1e-5, rtol=1e-5)
    assert torch.equal(fused.is_top1, expected["is_top1"] & mask)
    torch.testing.assert_close(fused.loss, out.loss, atol=1e-5, rtol=1e-5)  # at T = 1 the model's own loss
    torch.testing.assert_close(fused.value, out.value)

    fused.loss.backward()  # gradients of the chunked path equal those of the full-logits loss
    grads = [p.grad.clone() for p in model.pretrained_model.parameters()]
    model.zero_grad()
    model(**batch, labels=labels).loss.backward()
    for fused_grad, p in zip(grads, model.pretrained_model.parameters()):
        torch.testing.assert_close(fused_grad, p.grad, atol=1e-5, rtol=1e-4)


def test_fused_forward_options(tiny_tokenizer):
    model = _wrapped("llama", tiny_tokenizer).eval()
    batch = _batch(tiny_tokenizer)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    logits = model(**batch).logits
    expected, mask = _reference_fields(logits, labels)
    # chunking does not change anything; the lean log-probs-only path uses trl_ext.ops
    model.configure_fused_lm_head(chunk_size=3)
    chunked = model(**batch, labels=labels, fused_lm_head=True)
    assert chunked.entropy is None
    torch.testing.assert_close(chunked.log_probs, expected["log_probs"], atol=1e-5, rtol=1e-5)
    # num_items_in_batch replaces the count of labels in the loss
    out = model(**batch, labels=labels, fused_lm_head=True, num_items_in_batch=100)
    torch.testing.assert_close(out.loss, -expected["log_probs"].sum() / 100)
    # pre-shifted labels are scored without shifting: (B, T)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shifted = model(**batch, shift_labels=shift, fused_lm_head=True)
    assert shifted.log_probs.shape == labels.shape
    torch.testing.assert_close(shifted.log_probs[:, :-1], expected["log_probs"], atol=1e-5, rtol=1e-5)
    # temperature
    model.configure_fused_lm_head(temperature=0.7)
    warm = model(**batch, labels=labels, fused_lm_head=True, return_values=False)
    expected_warm = _reference_fields(logits, labels, temperature=0.7)[0]["log_probs"]
    torch.testing.assert_close(warm.log_probs, expected_warm, atol=1e-5, rtol=1e-5)
    assert warm.value is None
    # every label ignored: zeros, loss 0, and backward still works
    model.train()
    empty = model(**batch, labels=torch.full_like(labels, -100), fused_lm_head=True)
    assert torch.all(empty.log_probs == 0) and empty.loss.item() == 0
    empty.loss.backward()


def test_trl_fused_patch_is_refused_and_its_settings_adopted(tiny_tokenizer, caplog, monkeypatch):
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    from trl_ext.models import fused_patch

    monkeypatch.setattr(AutoModelForCausalLMWithValueHead, "_trl_patch_logged", False)
    model = _wrapped("gpt_neox", tiny_tokenizer).eval()
    batch = _batch(tiny_tokenizer)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with caplog.at_level(logging.INFO, logger=fused_patch.__name__):
        add_fused_lm_head(model, temperature=0.5, outputs=("log_probs", "entropy"))
        add_fused_lm_head(model, temperature=0.5, outputs=("log_probs", "entropy"))
    assert sum("ignored TRL's add_fused_lm_head" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert "forward" not in model.__dict__ and model.forward.__func__ is AutoModelForCausalLMWithValueHead.forward

    out = model(**batch, labels=labels)  # the normal forward still computes the values
    assert out.value.shape == batch["input_ids"].shape
    fused = model(**batch, labels=labels, fused_lm_head=True)
    assert isinstance(fused, FusedCausalLMOutput) and fused.entropy is not None and fused.is_top1 is None
    expected, _ = _reference_fields(out.logits, labels, temperature=0.5)
    torch.testing.assert_close(fused.log_probs, expected["log_probs"], atol=1e-5, rtol=1e-5)

    # Other assignments of `forward` (accelerate's autocast wrapper, ...) are not blocked.
    def wrapper(*args, **kwargs):
        return AutoModelForCausalLMWithValueHead.forward(model, *args, **kwargs)

    model.forward = wrapper
    assert model.__dict__["forward"] is wrapper


def test_fused_forward_with_logit_scale_uses_the_wrapped_forward(tiny_tokenizer):
    """Configs that rescale logits after the head: the fused path scores the wrapped model's own logits."""
    lm = kit.build_causal_lm("llama", tiny_tokenizer)
    lm.config.logit_scale = 0.5  # read by the check; Llama itself ignores it, so the logits are unchanged
    model = AutoModelForCausalLMWithValueHead.from_model(lm).eval()
    model.configure_fused_lm_head(outputs=("log_probs", "is_top1"))
    batch = _batch(tiny_tokenizer)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    out = model(**batch, labels=labels)
    fused = model(**batch, labels=labels, fused_lm_head=True)
    expected, _ = _reference_fields(out.logits, labels)
    torch.testing.assert_close(fused.log_probs, expected["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.value, out.value)


# ----------------------------------------------------------------------------------------------- training
def test_trl_dpo_trainer_trains_value_head_model(tiny_tokenizer, tmp_path):
    from trl import DPOConfig, DPOTrainer

    model = _wrapped("llama", tiny_tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = DPOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        activation_checkpointing=False,
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=kit.build_causal_lm("llama", tiny_tokenizer),  # explicit: a config-built model has no Hub name
        args=args,
        train_dataset=kit.preference_dataset(n=8),
        processing_class=tiny_tokenizer,
    )
    assert "forward" not in model.__dict__  # TRL's patch was refused, our fused forward serves DPO
    assert set(model._fused_settings["outputs"]) >= {"log_probs", "entropy", "is_top1"}
    result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert {name for name in before if name.startswith("pretrained_model.")} == changed  # every LM weight moved
    assert "entropy" in trainer.state.log_history[-1] or any("entropy" in h for h in trainer.state.log_history)


def test_lora_on_trunk_with_trainable_value_head(tiny_tokenizer, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = _wrapped("gpt_neox", tiny_tokenizer)
    model.save_pretrained(tmp_path / "base")
    config = prepare_value_head_for_peft(model, LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    assert config.modules_to_save == ["v_head"] and config.target_modules == {"query_key_value"}
    peft_model = get_peft_model(model, config)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or ".v_head.modules_to_save." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}

    batch = _batch(tiny_tokenizer)
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):  # LoRA B starts at zero: A only moves from the second step on
        out = peft_model(**batch, labels=batch["input_ids"])
        (out.loss + (out.value - 1.0).square().mean()).backward()  # policy loss + value loss
        optimizer.step()
        optimizer.zero_grad()
    changed = {n for n, p in peft_model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable  # LoRA and the value head moved, the base trunk and LM head did not

    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(**batch)
    peft_model.save_pretrained(tmp_path / "adapter")
    assert any("v_head" in k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    base = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = reloaded(**batch)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.value, expected.value)
    generated = reloaded.generate(**batch, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == batch["input_ids"].shape[1] + 3


def test_fused_forward_includes_moe_router_loss():
    """MoE models: the fused forward adds the load-balancing loss the wrapped model computes."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.5, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_model(MixtralForCausalLM(config))
    ids = torch.randint(1, 64, (2, 6))
    labels = ids.clone()
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    full = model.pretrained_model(input_ids=ids, attention_mask=torch.ones_like(ids))
    logps = torch.log_softmax(full.logits[:, :-1].float(), -1).gather(-1, labels[:, 1:, None]).squeeze(-1)
    expected = -logps.mean() + 0.5 * out.aux_loss
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-5)
