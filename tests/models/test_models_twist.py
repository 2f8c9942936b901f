"""Twist values of the proposal parameterisations (`trl_ext.models.twist`, docs/algorithms.md §6): hand-computed
values, stop-gradient on the reference, the dispatcher and its errors, and the modulated-policy identity."""

from __future__ import annotations

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.models.modulated import ModulatedCausalLM, normalize_modulation_kind
from trl_ext.models.twist import (
    MODULATION_PARAMETERIZATIONS,
    TWIST_PARAMETERIZATIONS,
    modulation_kind_of,
    psi_modulation,
    psi_q_p_s_1_to_t,
    psi_q_p_s_t,
    psi_unnorm,
    twist_values,
)

Q = [[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]]
P = [[-0.5, -1.0, -4.0], [-1.5, -0.25, -1.0]]
MASK = [[1, 1, 0], [0, 1, 1]]  # right padding in row 0, left padding in row 1


def _leaves():
    q = torch.tensor(Q, requires_grad=True)
    p = torch.tensor(P, requires_grad=True)
    return q, p


def test_psi_q_p_s_t_values_and_stop_gradient():
    q, p = _leaves()
    v = psi_q_p_s_t(q, p)
    torch.testing.assert_close(v, torch.tensor([[-0.5, -1.0, 1.0], [1.0, 0.0, -3.0]]))
    v.sum().backward()
    torch.testing.assert_close(q.grad, torch.ones(2, 3))
    assert p.grad is None  # sg[log p]


def test_psi_q_p_s_1_to_t_values_mask_and_stop_gradient():
    q, p = _leaves()
    v = psi_q_p_s_1_to_t(q, p, torch.tensor(MASK))
    # row 0: steps (−0.5, −1, ·) → (−0.5, −1.5, 0); row 1: steps (·, 0, −3) → (0, 0, −3)
    torch.testing.assert_close(v, torch.tensor([[-0.5, -1.5, 0.0], [0.0, 0.0, -3.0]]))
    (v * torch.tensor([[1.0, 10.0, 100.0], [1.0, 10.0, 100.0]])).sum().backward()
    # ∂/∂q_k = Σ_{t≥k, mask_t} weight_t over real tokens k; masked tokens get no gradient
    torch.testing.assert_close(q.grad, torch.tensor([[11.0, 10.0, 0.0], [0.0, 110.0, 100.0]]))
    assert p.grad is None
    with pytest.raises(ValueError, match="same shape"):
        psi_q_p_s_1_to_t(q, p, torch.ones(2, 2))


def test_psi_unnorm_values_and_stop_gradient():
    logits_at_token = torch.tensor([[2.0, 0.5, -1.0]], requires_grad=True)
    p = torch.tensor([[-0.5, -1.0, -4.0]], requires_grad=True)
    v = psi_unnorm(logits_at_token, p)
    torch.testing.assert_close(v, torch.tensor([[2.5, 1.5, 3.0]]))
    v.sum().backward()
    assert p.grad is None and logits_at_token.grad is not None


def test_psi_modulation_gathers_the_raw_logit():
    m = torch.tensor([[[0.1, 0.2, 0.3], [1.0, -1.0, 0.5]]], requires_grad=True)  # (1, T=2, V=3)
    tokens = torch.tensor([[2, -100]])
    v = psi_modulation(m, tokens)
    torch.testing.assert_close(v, torch.tensor([[0.3, 0.0]]))
    v.sum().backward()
    torch.testing.assert_close(m.grad, torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]]))
    assert psi_modulation(m) is m  # all-vocabulary twist
    with pytest.raises(ValueError, match="shape"):
        psi_modulation(m, torch.tensor([2, 0]))


