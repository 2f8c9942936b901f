"""Padding-free forward passes (rows packed into one sequence with per-row ``position_ids``) give the losses and
gradients of the padded computation, on tiny Llama and GPT-NeoX models; models that would let packed rows see
each other are refused."""

from __future__ import annotations

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead
from trl_ext.models.padding_free import check_padding_free
from trl_ext.rollout import forward_response
from trl_ext.trainers.ppo.policy_value import PolicyAndValueModel
from trl_ext.trainers.twist.twist_step import twist_loss

T = 5


def batch(vocab: int, seed: int = 0):
    """4 rows: left-padded prompts of 3..6 tokens, right-padded responses of 1..5 tokens."""
    g = torch.Generator().manual_seed(seed)
    P = 6
    ids = torch.randint(3, vocab, (4, P + T), generator=g)
    mask = torch.zeros_like(ids)
    for row, (prompt, response) in enumerate([(6, 5), (3, 2), (4, 1), (5, 4)]):
        mask[row, P - prompt : P + response] = 1
    return ids, mask


def loss_and_grads(model, ids, mask, padding_free: bool, values: bool = False, hidden: bool = False):
    model.zero_grad(set_to_none=True)
    out = forward_response(
        model, ids, mask, T, temperature=0.9, return_entropy=True, return_values=values, padding_free=padding_free,
        hidden_logprobs=hidden,
    )  # fmt: skip
    loss = (out.logprobs * torch.linspace(0.5, 2.0, T)).sum()
    if values:
        loss = loss + out.values.pow(2).sum()
    loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal_results(packed, padded):
    (a, grads_a), (b, grads_b) = packed, padded
    for name in ("logprobs", "entropy", "values"):
        if getattr(b, name) is not None:
            torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=2e-5, rtol=1e-5, msg=name)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_packed_rows_give_the_padded_losses_and_gradients(arch, attn, hidden):
    model = kit.build_causal_lm(arch, attn_implementation=attn).train()
    check_padding_free(model)
    ids, mask = batch(model.config.vocab_size)
    packed = loss_and_grads(model, ids, mask, True, hidden=hidden)
    assert_equal_results(packed, loss_and_grads(model, ids, mask, False, hidden=False))
    assert (packed[0].logprobs != 0).sum() == int(mask[:, -T:].sum())


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("critic", ["separate", "value_head"])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
def test_policy_and_critic_packed(arch, critic, hidden):
    torch.manual_seed(3)
    policy = kit.build_causal_lm(arch, seed=1)
    if critic == "value_head":
        model = PolicyAndValueModel(AutoModelForCausalLMWithValueHead.from_model(policy), use_policy_value_head=True)
    else:
        model = PolicyAndValueModel(policy, kit.build_sequence_classifier(arch, seed=2))
    model.train()
    ids, mask = batch(model.config.vocab_size, seed=1)
    packed = loss_and_grads(model, ids, mask, True, values=True, hidden=hidden)
    assert_equal_results(packed, loss_and_grads(model, ids, mask, False, values=True))


def test_twist_loss_packed_equals_padded():
    q = kit.build_causal_lm("llama", seed=4).train()
    ids, mask = batch(q.config.vocab_size, seed=2)
    g = torch.Generator().manual_seed(0)
    batch_dict = {
        "input_ids": ids, "attention_mask": mask, "response_mask": mask[:, -T:],
        "old_logprobs": -torch.rand(4, T, generator=g), "ref_logprobs": -torch.rand(4, T, generator=g),
        "log_phi": torch.randn(4, generator=g),
    }  # fmt: skip
    results = []
    for padding_free in (True, False):
        q.zero_grad(set_to_none=True)
        out = twist_loss(
            q, batch_dict, num_samples_per_prompt=2, parameterization="policy_psi_q_p_s_t", loss_type="ctl",
            padding_free=padding_free,
        )  # fmt: skip
        out.loss.loss.backward()
        results.append((out, [p.grad.clone() for p in q.parameters()]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(a.loss.loss, b.loss.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a.q_logprobs, b.q_logprobs, atol=2e-5, rtol=1e-5)
    for x, y in zip(grads_a, grads_b):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def test_an_attention_that_ignores_packing_is_refused():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def causal_only(module, query, key, value, attention_mask, **kwargs):  # drops the block-diagonal mask
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("causal_only_test", causal_only)
    AttentionMaskInterface.register("causal_only_test", sdpa_mask)
    model = kit.build_causal_lm("llama", attn_implementation="causal_only_test")
    with pytest.raises(ValueError, match="causal_only_test.*does not keep packed rows apart"):
        check_padding_free(model, "policy")
    check_padding_free(kit.build_sequence_classifier("gpt_neox"), "value_model")  # critics are checked too


def test_config_refuses_padding_free_with_a_logits_twist(tmp_path):
    from trl_ext import ProposalConfig

    with pytest.raises(ValueError, match="padding_free=True needs a twist"):
        ProposalConfig(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, padding_free=True,
            parameterization="policy_psi_unnorm",
        )  # fmt: skip
