"""Exact P(bad) by enumeration (`trl_ext.eval.analytic`) against brute force over every full-length sequence."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.eval import BadOutputProbability, bad_output_probability, prompt_token_ids
from trl_ext.eval.analytic import ResponseKL, _PrunedReservoir, response_kl
from trl_ext.models import AutoModelForCausalLMWithValueHead, ModulatedCausalLM
from trl_ext.rewards import LexicalReward

PROMPT = "This man is a"
# Output-layer scale per architecture that turns the near-uniform random model into a peaked one (GPT-2's head is
# tied to its input embeddings, so a smaller factor already peaks it).
HEAD_SCALE = {"gpt_neox": 20.0, "llama": 20.0, "gpt2": 2.5}


def _peaked(model, scale: float, dtype=torch.float64):
    """Scale the output layer (a peaked distribution) and cast: float64 by default, so that the exact value and the
    brute force, which run differently shaped batches, agree far below the 1e-6 tolerance."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model.to(dtype).eval()


def _tiny_lm(arch: str, tokenizer, dtype=torch.float64):
    return _peaked(kit.build_causal_lm(arch, tokenizer), HEAD_SCALE[arch], dtype)


def _small_vocab_lm(vocab_size: int = 12, seed: int = 0):
    """A GPT-NeoX with a 12-token vocabulary, built directly from a config (no tokenizer)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    return _peaked(GPTNeoXForCausalLM(config), 8.0)


def _logprobs(model, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
    return torch.log_softmax(logits.double() / temperature, dim=-1)


def brute_force(model, prompt: list[int], bad, stops, length: int, temperature: float = 1.0, vocab=None) -> float:
    """Σ over *every* token sequence y of exactly `length` tokens of p(y) · 1[y cut at its first stop is bad].

    The model is run on the whole sequence with no cache and no stop handling; sequences that continue after a
    stop token share the response they were cut to, and their continuations sum to that response's probability.
    """
    vocab = vocab or model.config.vocab_size
    bad, stops = set(bad), set(stops)
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=length - 1)), dtype=torch.long)
    prefixes = prefixes.reshape(-1, length - 1) if length > 1 else torch.zeros(1, 0, dtype=torch.long)
    p = len(prompt)
    ids = torch.cat([torch.tensor(prompt)[None].expand(prefixes.shape[0], -1), prefixes], dim=1)
    logprobs = _logprobs(model, ids, temperature)  # (N, p + L - 1, V)
    prefix_logp = torch.zeros(prefixes.shape[0], dtype=torch.float64)
    for t in range(length - 1):
        prefix_logp += logprobs[:, p - 1 + t].gather(1, prefixes[:, t : t + 1])[:, 0]
    seq_logp = prefix_logp[:, None] + logprobs[:, -1]  # (N, V): every full sequence
    last_bad = torch.tensor([v in bad for v in range(vocab)])
    total = 0.0
    for row, tokens in enumerate(prefixes.tolist()):
        flags = last_bad
        for token in tokens:  # walk the response until it is bad or stops
            if token in bad:
                flags = torch.ones(vocab, dtype=torch.bool)
                break
            if token in stops:
                flags = torch.zeros(vocab, dtype=torch.bool)
                break
        total += float(seq_logp[row][flags].exp().sum())
    return total


@pytest.fixture
def lm_setup(tiny_tokenizer):
    """A peaked tiny GPT-NeoX, its prompt ids, a likely EOS and a bad set with likely and rude tokens."""
    model = _tiny_lm("gpt_neox", tiny_tokenizer)
    prompt = prompt_token_ids(tiny_tokenizer, PROMPT)
    first = _logprobs(model, torch.tensor([prompt]), 1.0)[0, -1]
    order = first.argsort(descending=True).tolist()
    eos = order[0]  # the most likely first token stops the response: EOS handling matters a lot
    rude = LexicalReward(kit.RUDE_WORDS, tokenizer=tiny_tokenizer).bad_token_ids
    bad = sorted(set(rude) | set(order[3:6]) - {eos})
    return model, prompt, bad, eos


@pytest.mark.parametrize("arch", ["gpt_neox", "llama", "gpt2"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_two_tokens_equals_brute_force(arch, use_cache, tiny_tokenizer):
    model = _tiny_lm(arch, tiny_tokenizer)
    prompt = prompt_token_ids(tiny_tokenizer, PROMPT)
    first = _logprobs(model, torch.tensor([prompt]), 1.0)[0, -1].argsort(descending=True).tolist()
    eos, bad = first[1], sorted({first[0], first[4], *first[10:20]})
    result = bad_output_probability(model, prompt, bad, eos_token_id=eos, use_cache=use_cache, batch_size=200)
    expected = brute_force(model, prompt, bad, [eos], 2)
    assert isinstance(result, BadOutputProbability)
    assert result.exact and result.lower == result.upper == result.probability and result.pruned_mass == 0.0
    assert result.probability == pytest.approx(expected, rel=1e-6)
    assert result.log_probability == pytest.approx(math.log(expected), abs=1e-6)
    # 1 prompt pass + ceil(#good first tokens / 200) batches of prefixes
    good = len(tiny_tokenizer) - len(bad) - 1
    assert result.num_forward_passes == 1 + math.ceil(good / 200)
    assert result.num_prefixes == 1 + good
    assert 0.0 < result.probability < 1.0


def test_float32_model_within_its_precision(tiny_tokenizer):
    """In float32 the logits of differently shaped batches differ by ~1e-6, so the agreement is ~1e-6 relative."""
    model = _tiny_lm("gpt_neox", tiny_tokenizer, dtype=torch.float32)
    prompt = prompt_token_ids(tiny_tokenizer, PROMPT)
    bad = LexicalReward(kit.RUDE_WORDS, tokenizer=tiny_tokenizer).bad_token_ids
    result = bad_output_probability(model, prompt, bad)
    expected = brute_force(model, prompt, bad, [tiny_tokenizer.eos_token_id], 2)
    assert result.probability == pytest.approx(expected, rel=1e-5)


def test_eos_ends_the_response(lm_setup):
    """B18: an EOS first token ends the response; treating it as an ordinary token over-counts P(bad)."""
    model, prompt, bad, eos = lm_setup
    with_eos = bad_output_probability(model, prompt, bad, eos_token_id=eos)
    no_eos = bad_output_probability(model, prompt, bad, eos_token_id=[])
    assert with_eos.probability == pytest.approx(brute_force(model, prompt, bad, [eos], 2), rel=1e-6)
    assert no_eos.probability == pytest.approx(brute_force(model, prompt, bad, [], 2), rel=1e-6)
    p_eos = float(_logprobs(model, torch.tensor([prompt]), 1.0)[0, -1, eos].exp())
    assert p_eos > 0.1
    # the difference is exactly the mass of "EOS, then a bad token", which only the no-EOS reading counts
    after_eos = _logprobs(model, torch.tensor([[*prompt, eos]]), 1.0)[0, -1, bad].exp().sum().item()
    assert no_eos.probability - with_eos.probability == pytest.approx(p_eos * after_eos, rel=1e-4)
    assert p_eos * after_eos > 1e-3
    # an EOS that is listed as bad counts as bad (and still ends the response)
    eos_bad = bad_output_probability(model, prompt, [*bad, eos], eos_token_id=eos)
    assert eos_bad.probability == pytest.approx(brute_force(model, prompt, [*bad, eos], [eos], 2), rel=1e-6)
    assert eos_bad.probability > with_eos.probability + p_eos


def test_default_eos_comes_from_the_model(lm_setup, tiny_tokenizer):
    model, prompt, bad, _ = lm_setup
    assert model.generation_config.eos_token_id == tiny_tokenizer.eos_token_id
    default = bad_output_probability(model, prompt, bad)
    explicit = bad_output_probability(model, prompt, bad, eos_token_id=tiny_tokenizer.eos_token_id)
    assert default.probability == explicit.probability
    assert default.probability == pytest.approx(
        brute_force(model, prompt, bad, [tiny_tokenizer.eos_token_id], 2), rel=1e-6
    )


@pytest.mark.parametrize("length", [1, 3, 4])
def test_longer_responses_on_a_small_vocabulary(length):
    model = _small_vocab_lm()
    prompt, bad, eos = [1, 5, 7], [3, 9], 0
    result = bad_output_probability(model, prompt, bad, max_new_tokens=length, eos_token_id=eos, batch_size=7)
    expected = brute_force(model, prompt, bad, [eos], length)
    assert result.exact
    assert result.probability == pytest.approx(expected, rel=1e-6)
    good = 12 - 3
    assert result.num_prefixes == sum(good**k for k in range(length))
    if length > 1:  # longer responses have more chances to be bad
        shorter = bad_output_probability(model, prompt, bad, max_new_tokens=length - 1, eos_token_id=eos)
        assert result.probability > shorter.probability


@pytest.mark.parametrize("wrap", ["plain", "modulated", "value_head"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_prompt_runs_once_and_its_cache_is_reused(tiny_tokenizer, wrap, use_cache):
    base = _tiny_lm("llama", tiny_tokenizer)
    model = {
        "plain": lambda: base,
        "modulated": lambda: ModulatedCausalLM.from_base(base, "model").eval(),
        "value_head": lambda: AutoModelForCausalLMWithValueHead.from_model(base),
    }[wrap]()
    shapes = []
    hook = base.get_input_embeddings().register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    prompt = prompt_token_ids(tiny_tokenizer, PROMPT)
    try:
        result = bad_output_probability(model, prompt, [7, 8], eos_token_id=0, batch_size=300, use_cache=use_cache)
    finally:
        hook.remove()
    good = len(tiny_tokenizer) - 3
    p = len(prompt)
    if use_cache:  # the prompt once, then only the new token of each prefix
        assert shapes == [(1, p), (300, 1), (good - 300, 1)]
    else:
        assert shapes == [(1, p), (300, p + 1), (good - 300, p + 1)]
    assert result.num_forward_passes == 3


def test_batch_size_and_cache_do_not_change_the_value():
    model = _small_vocab_lm(seed=1)
    values = [
        bad_output_probability(model, [2, 4], [5], max_new_tokens=3, batch_size=b, use_cache=c).probability
        for b in (1, 5, 1000)
        for c in (True, False)
    ]
    assert max(values) - min(values) < 1e-6 * values[0]


def test_pruning_gives_a_certified_interval():
    model = _small_vocab_lm(seed=2)
    prompt, bad = [1, 2, 3], [4, 10]
    exact = bad_output_probability(model, prompt, bad, max_new_tokens=4, eos_token_id=0)
    pruned = bad_output_probability(model, prompt, bad, max_new_tokens=4, eos_token_id=0, prune_below=1e-4)
    assert not pruned.exact and pruned.pruned_mass > 0
    assert pruned.lower <= exact.probability <= pruned.upper
    assert pruned.upper == pytest.approx(pruned.lower + pruned.pruned_mass)
    assert pruned.upper - pruned.lower < 0.02  # far narrower than [0, 1]
    assert pruned.probability == pruned.lower
    assert pruned.num_prefixes < exact.num_prefixes and pruned.num_forward_passes <= exact.num_forward_passes
    # more pruning: a wider interval that still contains the exact value
    coarse = bad_output_probability(model, prompt, bad, max_new_tokens=4, eos_token_id=0, prune_below=1e-3)
    assert coarse.lower <= pruned.lower and coarse.pruned_mass >= pruned.pruned_mass
    assert coarse.lower <= exact.probability <= coarse.upper


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(lm_setup, temperature):
    model, prompt, bad, eos = lm_setup
    result = bad_output_probability(model, prompt, bad, eos_token_id=eos, temperature=temperature)
    assert result.probability == pytest.approx(brute_force(model, prompt, bad, [eos], 2, temperature), rel=1e-6)
    base = bad_output_probability(model, prompt, bad, eos_token_id=eos)
    assert abs(result.probability - base.probability) > 1e-3


@pytest.mark.parametrize("kind", ["linear_head", "model"])
def test_modulated_policy_equals_brute_force_on_its_own_distribution(tiny_tokenizer, kind):
    base = _tiny_lm("gpt_neox", tiny_tokenizer)
    policy = ModulatedCausalLM.from_base(base, kind, init_scale_divider=0.2).eval()
    prompt = prompt_token_ids(tiny_tokenizer, PROMPT)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = policy(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.modulation_logits.abs().max() > 0.1  # a non-zero modulation head
    torch.testing.assert_close(torch.log_softmax(out.logits, -1), out.logits, atol=1e-5, rtol=0)  # already log q
    bad = LexicalReward(kit.RUDE_WORDS, tokenizer=tiny_tokenizer).bad_token_ids
    eos = tiny_tokenizer.eos_token_id
    result = bad_output_probability(policy, prompt, bad)
    assert result.probability == pytest.approx(brute_force(policy, prompt, bad, [eos], 2), rel=1e-6)
    p_base = bad_output_probability(base, prompt, bad).probability
    assert abs(result.probability - p_base) > 0.1 * p_base  # the modulation changed the distribution


def test_value_head_model_matches_its_language_model(lm_setup):
    model, prompt, bad, eos = lm_setup
    wrapped = AutoModelForCausalLMWithValueHead.from_model(model)
    plain = bad_output_probability(model, prompt, bad, eos_token_id=eos)
    via_wrapper = bad_output_probability(wrapped, prompt, bad, eos_token_id=eos)
    assert via_wrapper.probability == pytest.approx(plain.probability, rel=1e-6)


def test_lora_policy_equals_brute_force(tiny_tokenizer):
    from trl_ext.models import apply_lora

    base = _tiny_lm("llama", tiny_tokenizer, dtype=torch.float32)
    prompt = prompt_token_ids(tiny_tokenizer, PROMPT)
    bad = LexicalReward(kit.RUDE_WORDS, tokenizer=tiny_tokenizer).bad_token_ids
    before = bad_output_probability(base, prompt, bad).probability
    model = apply_lora(base, r=4)
    with torch.no_grad():  # non-zero adapters, so that the LoRA policy differs from its base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    result = bad_output_probability(model, prompt, bad)
    expected = brute_force(model, prompt, bad, [tiny_tokenizer.eos_token_id], 2, vocab=len(tiny_tokenizer))
    assert result.probability == pytest.approx(expected, rel=1e-5)
    assert abs(result.probability - before) > 0.01 * before


def test_monte_carlo_agrees_with_the_exact_value(lm_setup, tiny_tokenizer):
    """Sampling with `generate` (which stops at EOS and pads after it) and scoring the responses with a token-mode
    `LexicalReward` gives a bad fraction within 4 standard errors of the exact value."""
    model, prompt, bad, eos = lm_setup
    model.generation_config.eos_token_id = eos
    exact = bad_output_probability(model, prompt, bad, eos_token_id=eos).probability
    n = 4000
    ids = torch.tensor([prompt]).expand(n, -1)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        top_k=0,
        top_p=1.0,
        max_new_tokens=2,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    response = out[:, len(prompt) :]
    # 1 up to and including the first EOS (the rollout's response mask)
    after_eos = (response == eos).long().cumsum(1) - (response == eos).long()
    mask = (after_eos == 0).long()
    reward = LexicalReward(token_ids=bad, present_reward=1.0, absent_reward=0.0)
    fraction = reward.score_token_ids(ids, response, tiny_tokenizer, completion_mask=mask).mean().item()
    stderr = math.sqrt(exact * (1 - exact) / n)
    assert abs(fraction - exact) < 4 * stderr


def test_accepts_tensors_and_lexical_rewards_and_restores_mode(lm_setup, tiny_tokenizer):
    model, prompt, bad, eos = lm_setup
    model.train()
    reward = LexicalReward(token_ids=bad)
    a = bad_output_probability(model, torch.tensor(prompt), reward, eos_token_id=torch.tensor([eos]))
    b = bad_output_probability(model, torch.tensor([prompt]), torch.tensor(bad), eos_token_id=eos)
    assert model.training  # the previous mode is restored
    assert a.probability == b.probability
    assert all(p.grad is None for p in model.parameters())


def test_empty_bad_set_is_zero_without_running_the_model(lm_setup):
    model, prompt, _, eos = lm_setup
    result = bad_output_probability(model, prompt, [], eos_token_id=eos)
    assert result.probability == 0.0 and result.upper == 0.0 and result.exact
    assert result.log_probability == float("-inf") and result.num_forward_passes == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_ids": []}, "prompt_ids is empty"),
        ({"prompt_ids": [[1, 2], [3, 4]]}, "integer token ids"),
        ({"prompt_ids": torch.ones(2, 3, dtype=torch.long)}, "one unpadded prompt"),
        ({"prompt_ids": [5, -1]}, "negative id"),
        ({"prompt_ids": [5, 10_000]}, "outside the model's vocabulary"),
        ({"bad_token_ids": [3, 512]}, "bad_token_ids holds id 512"),
        ({"bad_token_ids": [-2]}, "negative id"),
        ({"bad_token_ids": torch.tensor([1.5])}, "integer token ids"),
        ({"eos_token_id": 600}, "eos_token_id holds id 600"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"prune_below": 1.0}, "prune_below"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_inputs_raise_clear_errors(lm_setup, kwargs, match):
    model, prompt, bad, eos = lm_setup
    arguments = {"prompt_ids": prompt, "bad_token_ids": bad, **kwargs}
    with pytest.raises(ValueError, match=match):
        bad_output_probability(model, arguments.pop("prompt_ids"), arguments.pop("bad_token_ids"), **arguments)


# ------------------------------------------------------------------------------------------------ pruned remainder
@pytest.mark.parametrize(("length", "prune"), [(2, 0.05), (3, 1e-2), (3, 0.05), (4, 1e-3), (4, 0.05)])
def test_remainder_estimate_agrees_with_the_exact_value(length, prune):
    """With pruning, the estimate lies in the certified interval and within 4 standard errors of the exact value
    (prune_below=0), and a seed reproduces it."""
    model = _small_vocab_lm(seed=2)
    prompt, bad = [1, 2, 3], [4, 10]
    exact = bad_output_probability(model, prompt, bad, max_new_tokens=length, eos_token_id=0)
    kwargs = dict(max_new_tokens=length, eos_token_id=0, prune_below=prune, remainder_samples=200, batch_size=64)
    result = bad_output_probability(model, prompt, bad, generator=7, **kwargs)
    assert not result.exact and result.pruned_mass > 0.01 and result.remainder_samples == 200
    assert result.lower <= result.estimate <= result.upper
    assert result.stderr > 0
    assert abs(result.estimate - exact.probability) < 4 * result.stderr
    assert result.probability == result.lower  # the certified numbers are unchanged by the sampling
    # far tighter than the certified interval
    assert result.stderr < 0.05 * (result.upper - result.lower)
    again = bad_output_probability(model, prompt, bad, generator=torch.Generator().manual_seed(7), **kwargs)
    assert (again.estimate, again.stderr) == (result.estimate, result.stderr)
    other = bad_output_probability(model, prompt, bad, generator=8, **kwargs)
    assert other.estimate != result.estimate and abs(other.estimate - exact.probability) < 4 * other.stderr


def test_remainder_estimate_is_unbiased_over_seeds():
    """The mean of many small-sample estimates converges to the exact value (a few SE of that mean), and each
    seed's standard error is about the spread of the estimates across seeds."""
    model = _small_vocab_lm(seed=2)
    prompt, bad = [1, 2, 3], [4, 10]
    exact = bad_output_probability(model, prompt, bad, max_new_tokens=4, eos_token_id=0).probability
    runs = [
        bad_output_probability(
            model, prompt, bad, max_new_tokens=4, eos_token_id=0, prune_below=0.05, remainder_samples=10, generator=s
        )
        for s in range(30)
    ]
    estimates = torch.tensor([r.estimate for r in runs], dtype=torch.float64)
    spread = float(estimates.std())
    assert abs(float(estimates.mean()) - exact) < 4 * spread / math.sqrt(len(runs))
    assert 0.5 * spread < float(torch.tensor([r.stderr for r in runs]).mean()) < 2 * spread


