"""Generation from modulated policies through the standard `model.generate(...)`, with a KV cache (B17 fixes).

The sampling tests compare the empirical distribution of 10,000 sampled first tokens with the analytic one by a
Pearson chi-square test. scipy is not a dependency, so the critical value is hard-coded: for V − 1 = 7 degrees of
freedom the 0.999 quantile of χ²₇ is 24.322 (any χ² table). Seeds are fixed, so each test is deterministic; with
the true distribution a run passes with probability 0.999, and the base-only (unmodulated) distribution is rejected
by a wide margin, which shows the test has power.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from trl_ext import testing as kit
from trl_ext.models.kv_cache import output_cache
from trl_ext.models.modulated import ModulatedCausalLM
from trl_ext.models.modulated_generation import ModulatedCache, resolve_modulated_cache

KINDS = ("model", "linear_head", "mlp_head")
TINY_VOCAB = 8  # the kit's special tokens are eos=0, pad=1, bos=2
CHI2_CRITICAL_DOF7_P999 = 24.322
N_SAMPLES = 10_000
PROMPT = [[2, 5, 6, 7, 3]]


def _modulated(kind, arch="llama", tokenizer=None, seed=0, **config_overrides):
    torch.manual_seed(seed)
    base = kit.build_causal_lm(arch, tokenizer, **config_overrides)
    model = ModulatedCausalLM.from_base(base, kind).eval()
    if model.modulation_backbone is not None:  # as after training: the two caches must then hold different values
        with torch.no_grad():
            for p in model.modulation_backbone.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def _first_token_counts(model, seed=123, **generate_kwargs):
    prompt = torch.tensor(PROMPT).repeat(N_SAMPLES, 1)
    torch.manual_seed(seed)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=1,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        **generate_kwargs,
    )
    assert out.shape == (N_SAMPLES, len(PROMPT[0]) + 1)
    return torch.bincount(out[:, -1], minlength=TINY_VOCAB)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_first_tokens_follow_the_modulated_distribution(kind, tiny_tokenizer):
    model = _modulated(kind, tokenizer=tiny_tokenizer, vocab_size=TINY_VOCAB)
    with torch.no_grad():
        out = model(torch.tensor(PROMPT))
    q = out.logits[0, -1].exp()
    p = torch.softmax(out.base_logits[0, -1], -1)
    torch.testing.assert_close(
        q, torch.softmax(torch.log_softmax(out.base_logits[0, -1], -1) + out.modulation_logits[0, -1], -1)
    )
    counts = _first_token_counts(model)
    assert _chi_square(counts, q) < CHI2_CRITICAL_DOF7_P999
    assert _chi_square(counts, p) > 5 * CHI2_CRITICAL_DOF7_P999  # the base alone is clearly rejected


def test_temperature_reshapes_the_modulated_distribution(tiny_tokenizer):
    """At temperature T, generate samples from softmax(log q / T) ∝ q^{1/T}."""
    model = _modulated("linear_head", tokenizer=tiny_tokenizer, vocab_size=TINY_VOCAB)
    with torch.no_grad():
        log_q = model(torch.tensor(PROMPT)).logits[0, -1]
    q_half = torch.softmax(log_q / 0.5, -1)
    counts = _first_token_counts(model, temperature=0.5)
    assert _chi_square(counts, q_half) < CHI2_CRITICAL_DOF7_P999
    assert _chi_square(counts, log_q.exp()) > 5 * CHI2_CRITICAL_DOF7_P999  # T=1 would be rejected


def _left_padded_prompts(tokenizer):
    return tokenizer(
        ["The cat sat on the mat", "Hi", "A longer prompt, with a comma"], return_tensors="pt", padding=True
    )


def _reference_greedy(model, ids, mask, steps):
    """Greedy decoding by full recomputation with plain forwards (no cache, no `generate`)."""
    eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(steps):
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            log_q = model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits[:, -1]
        nxt = torch.where(done, torch.full_like(done, pad, dtype=torch.long), log_q.argmax(-1))
        done |= nxt == eos
        ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if done.all():
            break
    return ids


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_and_without_cache_agree_on_a_left_padded_batch(kind, arch, tiny_tokenizer_left):
    model = _modulated(kind, arch, tiny_tokenizer_left)
    batch = _left_padded_prompts(tiny_tokenizer_left)
    assert (batch["attention_mask"][:, 0] == 0).any()  # really left-padded
    lengths = []
    hook = model.base_lm.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    cached = model.generate(**batch, max_new_tokens=8, do_sample=False)
    hook.remove()
    uncached = model.generate(**batch, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, _reference_greedy(model, batch["input_ids"], batch["attention_mask"], 8))
    # The cache is really used: after the prefill every step feeds one token to the base.
    assert lengths[0] == batch["input_ids"].shape[1] and set(lengths[1:]) == {1}
    # top-k = 1 sampling is greedy decoding, and so is a vanishing top-p nucleus
    torch.manual_seed(0)
    assert torch.equal(model.generate(**batch, max_new_tokens=8, do_sample=True, top_k=1), cached)
    torch.manual_seed(0)
    assert torch.equal(model.generate(**batch, max_new_tokens=8, do_sample=True, top_k=0, top_p=1e-6), cached)


def test_generate_returns_a_modulated_cache_and_supports_beam_search(tiny_tokenizer_left):
    model = _modulated("model", tokenizer=tiny_tokenizer_left)
    batch = _left_padded_prompts(tiny_tokenizer_left)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, min_new_tokens=4)
    cache = output_cache(out)
    assert isinstance(cache, ModulatedCache) and cache.modulation is not None
    assert cache.get_seq_length() == cache.modulation.get_seq_length() == out.sequences.shape[1] - 1
    head_only = _modulated("linear_head", tokenizer=tiny_tokenizer_left)
    assert output_cache(head_only.generate(**batch, max_new_tokens=2, return_dict_in_generate=True)).modulation is None
    # Beam search reorders both caches every step: cached and uncached beams must agree
    beams = model.generate(**batch, max_new_tokens=5, num_beams=3, do_sample=False)
    assert torch.equal(beams, model.generate(**batch, max_new_tokens=5, num_beams=3, do_sample=False, use_cache=False))


def test_eos_stops_rows_and_the_modulation_steers_generation(tiny_tokenizer_left):
    """A modulation that puts all mass on eos ends every row at once (the base alone would not)."""
    model = _modulated("linear_head", tokenizer=tiny_tokenizer_left)
    batch = _left_padded_prompts(tiny_tokenizer_left)
    eos, prompt_len = tiny_tokenizer_left.eos_token_id, batch["input_ids"].shape[1]
    with torch.no_grad():
        model.modulation_head.bias[eos] = 1e4
    out = model.generate(**batch, max_new_tokens=6, do_sample=True)
    assert out.shape[1] == prompt_len + 1 and torch.all(out[:, -1] == eos)


def test_finished_rows_are_padded(tiny_tokenizer_left):
    """Declare row 0's second greedy token the eos: row 0 stops there and is padded, the others run on."""
    model = _modulated("mlp_head", tokenizer=tiny_tokenizer_left)
    batch = _left_padded_prompts(tiny_tokenizer_left)
    prompt_len, pad = batch["input_ids"].shape[1], tiny_tokenizer_left.pad_token_id
    free = model.generate(**batch, max_new_tokens=6, do_sample=False, eos_token_id=None)
    stop = int(free[0, prompt_len + 1])
    expected = free.clone()
    for row in expected:
        hits = (row[prompt_len:] == stop).nonzero()
        if len(hits):
            row[prompt_len + int(hits[0]) + 1 :] = pad
    out = model.generate(**batch, max_new_tokens=6, do_sample=False, eos_token_id=stop, pad_token_id=pad)
    assert torch.equal(out, expected[:, : out.shape[1]]) and torch.all(expected[:, out.shape[1] :] == pad)
    assert torch.all(out[0, prompt_len + 2 :] == pad)


