"""Shared prompts in PPO's training forward (`PPOConfig.shared_prefix_training`): micro-batches of whole prompt groups
(`ppo_schedule(group_size=)`) whose prompts the policy and the critic run once, the gradient reaching the prompt pass
through the copied key/value cache. Exactness against the padded rows: log-probs, entropies, values and the gradients
of every parameter; a PPO update with and without sharing ends at the same weights."""

from __future__ import annotations

import pytest
import torch
from test_ppo_trainer import make_trainer, ppo_args, snapshot
from test_shared_prefix import rows

from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead, apply_lora
from trl_ext.trainers import PolicyAndValueModel, forward_response
from trl_ext.trainers.ppo.experience import ppo_schedule, shared_prefix_group_size

N = 3  # samples per prompt in `rows` (4 prompts, one of them one token long)


def outputs_and_grads(model, ids, mask, T, share, hidden_logprobs):
    model.zero_grad(set_to_none=True)
    out = forward_response(
        model, ids, mask, T, temperature=0.7, return_values=model.has_critic, return_entropy=True,
        hidden_logprobs=hidden_logprobs, shared_prefix=share,
    )  # fmt: skip
    # Weights that differ per row and position, so that each row's gradient counts.
    w = torch.linspace(0.5, 1.5, out.logprobs.numel()).view_as(out.logprobs)
    loss = (w * out.logprobs).sum() + (0 if out.values is None else (w.flip(0) * out.values).sum())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(model, ids, mask, T, hidden_logprobs, prompt_passes):
    counts = []
    model.policy.get_input_embeddings().register_forward_hook(lambda m, a, o: counts.append(tuple(a[0].shape)))
    expected, expected_grads = outputs_and_grads(model, ids, mask, T, False, hidden_logprobs)
    counts.clear()
    got, grads = outputs_and_grads(model, ids, mask, T, True, hidden_logprobs)
    assert counts[:2] == prompt_passes  # the policy ran the distinct prompts, then the responses on the cache
    for name in ("logprobs", "entropy", "values"):
        if getattr(expected, name) is not None:
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), atol=2e-5, rtol=1e-4)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=5e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("hidden_logprobs", [True, False])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_policy_and_critic_outputs_and_gradients_equal_the_padded_rows(tiny_tokenizer_pad_eos, arch, hidden_logprobs):
    tok = tiny_tokenizer_pad_eos
    policy, ids, mask, responses, response_mask = rows(tok, arch)
    model = PolicyAndValueModel(policy.train(), kit.build_sequence_classifier(arch, tok, seed=6).train())
    assert model.can_share_prompt()
    full_ids, full_mask, T = torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), responses.shape[1]
    assert_same(model, full_ids, full_mask, T, hidden_logprobs, [(4, ids.shape[1]), (ids.shape[0], T)])


def test_value_head_and_lora_policies(tiny_tokenizer_pad_eos):
    tok = tiny_tokenizer_pad_eos
    policy, ids, mask, responses, response_mask = rows(tok)
    full_ids, full_mask, T = torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), responses.shape[1]
    passes = [(4, ids.shape[1]), (ids.shape[0], T)]
    shared_ac = PolicyAndValueModel(AutoModelForCausalLMWithValueHead.from_model(policy), use_policy_value_head=True)
    assert_same(shared_ac, full_ids, full_mask, T, True, passes)
    lora = apply_lora(kit.build_causal_lm("llama", tok), r=4, init_lora_weights=False)
    model = PolicyAndValueModel(lora, kit.build_sequence_classifier("llama", tok, seed=6))
    assert_same(model, full_ids, full_mask, T, None, passes)


def test_rows_without_a_repeated_prompt_run_whole(tiny_tokenizer_pad_eos):
    tok = tiny_tokenizer_pad_eos
    policy, ids, mask, responses, response_mask = rows(tok)
    model = PolicyAndValueModel(policy, kit.build_sequence_classifier("llama", tok, seed=6))
    assert model.can_share_prompt()  # (its one-time LM-head probe runs here, not below)
    full_ids = torch.cat([ids, responses], 1)[::N]
    full_mask = torch.cat([mask, response_mask], 1)[::N]
    counts = []
    policy.get_input_embeddings().register_forward_hook(lambda m, a, o: counts.append(tuple(a[0].shape)))
    forward_response(model, full_ids, full_mask, responses.shape[1], shared_prefix=True, return_values=True)
    assert counts == [tuple(full_ids.shape)]  # one pass over the whole rows


