"""Property-based tests (Hypothesis) of `trl_ext.ops` on random shapes, masks (all-zero rows, single tokens, full
rows), dtypes and extreme values.

Properties: finite outputs for finite inputs; mask invariance (whatever masked-out entries hold, ``nan`` and ``±inf``
included, the result is the same, bit for bit); permutation of the samples (rows) permutes per-row results and leaves
batch statistics unchanged; agreement with a plain reference formula where one exists. The conventions these rely on
(an all-zero mask row gives a mean of 0, a variance of 0, whitened values of 0) are in the functions' docstrings.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_strategies import FAST, GARBAGE, assert_same, float_tensor, mask_rows, perm, with_garbage

from trl_ext.ops import (
    assemble_token_rewards,
    discounted_returns,
    entropy_from_logits,
    extend_mask_past_last,
    first_true_index,
    full_kl,
    gae_advantages,
    group_rows,
    kl_estimate,
    last_token_index,
    logprobs_from_hidden,
    logprobs_from_logits,
    masked_mean,
    masked_normalize,
    masked_std,
    masked_sum,
    masked_var,
    masked_whiten,
    modulated_logprobs,
    pack_padded,
    position_ids_from_attention_mask,
    response_mask_from_eos,
    truncate_after_stop_token,
    unpack_values,
)

SHAPES = st.tuples(st.integers(1, 5), st.integers(1, 6))
STATS = {
    "sum": masked_sum,
    "mean": masked_mean,
    "var": masked_var,
    "std": masked_std,
    "whiten": masked_whiten,
    "normalize": masked_normalize,
}


@st.composite
def batch(draw, lo=-1e4, hi=1e4, dtype=torch.float64, contiguous=False):
    B, T = draw(SHAPES)
    x = draw(float_tensor((B, T), lo, hi, dtype=dtype))
    return x, draw(mask_rows(B, T, contiguous=contiguous))


# ------------------------------------------------------------------------------------------- masked statistics
@FAST
@given(data=batch(lo=-1e15, hi=1e15), name=st.sampled_from(sorted(STATS)), dim=st.sampled_from([None, -1]),
       garbage=st.sampled_from(GARBAGE), dtype=st.sampled_from([torch.float32, torch.float64]))  # fmt: skip
def test_masked_stats_are_finite_and_ignore_masked_entries(data, name, dim, garbage, dtype):
    x, mask = data
    x = x.to(dtype)
    out = STATS[name](x, mask, dim=dim)
    assert torch.isfinite(out).all(), (name, x, mask, out)
    assert_same(STATS[name](with_garbage(x, mask, garbage), mask, dim=dim), out)
    if name in ("whiten", "normalize"):
        assert (out[mask == 0] == 0).all()  # masked-out entries of the output are exactly 0


@FAST
@given(data=batch(lo=-1e3, hi=1e3), name=st.sampled_from(sorted(STATS)), dim=st.sampled_from([None, -1]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]))  # fmt: skip
def test_masked_stats_of_half_precision_inputs_match_float64(data, name, dim, dtype):
    """fp16/bf16 inputs are reduced in fp32: finite, and equal to the float64 result up to the output's rounding
    (fp16 squares of 1e3 overflow, so a half-precision reduction gave inf variances and all-zero whitened values)."""
    x, mask = data
    half = x.to(dtype)
    out = STATS[name](half, mask, dim=dim)
    expected = STATS[name](half.double(), mask, dim=dim)
    fits = expected.abs() <= torch.finfo(dtype).max  # a result fp16 cannot hold (e.g. a variance of 1e5) is inf
    assert out.dtype == dtype and torch.isfinite(out[fits]).all()
    tol = 1e-2 * (1.0 + expected.abs())
    assert ((out.double() - expected).abs() <= tol)[fits].all(), (name, out, expected)


@FAST
@given(data=batch(), name=st.sampled_from(sorted(STATS)), order=st.data())
def test_masked_stats_follow_a_permutation_of_the_samples(data, name, order):
    x, mask = data
    p = order.draw(perm(x.shape[0]))
    fn = STATS[name]
    scale = 1e-9 * (1.0 + x.abs().max().item())
    # per-row statistics permute with the rows; batch statistics (dim=None) do not change
    assert_same(fn(x[p], mask[p], dim=-1), fn(x, mask, dim=-1)[p], rtol=1e-9, atol=scale)
    expected = fn(x, mask)[p] if name in ("whiten", "normalize") else fn(x, mask)
    assert_same(fn(x[p], mask[p]), expected, rtol=1e-7, atol=scale)


@FAST
@given(data=batch(), dim=st.sampled_from([None, -1]))
def test_empty_and_single_token_rows_have_documented_values(data, dim):
    """All-zero mask: mean, variance and whitened values 0. One real token: mean = the token, variance 0."""
    x, mask = data
    rows = mask.sum(-1)
    if dim == -1:
        mean, var = masked_mean(x, mask, dim=-1), masked_var(x, mask, dim=-1)
        assert (mean[rows == 0] == 0).all() and (var[rows <= 1] == 0).all()
        single = rows == 1
        assert_same(mean[single], masked_sum(x, mask, dim=-1)[single])
    if int(mask.sum()) == 0:
        assert masked_mean(x, mask).item() == 0 and masked_var(x, mask).item() == 0
        assert (masked_whiten(x, mask, dim=dim) == 0).all() and (masked_normalize(x, mask, dim=dim) == 0).all()


# ------------------------------------------------------------------------------------------------ KL estimates
@FAST
@given(shape=SHAPES, data=st.data(), estimator=st.sampled_from(["k1", "k2", "k3"]), garbage=st.sampled_from(GARBAGE),
       dtype=st.sampled_from([torch.float32, torch.float64]))  # fmt: skip
def test_kl_estimates_are_finite_non_negative_and_zero_where_masked(shape, data, estimator, garbage, dtype):
    """Log-probs in [-80, 0]: the whole range a sampled token's log-prob takes in fp32 (k3 = exp(logr) − 1 − logr
    itself overflows fp32 beyond logr ≈ 88, which no sampled token reaches)."""
    logp = data.draw(float_tensor(shape, -80.0, 0.0, dtype=dtype))
    ref = data.draw(float_tensor(shape, -80.0, 0.0, dtype=dtype))
    mask = data.draw(mask_rows(*shape))
    kl = kl_estimate(logp, ref, estimator, mask=mask)
    assert torch.isfinite(kl).all() and (kl[mask == 0] == 0).all()
    if estimator != "k1":
        assert (kl >= 0).all()
    assert_same(kl_estimate(with_garbage(logp, mask, garbage), with_garbage(ref, mask, garbage), estimator, mask), kl)


@FAST
@given(shape=SHAPES, V=st.integers(2, 6), data=st.data())
def test_full_kl_is_finite_non_negative_with_zero_probability_tokens(shape, V, data):
    """Vocabulary entries with π(v) = 0 (a ``-inf`` logit, e.g. a banned token) contribute 0, also where the
    reference gives them 0 too."""
    logits = data.draw(float_tensor((*shape, V), -50.0, 50.0))
    ref_logits = data.draw(float_tensor((*shape, V), -50.0, 50.0))
    banned = data.draw(st.lists(st.integers(1, V - 1), max_size=V - 1, unique=True))
    logits[..., banned] = -math.inf
    ref_logits[..., banned] = -math.inf
    mask = data.draw(mask_rows(*shape))
    kl = full_kl(torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1), mask)
    assert torch.isfinite(kl).all() and (kl >= -1e-9).all() and (kl[mask == 0] == 0).all()


# -------------------------------------------------------------------------------------------- advantages, GAE
@FAST
@given(data=batch(contiguous=True), order=st.data(), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0),
       garbage=st.sampled_from(GARBAGE))  # fmt: skip
def test_gae_is_finite_mask_invariant_and_follows_the_samples(data, order, gamma, lam, garbage):
    rewards, mask = data
    values = order.draw(float_tensor(tuple(rewards.shape), -1e4, 1e4))
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    adv_g, ret_g = gae_advantages(with_garbage(rewards, mask, garbage), with_garbage(values, mask, garbage), mask,
                                  gamma, lam)  # fmt: skip
    assert_same(adv_g, adv) and assert_same(ret_g, ret)
    p = order.draw(perm(rewards.shape[0]))
    adv_p, ret_p = gae_advantages(rewards[p], values[p], mask[p], gamma, lam)
    assert_same(adv_p, adv[p]) and assert_same(ret_p, ret[p])
    returns = discounted_returns(rewards, mask, gamma)
    assert torch.isfinite(returns).all() and (returns[mask == 0] == 0).all()
    assert_same(discounted_returns(with_garbage(rewards, mask, garbage), mask, gamma), returns)
    one_adv, _ = gae_advantages(rewards, values, mask, 1.0, 1.0)
    keep = mask != 0
    scale = 1e-9 * (1 + rewards.abs().sum().item() + values.abs().max().item())
    assert_same(one_adv[keep], (discounted_returns(rewards, mask, 1.0) - values)[keep], rtol=1e-9, atol=scale)


# ---------------------------------------------------------------------------------------------------- log-probs
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@FAST
@given(shape=SHAPES, V=st.integers(2, 7), dtype=st.sampled_from(DTYPES), temperature=st.sampled_from([0.3, 1.0, 7.0]),
       chunk=st.sampled_from([1, 2, 3, 1024]), data=st.data())  # fmt: skip
def test_logprobs_match_log_softmax_and_stay_finite_for_extreme_logits(shape, V, dtype, temperature, chunk, data):
    bound = 6e4 if dtype == torch.float16 else 1e4
    logits = data.draw(float_tensor((*shape, V), -bound, bound)).to(dtype)
    labels = data.draw(float_tensor(shape, 0, V - 1)).round().long()
    ignored = data.draw(mask_rows(*shape)) == 0
    labels = torch.where(ignored, torch.full_like(labels, -100), labels)
    logits.requires_grad_(True)
    out, entropy = logprobs_from_logits(logits, labels, temperature, chunk_size=chunk, return_entropy=True)
    ref = torch.log_softmax(logits.detach().double() / temperature, -1)
    expected = ref.gather(-1, labels.clamp_min(0)[..., None])[..., 0].masked_fill(ignored, 0.0)
    # fp32 arithmetic (the op's compute dtype): an error of a few ulps of the largest scaled logit of the row
    tol = 1e-5 * (1 + expected.abs()) + 1e-6 * (logits.detach().double().abs().amax(-1) / temperature)
    assert torch.isfinite(out).all() and (out <= tol).all() and (out[ignored] == 0).all()
    assert ((out.double() - expected).abs() <= tol).all(), (out, expected)
    assert torch.isfinite(entropy).all() and (entropy >= -1e-5).all() and (entropy <= math.log(V) + 1e-4).all()
    out.sum().backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[ignored] == 0).all()
    p = data.draw(perm(shape[0]))
    assert_same(logprobs_from_logits(logits.detach()[p], labels[p], temperature, chunk_size=chunk), out.detach()[p])


@FAST
@given(shape=SHAPES, V=st.integers(2, 7), data=st.data())
def test_logprobs_and_entropy_ignore_zero_probability_tokens(shape, V, data):
    """``-inf`` logits (banned tokens) other than the label's give finite log-probs, entropies and gradients."""
    logits = data.draw(float_tensor((*shape, V), -30.0, 30.0, dtype=torch.float32))
    labels = data.draw(float_tensor(shape, 0, V - 1)).round().long()
    banned = data.draw(st.lists(st.integers(0, V - 1), max_size=V - 1, unique=True))
    logits[..., banned] = -math.inf
    logits.scatter_(-1, labels[..., None], data.draw(float_tensor((*shape, 1), -30.0, 30.0, dtype=torch.float32)))
    logits.requires_grad_(True)
    out = logprobs_from_logits(logits, labels)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(logits.grad).all()
    ent = entropy_from_logits(logits.detach(), mask=data.draw(mask_rows(*shape)))
    assert torch.isfinite(ent).all() and (ent >= -1e-5).all()


