"""Tests of `trl_ext.models.quantization`: dtype defaults, bitsandbytes configs and a QLoRA step on the CPU.

The kit's tiny models (hidden 64, MLP 128) quantise as they are: bitsandbytes' 4-bit blocks hold 64 weights and every
weight matrix here has a multiple of 64 elements, so no size override is needed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from trl_ext import testing as kit
from trl_ext.models import quantization as q
from trl_ext.models.lora import apply_lora, find_trainable_heads

requires_bnb = pytest.mark.skipif(
    not q.is_bitsandbytes_available(), reason="bitsandbytes is not importable: install trl_ext[quantization]"
)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",  # peft calling a deprecated transformers API
    "ignore:MatMul8bitLt. inputs will be cast:UserWarning",  # bitsandbytes 8-bit on CPU, expected
)


def _input_ids(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(10, 200, (batch, length))


def _linear4bit_types():
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit


# ---------------------------------------------------------------------------------------------------- no bitsandbytes
def test_missing_bitsandbytes_gives_install_hint(monkeypatch, tiny_llama_dir):
    monkeypatch.setattr(q, "is_bitsandbytes_available", lambda: False)
    with pytest.raises(ImportError, match=r"install trl_ext\[quantization\]"):
        q.bnb_4bit_config()
    with pytest.raises(ImportError, match=r"8-bit loading needs bitsandbytes.*trl_ext\[quantization\]"):
        q.bnb_8bit_config()
    with pytest.raises(ImportError, match=r"4-bit loading needs bitsandbytes"):
        q.load_causal_lm(tiny_llama_dir, load_in_4bit=True)
    assert q.load_causal_lm(tiny_llama_dir) is not None  # full precision does not need it


def test_resolve_dtype(monkeypatch):
    monkeypatch.setattr(q, "_accelerator_available", lambda: False)
    assert q.resolve_dtype() is torch.float32
    assert q.resolve_dtype(None, device_map="auto") is torch.float32
    assert q.resolve_dtype("auto") == "auto"
    assert q.resolve_dtype("fp32") is torch.float32
    with pytest.warns(UserWarning, match="slower than float32"):
        assert q.resolve_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="Unknown dtype"):
        q.resolve_dtype("int3")
    monkeypatch.setattr(q, "_accelerator_available", lambda: True)
    assert q.resolve_dtype() == "auto"  # the checkpoint's dtype on a GPU
    assert q.resolve_dtype(None, device_map="cpu") is torch.float32
    assert q.resolve_dtype(None, device_map={"": "cpu"}) is torch.float32
    assert q.resolve_dtype(None, device_map={"": 0}) == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert q.resolve_dtype("bf16") is torch.bfloat16  # no CPU warning on a GPU


def test_bf16_checkpoint_loads_as_float32_on_cpu(tmp_path):
    model = kit.build_causal_lm("llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = q.load_causal_lm(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    kept = q.load_causal_lm(tmp_path, dtype="auto")
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}


def test_load_sequence_classifier_and_option_errors(tiny_reward_dir, tiny_llama_dir):
    model = q.load_sequence_classifier(tiny_reward_dir)
    assert model.config.num_labels == 1 and not q.is_quantized(model)
    assert type(q.load_model("LlamaForCausalLM", tiny_llama_dir)).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="not both"):
        q.load_causal_lm(tiny_llama_dir, load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ValueError, match="torch_dtype"):
        q.load_causal_lm(tiny_llama_dir, torch_dtype=torch.float32)
    with pytest.raises(ValueError, match="no model class"):
        q.load_model("AutoModelForNothing", tiny_llama_dir)


# ------------------------------------------------------------------------------------------------------ 4-bit configs
@requires_bnb
def test_bnb_4bit_config_fields():
    config = q.bnb_4bit_config()
    assert config.load_in_4bit and not config.load_in_8bit
    assert config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype is torch.float32
    fp4 = q.bnb_4bit_config("fp4", compute_dtype="bf16", double_quant=False, skip_modules=["score"])
    assert fp4.bnb_4bit_quant_type == "fp4" and fp4.bnb_4bit_compute_dtype is torch.bfloat16
    assert fp4.llm_int8_skip_modules == ["score"] and not fp4.bnb_4bit_use_double_quant
    with pytest.raises(ValueError, match="quant_type"):
        q.bnb_4bit_config("int4")
    assert q.bnb_8bit_config().load_in_8bit


# ---------------------------------------------------------------------------------------------------------- QLoRA
@requires_bnb
@pytest.mark.parametrize(
    ("arch", "quant_type"), [("llama", "nf4"), ("llama", "fp4"), ("gpt_neox", "nf4"), ("gpt2", "nf4")]
)
def test_qlora_step_trains_adapters_and_keeps_4bit_base(tiny_model_dir_factory, arch, quant_type):
    path = tiny_model_dir_factory(arch)
    model = q.load_causal_lm(path, load_in_4bit=True, quant_type=quant_type, prepare_for_training=True)
    assert q.is_quantized(model)
    linear4bit = _linear4bit_types()
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, linear4bit)}
    assert quantized, "no layer was quantised"
    assert all(m.weight.dtype == torch.uint8 for m in quantized.values())
    assert type(model.get_output_embeddings()) is nn.Linear  # transformers keeps the LM head in full precision

    before = {n: (m.weight.data.clone(), m.weight.quant_state.absmax.clone()) for n, m in quantized.items()}
    peft_model = apply_lora(model, r=4, alpha=8)
    lora_layers = [m for m in peft_model.modules() if hasattr(m, "lora_A") and isinstance(m.base_layer, linear4bit)]
    assert len(lora_layers) == len(quantized)  # every 4-bit layer got an adapter (GPT-2: Conv1D became Linear4bit)
    lora_params = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    assert lora_params and all("lora_" in n for n in lora_params)

    ids = _input_ids()
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    loss = peft_model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()

    changed = [n for n, p in peft_model.named_parameters() if n in lora_params and not torch.equal(p, lora_params[n])]
    assert any("lora_B" in n for n in changed)
    for name, module in quantized.items():
        weight, absmax = before[name]
        assert torch.equal(module.weight.data, weight) and torch.equal(module.weight.quant_state.absmax, absmax)

    with torch.no_grad():
        peft_model.eval()
        with peft_model.disable_adapter():
            reference = peft_model(input_ids=ids).logits
        adapted = peft_model(input_ids=ids).logits
    assert torch.isfinite(adapted).all() and not torch.allclose(adapted, reference)


@requires_bnb
def test_4bit_reward_model_scores_and_head_stays_trainable(tiny_reward_dir, tiny_tokenizer):
    model = q.load_sequence_classifier(tiny_reward_dir, load_in_4bit=True, prepare_for_training=True)
    assert type(model.score) is nn.Linear and model.score.weight.dtype == torch.float32  # last module: not quantised
    batch = tiny_tokenizer(["This man is a jerk.", "A fine day."], padding=True, return_tensors="pt")
    with torch.no_grad():
        scores = model(**batch).logits
    assert scores.shape == (2, 1) and torch.isfinite(scores).all()

    peft_model = apply_lora(model, r=4)
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    head_before = peft_model.base_model.model.score.modules_to_save["default"].weight.detach().clone()
    loss = (peft_model(**batch).logits.squeeze(-1) - torch.tensor([-1.0, 1.0])).square().mean()
    loss.backward()
    optimizer.step()
    assert not torch.equal(peft_model.base_model.model.score.modules_to_save["default"].weight, head_before)


@requires_bnb
def test_quantized_head_is_reported(tiny_reward_dir):
    # `skip_modules=[]` replaces transformers' default skips, so the score head is quantised too.
    model = q.load_sequence_classifier(tiny_reward_dir, load_in_4bit=True, skip_modules=[])
    assert isinstance(model.score, _linear4bit_types())
    with pytest.raises(ValueError, match=r"head 'score' is quantized.*skip_modules"):
        find_trainable_heads(model)


@requires_bnb
def test_8bit_load_runs_on_cpu(tiny_llama_dir):
    import bitsandbytes as bnb

    model = q.load_causal_lm(tiny_llama_dir, load_in_8bit=True)
    assert q.is_quantized(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear8bitLt)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_input_ids()).logits).all()
