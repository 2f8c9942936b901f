"""Tests of `trl_ext.models.lora`: automatic LoRA targets, trainable heads, and the adapters-disabled reference."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from peft import PeftModel
from torch import nn

from trl_ext import testing as kit
from trl_ext.models.lora import (
    adapters_disabled,
    apply_lora,
    build_lora_config,
    count_parameters,
    find_lora_target_modules,
    find_trainable_heads,
    is_peft_model,
    reference_is_base_with_adapters_disabled,
)

ARCHS = ("gpt_neox", "llama", "gpt2")
EXPECTED_LEAVES = {
    "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},
}
# peft 0.21 calls transformers' deprecated `is_gradient_checkpointing` when wrapping a model: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _input_ids(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(10, 200, (batch, length))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _changed(model: nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}


def _adamw_step(model: nn.Module, loss: torch.Tensor) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss.backward()
    optimizer.step()


class _ToyValueModel(nn.Module):
    """A non-transformers model with a body, a value head and a modulation head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.v_head = nn.Linear(8, 1)
        self.modulation_nn_head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16))

    def forward(self, input_ids):
        hidden = self.body(self.embed(input_ids))
        return self.v_head(hidden).squeeze(-1), self.modulation_nn_head(hidden)


class _ToyMultimodal(nn.Module):
    """Vision tower, projector, a language model and an LM head; the tower reuses the leaf name `q_proj`."""

    def __init__(self):
        super().__init__()
        self.vision_tower = nn.ModuleDict({"q_proj": nn.Linear(4, 4), "fc": nn.Linear(4, 4)})
        self.multi_modal_projector = nn.Linear(4, 8)
        self.language_model = nn.ModuleDict({"q_proj": nn.Linear(8, 8), "mlp": nn.Linear(8, 8)})
        self.lm_head = nn.Linear(8, 16)

    def forward(self, x):
        return self.lm_head(self.language_model["mlp"](self.language_model["q_proj"](x)))


# ------------------------------------------------------------------------------------------------ target selection
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_targets_causal_lm_exclude_output_embedding(arch):
    model = kit.build_causal_lm(arch)
    targets = find_lora_target_modules(model)
    assert set(targets) == EXPECTED_LEAVES[arch]  # every block projection, as unambiguous leaf names
    full = find_lora_target_modules(model, return_full_names=True)
    assert not any(name.split(".")[-1] in ("lm_head", "embed_out") for name in full)
    out_name = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    assert out_name == "lm_head" and out_name not in full  # transformers 5 names GPT-NeoX's `embed_out` lm_head
    assert len(full) == 2 * (7 if arch == "llama" else 4)  # every projection of both layers (GPT-2: c_proj twice)


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_targets_seq_cls_exclude_score_and_save_it(arch):
    model = kit.build_sequence_classifier(arch)
    full = find_lora_target_modules(model, return_full_names=True)
    assert "score" not in full and all(not n.endswith("score") for n in full)
    assert set(find_lora_target_modules(model)) == EXPECTED_LEAVES[arch]
    assert find_trainable_heads(model) == ["score"]


def test_vision_tower_and_projector_are_never_targets():
    model = _ToyMultimodal()
    full = find_lora_target_modules(model, return_full_names=True)
    assert full == ["language_model.mlp", "language_model.q_proj"]
    # `q_proj` also names a vision-tower layer, so it must be given by full name; `mlp` is unambiguous.
    assert sorted(find_lora_target_modules(model)) == ["language_model.q_proj", "mlp"]
    peft_model = apply_lora(model, r=2)
    base = peft_model.get_base_model()
    assert type(base.vision_tower["q_proj"]) is nn.Linear and type(base.multi_modal_projector) is nn.Linear
    assert type(base.lm_head) is nn.Linear
    assert hasattr(base.language_model["q_proj"], "lora_A") and hasattr(base.language_model["mlp"], "lora_A")


def test_exclude_patterns_regex_and_substring():
    model = kit.build_causal_lm("llama")
    no_mlp = find_lora_target_modules(model, exclude="mlp")
    assert set(no_mlp) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # A regex leaving out layer 0: the leaves are now ambiguous, so full names are used.
    layer1 = find_lora_target_modules(model, exclude=[r"layers\.0\."])
    assert all(t.startswith("model.layers.1.") for t in layer1) and len(layer1) == 7
    # An invalid regex is taken literally.
    assert set(find_lora_target_modules(model, exclude="(")) == EXPECTED_LEAVES["llama"]
    peft_model = apply_lora(model, r=2, exclude=[r"layers\.0\."])
    lora_modules = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and n.endswith("_proj")}
    assert lora_modules and all(".layers.1." in n for n in lora_modules)