@FAST
@given(shape=SHAPES, V=st.integers(2, 6), H=st.integers(1, 4), chunk=st.sampled_from([1, 2, 1024]), data=st.data())
def test_logprobs_from_hidden_match_the_full_logits(shape, V, H, chunk, data):
    hidden = data.draw(float_tensor((*shape, H), -30.0, 30.0))
    weight = data.draw(float_tensor((V, H), -30.0, 30.0))
    bias = data.draw(float_tensor((V,), -30.0, 30.0))
    labels = data.draw(float_tensor(shape, 0, V - 1)).round().long()
    out = logprobs_from_hidden(hidden, weight, labels, bias, chunk_size=chunk)
    expected = torch.log_softmax(hidden @ weight.T + bias, -1).gather(-1, labels[..., None])[..., 0]
    assert torch.isfinite(out).all()
    assert_same(out, expected, rtol=1e-9, atol=1e-9)
    modulation = data.draw(float_tensor((*shape, V), -30.0, 30.0))
    mod = modulated_logprobs(hidden @ weight.T, modulation, labels, chunk_size=chunk)
    expected = torch.log_softmax(hidden @ weight.T + modulation, -1).gather(-1, labels[..., None])[..., 0]
    assert_same(mod, expected, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------------- sequences
@FAST
@given(shape=SHAPES, stops=st.lists(st.integers(0, 5), min_size=1, max_size=2), pad=st.integers(0, 5), data=st.data())
def test_stop_token_truncation_keeps_a_prefix_up_to_the_first_stop(shape, stops, pad, data):
    responses = data.draw(float_tensor(shape, 0, 5)).round().long()
    mask = response_mask_from_eos(responses, stops)
    trunc = truncate_after_stop_token(responses, stops, pad)
    for row, m in zip(responses.tolist(), mask.tolist()):
        first = next((i for i, t in enumerate(row) if t in stops), len(row))
        assert m == [int(i <= first) for i in range(len(row))]
    assert torch.equal(trunc.mask, mask) and torch.equal(trunc.responses[mask == 1], responses[mask == 1])
    assert torch.equal(truncate_after_stop_token(trunc.responses, stops, pad).responses, trunc.responses)
    p = data.draw(perm(shape[0]))
    assert torch.equal(response_mask_from_eos(responses[p], stops), mask[p])


@FAST
@given(shape=SHAPES, data=st.data())
def test_mask_indices_positions_and_packing(shape, data):
    mask = data.draw(mask_rows(*shape))
    last = last_token_index(mask, allow_empty=True)
    first = first_true_index(mask)
    for row, lo, hi in zip(mask.tolist(), first.tolist(), last.tolist()):
        real = [i for i, m in enumerate(row) if m]
        assert hi == (real[-1] if real else -1) and lo == (real[0] if real else len(row))
    if bool((mask.sum(-1) == 0).any()):
        with pytest.raises(ValueError, match="without any real token"):
            last_token_index(mask)
    positions = position_ids_from_attention_mask(mask)
    assert torch.equal(positions[mask != 0], torch.cat([torch.arange(int(n)) for n in mask.sum(-1)]))
    extended = extend_mask_past_last(mask)  # exactly one more position, right after the last real one
    added = (last + 1).clamp_max(shape[1] - 1)
    expected = mask.clone()
    expected[(last >= 0) & (last + 1 < shape[1]), added[(last >= 0) & (last + 1 < shape[1])]] = 1
    assert torch.equal(extended, expected), (mask, extended)
    values = data.draw(float_tensor(shape, -1e4, 1e4))
    packed, cu = pack_padded(values, mask)
    padded, unpacked_mask = unpack_values(packed, cu.diff(), padding_side="right")
    assert torch.equal(padded[unpacked_mask != 0], values[mask != 0])
    assert torch.equal(group_rows(values, num_prompts=1)[0], values)


# ------------------------------------------------------------------------------------------------ token rewards
@FAST
@given(data=batch(lo=-1e6, hi=1e6), order=st.data(), kl_coef=st.floats(0.0, 10.0), garbage=st.sampled_from(GARBAGE))
def test_token_rewards_put_the_score_at_the_last_token_and_ignore_masked_kl(data, order, kl_coef, garbage):
    kl, mask = data
    scores = order.draw(float_tensor((kl.shape[0],), -1e6, 1e6))
    empty = mask.sum(-1) == 0
    if bool(empty.any()):
        with pytest.raises(ValueError, match="no valid token"):
            assemble_token_rewards(kl, scores, mask, kl_coef)
        mask = torch.where(empty[:, None], torch.ones_like(mask), mask)  # documented: every row needs a token
    out = assemble_token_rewards(kl, scores, mask, kl_coef)
    assert torch.isfinite(out.rewards).all() and (out.rewards[mask == 0] == 0).all()
    total = scores - kl_coef * masked_sum(kl, mask, dim=-1)
    assert_same(out.rewards.sum(-1), total, rtol=1e-9, atol=1e-6)
    assert_same(assemble_token_rewards(with_garbage(kl, mask, garbage), scores, mask, kl_coef).rewards, out.rewards)
    p = order.draw(perm(kl.shape[0]))
    assert_same(assemble_token_rewards(kl[p], scores[p], mask[p], kl_coef).rewards, out.rewards[p])
