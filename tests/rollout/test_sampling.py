"""`SampleAndRecord`: the inverse-CDF sampler that runs inside `generate`, and the rollout that uses its log-probs."""

import pytest
import torch

from trl_ext.rollout import SamplingSettings, forward_response, generate_responses
from trl_ext.rollout.sampling import SampleAndRecord
from trl_ext.testing import build_causal_lm


def _draw(sampler: SampleAndRecord, logits: torch.Tensor, draws: int) -> torch.Tensor:
    """Drawn tokens of ``draws`` rows of the same ``(1, V)`` logits; checks that one score per row is finite."""
    rows = logits.expand(draws, -1).clone()
    chosen = sampler(torch.zeros(draws, 1, dtype=torch.long), rows)
    assert torch.isinf(chosen).sum() == draws * (logits.shape[-1] - 1)
    return chosen.argmax(-1)


def _frequencies(sampler: SampleAndRecord, logits: torch.Tensor, draws: int) -> torch.Tensor:
    return torch.bincount(_draw(sampler, logits, draws), minlength=logits.shape[-1]).double() / draws


def test_draws_follow_the_tempered_distribution_and_record_its_logprobs():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 1.0, -3.0]])
    sampler = SampleAndRecord(temperature=0.7)
    tokens = _draw(sampler, logits, 200_000)
    freq = torch.bincount(tokens, minlength=6).double() / tokens.numel()
    expected = torch.softmax(logits / 0.7, -1).double()[0]
    # 200k draws: the standard error of each frequency is < 1.2e-3; 5e-3 is > 4 standard errors.
    assert torch.allclose(freq, expected, atol=5e-3), (freq, expected)
    logp = torch.log_softmax(logits / 0.7, -1)[0]
    assert torch.equal(sampler.logprobs()[:, 0], logp[tokens])


def test_top_k_and_top_p_restrict_draws_but_recorded_logprobs_are_unfiltered():
    torch.manual_seed(1)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    sampler = SampleAndRecord(temperature=1.0, top_k=2)
    freq = _frequencies(sampler, logits, 20_000)
    assert freq[2:].sum() == 0
    top2 = torch.softmax(logits[0, :2], -1).double()
    assert torch.allclose(freq[:2], top2, atol=1e-2)
    full = torch.log_softmax(logits, -1)[0]
    assert set(sampler.logprobs()[:, 0].tolist()) <= {float(full[0]), float(full[1])}
    nucleus = SampleAndRecord(top_p=0.5)
    assert _frequencies(nucleus, logits, 2_000)[1:].sum() == 0  # P(token 0) = 0.64 > 0.5 already


def test_zero_probability_tokens_are_never_drawn():
    torch.manual_seed(2)
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]])
    freq = _frequencies(SampleAndRecord(), logits, 10_000)
    assert freq[0] == freq[2] == freq[4] == 0 and abs(float(freq[1]) - 0.5) < 0.03


def test_bad_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        SampleAndRecord(temperature=0.0)


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_generation_logprobs_equal_a_full_forward_pass(tiny_tokenizer, arch):
    torch.manual_seed(3)
    model = build_causal_lm(arch, tiny_tokenizer, seed=0).eval()
    tiny_tokenizer.padding_side = "left"
    enc = tiny_tokenizer(["the cat", "a dog sat on the", "hello"], return_tensors="pt", padding=True)
    settings = SamplingSettings(
        max_new_tokens=6, pad_token_id=tiny_tokenizer.pad_token_id, temperature=0.8,
        stop_token_ids=(tiny_tokenizer.eos_token_id,),
    )  # fmt: skip
    ids, mask = enc["input_ids"], enc["attention_mask"]
    responses, response_mask, _, logprobs = generate_responses(
        model, ids, mask, settings, batch_size=2, return_logprobs=True
    )
    full = forward_response(
        model, torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), responses.shape[1],
        temperature=0.8,
    )  # fmt: skip
    assert logprobs.shape == responses.shape
    assert (logprobs[response_mask == 0] == 0).all()
    assert torch.allclose(logprobs, full.logprobs, atol=1e-5), (logprobs - full.logprobs).abs().max()


def test_greedy_settings_record_no_logprobs(tiny_tokenizer):
    model = build_causal_lm(tokenizer=tiny_tokenizer, seed=0)
    enc = tiny_tokenizer(["the cat"], return_tensors="pt")
    settings = SamplingSettings(max_new_tokens=3, pad_token_id=tiny_tokenizer.pad_token_id, do_sample=False)
    *_, logprobs = generate_responses(
        model, enc["input_ids"], enc["attention_mask"], settings, batch_size=1, return_logprobs=True
    )
    assert logprobs is None
