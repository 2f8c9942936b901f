"""Property-based tests (Hypothesis) of `trl_ext.losses` on random shapes, masks (all-zero rows, single tokens, full
rows), aggregations and extreme values.

Properties: finite losses, metrics and gradients for finite inputs; mask invariance (masked-out entries holding
``nan``/``±inf``/huge numbers change nothing, gradients included); permutation invariance across samples (of the rows
of a flat batch, of the prompts of a grouped ``(P, N, T)`` batch, and of the N samples of each prompt for the
self-normalised losses); importance weights that sum to 1 (or to 0 for an empty population) and stay finite.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_strategies import FAST, GARBAGE, assert_same, float_tensor, mask_rows, perm, with_garbage

from trl_ext.losses import AGGREGATIONS, aggregate
from trl_ext.losses.negative import negative_dpo_loss, sft_regularised_dpo_loss, unlikelihood_loss
from trl_ext.losses.ppo import clipped_value_loss, ppo_policy_loss
from trl_ext.losses.preference import dpo_loss, ipo_loss, kto_loss, log_exp_loss, pairwise_loss, vanilla_kto_loss
from trl_ext.losses.reinforce import neg_reinforce_loss, neg_training_loss, reinforce_loss
from trl_ext.losses.supervised import gpt_lm_loss, kd_loss
from trl_ext.losses.twist import ctl_loss, ctl_no_second_term_loss, dpg_loss, sixo_approx_loss, sixo_loss
from trl_ext.losses.weights import effective_sample_size, per_step_weights, sigma_weights

SHAPES = st.tuples(st.integers(1, 5), st.integers(1, 6))
GROUPED = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5))


def finite(out) -> None:
    """The loss and every metric of a `LossOutput` are finite."""
    assert torch.isfinite(out.loss).all(), out.loss
    for key, value in out.metrics.items():
        assert torch.isfinite(value).all(), (key, value)


def close(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> None:
    """Equal up to float64 summation order (permutations change it)."""
    assert_same(a, b, rtol=1e-9, atol=1e-9 * (1.0 + scale))


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


# ----------------------------------------------------------------------------------------------- aggregation
@FAST
@given(shape=SHAPES, mode=st.sampled_from(AGGREGATIONS), garbage=st.sampled_from(GARBAGE), data=st.data())
def test_aggregate_is_finite_mask_invariant_and_permutation_invariant(shape, mode, garbage, data):
    per_token = data.draw(float_tensor(shape))
    mask = data.draw(mask_rows(*shape))
    loss = aggregate(per_token, mask, mode)
    assert torch.isfinite(loss)
    assert_same(aggregate(with_garbage(per_token, mask, garbage), mask, mode), loss)
    p = data.draw(perm(shape[0]))
    close(aggregate(per_token[p], mask[p], mode), loss, per_token.abs().sum().item())
    if int(mask.sum()) == 0:
        assert loss.item() == 0.0  # nothing to average: 0, not nan


# ------------------------------------------------------------------------------------------------------- PPO
@FAST
@given(shape=SHAPES, mode=st.sampled_from(AGGREGATIONS), dual=st.sampled_from([None, 3.0]),
       garbage=st.sampled_from(GARBAGE), data=st.data())  # fmt: skip
def test_ppo_policy_loss_is_finite_mask_and_permutation_invariant(shape, mode, dual, garbage, data):
    """Log-ratios up to ±20 (ρ up to 5e8) and advantages up to ±1e4, zero included."""
    old = data.draw(float_tensor(shape, -40.0, 0.0))
    logp = old + data.draw(float_tensor(shape, -20.0, 20.0))
    adv = data.draw(float_tensor(shape, -1e4, 1e4)) * data.draw(float_tensor(shape, 0, 1)).round()
    mask = data.draw(mask_rows(*shape))
    x = leaf(logp)
    out = ppo_policy_loss(x, old, adv, mask, dual_clip=dual, aggregation=mode)
    finite(out)
    out.loss.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[mask == 0] == 0).all()
    g = leaf(with_garbage(logp, mask, garbage))
    out_g = ppo_policy_loss(g, with_garbage(old, mask, garbage), with_garbage(adv, mask, garbage), mask,
                            dual_clip=dual, aggregation=mode)  # fmt: skip
    out_g.loss.backward()
    assert_same(out_g.loss, out.loss) and assert_same(g.grad, x.grad)
    for key in out.metrics:
        assert_same(out_g.metrics[key], out.metrics[key])
    p = data.draw(perm(shape[0]))
    out_p = ppo_policy_loss(logp[p], old[p], adv[p], mask[p], dual_clip=dual, aggregation=mode)
    close(out_p.loss, out.loss, (adv.abs() * logp.exp().div(old.exp())).sum().item())


@FAST
@given(shape=SHAPES, dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       dual=st.sampled_from([None, 3.0]), data=st.data())  # fmt: skip
def test_ppo_policy_loss_stays_finite_for_log_ratios_beyond_exp_range(shape, dtype, dual, data):
    """A log-ratio of ±200 (ρ = exp(200) is inf in fp32) with a zero advantage used to give ``0·inf = nan``: ρ is
    computed from the log-ratio clamped to ±20 (`MAX_LOG_RATIO`), so loss, metrics and gradients stay finite.

    The loss is computed in fp32, so its gradient is an fp32 number; an fp16 leaf stores it in fp16, whose largest
    value is 65504. A gradient of ρ·|A|/n beyond that (ρ = e^12 with A = −1 is 1.6e5) is ``inf`` in an fp16 leaf
    whatever the loss does (the mixed-precision grad scaler skips such a step). So the fp32 gradient must be finite
    everywhere, and the leaf's own gradient wherever the fp32 one fits its dtype — never ``nan``."""
    old = data.draw(float_tensor(shape, -10.0, 0.0)).to(dtype)
    logp = (old.double() + data.draw(float_tensor(shape, -200.0, 200.0))).to(dtype)
    adv = (data.draw(float_tensor(shape, -10.0, 10.0)) * data.draw(float_tensor(shape, 0, 1)).round()).to(dtype)
    mask = data.draw(mask_rows(*shape))
    x = leaf(logp)
    out = ppo_policy_loss(x, old, adv, mask, dual_clip=dual)
    finite(out)
    out.loss.backward()
    x32 = leaf(logp.float())
    ppo_policy_loss(x32, old, adv, mask, dual_clip=dual).loss.backward()
    assert torch.isfinite(x32.grad).all()
    assert not torch.isnan(x.grad).any()
    fits = x32.grad.abs() < torch.finfo(dtype).max
    assert torch.isfinite(x.grad[fits]).all()


