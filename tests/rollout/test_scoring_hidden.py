"""Log-probs from hidden states (chunked LM head, no ``(B, T, V)`` logits) equal the logits path: values, entropies,
critic values and gradients, for plain, value-head, PEFT and multi-model (`ModelParts`) modules; models where the
split is not exact keep the logits path."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

import trl_ext.rollout.scoring as scoring
from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead
from trl_ext.models.lm_head import split_lm_head
from trl_ext.models.lora import adapters_disabled
from trl_ext.ops import entropy_from_logits, logprobs_from_hidden
from trl_ext.rollout import forward_response
from trl_ext.trainers.harmlessness.models import HarmlessnessModels
from trl_ext.trainers.ppo.policy_value import PolicyAndValueModel

T = 4


def batch(vocab: int, B: int = 3, P: int = 5, seed: int = 0):
    """Left-padded prompts + right-padded responses (a row with one response token, one with none padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, -1] = 0
    mask[2, -3:] = 0
    return ids, mask


def run(model, ids, mask, **kwargs):
    """Forward + backward of a weighted sum of the log-probs (and values); returns outputs and parameter grads. The
    hidden-state path is forced where the model allows it (with gradients, tiny logits would take the logits path)."""
    model.zero_grad(set_to_none=True)
    kwargs.setdefault("hidden_logprobs", True)
    out = forward_response(model, ids, mask, T, temperature=0.7, return_entropy=True, **kwargs)
    loss = (out.logprobs * torch.arange(1.0, T + 1)).sum()
    if out.values is not None:
        loss = loss + out.values.pow(2).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(a, b, grads_a, grads_b, atol=1e-5):
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=1e-5)
    torch.testing.assert_close(a.entropy, b.entropy, atol=atol, rtol=1e-5)
    if a.values is not None or b.values is not None:
        torch.testing.assert_close(a.values, b.values, atol=atol, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=1e-4, msg=name)


def spy_on_head(head: torch.nn.Linear, monkeypatch) -> list:
    """Record every call of ``head`` (patched on the class: an instance-level ``forward`` disables the split)."""
    calls, original = [], torch.nn.Linear.forward

    def forward(self, x):
        if self is head:
            calls.append(1)
        return original(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", forward)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
def test_plain_model_matches_the_full_log_softmax(arch, monkeypatch):
    model = kit.build_causal_lm(arch).train()
    ids, mask = batch(model.config.vocab_size)
    assert split_lm_head(model) is not None
    calls = spy_on_head(model.get_output_embeddings(), monkeypatch)
    out, grads = run(model, ids, mask)
    assert not calls  # the LM head module never ran: no (B, T, V) logits
    monkeypatch.undo()
    # reference: the model's own logits, full log-softmax at T = 0.7
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, -(T + 1) : -1].float() / 0.7, dim=-1)
    keep = mask[:, -T:] != 0
    ref = logp.gather(-1, ids[:, -T:, None])[..., 0] * keep
    (ref * torch.arange(1.0, T + 1)).sum().backward()
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, -(logp.exp() * logp).sum(-1) * keep, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_value_head_model_gives_the_same_values_and_gradients():
    model = AutoModelForCausalLMWithValueHead.from_model(kit.build_causal_lm("llama")).train()
    ids, mask = batch(model.config.vocab_size)
    fast = run(model, ids, mask, return_values=True)
    slow = run(model, ids, mask, return_values=True, hidden_logprobs=False)
    assert_same(fast[0], slow[0], fast[1], slow[1])