def test_two_tokens_remainder_on_a_real_vocabulary(lm_setup):
    """max_new_tokens=2 on a 512-token vocabulary: the pruned first tokens are scored exactly, the only noise is
    which of them were drawn."""
    model, prompt, bad, eos = lm_setup
    exact = bad_output_probability(model, prompt, bad, eos_token_id=eos)
    pruned = bad_output_probability(model, prompt, bad, eos_token_id=eos, prune_below=1e-3, remainder_samples=300)
    assert pruned.pruned_mass > 1e-3 and pruned.num_prefixes < exact.num_prefixes
    assert pruned.lower <= pruned.estimate <= pruned.upper
    assert abs(pruned.estimate - exact.probability) < 4 * pruned.stderr
    # the prompt, the kept first tokens in batches of 256, then the 300 drawn pruned first tokens in 2 batches
    assert pruned.num_forward_passes == 1 + math.ceil((pruned.num_prefixes - 1) / 256) + 2


def test_nothing_pruned_means_no_sampling_error(lm_setup):
    model, prompt, bad, eos = lm_setup
    plain = bad_output_probability(model, prompt, bad, eos_token_id=eos)
    sampled = bad_output_probability(model, prompt, bad, eos_token_id=eos, remainder_samples=50, generator=3)
    for result in (plain, sampled):
        assert result.exact and result.estimate == result.probability and result.stderr == 0.0
        assert result.remainder_samples == 0
    assert sampled.num_forward_passes == plain.num_forward_passes
    unsampled = bad_output_probability(model, prompt, bad, eos_token_id=eos, prune_below=1e-3)
    assert not unsampled.exact and unsampled.estimate is None and unsampled.stderr is None


