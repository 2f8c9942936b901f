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


def _has_cpu_inference_repacking() -> bool:
    """Whether this machine's bitsandbytes repacks 4-bit weights for CPU inference (AVX512-BF16 CPUs)."""
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


@requires_bnb
def test_qlora_trains_every_layer_after_an_eval_forward(tiny_llama_dir):
    # The trainers alternate eval-mode no-grad passes (sampling, scoring) with training. On bitsandbytes 0.50 the
    # first such pass repacks the 4-bit weights for inference and the layers stop passing gradients down; the loaders
    # and apply_lora switch that off (keep_4bit_layers_trainable). Without it, the lower layers' adapters get no
    # gradient here and eval/train logits differ by the bf16 kernel's error.
    model = q.load_causal_lm(tiny_llama_dir, load_in_4bit=True, prepare_for_training=True)
    peft_model = apply_lora(model, r=4, alpha=8, init_lora_weights=False)  # non-zero B: gradients reach A too
    ids = _input_ids()
    peft_model.eval()
    with torch.no_grad():
        eval_logits = peft_model(input_ids=ids).logits
    linear4bit = _linear4bit_types()
    layers = [m for m in peft_model.modules() if isinstance(m, linear4bit)]
    assert layers and not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    peft_model.train()
    logits = peft_model(input_ids=ids).logits
    torch.testing.assert_close(logits.detach(), eval_logits, rtol=1e-5, atol=1e-5)
    logits.logsumexp(-1).mean().backward()
    lora_a = {n: p for n, p in peft_model.named_parameters() if "lora_A" in n}
    no_grad = [n for n, p in lora_a.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"adapters without gradient: {no_grad}"
    assert any(".layers.0." in n for n in lora_a)  # the lowest block is among them


@requires_bnb
def test_keep_4bit_layers_trainable_undoes_an_earlier_repacking(tiny_llama_dir):
    if not _has_cpu_inference_repacking():
        pytest.skip("bitsandbytes does not repack 4-bit weights on this CPU (no AVX512-BF16)")
    model = q.load_causal_lm(tiny_llama_dir, load_in_4bit=True)  # not prepared: repacking stays on
    ids = _input_ids()
    with torch.no_grad():
        model.eval()(input_ids=ids)
    layers = [m for m in model.modules() if isinstance(m, _linear4bit_types())]
    assert all(m.weight.quant_state.packing_format_for_cpu for m in layers)
    with pytest.warns(UserWarning, match=r"repacked by bitsandbytes for CPU inference"):
        assert q.keep_4bit_layers_trainable(model) == len(layers)
    assert not any(m.weight.quant_state.packing_format_for_cpu for m in layers)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    model.train()(inputs_embeds=embeds).logits.sum().backward()
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0  # gradient crosses every 4-bit layer again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert q.keep_4bit_layers_trainable(model) == len(layers)  # idempotent, silent
    assert q.keep_4bit_layers_trainable(nn.Linear(2, 2)) == 0


@requires_bnb
def test_upstream_cpu_repacking_still_cuts_gradients(tiny_llama_dir):
    """The bitsandbytes behaviour `keep_4bit_layers_trainable` works around (0.50.2). When this fails, upstream has
    fixed it: the workaround can go, and this test with it."""
    if not _has_cpu_inference_repacking():
        pytest.skip("bitsandbytes does not repack 4-bit weights on this CPU (no AVX512-BF16)")
    model = q.load_causal_lm(tiny_llama_dir, load_in_4bit=True)
    ids = _input_ids()
    with torch.no_grad():
        model.eval()(input_ids=ids)
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.weight.quant_state.packing_format_for_cpu  # repacked by the eval pass
    x = torch.randn(2, layer.in_features, requires_grad=True)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        layer.train()(x).sum().backward()
    assert x.grad is None  # the repacked layer has no backward: the gradient stops here


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


@requires_bnb
def test_ppo_trains_every_adapter_of_a_4bit_policy(
    tmp_path, tiny_llama_dir, tiny_llama_reward_dir, tiny_prompt_dataset
):
    """A QLoRA policy loaded by plain transformers (not our loader) goes through PPO's sampling in eval mode and then
    trains: every adapter, down to the first block, must change (bitsandbytes' CPU repacking would freeze them)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from trl_ext import PPOConfig, PPOTrainer

    policy = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=q.bnb_4bit_config(), dtype=torch.float32
    )
    args = PPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_ppo_epochs=1, num_mini_batches=1,
        total_episodes=4, response_length=4, learning_rate=1e-2, report_to="none", save_strategy="no",
        num_sample_generations=0, activation_checkpointing=False, seed=0,
    )  # fmt: skip
    trainer = PPOTrainer(
        args=args,
        processing_class=AutoTokenizer.from_pretrained(tiny_llama_dir),
        model=policy,
        ref_model=None,
        reward_model=AutoModelForSequenceClassification.from_pretrained(tiny_llama_reward_dir, num_labels=1),
        value_model=AutoModelForSequenceClassification.from_pretrained(tiny_llama_reward_dir, num_labels=1),
        train_dataset=tiny_prompt_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert any(".layers.0." in n for n in lora)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n in lora if torch.equal(after[n], lora[n])]
    assert not unchanged, f"adapters that did not train: {unchanged}"