@FAST
@given(shape=SHAPES, clip=st.sampled_from([None, 0.2]), garbage=st.sampled_from(GARBAGE), data=st.data())
def test_clipped_value_loss_is_finite_mask_and_permutation_invariant(shape, clip, garbage, data):
    values, old, returns = (data.draw(float_tensor(shape, -1e6, 1e6)) for _ in range(3))
    mask = data.draw(mask_rows(*shape))
    out = clipped_value_loss(values, old, returns, mask, cliprange_value=clip)
    finite(out)
    junk = [with_garbage(t, mask, garbage) for t in (values, old, returns)]
    assert_same(clipped_value_loss(*junk, mask, cliprange_value=clip).loss, out.loss)
    p = data.draw(perm(shape[0]))
    close(clipped_value_loss(values[p], old[p], returns[p], mask[p], cliprange_value=clip).loss, out.loss, 1e12)


# ------------------------------------------------------------------------------------------- REINFORCE family
@st.composite
def grouped_samples(draw, shape=GROUPED, lo=-60.0):
    P, N, T = draw(shape)
    logp = draw(float_tensor((P, N, T), lo, 0.0))
    rewards = draw(float_tensor((P, N), -1e4, 1e4))
    mask = draw(mask_rows(P * N, T)).reshape(P, N, T)
    return logp, rewards, mask


def _permute(tensors, p_prompts, p_samples):
    """Permute the prompts (dim 0) and, within every prompt, the samples (dim 1) of ``(P, N, ...)`` tensors."""
    return [t[p_prompts][:, p_samples] for t in tensors]


@FAST
@given(batch=grouped_samples(), baseline=st.sampled_from(["none", "rloo", "hardcoded"]),
       mode=st.sampled_from(AGGREGATIONS), garbage=st.sampled_from(GARBAGE), data=st.data())  # fmt: skip
