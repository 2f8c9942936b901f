"""Tests of the REINFORCE / RePULSe p-losses (trl_ext.losses.reinforce), against explicit Python loops."""

import math

import pytest
import torch

from trl_ext.losses import get_loss_spec
from trl_ext.losses.reinforce import neg_reinforce_loss, neg_training_loss, reinforce_loss
from trl_ext.ops.advantages import compute_baseline

MODES = ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean")


def _batch(P=2, N=3, T=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(P, N, T, generator=g, dtype=dtype) * 3
    rewards = torch.randn(P, N, generator=g, dtype=dtype)
    lengths = torch.randint(1, T + 1, (P, N), generator=g)
    mask = (torch.arange(T)[None, None, :] < lengths[..., None]).to(dtype)
    return logprobs, rewards, mask


def _weights(P, N, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(P, N, generator=g, dtype=dtype) * 2, dim=-1)


def _loop_agg(per_token, mask, mode):
    """Aggregate a nested-list per-token loss [p][i][t] by hand."""
    P, N, T = mask.shape
    total, count, seqs = 0.0, 0.0, 0
    for p in range(P):
        for i in range(N):
            s = sum(per_token[p][i][t] for t in range(T) if mask[p, i, t] != 0)
            n = sum(1 for t in range(T) if mask[p, i, t] != 0)
            seqs += 1
            count += n
            if mode == "seq-mean-token-mean":
                total += s / n if n else 0.0
            else:
                total += s
    return total / (count if mode == "token-mean" else seqs)


def _loop_rloo(rewards):
    P, N = rewards.shape
    return [[(sum(rewards[p].tolist()) - rewards[p, i].item()) / (N - 1) for i in range(N)] for p in range(P)]


def _garbage(x, mask):
    y = x.clone()
    fills = [math.inf, -math.inf, math.nan]
    for k, idx in enumerate((mask == 0).nonzero().tolist()):
        y[tuple(idx)] = fills[k % 3]
    return y


# ----------------------------------------------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------------------------------------------
def test_rloo_baseline_matches_loop_and_alias():
    _, rewards, _ = _batch(P=3, N=4)
    b = compute_baseline(rewards, "rloo")
    torch.testing.assert_close(b, torch.tensor(_loop_rloo(rewards), dtype=b.dtype))
    torch.testing.assert_close(compute_baseline(rewards, "expectation"), b)


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        compute_baseline(torch.randn(3, 1), "rloo")
    logprobs, rewards, mask = _batch(P=2, N=1)
    with pytest.raises(ValueError, match="at least 2"):
        reinforce_loss(logprobs, rewards, mask, baseline="rloo")


def test_other_baselines():
    rewards = torch.tensor([[1.0, 2.0, 4.0], [0.0, -1.0, 3.0]])
    assert torch.equal(compute_baseline(rewards, "none"), torch.zeros(2, 3))
    assert torch.equal(compute_baseline(rewards, None), torch.zeros(2, 3))
    assert torch.equal(compute_baseline(rewards, "hardcoded", baseline_value=0.5), torch.full((2, 3), 0.5))
    other = torch.tensor([[1.0, 3.0], [-2.0, 0.0]])
    want = torch.tensor([[2.0] * 3, [-1.0] * 3])
    assert torch.equal(compute_baseline(rewards, "other_expectation", other_rewards=other), want)
    with pytest.raises(ValueError, match="other_rewards"):
        compute_baseline(rewards, "other_expectation")
    with pytest.raises(ValueError, match="Unknown baseline"):
        compute_baseline(rewards, "mean")
    # a flat (B,) batch is one prompt group
    flat = compute_baseline(torch.tensor([1.0, 2.0, 4.0]), "rloo")
    torch.testing.assert_close(flat, torch.tensor([3.0, 2.5, 1.5]))


# ----------------------------------------------------------------------------------------------------------------
# REINFORCE
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("baseline", ["none", "rloo"])
def test_reinforce_loss_matches_loop(mode, baseline):
    logprobs, rewards, mask = _batch(seed=2)
    out = reinforce_loss(logprobs, rewards, mask, baseline=baseline, aggregation=mode)
    b = _loop_rloo(rewards) if baseline == "rloo" else [[0.0] * 3 for _ in range(2)]
    per_token = [
        [[-logprobs[p, i, t].item() * (rewards[p, i].item() - b[p][i]) for t in range(4)] for i in range(3)]
        for p in range(2)
    ]
    assert out.loss.item() == pytest.approx(_loop_agg(per_token, mask, mode), rel=1e-10)
    assert set(out.metrics) >= {"advantage_mean", "advantage_std", "baseline_mean"}


def test_reinforce_gradient_and_rewards_detached():
    logprobs, rewards, mask = _batch(seed=3)
    logprobs.requires_grad_()
    rewards.requires_grad_()
    out = reinforce_loss(logprobs, rewards, mask, baseline="rloo")
    out.loss.backward()
    assert rewards.grad is None
    b = _loop_rloo(rewards.detach())
    for p in range(2):
        for i in range(3):
            n = int(mask[p, i].sum())
            for t in range(4):
                want = -(rewards[p, i].item() - b[p][i]) / (n * 6) if mask[p, i, t] else 0.0
                assert logprobs.grad[p, i, t].item() == pytest.approx(want, abs=1e-12)


def test_reinforce_flat_equals_one_group_and_normalizer():
    logprobs, rewards, mask = _batch(P=1, N=4, seed=4)
    grouped = reinforce_loss(logprobs, rewards, mask, baseline="rloo").loss
    flat = reinforce_loss(logprobs[0], rewards[0], mask[0], baseline="rloo").loss
    torch.testing.assert_close(flat, grouped)
    half = reinforce_loss(logprobs, rewards, mask, baseline="rloo", normalizer=8).loss
    torch.testing.assert_close(half, grouped / 2)


# ----------------------------------------------------------------------------------------------------------------
# neg_training (RePULSe)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_neg_training_matches_loop(mode):
    logprobs, rewards, mask = _batch(seed=5)
    neg_lp, _, neg_mask = _batch(P=2, N=3, T=5, seed=6)
    w = _weights(2, 3)
    alpha = 0.7
    out = neg_training_loss(logprobs, rewards, mask, neg_lp, w, neg_mask, alpha=alpha, aggregation=mode)
    b = _loop_rloo(rewards)
    rl = [
        [[-logprobs[p, i, t].item() * (rewards[p, i].item() - b[p][i]) for t in range(4)] for i in range(3)]
        for p in range(2)
    ]
    neg = [[[alpha * neg_lp[p, i, t].item() * w[p, i].item() for t in range(5)] for i in range(3)] for p in range(2)]
    want_neg = _loop_agg(neg, neg_mask, mode)
    assert out.metrics["neg_loss"].item() == pytest.approx(want_neg, rel=1e-10)
    assert out.loss.item() == pytest.approx(_loop_agg(rl, mask, mode) + want_neg, rel=1e-10)
    tokmeans = [[neg_lp[p, i][neg_mask[p, i] != 0].mean().item() for i in range(3)] for p in range(2)]
    weighted = sum(sum(w[p, i].item() * tokmeans[p][i] for i in range(3)) for p in range(2)) / 2
    assert out.metrics["neg_logprob_weighted"].item() == pytest.approx(weighted, rel=1e-10)


def test_neg_training_conventions_differ_by_factor_n():
    logprobs, rewards, mask = _batch(P=2, N=4, seed=7)
    neg_lp, _, neg_mask = _batch(P=2, N=4, T=3, seed=8)
    w = _weights(2, 4)
    ref = neg_training_loss(logprobs, rewards, mask, neg_lp, w, neg_mask, alpha=0.3)
    code = neg_training_loss(logprobs, rewards, mask, neg_lp, w, neg_mask, alpha=0.3, alpha_convention="code")
    exp = neg_training_loss(logprobs, rewards, mask, neg_lp, w, neg_mask, alpha=0.3, alpha_convention="expectation")
    assert exp.metrics["neg_loss"].item() == pytest.approx(4 * ref.metrics["neg_loss"].item(), rel=1e-12)
    assert code.loss.item() == ref.loss.item()
    assert exp.metrics["reinforce_loss"].item() == ref.metrics["reinforce_loss"].item()
    # "expectation": α · mean_P Σ_i w_i · tokenmean_i
    assert exp.metrics["neg_loss"].item() == pytest.approx(0.3 * ref.metrics["neg_logprob_weighted"].item())


def test_neg_training_validates_alpha_and_convention():
    logprobs, rewards, mask = _batch()
    w = _weights(2, 3)
    with pytest.raises(ValueError, match="alpha"):
        neg_training_loss(logprobs, rewards, mask, logprobs, w, mask, alpha=-0.1)
    with pytest.raises(ValueError, match="alpha_convention"):
        neg_training_loss(logprobs, rewards, mask, logprobs, w, mask, alpha=0.1, alpha_convention="paper")
    with pytest.raises(ValueError, match="neg_weights"):
        neg_training_loss(logprobs, rewards, mask, logprobs, w[:, :2], mask, alpha=0.1)
    with pytest.raises(ValueError, match="neg_normalizer"):
        neg_training_loss(
            logprobs, rewards, mask, logprobs, w, mask, alpha=0.1, aggregation="token-mean", normalizer=9
        )


def test_neg_training_weights_detached():
    logprobs, rewards, mask = _batch()
    neg_lp = logprobs.clone().requires_grad_()
    w = _weights(2, 3).requires_grad_()
    rewards.requires_grad_()
    out = neg_training_loss(logprobs, rewards, mask, neg_lp, w, mask, alpha=1.0)
    out.loss.backward()
    assert w.grad is None and rewards.grad is None
    assert neg_lp.grad is not None


def _table_logprobs(logits, tokens):
    """Per-token log-probs of ``tokens`` (P, N, T) under a context-free logit table (V,)."""
    return torch.log_softmax(logits, dim=-1)[tokens]


def test_neg_training_step_lowers_probability_of_weighted_samples():
    logits = torch.tensor([0.2, -0.1, 0.5, 0.0], requires_grad=True)
    p_tokens = torch.tensor([[[0, 1], [2, 3]]])
    q_tokens = torch.tensor([[[1, 1], [2, 0]]])  # q-sample 0 (tokens 1, 1) gets all the σ-weight
    mask = torch.ones(1, 2, 2)
    w = torch.tensor([[1.0, 0.0]])
    rewards = torch.zeros(1, 2)  # REINFORCE term has zero gradient; isolate the negative term
    before = _table_logprobs(logits, q_tokens)[0, 0].sum().item()
    out = neg_training_loss(
        _table_logprobs(logits, p_tokens), rewards, mask, _table_logprobs(logits, q_tokens), w, mask, alpha=1.0
    )
    out.loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    after = _table_logprobs(logits, q_tokens)[0, 0].sum().item()
    assert after < before


# ----------------------------------------------------------------------------------------------------------------
# neg_reinforce
# ----------------------------------------------------------------------------------------------------------------
def test_neg_reinforce_matches_loop_and_detaches():
    logprobs, rewards, mask = _batch(seed=9)
    neg_lp, neg_rewards, neg_mask = _batch(P=2, N=3, T=5, seed=10)
    neg_lp.requires_grad_()
    neg_rewards.requires_grad_()
    w = _weights(2, 3, seed=11).requires_grad_()
    out = neg_reinforce_loss(logprobs, rewards, mask, neg_lp, neg_rewards, w, neg_mask, alpha=0.5)
    mean_r = [sum(rewards[p].tolist()) / 3 for p in range(2)]
    neg = [
        [
            [-0.5 * w[p, i].item() * neg_lp[p, i, t].item() * (neg_rewards[p, i].item() - mean_r[p]) for t in range(5)]
            for i in range(3)
        ]
        for p in range(2)
    ]
    want_neg = _loop_agg(neg, neg_mask, "seq-mean-token-mean")
    assert out.metrics["neg_loss"].item() == pytest.approx(want_neg, rel=1e-10)
    rl = reinforce_loss(logprobs, rewards, mask, baseline="rloo").loss.item()
    assert out.loss.item() == pytest.approx(rl + want_neg, rel=1e-10)
    out.loss.backward()
    assert neg_rewards.grad is None and w.grad is None
    exp = neg_reinforce_loss(
        logprobs, rewards, mask, neg_lp, neg_rewards, w, neg_mask, alpha=0.5, alpha_convention="expectation"
    )
    assert exp.metrics["neg_loss"].item() == pytest.approx(3 * want_neg, rel=1e-10)


def test_neg_reinforce_pushes_low_reward_q_sample_down():
    logits = torch.tensor([0.1, 0.3, -0.2], requires_grad=True)
    p_tokens = torch.tensor([[[0], [2]]])
    q_tokens = torch.tensor([[[1], [0]]])
    mask = torch.ones(1, 2, 1)
    rewards = torch.tensor([[0.0, 0.0]])  # p-samples: mean return 0, and no REINFORCE gradient
    neg_rewards = torch.tensor([[-5.0, 0.0]])  # q-sample 0 is bad (reward units, not β·r)
    w = torch.tensor([[1.0, 0.0]])
    before = torch.log_softmax(logits, -1)[1].item()
    out = neg_reinforce_loss(
        _table_logprobs(logits, p_tokens),
        rewards,
        mask,
        _table_logprobs(logits, q_tokens),
        neg_rewards,
        w,
        mask,
        alpha=1.0,
        baseline="none",
    )
    out.loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    assert torch.log_softmax(logits, -1)[1].item() < before


# ----------------------------------------------------------------------------------------------------------------
# Robustness, registry
# ----------------------------------------------------------------------------------------------------------------
def test_garbage_in_masked_positions_never_reaches_loss_and_inputs_not_mutated():
    logprobs, rewards, mask = _batch(seed=12)
    neg_lp, neg_rewards, neg_mask = _batch(P=2, N=3, T=5, seed=13)
    w = _weights(2, 3)
    clean = neg_reinforce_loss(logprobs, rewards, mask, neg_lp, neg_rewards, w, neg_mask, alpha=0.4).loss
    clean_nt = neg_training_loss(logprobs, rewards, mask, neg_lp, w, neg_mask, alpha=0.4).loss
    glp = _garbage(logprobs, mask).requires_grad_()
    gneg = _garbage(neg_lp, neg_mask).requires_grad_()
    inputs = (glp, rewards, mask, gneg, neg_rewards, w, neg_mask)
    copies = [x.detach().clone() for x in inputs]
    out = neg_reinforce_loss(glp, rewards, mask, gneg, neg_rewards, w, neg_mask, alpha=0.4)
    out2 = neg_training_loss(glp, rewards, mask, gneg, w, neg_mask, alpha=0.4)
    torch.testing.assert_close(out.loss, clean)
    torch.testing.assert_close(out2.loss, clean_nt)
    (out.loss + out2.loss).backward()
    assert torch.isfinite(glp.grad).all() and torch.isfinite(gneg.grad).all()
    assert (glp.grad[mask == 0] == 0).all()
    for metric in (*out.metrics.values(), *out2.metrics.values()):
        assert torch.isfinite(metric).all()
    for before, after in zip(copies, inputs):
        torch.testing.assert_close(after.detach(), before, rtol=0, atol=0, equal_nan=True)


def test_registry_names_and_kinds():
    assert get_loss_spec("reinforce").fn is reinforce_loss
    assert get_loss_spec("reinforce").kind == "reinforce"
    assert get_loss_spec("neg_training", "harmlessness").fn is neg_training_loss
    assert get_loss_spec("neg_reinforce", "harmlessness").fn is neg_reinforce_loss