def test_twist_values_dispatches_every_name():
    q, p = _leaves()
    mask = torch.tensor(MASK)
    m = torch.randn(2, 3, 5)
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]])
    torch.testing.assert_close(twist_values("policy_psi_q_p_s_t", q_logprobs=q, p_logprobs=p), psi_q_p_s_t(q, p))
    torch.testing.assert_close(
        twist_values("policy_psi_q_p_s_1_to_t", q_logprobs=q, p_logprobs=p, mask=mask), psi_q_p_s_1_to_t(q, p, mask)
    )
    torch.testing.assert_close(twist_values("policy_psi_unnorm", q_logits_at_token=q, p_logprobs=p), psi_unnorm(q, p))
    for name in MODULATION_PARAMETERIZATIONS:
        torch.testing.assert_close(twist_values(name, modulation_logits=m, tokens=tokens), psi_modulation(m, tokens))
    # The all-vocabulary form used by DPG: log ψ = log q − sg log p over (…, V) tensors, or m itself
    assert twist_values("modulation_nn_head", modulation_logits=m) is m
    log_q_all, log_p_all = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    torch.testing.assert_close(
        twist_values("policy_psi_q_p_s_t", q_logprobs=log_q_all, p_logprobs=log_p_all), log_q_all - log_p_all
    )


def test_twist_values_errors():
    q, p = _leaves()
    with pytest.raises(ValueError) as err:
        twist_values("policy_psi_q_s_t", q_logprobs=q, p_logprobs=p)
    assert all(name in str(err.value) for name in TWIST_PARAMETERIZATIONS)
    with pytest.raises(ValueError, match="no twist"):
        twist_values("policy", q_logprobs=q, p_logprobs=p)
    with pytest.raises(ValueError, match="needs mask"):
        twist_values("policy_psi_q_p_s_1_to_t", q_logprobs=q, p_logprobs=p)
    with pytest.raises(ValueError, match="needs q_logits_at_token"):
        twist_values("policy_psi_unnorm", p_logprobs=p)
    with pytest.raises(ValueError, match="needs modulation_logits"):
        twist_values("modulation_model", tokens=torch.zeros(2, 3, dtype=torch.long))


def test_modulation_kinds_match_the_model():
    for name in MODULATION_PARAMETERIZATIONS:
        assert modulation_kind_of(name) == normalize_modulation_kind(name)
    assert modulation_kind_of("modulation_nn_head") == modulation_kind_of("modulation_mlp_head") == "mlp_head"
    assert modulation_kind_of("policy_psi_q_p_s_t") is None and modulation_kind_of("policy") is None
    with pytest.raises(ValueError, match="Unknown"):
        modulation_kind_of("modulation_attention")


def test_modulated_policy_twist_is_the_log_ratio_up_to_the_normaliser(tiny_tokenizer):
    """For q ∝ p·e^m: v_t = m_t[s_t] = log q(s_t) − log p(s_t) + log Σ_v p_v e^{m_t[v]}, and policy_psi_q_p_s_t on the
    same model gives the log-ratio itself, so the two differ by exactly the per-step log-normaliser."""
    torch.manual_seed(0)
    model = ModulatedCausalLM.from_base(kit.build_causal_lm("gpt_neox", tiny_tokenizer), "linear_head")
    ids = torch.randint(3, 512, (2, 6))
    out = model(ids)
    tokens = ids[:, 1:]
    m = out.modulation_logits[:, :-1]
    log_q = out.logits[:, :-1].gather(-1, tokens[..., None])[..., 0]
    log_p_all = torch.log_softmax(out.base_logits[:, :-1], -1)
    log_p = log_p_all.gather(-1, tokens[..., None])[..., 0]
    v_mod = twist_values("modulation_linear_head", modulation_logits=m, tokens=tokens)
    v_ratio = twist_values("policy_psi_q_p_s_t", q_logprobs=log_q, p_logprobs=log_p)
    torch.testing.assert_close(v_mod - v_ratio, torch.logsumexp(log_p_all + m, -1), atol=1e-5, rtol=1e-5)
    v_mod.sum().backward()
    assert model.modulation_head.weight.grad is not None