def test_reinforce_loss_is_finite_mask_and_permutation_invariant(batch, baseline, mode, garbage, data):
    logp, rewards, mask = batch
    if baseline == "rloo" and logp.shape[1] < 2:
        with pytest.raises(ValueError, match="at least 2 samples"):
            reinforce_loss(logp, rewards, mask, baseline=baseline)
        return
    kwargs = dict(baseline=baseline, baseline_value=3.0, aggregation=mode)
    x = leaf(logp)
    out = reinforce_loss(x, rewards, mask, **kwargs)
    finite(out)
    out.loss.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[mask == 0] == 0).all()
    assert_same(reinforce_loss(with_garbage(logp, mask, garbage), rewards, mask, **kwargs).loss, out.loss)
    pp, ps = data.draw(perm(logp.shape[0])), data.draw(perm(logp.shape[1]))
    lp, m = _permute([logp, mask], pp, ps)
    close(reinforce_loss(lp, rewards[pp][:, ps], m, **kwargs).loss, out.loss, 60 * rewards.abs().sum().item())


@FAST
@given(batch=grouped_samples(shape=st.tuples(st.integers(1, 3), st.integers(2, 4), st.integers(1, 5))),
       loss=st.sampled_from(["neg_training", "neg_reinforce"]),
       convention=st.sampled_from(["reference", "expectation"]), garbage=st.sampled_from(GARBAGE),
       data=st.data())  # fmt: skip
def test_harmlessness_losses_are_finite_mask_and_permutation_invariant(batch, loss, convention, garbage, data):
    logp, rewards, mask = batch
    neg_logp, neg_rewards, neg_mask = data.draw(grouped_samples(shape=st.just(tuple(logp.shape))))
    neg_weights = torch.softmax(data.draw(float_tensor(tuple(rewards.shape), -1e4, 1e4)), -1)
    extra = {"neg_rewards": neg_rewards} if loss == "neg_reinforce" else {}
    fn = neg_training_loss if loss == "neg_training" else neg_reinforce_loss

    def run(lp, r, m, nlp, nr, nw, nm):
        kw = {"neg_rewards": nr} if extra else {}
        return fn(lp, r, m, neg_logprobs=nlp, neg_weights=nw, neg_mask=nm, alpha=0.5, alpha_convention=convention,
                  **kw)  # fmt: skip

    out = run(logp, rewards, mask, neg_logp, neg_rewards, neg_weights, neg_mask)
    finite(out)
    junk = run(with_garbage(logp, mask, garbage), rewards, mask, with_garbage(neg_logp, neg_mask, garbage),
               neg_rewards, neg_weights, neg_mask)  # fmt: skip
    assert_same(junk.loss, out.loss)
    pp = data.draw(perm(logp.shape[0]))  # prompts; the samples of the two sets are paired only through the prompt
    permuted = run(logp[pp], rewards[pp], mask[pp], neg_logp[pp], neg_rewards[pp], neg_weights[pp], neg_mask[pp])
    close(permuted.loss, out.loss, 60 * (rewards.abs().sum() + neg_rewards.abs().sum()).item())


# ------------------------------------------------------------------------------------------ importance weights
@st.composite
def twist_batch(draw, shape=GROUPED):
    P, N, T = draw(shape)
    ref = draw(float_tensor((P, N, T), -60.0, 0.0))
    old = draw(float_tensor((P, N, T), -60.0, 0.0))
    v = draw(float_tensor((P, N, T), -60.0, 60.0))
    log_phi = draw(float_tensor((P, N), -1e5, 1e5))  # β·R with β = −10 and |R| up to 1e4
    mask = draw(mask_rows(P * N, T)).reshape(P, N, T)
    return v, log_phi, mask, old, ref