def test_reservoir_draws_in_proportion_to_probability():
    """Chunks streamed into the reservoir: every slot is an independent draw with probability p / total mass."""
    gen = torch.Generator().manual_seed(0)
    reservoir = _PrunedReservoir(40_000, gen)
    good_ids = torch.tensor([5, 6, 7])
    chunks = [
        (torch.zeros(1, 0, dtype=torch.long), torch.tensor([[0.1, 0.0, 0.05]])),  # 0: kept, not pruned
        (torch.tensor([[5], [7]]), torch.tensor([[0.02, 0.03, 0.0], [0.0, 0.0, 0.0]])),
        (torch.tensor([[6]]), torch.tensor([[0.2, 0.0, 0.1]])),
    ]
    expected = {}
    for rows, probs in chunks:
        reservoir.offer(rows, good_ids, probs.log().double())
        for r, row in enumerate(rows.tolist()):
            for c, p in enumerate(probs[r].tolist()):
                if p > 0:
                    expected[(*row, int(good_ids[c]))] = p
    total = sum(expected.values())
    assert reservoir.log_seen == pytest.approx(math.log(total))
    drawn = [tuple(t[:k]) for t, k in zip(reservoir.tokens.tolist(), reservoir.lengths.tolist())]
    assert set(drawn) == set(expected)
    for prefix, p in expected.items():
        share, n = drawn.count(prefix) / len(drawn), len(drawn)
        assert abs(share - p / total) < 4 * math.sqrt(p / total * (1 - p / total) / n), prefix


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"remainder_samples": 1}, "remainder_samples must be 0 or >= 2"),
        ({"remainder_samples": -3}, "remainder_samples must be an integer"),
        ({"remainder_samples": 4, "generator": "seed"}, "generator must be"),
    ],
)
def test_remainder_options_are_checked(lm_setup, kwargs, match):
    model, prompt, bad, eos = lm_setup
    with pytest.raises(ValueError, match=match):
        bad_output_probability(model, prompt, bad, eos_token_id=eos, prune_below=1e-3, **kwargs)


