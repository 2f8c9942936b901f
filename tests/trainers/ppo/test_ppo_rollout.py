"""Tests of the shared rollout (`trl_ext.rollout.generator`) and of the prompt data helpers (`trainers.data`)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead, apply_lora, get_sequence_scores, get_token_values
from trl_ext.rollout.data import check_pad_token, left_padded
from trl_ext.trainers import (
    PolicyAndValueModel,
    PromptCollator,
    ReferencePolicy,
    RolloutGenerator,
    RolloutReward,
    RolloutSampler,
    SamplingSettings,
    forward_response,
    generate_responses,
    prepare_prompt_dataset,
)


def prompts(tokenizer, texts=("This man is a", "Describe some fresh bread.", "Hi")):
    batch = PromptCollator(tokenizer.pad_token_id)([{"input_ids": tokenizer(t)["input_ids"]} for t in texts])
    return batch["input_ids"], batch["attention_mask"]


def settings(tokenizer, **kwargs) -> SamplingSettings:
    defaults = dict(max_new_tokens=6, pad_token_id=tokenizer.pad_token_id, temperature=0.7,
                    stop_token_ids=(tokenizer.eos_token_id,), eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return SamplingSettings(**{**defaults, **kwargs})


# ------------------------------------------------------------------------------------------------------ data
def test_prepare_prompt_dataset_text_conversational_and_token_ids(tiny_tokenizer):
    dataset = Dataset.from_dict({"prompt": ["Hello there", "Hi"], "other": [1, 2]})
    text = prepare_prompt_dataset(dataset, tiny_tokenizer)
    assert text.column_names == ["input_ids"] and text[0]["input_ids"] == tiny_tokenizer("Hello there")["input_ids"]
    chat = prepare_prompt_dataset(kit.prompt_dataset(n=2, conversational=True), tiny_tokenizer)
    rendered = tiny_tokenizer.decode(chat[0]["input_ids"])
    assert rendered.startswith("<|im_start|>user\n") and rendered.endswith("<|im_start|>assistant\n")
    ids = prepare_prompt_dataset(Dataset.from_dict({"input_ids": [[5, 6, 7]], "query": ["x"]}), tiny_tokenizer)
    assert ids.column_names == ["input_ids"] and ids[0]["input_ids"] == [5, 6, 7]


def test_prepare_prompt_dataset_errors_name_the_columns(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"columns \['question'\].*'prompt' column.*'input_ids'"):
        prepare_prompt_dataset(Dataset.from_dict({"question": ["a"]}), tiny_tokenizer)
    with pytest.raises(ValueError, match="empty after tokenisation"):
        prepare_prompt_dataset(Dataset.from_dict({"prompt": ["a", ""]}), tiny_tokenizer)
    tiny_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        prepare_prompt_dataset(kit.prompt_dataset(n=2, conversational=True), tiny_tokenizer)


def test_check_pad_token(tiny_tokenizer):
    tiny_tokenizer.pad_token = None
    with pytest.raises(ValueError, match=r"tokenizer.pad_token = tokenizer.eos_token"):
        check_pad_token(tiny_tokenizer)


def test_collator_left_pads_and_left_padded_fixes_right_padding():
    batch = PromptCollator(9)([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    same = left_padded(ids, mask, 9)
    assert same[0] is ids
    fixed_ids, fixed_mask = left_padded(torch.tensor([[1, 2, 3], [4, 9, 9]]), torch.tensor([[1, 1, 1], [1, 0, 0]]), 9)
    assert fixed_ids.tolist() == [[1, 2, 3], [9, 9, 4]] and fixed_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_rollout_sampler_repeats_each_rollout_and_reshuffles_per_epoch():
    sampler = RolloutSampler(num_rows=7, prompts_per_rollout=3, repeat=2, seed=1)
    first = list(sampler)
    assert len(first) == len(sampler) == 12  # 2 rollouts (the last incomplete chunk is dropped) × 3 prompts × 2
    assert first[:3] == first[3:6] and first[6:9] == first[9:12] and len(set(first)) == 6
    assert list(sampler) == first  # same epoch, same order
    sampler.set_epoch(1)
    assert list(sampler) != first
    with pytest.raises(ValueError, match="add prompts"):
        RolloutSampler(num_rows=2, prompts_per_rollout=3, repeat=1)


def test_rollout_sampler_gives_each_process_its_own_prompts_once_per_micro_step():
    """With accelerate's round-robin batch sharding, process i gets slice i of each rollout, `repeat` times."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    sampler = RolloutSampler(num_rows=12, prompts_per_rollout=4, repeat=3, seed=0)  # 2 processes × 2 prompts
    batches = BatchSampler(sampler, batch_size=2, drop_last=False)
    shards = [list(BatchSamplerShard(batches, num_processes=2, process_index=i)) for i in (0, 1)]
    for shard in shards:
        assert len(shard) == 9 and shard[0] == shard[1] == shard[2] and shard[3] == shard[4] == shard[5]
    for rollout in range(3):
        a, b = shards[0][3 * rollout], shards[1][3 * rollout]
        assert not set(a) & set(b)