def test_explicit_targets_are_passed_through_with_exclude():
    model = kit.build_causal_lm("llama")
    peft_model = apply_lora(model, r=2, target_modules=["q_proj"], exclude="layers.0")
    adapted = sorted(n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and n.endswith("q_proj"))
    assert adapted == ["base_model.model.model.layers.1.self_attn.q_proj"]


def test_gpt2_conv1d_gets_fan_in_fan_out(recwarn):
    model = kit.build_causal_lm("gpt2")
    peft_model = apply_lora(model, r=2)
    assert peft_model.peft_config["default"].fan_in_fan_out is True
    assert not [w for w in recwarn if "fan_in_fan_out" in str(w.message)]
    assert build_lora_config(kit.build_causal_lm("llama")).fan_in_fan_out is False


def test_task_type_inferred():
    assert build_lora_config(kit.build_causal_lm("llama")).task_type == "CAUSAL_LM"
    assert build_lora_config(kit.build_sequence_classifier("llama")).task_type == "SEQ_CLS"
    assert build_lora_config(_ToyValueModel()).task_type is None


# ------------------------------------------------------------------------------------------------------ errors
def test_error_when_no_linear_layer():
    with pytest.raises(ValueError, match=r"found no layer to adapt in Sequential.*0 \(Embedding\)"):
        apply_lora(nn.Sequential(nn.Embedding(10, 4)))


def test_error_when_only_excluded_linears():
    class OnlyHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.lm_head = nn.Linear(4, 10)

    with pytest.raises(ValueError, match=r"lm_head: output embedding"):
        find_lora_target_modules(OnlyHead())
    legacy = nn.ModuleDict({"embed_in": nn.Embedding(10, 4), "embed_out": nn.Linear(4, 10)})  # no getter at all
    with pytest.raises(ValueError, match=r"embed_out: output embedding"):
        find_lora_target_modules(legacy)
    with pytest.raises(ValueError, match=r"matches `exclude`"):
        find_lora_target_modules(kit.build_causal_lm("llama"), exclude=".*")


def test_error_on_bad_arguments_and_double_wrap():
    model = kit.build_causal_lm("llama")
    with pytest.raises(ValueError, match="rank"):
        apply_lora(model, r=0)
    with pytest.raises(ValueError, match="target_modules is empty"):
        apply_lora(model, target_modules=[])
    peft_model = apply_lora(model, r=2)
    with pytest.raises(ValueError, match="already carries PEFT adapters"):
        apply_lora(peft_model)


# ---------------------------------------------------------------------------------------- training and reference
@pytest.mark.parametrize("arch", ARCHS)
def test_causal_lm_step_changes_only_lora_and_disabled_adapters_match_base(arch):
    model = kit.build_causal_lm(arch)
    original = copy.deepcopy(model)
    ids = _input_ids()
    peft_model = apply_lora(model, r=4, alpha=8)
    assert isinstance(peft_model, PeftModel) and is_peft_model(peft_model)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    before = _snapshot(peft_model)
    peft_model.train()
    _adamw_step(peft_model, peft_model(input_ids=ids, labels=ids).loss)
    changed = _changed(peft_model, before)
    assert any("lora_B" in n for n in changed)
    assert all("lora_" in n for n in changed), sorted(changed - {n for n in changed if "lora_" in n})

    peft_model.eval()
    with torch.no_grad():
        expected = original(input_ids=ids).logits
        adapted = peft_model(input_ids=ids).logits
        with adapters_disabled(peft_model) as inner:
            reference = inner(input_ids=ids).logits
    assert torch.equal(reference, expected)
    assert not torch.allclose(adapted, expected)


@pytest.mark.parametrize("arch", ("gpt_neox", "llama"))
def test_reward_model_score_head_trains_in_full_and_reference_is_original(arch):
    model = kit.build_sequence_classifier(arch)
    original = copy.deepcopy(model)
    ids = _input_ids()
    peft_model = apply_lora(model, r=4)
    assert "score" in peft_model.peft_config["default"].modules_to_save

    before = _snapshot(peft_model)
    peft_model.train()
    scores = peft_model(input_ids=ids).logits.squeeze(-1)
    _adamw_step(peft_model, (scores - torch.tensor([1.0, -1.0])).square().mean())
    changed = _changed(peft_model, before)
    assert any("score.modules_to_save" in n for n in changed)
    assert any("lora_" in n for n in changed)
    assert all("lora_" in n or "modules_to_save" in n for n in changed), sorted(changed)

    peft_model.eval()
    with torch.no_grad():
        with adapters_disabled(peft_model):
            reference = peft_model(input_ids=ids).logits
        adapted = peft_model(input_ids=ids).logits
    assert torch.equal(reference, original(input_ids=ids).logits)
    assert not torch.allclose(adapted, reference)