@FAST
@given(batch=twist_batch(), data=st.data())
def test_weights_sum_to_one_or_zero_and_follow_the_samples(batch, data):
    v, log_phi, mask, old, ref = batch
    w = sigma_weights(ref, old, log_phi, mask)
    u = per_step_weights(ref, old, v, mask)
    assert torch.isfinite(w).all() and torch.isfinite(u).all() and (w >= 0).all() and (u >= 0).all()
    close(w.sum(-1), torch.ones(w.shape[0], dtype=w.dtype))
    valid_at_t = (mask != 0).any(1)  # (P, T): some sample is valid at t
    close(u.sum(1), valid_at_t.to(u.dtype))
    assert (u[mask == 0] == 0).all()
    ess = effective_sample_size(w)
    assert ((ess >= 1 - 1e-9) & (ess <= w.shape[1] + 1e-9)).all()
    thresholded = sigma_weights(ref, old, log_phi, mask, indicator_threshold=0.0)
    assert torch.isfinite(thresholded).all() and (thresholded.sum(-1) <= 1 + 1e-9).all()
    pp, ps = data.draw(perm(v.shape[0])), data.draw(perm(v.shape[1]))
    r, o, m, vv = _permute([ref, old, mask, v], pp, ps)
    close(sigma_weights(r, o, log_phi[pp][:, ps], m), w[pp][:, ps])
    close(per_step_weights(r, o, vv, m), u[pp][:, ps])


# ------------------------------------------------------------------------------------------------ twist losses
def _sixo_exact(v, log_phi, mask, old, ref, aggregation):
    """SIXO with the q-samples' own twist standing in for the base samples' (same shapes, permuted alike)."""
    return sixo_loss(v, log_phi, mask, old, ref, base_v=v, base_mask=mask, aggregation=aggregation)


TWIST = {"ctl": ctl_loss, "ctl_no_second_term": ctl_no_second_term_loss, "sixo": _sixo_exact,
         "sixo_approx": sixo_approx_loss}  # fmt: skip


@FAST
@given(batch=twist_batch(), name=st.sampled_from(sorted(TWIST)), mode=st.sampled_from(AGGREGATIONS),
       garbage=st.sampled_from(GARBAGE), data=st.data())  # fmt: skip
def test_twist_losses_are_finite_mask_and_permutation_invariant(batch, name, mode, garbage, data):
    v, log_phi, mask, old, ref = batch
    fn = TWIST[name]
    x = leaf(v)
    out = fn(x, log_phi, mask, old, ref, aggregation=mode)
    finite(out)
    out.loss.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[mask == 0] == 0).all()
    junk = [with_garbage(t, mask, garbage) for t in (v, old, ref)]
    assert_same(fn(junk[0], log_phi, mask, junk[1], junk[2], aggregation=mode).loss, out.loss)
    pp, ps = data.draw(perm(v.shape[0])), data.draw(perm(v.shape[1]))
    vv, m, o, r = _permute([v, mask, old, ref], pp, ps)
    close(fn(vv, log_phi[pp][:, ps], m, o, r, aggregation=mode).loss, out.loss, 60.0 * v.numel())


@FAST
@given(batch=twist_batch(shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3))),
       V=st.integers(2, 4), data=st.data())  # fmt: skip
def test_dpg_loss_is_finite_and_mask_invariant(batch, V, data):
    _, log_phi, mask, old, ref = batch
    shape = (*mask.shape, V)
    log_psi_all = data.draw(float_tensor(shape, -60.0, 60.0))
    ref_all = torch.log_softmax(data.draw(float_tensor(shape, -60.0, 60.0)), -1)
    tokens = data.draw(float_tensor(tuple(mask.shape), 0, V - 1)).round().long()
    v = log_psi_all.gather(-1, tokens[..., None])[..., 0]
    psi = leaf(log_psi_all)
    out = dpg_loss(v, log_phi, mask, old, ref, log_psi_all=psi, ref_logprobs_all=ref_all)
    finite(out)
    out.loss.backward()
    assert torch.isfinite(psi.grad).all()
    junk = dpg_loss(with_garbage(v, mask, math.nan), log_phi, mask, old, ref,
                    log_psi_all=with_garbage(log_psi_all, mask, math.nan),
                    ref_logprobs_all=with_garbage(ref_all, mask, math.nan))  # fmt: skip
    assert_same(junk.loss, out.loss)


# -------------------------------------------------------------------------------------------- preference losses
@st.composite
def sequence_logps(draw, lo=-1e4):
    B = draw(st.integers(1, 6))
    return [draw(float_tensor((B,), lo, 0.0)) for _ in range(4)]