# ------------------------------------------------------------------------------------------------ generation
def test_generate_responses_stops_pads_and_ignores_saved_generation_config(tiny_tokenizer):
    model = kit.build_causal_lm("llama", tiny_tokenizer)
    model.generation_config.top_k = 1  # a saved default that must not leak into sampling
    model.generation_config.repetition_penalty = 5.0
    ids, mask = prompts(tiny_tokenizer)
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)
    eos = tiny_tokenizer.eos_token_id
    torch.manual_seed(0)
    responses, response_mask, stop = generate_responses(model, ids, mask, settings(tiny_tokenizer), batch_size=5)
    assert responses.shape[0] == 12 and responses.shape[1] <= 6
    assert len({tuple(r.tolist()) for r in responses}) > 3  # sampled, not top-1
    assert model.generation_config.top_k == 1  # restored
    for row, m, s in zip(responses, response_mask, stop):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any() and n >= 1
        assert (row[n:] == tiny_tokenizer.pad_token_id).all()
        assert bool(s) == bool((row[:n] == eos).any())
        if s:
            assert row[n - 1] == eos and not (row[: n - 1] == eos).any()


def test_generate_without_stop_token_samples_full_length(tiny_tokenizer):
    model = kit.build_causal_lm("gpt2", tiny_tokenizer)
    ids, mask = prompts(tiny_tokenizer)
    responses, response_mask, _ = generate_responses(
        model, ids, mask, settings(tiny_tokenizer, stop_token_ids=None), batch_size=2
    )
    assert responses.shape[1] == 6 and response_mask.all()


# ------------------------------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("arch", ["gpt_neox", "llama", "gpt2"])
def test_forward_response_matches_a_plain_log_softmax(tiny_tokenizer, arch):
    model = kit.build_causal_lm(arch, tiny_tokenizer)
    ids, mask = prompts(tiny_tokenizer)
    responses, response_mask, _ = generate_responses(model, ids, mask, settings(tiny_tokenizer), batch_size=8)
    full_ids, full_mask = torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1)
    T = responses.shape[1]
    out = forward_response(model, full_ids, full_mask, T, temperature=0.7, return_entropy=True)
    for row in range(full_ids.shape[0]):  # each row alone and unpadded
        real = full_mask[row] != 0
        logits = model(full_ids[row][real][None]).logits[0].float() / 0.7
        expected = torch.log_softmax(logits[:-1], -1).gather(-1, full_ids[row][real][1:, None])[:, 0]
        n = int(response_mask[row].sum())
        torch.testing.assert_close(out.logprobs[row, :n], expected[-n:], atol=1e-5, rtol=1e-5)
        assert (out.logprobs[row, n:] == 0).all() and (out.entropy[row, n:] == 0).all()
    assert (out.entropy[response_mask != 0] > 0).all()


def test_values_are_read_at_the_state_before_each_token(tiny_tokenizer):
    policy = kit.build_causal_lm("llama", tiny_tokenizer)
    critic = kit.build_sequence_classifier("llama", tiny_tokenizer)
    ids, mask = prompts(tiny_tokenizer)
    responses, response_mask, _ = generate_responses(policy, ids, mask, settings(tiny_tokenizer), batch_size=8)
    full_ids, full_mask = torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1)
    T = responses.shape[1]
    P = ids.shape[1]
    out = forward_response(PolicyAndValueModel(policy, critic), full_ids, full_mask, T, return_values=True)
    values = get_token_values(critic, full_ids, full_mask)[:, P - 1 : P - 1 + T] * response_mask
    torch.testing.assert_close(out.values, values)
    shared = AutoModelForCausalLMWithValueHead.from_model(policy)
    out = forward_response(PolicyAndValueModel(shared, use_policy_value_head=True), full_ids, full_mask, T,
                           return_values=True)  # fmt: skip
    expected = shared(full_ids, attention_mask=full_mask).value[:, P - 1 : P - 1 + T] * response_mask
    torch.testing.assert_close(out.values, expected, atol=1e-5, rtol=1e-5)


