"""`trl_ext.utils`: the shared eval-mode guard and wrapper stripping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trl_ext import testing as kit
from trl_ext.models import apply_lora
from trl_ext.utils import eval_mode, unwrap_model


def test_eval_mode_restores_each_models_own_mode_even_on_error():
    a, b = nn.Dropout(0.5).train(), nn.Dropout(0.5).eval()
    with eval_mode(a, None, b) as first:
        assert first is a and not a.training and not b.training
    assert a.training and not b.training
    with pytest.raises(RuntimeError), eval_mode(a):
        raise RuntimeError("boom")
    assert a.training


class _Engine(nn.Module):  # a DDP / DeepSpeed-engine-like wrapper: the real model in `.module`
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def test_unwrap_model_strips_engine_compile_and_peft_wrappers():
    model = kit.build_causal_lm("llama")
    peft_model = apply_lora(model, r=2)
    wrapped = _Engine(torch.compile(peft_model, backend="eager"))
    assert unwrap_model(wrapped) is model  # LoRA layers stay inside
    assert unwrap_model(wrapped, peft=False) is peft_model
    assert unwrap_model(model) is model


def test_require_peft_names_the_extra(monkeypatch):
    """PEFT is optional: without it, an adapter feature fails with the install command, not a bare ImportError."""
    import sys

    from trl_ext.utils import require_peft

    require_peft("LoRA")  # installed here: no error
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"LoRA needs PEFT.*pip install 'trl_ext\[peft\]'"):
        require_peft("LoRA")