def test_peft_policy_and_its_adapters_disabled_base(monkeypatch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(kit.build_causal_lm("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    for name, p in model.named_parameters():  # non-zero LoRA B, so that the adapters change the outputs
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    ids, mask = batch(model.config.vocab_size)
    assert split_lm_head(model) is not None
    calls = spy_on_head(model.get_output_embeddings(), monkeypatch)
    fast = run(model, ids, mask, hidden_logprobs=None)  # frozen head: the default takes the hidden path
    assert not calls
    monkeypatch.undo()
    with torch.no_grad(), adapters_disabled(model) as base:
        base_fast = forward_response(base, ids, mask, T, temperature=0.7)  # no gradient: hidden path by default
    slow = run(model, ids, mask, hidden_logprobs=False)
    with torch.no_grad(), adapters_disabled(model) as base:
        base_slow = forward_response(base, ids, mask, T, temperature=0.7, hidden_logprobs=False)
    assert_same(fast[0], slow[0], fast[1], slow[1])
    torch.testing.assert_close(base_fast.logprobs, base_slow.logprobs, atol=1e-5, rtol=1e-5)
    assert (base_fast.logprobs - fast[0].logprobs).abs().max() > 1e-3  # the adapters were really off


@pytest.mark.parametrize("critic", ["separate", "value_head"])
def test_policy_and_value_model_scores_inside_its_forward(critic):
    def build():
        torch.manual_seed(5)  # the same fresh value head each time
        policy = kit.build_causal_lm("gpt_neox", seed=1)
        if critic == "value_head":
            return PolicyAndValueModel(
                AutoModelForCausalLMWithValueHead.from_model(policy), use_policy_value_head=True
            )
        return PolicyAndValueModel(policy, kit.build_sequence_classifier("gpt_neox", seed=2))

    fast_model, slow_model = build().train(), build().train()
    ids, mask = batch(fast_model.config.vocab_size)
    slow = run(slow_model, ids, mask, return_values=True, hidden_logprobs=False)
    assert fast_model.lm_head_split() is not None
    calls = []
    fast_model.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs), with_kwargs=True)
    fast = run(fast_model, ids, mask, return_values=True)
    assert "token_labels" in calls[0]  # scored inside the module's forward (what a DDP wrapper sees)
    assert_same(fast[0], slow[0], fast[1], slow[1])


def test_harmlessness_models_score_the_acting_model():
    def build():
        return HarmlessnessModels(kit.build_causal_lm("llama", seed=1), kit.build_causal_lm("llama", seed=2)).train()

    fast_model, slow_model = build(), build()
    ids, mask = batch(fast_model.config.vocab_size)
    with slow_model.acting_as("proposal"):
        slow = run(slow_model, ids, mask, hidden_logprobs=False)
    with fast_model.acting_as("proposal"):
        fast = run(fast_model, ids, mask)
    assert all(name.startswith("proposal.") for name in fast[1])
    assert_same(fast[0], slow[0], fast[1], slow[1])


class ScaledLogits(LlamaForCausalLM):
    """A forward that does more than ``lm_head(h)``: the probe must catch it."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_models_whose_logits_are_not_head_of_hidden_keep_the_logits_path():
    base = kit.build_causal_lm("llama")
    scaled = ScaledLogits(base.config)
    scaled.load_state_dict(base.state_dict())
    assert split_lm_head(scaled) is None  # rejected by the probe
    ids, mask = batch(base.config.vocab_size)
    with torch.no_grad():
        out = forward_response(scaled, ids, mask, T)
        plain = forward_response(base, ids, mask, T, temperature=0.5)
    torch.testing.assert_close(out.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)  # log_softmax(2z) = T=0.5
    capped = kit.build_causal_lm("llama")
    capped.config.final_logit_softcapping = 30.0
    assert split_lm_head(capped) is None
    from trl_ext.models import ModulatedCausalLM

    assert split_lm_head(ModulatedCausalLM.from_base(kit.build_causal_lm("llama"), "linear_head")) is None


def test_with_gradients_the_hidden_path_is_taken_for_large_logits_only(monkeypatch):
    model = PolicyAndValueModel(kit.build_causal_lm("llama"))
    ids, mask = batch(model.config.vocab_size)
    seen = []
    model.register_forward_hook(lambda m, a, kwargs, out: seen.append("token_labels" in kwargs), with_kwargs=True)
    forward_response(model, ids, mask, T)  # tiny logits, with gradients: the logits path (no recomputation)
    with torch.no_grad():
        forward_response(model, ids, mask, T)  # without gradients: always the hidden path
    monkeypatch.setattr(scoring, "HIDDEN_PATH_MIN_BYTES", 0)
    forward_response(model, ids, mask, T)
    assert seen == [False, True, True]


def test_hidden_logprobs_entropy_matches_entropy_from_logits():
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = (
        torch.randn(7, 8, generator=g),
        torch.randn(50, 8, generator=g),
        torch.randn(50, generator=g),
    )
    labels = torch.randint(0, 50, (7,), generator=g)
    labels[2] = -100
    lp, ent = logprobs_from_hidden(hidden, weight, labels, bias, temperature=1.3, chunk_size=3, return_entropy=True)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    torch.testing.assert_close(ent, entropy_from_logits(logits, temperature=1.3), atol=1e-5, rtol=1e-5)
    assert lp[2] == 0 and not ent.requires_grad


def test_hidden_logprobs_under_autocast_match_the_autocast_lm_head():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = logprobs_from_hidden(hidden, weight, labels, chunk_size=4)
        ref = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), -1).gather(-1, labels[:, None])
    torch.testing.assert_close(out, ref[:, 0], atol=1e-6, rtol=0)  # the same bf16 projection
    grads = torch.autograd.grad(out.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    assert all(g.dtype == torch.float32 for g in grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)  # bf16 products


def test_critic_values_of_a_value_head_skip_the_lm_head(monkeypatch):
    torch.manual_seed(5)
    model = PolicyAndValueModel(AutoModelForCausalLMWithValueHead.from_model(kit.build_causal_lm("llama")), None, True)
    ids, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        expected = forward_response(model, ids, mask, T, return_values=True, hidden_logprobs=False).values
        calls = spy_on_head(model.policy.get_output_embeddings(), monkeypatch)
        values = model.critic_values(ids, mask, T)
    assert not calls
    torch.testing.assert_close(values, expected, atol=1e-6, rtol=1e-6)