def generator(tokenizer, reward, reference, **kwargs) -> RolloutGenerator:
    kwargs.setdefault("policy_of", lambda m: m.policy)
    return RolloutGenerator(settings(tokenizer, **kwargs.pop("sampling", {})), RolloutReward(reward, tokenizer),
                            reference, forward_batch_size=kwargs.pop("forward_batch_size", 2), **kwargs)  # fmt: skip


def test_rollout_with_reference_equal_to_policy(tiny_tokenizer_pad_eos):
    tok = tiny_tokenizer_pad_eos
    policy = kit.build_causal_lm("llama", tok)
    critic = kit.build_sequence_classifier("llama", tok)
    reward = kit.build_sequence_classifier("llama", tok, seed=1)
    model = PolicyAndValueModel(policy, critic)
    make = generator(tok, reward, ReferencePolicy(kit.build_causal_lm("llama", tok)), with_values=True,
                     sampling={"num_samples_per_prompt": 2})  # fmt: skip
    ids, mask = prompts(tok)
    torch.manual_seed(0)
    rollout = make(model, ids, mask)
    assert rollout.batch_size == 6 and rollout.num_samples_per_prompt == 2
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[1]) and torch.equal(rollout.prompt_ids[2], ids[1])
    torch.testing.assert_close(rollout.ref_logprobs, rollout.logprobs)  # reference == policy: KL exactly 0
    assert rollout.values.shape == rollout.logprobs.shape and set(rollout.timings) == {"generation", "scoring"}
    for row in range(rollout.batch_size):  # pad == eos: the score is read at the real final eos, as if unpadded
        real = rollout.attention_mask[row] != 0
        expected = get_sequence_scores(reward, rollout.input_ids[row][real][None], torch.ones(1, int(real.sum())))
        torch.testing.assert_close(rollout.scores[row : row + 1], expected, atol=1e-5, rtol=1e-5)
    sub = rollout.select(slice(0, 2)).to("cpu")
    assert sub.batch_size == 2 and sub.num_samples_per_prompt == 2
    parts = rollout.split(4)
    assert [p.batch_size for p in parts] == [4, 2] and torch.equal(parts[1].scores, rollout.scores[4:])


def test_missing_eos_penalty_and_text_rewards(tiny_tokenizer):
    policy = kit.build_causal_lm("gpt_neox", tiny_tokenizer)
    seen = {"prompts": [], "completions": []}

    def length_reward(prompts, completions):
        seen["prompts"] += prompts
        seen["completions"] += completions
        return [float(len(c)) for c in completions]

    make = generator(tiny_tokenizer, length_reward, ReferencePolicy(policy), missing_eos_penalty=2.5,
                     policy_of=lambda m: m)  # fmt: skip
    ids, mask = prompts(tiny_tokenizer)
    rollout = make(policy, ids, mask)
    assert seen["prompts"] == ["This man is a", "Describe some fresh bread.", "Hi"]
    lengths = torch.tensor([float(len(c)) for c in seen["completions"]])
    torch.testing.assert_close(rollout.scores, lengths - 2.5 * (~rollout.contains_stop).float())


def test_reward_model_with_another_vocabulary_is_refused(tiny_tokenizer):
    small = kit.build_sequence_classifier("llama", tiny_tokenizer, vocab_size=100)
    with pytest.raises(ValueError, match=r"reward_model=\(model, its_tokenizer\)"):
        RolloutReward(small, tiny_tokenizer)
    assert not RolloutReward((small, tiny_tokenizer), tiny_tokenizer).uses_token_ids


def test_lora_reference_is_the_base_with_adapters_disabled(tiny_tokenizer):
    base = kit.build_causal_lm("llama", tiny_tokenizer)
    frozen_copy = kit.build_causal_lm("llama", tiny_tokenizer)
    policy = apply_lora(base, r=4, init_lora_weights=False)  # non-zero adapters: policy != base
    make = generator(tiny_tokenizer, kit.build_sequence_classifier("llama", tiny_tokenizer), ReferencePolicy(),
                     policy_of=lambda m: m)  # fmt: skip
    assert "adapters disabled" in make.reference.describe()
    ids, mask = prompts(tiny_tokenizer)
    rollout = make(policy, ids, mask)
    expected = forward_response(frozen_copy, rollout.input_ids, rollout.attention_mask, rollout.response_length,
                                temperature=0.7)  # fmt: skip
    torch.testing.assert_close(rollout.ref_logprobs, expected.logprobs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rollout.logprobs, rollout.ref_logprobs)