def test_activation_checkpointing_and_modulated_policies_cannot_share(tiny_tokenizer):
    from trl_ext.models.modulated import ModulatedCausalLM

    policy = kit.build_causal_lm("llama", tiny_tokenizer)
    model = PolicyAndValueModel(policy, kit.build_sequence_classifier("llama", tiny_tokenizer))
    assert model.can_share_prompt()
    policy.activation_checkpointing_enable()
    assert not model.can_share_prompt()
    modulated = ModulatedCausalLM.from_base(kit.build_causal_lm("llama", tiny_tokenizer), "model")
    assert not PolicyAndValueModel(modulated).can_share_prompt()


@pytest.mark.parametrize("num_mini_batches,accumulation", [(1, 1), (1, 2), (2, 2)])
def test_group_schedule_keeps_groups_whole(num_mini_batches, accumulation):
    B, G = 24, 3
    lengths = torch.arange(B) % 7
    schedule = ppo_schedule(B, 2, num_mini_batches, accumulation, seed=5, lengths=lengths, group_size=G)
    assert len(schedule) == 2 * num_mini_batches * accumulation
    for micro in schedule:  # whole groups, each group's rows in order
        assert len(micro) % G == 0 and torch.equal(
            micro.view(-1, G) - micro.view(-1, G)[:, :1], torch.arange(G)[None].expand(len(micro) // G, G)
        )
    for epoch in range(2):
        steps = schedule[epoch * num_mini_batches * accumulation : (epoch + 1) * num_mini_batches * accumulation]
        assert sorted(torch.cat(steps).tolist()) == list(range(B))  # every row once an epoch
    if num_mini_batches == 1:  # the minibatch is the whole rollout, as without groups
        plain = ppo_schedule(B, 2, 1, accumulation, seed=5, lengths=lengths)
        assert sorted(torch.cat(plain[:accumulation]).tolist()) == sorted(torch.cat(schedule[:accumulation]).tolist())


def test_group_size_decision(tmp_path, tiny_tokenizer):
    policy = kit.build_causal_lm("llama", tiny_tokenizer)
    model = PolicyAndValueModel(policy, kit.build_sequence_classifier("llama", tiny_tokenizer))
    args = ppo_args(tmp_path, num_samples_per_prompt=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert shared_prefix_group_size(args, model) == 2  # auto: one minibatch, fp32
    args.num_mini_batches = 2
    assert shared_prefix_group_size(args, model) == 1  # auto leaves a different random split alone
    args.shared_prefix_training = True
    assert shared_prefix_group_size(args, model) == 2  # asked for: minibatches of whole groups
    args.per_device_train_batch_size, args.gradient_accumulation_steps = 2, 4  # 4 groups: 2 a minibatch, 4 micro-steps
    with pytest.raises(ValueError, match="whole number of prompt groups"):
        shared_prefix_group_size(args, model)
    args.per_device_train_batch_size, args.gradient_accumulation_steps, args.padding_free = 4, 2, True
    with pytest.raises(ValueError, match="padding_free"):
        shared_prefix_group_size(args, model)
    args.padding_free, args.shared_prefix_training = False, False
    assert shared_prefix_group_size(args, model) == 1
    args.shared_prefix_training, args.num_samples_per_prompt = None, 1
    assert shared_prefix_group_size(args, model) == 1


def test_ppo_update_with_and_without_shared_prompts(tmp_path, tiny_llama_dir, tiny_llama_reward_dir):
    """Same seed, one minibatch: the rollout is identical and the summed gradient too, so the weights match (SGD:
    Adam divides by the root of the squared gradient, so a weight whose gradient is rounding noise still moves by
    ~lr, differently on each side)."""
    dataset = kit.prompt_dataset(n=16)
    weights, calls = {}, {}
    for share in (False, None):
        args = ppo_args(
            tmp_path / str(share), num_samples_per_prompt=2, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, num_ppo_epochs=2, total_episodes=16, shared_prefix_training=share,
            optim="sgd", learning_rate=0.05,  # Adam would turn rounding-level gradients into full-size steps
        )  # fmt: skip
        trainer = make_trainer(args, tiny_llama_dir, tiny_llama_reward_dir, dataset)
        assert trainer._group_size == (2 if share is None else 1)
        seen = calls[share] = []
        trainer.policy_model.get_input_embeddings().register_forward_hook(
            lambda m, a, o, seen=seen: seen.append(a[0].shape[0]) if torch.is_grad_enabled() else None
        )
        before = snapshot(trainer.model)
        trainer.train()
        weights[share] = snapshot(trainer.model)
        assert any(not torch.equal(before[n], w) for n, w in weights[share].items())  # it did train
    assert min(calls[None]) == 2 and min(calls[False]) == 4  # the prompt pass: 2 distinct prompts of 4 rows
    for name, value in weights[False].items():
        torch.testing.assert_close(weights[None][name], value, atol=2e-5, rtol=1e-4, msg=name)