def test_modulated_cache_edits_both_caches():
    def filled(length):
        cache = DynamicCache()
        cache.update(torch.randn(3, 2, length, 4), torch.randn(3, 2, length, 4), 0)
        return cache

    cache = ModulatedCache(filled(5), filled(5))
    assert cache.get_seq_length() == 5 and not cache.is_compileable and len(cache) == 1
    cache.crop(-2)  # transformers 5: a negative count removes that many tokens
    assert cache.base.get_seq_length() == cache.modulation.get_seq_length() == 3
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.base.layers[0].keys.shape[0] == cache.modulation.layers[0].keys.shape[0] == 2
    cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(TypeError, match="two caches"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)
    with pytest.raises(TypeError, match="Cache objects"):
        ModulatedCache((torch.zeros(1), torch.zeros(1)))


def test_resolve_modulated_cache(tiny_tokenizer):
    config = kit.build_causal_lm("llama", tiny_tokenizer).config
    assert resolve_modulated_cache(None, False, config) is None
    fresh = resolve_modulated_cache(None, True, config, config)
    assert isinstance(fresh, ModulatedCache) and fresh.modulation is not None
    assert isinstance(resolve_modulated_cache(DynamicCache(), True, config), ModulatedCache)  # empty: replaced
    filled = DynamicCache()
    filled.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)
    with pytest.raises(ValueError, match="ModulatedCache"):
        resolve_modulated_cache(filled, True, config)
    with pytest.raises(ValueError, match="does not match"):
        resolve_modulated_cache(ModulatedCache(DynamicCache()), True, config, config)
