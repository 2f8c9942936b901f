"""Shared-prefix rollouts (`trl_ext.rollout.shared_prefix`): each distinct prompt is run once and its KV cache fanned
out to its samples. Exactness against running every repeated prompt: the same first-step logits, the same sampled
tokens for a seed, the same recorded log-probs, the same reference log-probs, critic values and reward scores."""

from __future__ import annotations

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.models import apply_lora, get_sequence_scores
from trl_ext.models.modulated import ModulatedCausalLM
from trl_ext.ops.sequences import distinct_prompts
from trl_ext.rollout import sampling
from trl_ext.rollout.shared_prefix import (
    prefill_prompts,
    shared_prompt_logprobs,
    shared_prompt_scores,
    shared_prompt_values,
)
from trl_ext.trainers import (
    PolicyAndValueModel,
    PromptCollator,
    ReferencePolicy,
    RolloutGenerator,
    RolloutReward,
    SamplingSettings,
    forward_response,
    generate_responses,
)

TEXTS = ("This man is a", "Describe some fresh bread.", "Hi", "A")  # "A": a one-token prompt (all-pad prefix)
N = 3


def prompts(tokenizer, n=N):
    batch = PromptCollator(tokenizer.pad_token_id)([{"input_ids": tokenizer(t)["input_ids"]} for t in TEXTS])
    return batch["input_ids"].repeat_interleave(n, 0), batch["attention_mask"].repeat_interleave(n, 0)


def settings(tokenizer, **kwargs) -> SamplingSettings:
    defaults = dict(max_new_tokens=7, pad_token_id=tokenizer.pad_token_id, temperature=0.7,
                    stop_token_ids=(tokenizer.eos_token_id,), eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return SamplingSettings(**{**defaults, **kwargs})


def input_tokens(model: torch.nn.Module) -> list[int]:
    """A list that receives the number of input tokens of every forward of ``model``'s embedding."""
    counts: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: counts.append(args[0].numel()))
    return counts


def sample(model, ids, mask, tokenizer, share, batch_size, seed=0, **kwargs):
    """``generate_responses`` with a seed; also returns the scores the sampler saw at the first step."""
    first: list[torch.Tensor] = []
    call = sampling.SampleAndRecord.__call__

    def spy(self, input_ids, scores):
        if not self._steps:
            first.append(scores.detach().clone())
        return call(self, input_ids, scores)

    torch.manual_seed(seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling.SampleAndRecord, "__call__", spy)
        out = generate_responses(
            model, ids, mask, settings(tokenizer, **kwargs), batch_size, return_logprobs=True, share_prompts=share
        )
    return out, torch.cat(first)


def test_distinct_prompts_compares_ids_and_masks():
    ids = torch.tensor([[1, 5], [1, 5], [1, 5], [7, 8]])
    mask = torch.tensor([[0, 1], [0, 1], [1, 1], [1, 1]])  # row 2: the same ids, but its first token is real
    unique, unique_mask, inverse = distinct_prompts(ids, mask)
    assert unique.shape[0] == 3 and torch.equal(unique[inverse], ids) and torch.equal(unique_mask[inverse], mask)
    assert distinct_prompts(ids[2:], mask[2:]) is None  # all distinct: nothing to share


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
@pytest.mark.parametrize("batch_size", [64, 5])  # 5: generate calls that split a prompt's samples
def test_generation_samples_the_same_tokens_and_logprobs(tiny_tokenizer, arch, batch_size):
    model = kit.build_causal_lm(arch, tiny_tokenizer).eval()
    ids, mask = prompts(tiny_tokenizer)
    counts = input_tokens(model)
    naive, naive_first = sample(model, ids, mask, tiny_tokenizer, share=False, batch_size=batch_size)
    naive_prefill = counts[0]
    counts.clear()
    shared, shared_first = sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=batch_size)
    torch.testing.assert_close(shared_first, naive_first, atol=1e-5, rtol=1e-5)  # the first step's logits
    assert torch.equal(shared[0], naive[0]) and torch.equal(shared[1], naive[1]) and torch.equal(shared[2], naive[2])
    torch.testing.assert_close(shared[3], naive[3], atol=1e-5, rtol=1e-5)
    if batch_size == 64:  # one call: the 4 distinct prompts' P - 1 tokens, then one token per row
        P = ids.shape[1]
        assert naive_prefill == ids.numel() and counts[:2] == [len(TEXTS) * (P - 1), ids.shape[0]]
    # The recorded log-probs are the model's at the sampled tokens (teacher-forced, no cache).
    responses, response_mask, _, logprobs = shared
    full = forward_response(model, torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1),
                            responses.shape[1], temperature=0.7)  # fmt: skip
    torch.testing.assert_close(logprobs, full.logprobs, atol=1e-5, rtol=1e-5)


