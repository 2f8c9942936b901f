"""Modulated policies (`trl_ext.models.modulated`): formula, init, freezing, saving, TRL's fused-head protocol, DPO.

Generation and caching are tested in `test_models_modulated_generation.py`.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from safetensors import safe_open

from trl_ext import testing as kit
from trl_ext.models.modulated import (
    ModulatedCausalLM,
    ModulatedConfig,
    build_modulation_head,
    normalize_modulation_kind,
)

KINDS = ("model", "linear_head", "mlp_head")
ARCHS = ("gpt_neox", "llama", "gpt2")


def _modulated(kind, arch="llama", tokenizer=None, seed=0, perturb=False, **kwargs):
    torch.manual_seed(seed)
    model = ModulatedCausalLM.from_base(kit.build_causal_lm(arch, tokenizer), kind, **kwargs)
    if perturb and model.modulation_backbone is not None:  # as after training: no longer a copy of the base
        with torch.no_grad():
            for p in model.modulation_backbone.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(batch=2, length=7, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    return ids, mask


# ----------------------------------------------------------------------------------------------- config & init
def test_kind_names_and_errors():
    assert normalize_modulation_kind("nn_head") == "mlp_head"
    assert normalize_modulation_kind("modulation_nn_head") == "mlp_head"
    assert normalize_modulation_kind("modulation_linear_head") == "linear_head"
    assert normalize_modulation_kind("modulation_model") == "model"
    with pytest.raises(ValueError, match="linear_head"):
        ModulatedConfig(modulation_kind="attention_head")
    with pytest.raises(ValueError, match="positive"):
        ModulatedConfig(init_scale_divider=0)
    with pytest.raises(ValueError, match="init_head_from_base"):
        ModulatedConfig(modulation_kind="mlp_head", init_head_from_base=True)
    assert ModulatedConfig(additional_sd_divider=7).init_scale_divider == 7  # the research code's name


@pytest.mark.parametrize("kind", KINDS)
def test_last_layer_init_is_xavier_over_divider(kind):
    """Xavier-normal / d with zero bias in every kind — the mlp head included (fix of B17)."""
    torch.manual_seed(0)
    plain = build_modulation_head(kind, 64, 512, 1.0)
    torch.manual_seed(0)
    scaled = build_modulation_head(kind, 64, 512, 8.0)
    last_plain = plain[-1] if isinstance(plain, torch.nn.Sequential) else plain
    last_scaled = scaled[-1] if isinstance(scaled, torch.nn.Sequential) else scaled
    torch.testing.assert_close(last_scaled.weight, last_plain.weight / 8.0)
    assert torch.count_nonzero(last_scaled.bias) == 0
    xavier_std = math.sqrt(2.0 / (64 + 512))
    assert abs(last_plain.weight.std().item() / xavier_std - 1) < 0.05
    if kind == "mlp_head":
        assert [type(m).__name__ for m in plain] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
        assert plain[0].weight.shape == (64, 64) and plain[2].weight.shape == (64, 64)


@pytest.mark.parametrize("kind", ["model", "linear_head"])
def test_init_head_from_base(kind, tiny_tokenizer):
    model = _modulated(kind, "gpt2", tiny_tokenizer, init_head_from_base=True, init_scale_divider=4)
    base_head = model.base_lm.get_output_embeddings()
    torch.testing.assert_close(model.modulation_head.weight, base_head.weight / 4)
    assert torch.count_nonzero(model.modulation_head.bias) == 0
    # GPT-2 ties its head to its input embeddings: the modulation head must be a separate, untied parameter
    assert model.modulation_head.weight.data_ptr() != base_head.weight.data_ptr()


def test_clear_errors_for_unusable_bases(tiny_tokenizer, monkeypatch):
    backbone_only = kit.build_causal_lm("gpt2", tiny_tokenizer).base_model  # a GPT2Model: no separate backbone
    with pytest.raises(ValueError, match="backbone"):
        ModulatedCausalLM.from_base(backbone_only, "model")
    with pytest.raises(TypeError, match="plain causal LM"):
        ModulatedCausalLM.from_base(_modulated("linear_head", tokenizer=tiny_tokenizer))
    with pytest.raises(ValueError, match="base model"):
        ModulatedCausalLM(ModulatedConfig())  # no base and no path
    quantized = kit.build_causal_lm("llama", tiny_tokenizer)
    quantized.hf_quantizer = object()  # what a bitsandbytes load sets
    with pytest.raises(ValueError, match="quantized"):
        ModulatedCausalLM.from_base(quantized, "model")

    model = _modulated("linear_head", tokenizer=tiny_tokenizer)
    original = type(model.base_lm).forward

    def no_hidden_states(self, *args, **kwargs):
        out = original(self, *args, **{k: v for k, v in kwargs.items() if k != "output_hidden_states"})
        out.hidden_states = None
        return out

    monkeypatch.setattr(type(model.base_lm), "forward", no_hidden_states)
    with pytest.raises(ValueError, match="no hidden states"):
        model(_batch()[0])


# ------------------------------------------------------------------------------------------- forward & freezing
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_are_the_modulated_distribution(kind, arch, tiny_tokenizer):
    """logits = log_softmax(log_softmax(ℓ^p) + m), base_logits = the plain base forward, m = head(hidden)."""
    model = _modulated(kind, arch, tiny_tokenizer, perturb=True)
    ids, mask = _batch()
    out = model(ids, attention_mask=mask)
    with torch.no_grad():
        base_out = model.base_lm(ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(out.base_logits, base_out.logits)
    expected = torch.log_softmax(torch.log_softmax(base_out.logits, -1) + out.modulation_logits, -1)
    torch.testing.assert_close(out.logits, expected)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 7, 512)
    if kind == "model":  # the head reads the modulation backbone (trained copy), the others the base's last state
        hidden = model.modulation_backbone(ids, attention_mask=mask).last_hidden_state
        assert not torch.allclose(hidden, base_out.hidden_states[-1])
    else:
        hidden = base_out.hidden_states[-1]
    torch.testing.assert_close(out.modulation_logits, model.modulation_head(hidden), atol=1e-5, rtol=1e-5)
    # Shifted twist identity: m[s] = log q(s) − log p(s) + log Σ_v p_v e^{m_v}
    tokens = ids[:, 1:]
    log_q = out.logits[:, :-1].gather(-1, tokens[..., None])[..., 0]
    log_p = torch.log_softmax(base_out.logits[:, :-1], -1).gather(-1, tokens[..., None])[..., 0]
    log_z = torch.logsumexp(torch.log_softmax(base_out.logits[:, :-1], -1) + out.modulation_logits[:, :-1], -1)
    m_at_token = out.modulation_logits[:, :-1].gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(m_at_token, log_q - log_p + log_z, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_modulation_trains(kind, tiny_tokenizer):
    model = _modulated(kind, tokenizer=tiny_tokenizer)
    assert not any(p.requires_grad for p in model.base_lm.parameters())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(not n.startswith("base_lm.") for n in trainable)
    assert len(model.modulation_parameters()) == len(trainable)
    model.train()
    assert model.training and model.modulation_head.training and not model.base_lm.training
    ids, mask = _batch()
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert all(p.grad is None for p in model.base_lm.parameters())
    assert all(p.grad is not None for p in model.modulation_parameters())


def test_labels_loss_and_logits_to_keep(tiny_tokenizer):
    model = _modulated("linear_head", tokenizer=tiny_tokenizer)
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    token_logq = out.logits[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    valid = labels[:, 1:] != -100
    torch.testing.assert_close(out.loss, -(token_logq * valid).sum() / valid.sum())
    last = model(ids, attention_mask=mask, logits_to_keep=1)
    assert last.logits.shape == (2, 1, 512)
    torch.testing.assert_close(last.logits, out.logits[:, -1:])
    assert isinstance(model(ids, return_dict=False), tuple)


@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_base(kind, tiny_tokenizer):
    """A bf16 base: the head stays fp32 (the "model" backbone copy follows the base), outputs are fp32 log-probs."""
    torch.manual_seed(0)
    model = ModulatedCausalLM.from_base(kit.build_causal_lm("llama", tiny_tokenizer).to(torch.bfloat16), kind)
    assert all(p.dtype == torch.float32 for p in model.modulation_head.parameters())
    if kind == "model":
        assert all(p.dtype == torch.bfloat16 for p in model.modulation_backbone.parameters())
    ids, mask = _batch()
    out = model(ids, attention_mask=mask)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.logits.exp().sum(-1), torch.ones(2, 7))
    fused = model(ids, attention_mask=mask, labels=ids, fused_lm_head=True)
    fused.loss.backward()
    assert all(p.grad is not None for p in model.modulation_parameters())
    assert model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False).shape[1] <= 10


# ------------------------------------------------------------------------------------------------------- saving
@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])  # tied embeddings; transformers 5 key renaming (embed_out)
@pytest.mark.parametrize("kind", KINDS)
def test_save_writes_only_the_modulation_and_reloads_identically(kind, arch, tiny_model_dir_factory, tmp_path):
    base_dir = tiny_model_dir_factory(arch)
    torch.manual_seed(0)
    model = ModulatedCausalLM.from_base(base_dir, kind, init_scale_divider=2)
    with torch.no_grad():  # move away from the deterministic init, as training would
        for p in model.modulation_parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith(("modulation_head.", "modulation_backbone.")) for k in keys)
    config = ModulatedConfig.from_pretrained(tmp_path)
    assert (config.base_model_name_or_path, config.modulation_kind, config.init_scale_divider) == (base_dir, kind, 2)

    ids, mask = _batch()
    expected = model(ids, attention_mask=mask).logits
    reloaded = ModulatedCausalLM.from_pretrained(tmp_path)  # loads the base from the recorded local folder
    torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, expected, rtol=0, atol=0)
    assert not any(p.requires_grad for p in reloaded.base_lm.parameters())

    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM.from_pretrained(tmp_path)  # registered with the Auto classes
    assert isinstance(auto, ModulatedCausalLM)
    torch.testing.assert_close(auto(ids, attention_mask=mask).logits, expected, rtol=0, atol=0)
    shared = ModulatedCausalLM.from_pretrained(tmp_path, base_model=model.base_lm)  # an already loaded base
    assert shared.base_lm is model.base_lm
    torch.testing.assert_close(shared(ids, attention_mask=mask).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["linear_head", "mlp_head"])
def test_saved_head_is_much_smaller_than_the_base(kind, tiny_tokenizer, tmp_path):
    base = kit.build_causal_lm("llama", tiny_tokenizer, num_hidden_layers=8)
    kit.save_tiny_model(base, tiny_tokenizer, tmp_path / "base")
    ModulatedCausalLM.from_base(str(tmp_path / "base"), kind).save_pretrained(tmp_path / "mod")
    saved = os.path.getsize(tmp_path / "mod" / "model.safetensors")
    assert saved < 0.2 * os.path.getsize(tmp_path / "base" / "model.safetensors")


def test_reload_errors(tiny_tokenizer, tiny_model_dir_factory, tmp_path, caplog):
    model = _modulated("linear_head", tokenizer=tiny_tokenizer)  # built in memory: no path to record
    with caplog.at_level(logging.WARNING, logger="trl_ext.models.modulated"):
        model.save_pretrained(tmp_path / "mod")
    assert "base_model=" in caplog.text
    with pytest.raises(ValueError, match="base_model"):
        ModulatedCausalLM.from_pretrained(tmp_path / "mod")
    small = kit.build_causal_lm("llama", tiny_tokenizer, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden_size"):
        ModulatedCausalLM.from_pretrained(tmp_path / "mod", base_model=small)
    with pytest.raises(ValueError, match="from_base"):
        ModulatedCausalLM.from_pretrained(tiny_model_dir_factory("llama"))  # a plain LM folder
    with pytest.raises(ValueError, match="missing"):  # weights of another kind
        ModulatedCausalLM.from_pretrained(
            tmp_path / "mod", config=ModulatedConfig(modulation_kind="mlp_head"), base_model=model.base_lm
        )


# ----------------------------------------------------------------------------------------- TRL fused LM head
def _fused_reference(model, ids, mask, labels, temperature=1.0):
    with torch.no_grad():
        log_q = model(ids, attention_mask=mask).logits[:, :-1]
    z = torch.log_softmax(log_q / temperature, -1)
    targets = labels[:, 1:]
    valid = targets != -100
    lp = z.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * valid
    return lp, valid, z


@pytest.mark.parametrize("kind", KINDS)
def test_trl_patch_is_ignored_and_fused_protocol_holds(kind, tiny_tokenizer, caplog):
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    model = _modulated(kind, tokenizer=tiny_tokenizer, perturb=True)
    ModulatedCausalLM._trl_patch_logged = False
    with caplog.at_level(logging.INFO, logger="trl_ext.models.fused_patch"):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"))
        add_fused_lm_head(model)
    assert "forward" not in model.__dict__  # the class forward is still the one that runs
    assert caplog.text.count("ignored TRL's add_fused_lm_head") == 1

    ids, mask = _batch(batch=3, length=9)
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :5] = -100  # a "prompt" part
    out = model(ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
    assert isinstance(out, FusedCausalLMOutput)
    lp, valid, z = _fused_reference(model, ids, mask, labels)
    assert out.log_probs.shape == (3, 8)
    torch.testing.assert_close(out.log_probs, lp, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.label_mask, valid) and torch.all(out.log_probs[~valid] == 0)
    torch.testing.assert_close(out.loss, -lp.sum() / valid.sum(), atol=1e-5, rtol=1e-5)
    p = z.exp()
    torch.testing.assert_close(out.entropy, -(p * z).sum(-1) * valid, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.log_sum_sq_probs, torch.logsumexp(2 * z, -1) * valid, atol=1e-4, rtol=1e-4)
    log_q = model(ids, attention_mask=mask).logits[:, :-1].detach()
    torch.testing.assert_close(out.mean_logits, log_q.mean(-1) * valid, atol=1e-4, rtol=1e-4)
    assert torch.equal(out.is_top1, (log_q.argmax(-1) == labels[:, 1:]) & valid)

    out.loss.backward()  # the gradient reaches the modulation, never the base
    assert all(p.grad is not None for p in model.modulation_parameters())
    assert all(p.grad is None for p in model.base_lm.parameters())

    summed = model(ids, attention_mask=mask, labels=labels, fused_lm_head=True, num_items_in_batch=5)
    torch.testing.assert_close(summed.loss, -lp.sum() / 5, atol=1e-5, rtol=1e-5)
    shift_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # pre-shifted, (B, T)
    shifted = model(ids, attention_mask=mask, fused_lm_head=True, shift_labels=shift_labels)
    assert shifted.log_probs.shape == (3, 9) and torch.all(shifted.log_probs[:, -1] == 0)
    torch.testing.assert_close(shifted.log_probs[:, :-1], lp, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shift_labels"):
        model(ids, attention_mask=mask, fused_lm_head=True, shift_labels=labels[:, 1:])
    with pytest.raises(ValueError, match="labels"):
        model(ids, fused_lm_head=True)


def test_fused_head_keeps_trl_temperature_and_other_patches(tiny_tokenizer):
    from trl.trainer.utils import add_fused_lm_head

    model = _modulated("linear_head", tokenizer=tiny_tokenizer)
    add_fused_lm_head(model, temperature=0.7)  # e.g. GRPO/RLOO, which generate at that temperature
    assert model.fused_temperature == pytest.approx(0.7)
    ids, mask = _batch()
    out = model(ids, attention_mask=mask, labels=ids, fused_lm_head=True)
    lp, _, _ = _fused_reference(model, ids, mask, ids, temperature=0.7)
    torch.testing.assert_close(out.log_probs, lp, atol=1e-5, rtol=1e-5)

    calls = []
    inner = model.forward

    def wrapped(*args, **kwargs):  # e.g. accelerate's autocast wrapper: wraps *our* forward, so it is kept
        calls.append(1)
        return inner(*args, **kwargs)

    model.forward = wrapped
    model(ids)
    assert calls == [1]


# --------------------------------------------------------------------------------------------------------- DPO
@pytest.mark.parametrize(("kind", "reference"), [(k, "copy") for k in KINDS] + [("linear_head", "own base")])
def test_trl_dpo_trains_the_modulation_and_leaves_the_base_untouched(kind, reference, tiny_tokenizer, tmp_path):
    from trl import DPOConfig, DPOTrainer

    model = _modulated(kind, tokenizer=tiny_tokenizer)
    base_before = {k: v.clone() for k, v in model.base_lm.state_dict().items()}
    mod_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("base_lm.")}
    args = DPOConfig(
        output_dir=str(tmp_path),
        activation_checkpointing=True,  # TRL's default, under the name that does not warn
        bf16=False,
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )  # TRL's default activation checkpointing stays on: it must work too
    trainer = DPOTrainer(
        model=model,
        # explicit: the in-memory base has no Hub name. "own base": the policy's frozen base object itself, which
        # TRL then patches with its fused head (harmless: our forward calls it without `fused_lm_head`)
        ref_model=kit.build_causal_lm("llama", tiny_tokenizer) if reference == "copy" else model.base_lm,
        args=args,
        train_dataset=kit.preference_dataset(n=8),
        processing_class=tiny_tokenizer,
    )
    assert "forward" not in model.__dict__
    result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    for key, value in model.base_lm.state_dict().items():
        assert torch.equal(value, base_before[key]), key
    changed = [n for n, p in model.named_parameters() if n in mod_before and not torch.equal(p, mod_before[n])]
    assert len(changed) == len(mod_before)
    assert not model.base_lm.training


def test_inputs_embeds_is_refused_with_a_clear_error(tiny_tokenizer):
    model = _modulated("linear_head", tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.zeros(1, 3, 64))