def test_custom_model_value_and_modulation_heads_go_to_modules_to_save():
    model = _ToyValueModel()
    original = copy.deepcopy(model)
    assert find_trainable_heads(model) == ["v_head", "modulation_nn_head"]
    assert find_lora_target_modules(model, return_full_names=True) == ["body.0", "body.2"]
    peft_model = apply_lora(model, r=2)
    ids = torch.randint(0, 16, (3, 5))

    before = _snapshot(peft_model)
    values, modulation = peft_model(ids)
    _adamw_step(peft_model, values.square().mean() + modulation.logsumexp(-1).mean())
    changed = _changed(peft_model, before)
    assert any(n.startswith("base_model.model.v_head.modules_to_save") for n in changed)
    assert any(n.startswith("base_model.model.modulation_nn_head.modules_to_save") for n in changed)
    assert all("lora_" in n or "modules_to_save" in n for n in changed), sorted(changed)
    with torch.no_grad(), adapters_disabled(peft_model):
        ref_values, ref_modulation = peft_model(ids)
    exp_values, exp_modulation = original(ids)
    assert torch.equal(ref_values, exp_values) and torch.equal(ref_modulation, exp_modulation)


def test_explicit_empty_modules_to_save_keeps_heads_frozen():
    model = _ToyValueModel()
    peft_model = apply_lora(model, r=2, modules_to_save=[])
    assert not peft_model.peft_config["default"].modules_to_save
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if "v_head" in n)


def test_adapter_saves_and_reloads_with_full_name_targets(tmp_path):
    model = kit.build_causal_lm("llama")
    peft_model = apply_lora(model, r=2, exclude=[r"layers\.0\."], init_lora_weights=False)
    ids = _input_ids()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(kit.build_causal_lm("llama"), tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


# ------------------------------------------------------------------------------------------- logging and helpers
def test_apply_lora_logs_targets_and_parameter_count(caplog):
    model = kit.build_causal_lm("llama")
    modules = dict(model.named_modules())
    expected = sum(
        4 * (modules[n].in_features + modules[n].out_features)
        for n in find_lora_target_modules(model, return_full_names=True)
    )
    with caplog.at_level(logging.INFO, logger="trl_ext.models.lora"):
        peft_model = apply_lora(model, r=4)
    trainable, total = count_parameters(peft_model)
    assert trainable == expected
    text = caplog.text
    assert "target_modules=" in text and "q_proj" in text and "lm_head" not in text.split("modules_to_save")[0]
    assert f"trainable params {trainable} / {total}" in text
    assert "adapters disabled" in text


def test_count_parameters_on_plain_model():
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    assert count_parameters(model) == (6, 8)


def test_reference_decision_is_logged(caplog):
    plain = kit.build_causal_lm("llama")
    peft_model = apply_lora(kit.build_causal_lm("llama"), r=2)
    with caplog.at_level(logging.INFO, logger="trl_ext.models.lora"):
        assert reference_is_base_with_adapters_disabled(peft_model) is True
        assert "adapters disabled" in caplog.text
        caplog.clear()
        assert reference_is_base_with_adapters_disabled(peft_model, ref_model=plain) is False
        assert "explicitly passed" in caplog.text
        assert reference_is_base_with_adapters_disabled(plain) is False
    with pytest.raises(TypeError, match="needs a peft.PeftModel"):
        with adapters_disabled(plain):
            pass


def test_target_compression_falls_back_to_exact_regex():
    import re

    from trl_ext.models.lora import _compress_targets

    # "a.b" is also the dotted suffix of "x.a.b": neither the leaf nor the full name selects exactly "a.b".
    result = _compress_targets(["a.b"], ["a", "a.b", "x", "x.a", "x.a.b"])
    assert isinstance(result, str) and re.fullmatch(result, "a.b") and not re.fullmatch(result, "x.a.b")
    assert _compress_targets(["a.b", "x.a.b"], ["a", "a.b", "x", "x.a", "x.a.b"]) == ["b"]


def test_is_peft_model_sees_through_torch_compile():
    peft_model = apply_lora(_ToyValueModel(), r=2)
    compiled = torch.compile(peft_model)  # wrapping only; nothing is compiled until it is called
    assert is_peft_model(compiled) and not is_peft_model(torch.compile(_ToyValueModel()))
    with adapters_disabled(compiled) as inner:
        assert inner is peft_model