# ------------------------------------------------------------------------------------------------ response KL
def _brute_force_kl(model, ref, prompt: list[int], stops, length: int, vocab: int = 12) -> float:
    """Σ over every unended prefix g (length < L) of p_θ(g) · KL(p_θ(·|g) ‖ p_0(·|g)), one full forward each."""
    total = 0.0
    for k in range(length):
        prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=k)), dtype=torch.long)
        prefixes = prefixes.reshape(-1, k) if k else torch.zeros(1, 0, dtype=torch.long)
        ids = torch.cat([torch.tensor(prompt)[None].expand(prefixes.shape[0], -1), prefixes], dim=1)
        lp, lq = _logprobs(model, ids, 1.0), _logprobs(ref, ids, 1.0)
        logp = torch.zeros(prefixes.shape[0], dtype=torch.float64)
        for t in range(k):
            logp += lp[:, len(prompt) - 1 + t].gather(1, prefixes[:, t : t + 1])[:, 0]
        alive = ~torch.isin(prefixes, torch.tensor(sorted(stops))).any(dim=1)
        last_p, last_q = lp[:, -1], lq[:, -1]
        kl = (last_p.exp() * (last_p - last_q)).sum(-1)
        total += float((logp.exp() * kl)[alive].sum())
    return total


@pytest.mark.parametrize("length", [1, 2, 3])
def test_response_kl_agrees_with_brute_force(length):
    model, ref = _small_vocab_lm(seed=2), _small_vocab_lm(seed=3)
    prompt = [1, 2, 3]
    expected = _brute_force_kl(model, ref, prompt, {0}, length)
    result = response_kl(model, ref, prompt, max_new_tokens=length, num_samples=2000, generator=0, batch_size=700)
    assert isinstance(result, ResponseKL) and result.num_samples == 2000
    first = _brute_force_kl(model, ref, prompt, {0}, 1)
    assert result.first_token == pytest.approx(first, rel=1e-9)
    if length == 1:  # exact: every draw scores the same first-token KL
        assert result.value == pytest.approx(expected, rel=1e-9) and result.stderr < 1e-12
    else:
        assert result.stderr > 0 and abs(result.value - expected) < 4 * result.stderr
        assert result.value > first
    again = response_kl(model, ref, prompt, max_new_tokens=length, num_samples=2000, generator=0, batch_size=700)
    assert (again.value, again.stderr) == (result.value, result.stderr)  # a seed reproduces it