def test_generation_without_padding(tiny_tokenizer):
    """No padding at all (``generate`` then drops the mask): still only the last prompt token is run again."""
    model = kit.build_causal_lm("llama", tiny_tokenizer).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]).repeat_interleave(N, 0)
    naive, naive_first = sample(model, ids, torch.ones_like(ids), tiny_tokenizer, share=False, batch_size=64)
    shared, shared_first = sample(model, ids, torch.ones_like(ids), tiny_tokenizer, share=True, batch_size=64)
    torch.testing.assert_close(shared_first, naive_first, atol=1e-5, rtol=1e-5)
    assert torch.equal(shared[0], naive[0])
    torch.testing.assert_close(shared[3], naive[3], atol=1e-5, rtol=1e-5)


def test_sharing_keeps_the_sampling_distribution(tiny_tokenizer):
    """Without a common seed: the first token's frequencies over many draws match the model's probabilities."""
    model = kit.build_causal_lm("llama", tiny_tokenizer, vocab_size=8).eval()
    ids = torch.tensor([[2, 5, 6, 7, 3]]).repeat(4000, 1)
    mask = torch.ones_like(ids)
    torch.manual_seed(7)
    one_token = settings(tiny_tokenizer, max_new_tokens=1, stop_token_ids=None, temperature=1.0)
    responses, *_ = generate_responses(model, ids, mask, one_token, batch_size=4000, share_prompts=True)
    probs = torch.softmax(model(ids[:1]).logits[0, -1].float(), -1).detach()
    counts = torch.bincount(responses[:, 0], minlength=8).double()
    expected = probs.double() * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum())
    assert chi2 < 24.322  # chi-square, 7 degrees of freedom, p = 0.001


def test_lora_and_modulated_policies_share_their_prompts(tiny_tokenizer):
    ids, mask = prompts(tiny_tokenizer)
    lora = apply_lora(kit.build_causal_lm("llama", tiny_tokenizer), r=4, init_lora_weights=False).eval()
    modulated = ModulatedCausalLM.from_base(kit.build_causal_lm("llama", tiny_tokenizer), "model").eval()
    with torch.no_grad():
        for p in modulated.modulation_backbone.parameters():
            p.add_(0.1 * torch.randn_like(p))
    for model in (lora, modulated):
        assert prefill_prompts(model, ids, mask) is not None
        naive, naive_first = sample(model, ids, mask, tiny_tokenizer, share=False, batch_size=64)
        shared, shared_first = sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=64)
        torch.testing.assert_close(shared_first, naive_first, atol=1e-5, rtol=1e-5)
        assert torch.equal(shared[0], naive[0])
        torch.testing.assert_close(shared[3], naive[3], atol=1e-5, rtol=1e-5)