PAIRED = {
    "dpo": lambda c, r, rc, rr: dpo_loss(c, r, rc, rr, beta=0.1, label_smoothing=0.1),
    "dpo_ipo": lambda c, r, rc, rr: dpo_loss(c, r, rc, rr, beta=0.1, loss_type="ipo"),
    "ipo": lambda c, r, rc, rr: ipo_loss(c, r, rc, rr, beta=0.1),
    "vanilla_kto": lambda c, r, rc, rr: vanilla_kto_loss(c, r, rc, rr, beta=0.1),
    "negative_dpo": lambda c, r, rc, rr: negative_dpo_loss(None, r, None, rr, beta=0.1),
    "kto": lambda c, r, rc, rr: kto_loss(c, r, None, rc, rr, None, beta=0.1),
    "pairwise": lambda c, r, rc, rr: pairwise_loss(c - rc, r - rr, margin=1.0),
    "log_exp": lambda c, r, rc, rr: log_exp_loss(c - rc, r - rr),
}


@FAST
@given(logps=sequence_logps(), name=st.sampled_from(sorted(PAIRED)), data=st.data())
def test_preference_losses_are_finite_and_permutation_invariant(logps, name, data):
    """Summed log-probs down to −1e4 (long, unlikely completions) and rewards of the same size."""
    fn = PAIRED[name]
    leaves = [leaf(t) for t in logps]
    out = fn(*leaves)
    finite(out)
    out.loss.backward()
    for t in leaves[:2]:
        assert t.grad is None or torch.isfinite(t.grad).all()
    p = data.draw(perm(logps[0].shape[0]))
    close(fn(*[t[p] for t in logps]).loss, out.loss, 1e9)


@FAST
@given(shape=SHAPES, mode=st.sampled_from(AGGREGATIONS), garbage=st.sampled_from(GARBAGE), data=st.data())
def test_token_level_preference_losses_are_finite_and_mask_invariant(shape, mode, garbage, data):
    """Token log-probs in [−1e4, 0], exactly 0 included (a token the policy is sure of: 1 − π = 0)."""
    token_logps = data.draw(float_tensor(shape, -1e4, 0.0)) * data.draw(float_tensor(shape, 0, 1)).round()
    mask = data.draw(mask_rows(*shape))
    x = leaf(token_logps)
    out = unlikelihood_loss(None, None, None, None, rejected_token_logps=x, rejected_mask=mask, aggregation=mode)
    finite(out)
    out.loss.backward()
    assert torch.isfinite(x.grad).all()
    junk = unlikelihood_loss(None, None, None, None, rejected_token_logps=with_garbage(token_logps, mask, garbage),
                             rejected_mask=mask, aggregation=mode)  # fmt: skip
    assert_same(junk.loss, out.loss)
    seqs = [data.draw(float_tensor((shape[0],), -1e4, 0.0)) for _ in range(4)]
    sft = sft_regularised_dpo_loss(*seqs, chosen_token_logps=token_logps, chosen_mask=mask)
    finite(sft)
    junk = sft_regularised_dpo_loss(
        *seqs, chosen_token_logps=with_garbage(token_logps, mask, garbage), chosen_mask=mask
    )
    assert_same(junk.loss, sft.loss)


# ------------------------------------------------------------------------------------------- supervised losses
@FAST
@given(shape=SHAPES, V=st.integers(2, 6), mode=st.sampled_from(AGGREGATIONS), data=st.data())
def test_supervised_losses_are_finite_with_extreme_logits_and_no_counted_token(shape, V, mode, data):
    logits = leaf(data.draw(float_tensor((*shape, V), -1e4, 1e4)))
    labels = data.draw(float_tensor(shape, 0, V - 1)).round().long()
    mask = data.draw(mask_rows(*shape))
    labels = torch.where(mask != 0, labels, torch.full_like(labels, -100))
    out = gpt_lm_loss(logits, labels, aggregation=mode)
    finite(out)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    teacher = data.draw(float_tensor((*shape, V), -1e4, 1e4))
    kd = kd_loss(logits.detach(), teacher, mask, temperature=2.0, aggregation=mode)
    finite(kd)
    assert kd.loss.item() >= -1e-6  # a KL divergence
    assert_same(kd_loss(with_garbage(logits.detach(), mask, math.nan), with_garbage(teacher, mask, math.nan), mask,
                        temperature=2.0, aggregation=mode).loss, kd.loss)  # fmt: skip
    p = data.draw(perm(shape[0]))
    close(gpt_lm_loss(logits.detach()[p], labels[p], aggregation=mode).loss, out.loss, 1e5)