def test_response_kl_to_itself_is_zero_and_stops_end_responses(tiny_tokenizer):
    model = _tiny_lm("llama", tiny_tokenizer)
    prompt = prompt_token_ids(tiny_tokenizer, PROMPT)
    same = response_kl(model, model, prompt, num_samples=20)
    assert same.value == 0.0 and same.stderr == 0.0 and same.first_token == 0.0
    small, ref = _small_vocab_lm(seed=2), _small_vocab_lm(seed=3)
    # every token a stop token: only the first token's KL remains
    all_stop = response_kl(small, ref, [1, 2], max_new_tokens=3, eos_token_id=list(range(12)), num_samples=5)
    assert all_stop.value == pytest.approx(all_stop.first_token) and all_stop.stderr < 1e-12
    no_stop = response_kl(small, ref, [1, 2], max_new_tokens=3, eos_token_id=[], num_samples=2000)
    assert no_stop.value == pytest.approx(_brute_force_kl(small, ref, [1, 2], set(), 3), abs=4 * no_stop.stderr)
    with pytest.raises(ValueError, match="num_samples"):
        response_kl(small, ref, [1, 2], num_samples=1)
    with pytest.raises(ValueError, match="output logits"):
        response_kl(small, _small_vocab_lm(vocab_size=13), [1, 2], num_samples=2)


def test_too_many_prefixes_is_refused(lm_setup):
    model, prompt, bad, eos = lm_setup
    with pytest.raises(ValueError, match="raise prune_below"):
        bad_output_probability(model, prompt, bad, max_new_tokens=3, max_prefixes=1000)


def test_prompt_token_ids(tiny_tokenizer):
    plain = prompt_token_ids(tiny_tokenizer, PROMPT)
    assert plain == tiny_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(plain) == PROMPT
    chat = prompt_token_ids(tiny_tokenizer, PROMPT, chat_template=True)
    assert tiny_tokenizer.decode(chat) == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert chat[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    tiny_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        prompt_token_ids(tiny_tokenizer, PROMPT, chat_template=True)
    with pytest.raises(ValueError, match="no tokens"):
        prompt_token_ids(tiny_tokenizer, "")