def rows(tokenizer, arch="llama", T=6):
    """A policy, repeated prompts and random right-padded responses (some end with a real eos, = pad here)."""
    policy = kit.build_causal_lm(arch, tokenizer).eval()
    ids, mask = prompts(tokenizer)
    g = torch.Generator().manual_seed(3)
    responses = torch.randint(5, len(tokenizer), (ids.shape[0], T), generator=g)
    lengths = torch.randint(1, T + 1, (ids.shape[0],), generator=g)
    lengths[:2] = torch.tensor([1, T])
    response_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    responses[torch.arange(ids.shape[0]), lengths - 1] = tokenizer.eos_token_id
    responses = torch.where(response_mask != 0, responses, torch.full_like(responses, tokenizer.pad_token_id))
    return policy, ids, mask, responses, response_mask


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
def test_scoring_passes_equal_the_full_rows(tiny_tokenizer_pad_eos, arch):
    tok = tiny_tokenizer_pad_eos  # pad == eos: scores and values must still be read from the masks
    policy, ids, mask, responses, response_mask = rows(tok, arch)
    full_ids, full_mask, T = torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), responses.shape[1]
    reference = kit.build_causal_lm(arch, tok, seed=5).eval()
    expected = forward_response(reference, full_ids, full_mask, T, temperature=0.7).logprobs
    got = shared_prompt_logprobs(reference, ids, mask, responses, response_mask, temperature=0.7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    critic = kit.build_sequence_classifier(arch, tok, seed=6).eval()
    with torch.no_grad():
        expected = PolicyAndValueModel(policy, critic).critic_values(full_ids, full_mask, T)
    torch.testing.assert_close(shared_prompt_values(critic, ids, mask, responses, response_mask), expected,
                               atol=1e-5, rtol=1e-5)  # fmt: skip

    reward = kit.build_sequence_classifier(arch, tok, seed=7).eval()
    with torch.no_grad():
        expected = get_sequence_scores(reward, full_ids, full_mask)
    torch.testing.assert_close(shared_prompt_scores(reward, ids, mask, responses, response_mask), expected,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    # All prompts distinct: nothing to share, the caller runs the rows as they are.
    assert shared_prompt_logprobs(reference, ids[::N], mask[::N], responses[::N], response_mask[::N]) is None


@pytest.mark.parametrize("forward_batch_size", [64, 4])
def test_rollout_generator_with_and_without_sharing(tiny_tokenizer, forward_batch_size):
    tok = tiny_tokenizer
    policy = kit.build_causal_lm("llama", tok)
    model = PolicyAndValueModel(policy, kit.build_sequence_classifier("llama", tok, seed=1))
    reward = RolloutReward(kit.build_sequence_classifier("llama", tok, seed=2), tok)
    reference = ReferencePolicy(kit.build_causal_lm("llama", tok, seed=3))
    batch = PromptCollator(tok.pad_token_id)([{"input_ids": tok(t)["input_ids"]} for t in TEXTS])
    models = {"policy": policy, "reference": reference.model, "critic": model.value_model, "reward": reward.model}
    counts = {name: input_tokens(m) for name, m in models.items()}

    def run(shared_prefix: bool):
        make = RolloutGenerator(
            settings(tok, num_samples_per_prompt=N), reward, reference, forward_batch_size,
            policy_of=lambda m: m.policy, with_values=True, shared_prefix=shared_prefix,
        )  # fmt: skip
        for c in counts.values():
            c.clear()
        torch.manual_seed(0)
        return make(model, batch["input_ids"], batch["attention_mask"]), {k: sum(c) for k, c in counts.items()}

    (naive, naive_tokens), (shared, shared_tokens) = run(False), run(True)
    assert torch.equal(shared.response_ids, naive.response_ids) and torch.equal(shared.prompt_ids, naive.prompt_ids)
    for name in ("logprobs", "ref_logprobs", "values", "scores"):
        torch.testing.assert_close(getattr(shared, name), getattr(naive, name), atol=1e-5, rtol=1e-5, msg=name)
    for name in counts:  # every model ran each distinct prompt once: fewer input tokens
        assert shared_tokens[name] < naive_tokens[name], name
