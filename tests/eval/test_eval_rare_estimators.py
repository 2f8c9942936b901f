"""Rare-output estimators (`trl_ext.eval.rare`): P(y|x), exact enumeration, brute force, ITGIS and MHIS.

The sampling estimators are checked against the exact value on tiny GPT-NeoX models (vocabulary 24, one layer) whose
output head is scaled up so that ``P(y|x)`` really depends on ``x``; every test runs in about a second.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest
import torch

from trl_ext.eval.rare import (
    Estimate,
    brute_force,
    chain_ratio_estimate,
    effective_sample_size,
    estimate_rare_output,
    evaluate_inputs,
    exact_probability,
    from_token_ids,
    hex_distribution,
    importance_log_weights,
    itgis,
    log_space_mean,
    mhis,
    proposal_log_probs,
    target_logprob,
    target_token_ids,
    token_scores,
    uniform,
)
from trl_ext.eval.rare.itgis import itgis_temperature, score_normaliser
from trl_ext.eval.rare.mhis import mh_log_acceptance, mh_proposal_log_probs
from trl_ext.eval.report import write_json_report
from trl_ext.testing import build_causal_lm, build_rare_output_lm, build_tokenizer

VOCAB = 24


def small_lm(head_scale: float = 5.0, seed: int = 0, dropout: float = 0.0):
    """One-layer GPT-NeoX over 24 tokens; the LM head is multiplied by ``head_scale`` (peakier outputs)."""
    return build_rare_output_lm(head_scale, seed=seed, dropout=dropout, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def lm():
    return small_lm(5.0)


@pytest.fixture(scope="module")
def rare_lm():
    return small_lm(50.0)


def slow_logprob(model, prefix, x, target) -> float:
    """log P(target | prefix + x) from one unbatched forward pass over the whole sequence."""
    ids = torch.tensor([list(prefix) + list(x) + list(target)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double().log_softmax(-1)
    start = len(prefix) + len(x)
    return sum(float(logits[start - 1 + j, t]) for j, t in enumerate(target))


def within(estimate: Estimate, truth: float, k: float = 3.0) -> bool:
    return abs(estimate.estimate - truth) <= k * estimate.std_error


# ------------------------------------------------------------------------------------------------ P(y | x)
@pytest.mark.parametrize("arch", ["gpt_neox", "llama", "gpt2"])
def test_target_logprob_matches_a_direct_forward_pass(arch):
    tokenizer = build_tokenizer()
    model = build_causal_lm(arch, tokenizer=tokenizer)
    target = target_token_ids(tokenizer, "kill", leading_space=True)
    assert len(target) > 1 and target != target_token_ids(tokenizer, "kill")
    x = torch.randint(5, len(tokenizer), (5, 3))
    prefix = [tokenizer.bos_token_id]
    got = target_logprob(model, x, target, batch_size=2, prefix_ids=prefix)
    expected = torch.tensor([slow_logprob(model, prefix, row.tolist(), target) for row in x], dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    ev = evaluate_inputs(model, x, target, score="logprob", prefix_ids=prefix, with_grad=True, batch_size=3)
    torch.testing.assert_close(ev.target_logprob, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ev.score, ev.target_logprob)
    assert ev.embedding_grad.shape == (5, 3, model.config.get_text_config().hidden_size)


def test_target_token_ids_errors(tiny_tokenizer):
    with pytest.raises(ValueError, match="target_word is empty"):
        target_token_ids(tiny_tokenizer, "")


def test_logit_score_and_its_gradient(lm):
    x = torch.tensor([[3, 7, 11], [0, 23, 5]])
    target = [4, 9]
    ev = evaluate_inputs(lm, x, target, score="logit")
    with torch.no_grad():
        logits = lm(input_ids=x).logits[:, -1, 4].double()
    torch.testing.assert_close(ev.score, logits, atol=1e-5, rtol=1e-5)
    # ∂s/∂e against a central finite difference of the score along a random direction of the embeddings
    embeds = lm.get_input_embeddings()(torch.cat([x, torch.tensor([[4], [4]])], 1)).detach()
    direction = torch.randn_like(embeds)
    direction[:, -1] = 0  # the target token's embedding is not an input
    eps = 1e-3

    def score_at(e):
        with torch.no_grad():
            return lm(inputs_embeds=e).logits[:, 2, 4].double()

    finite_diff = (score_at(embeds + eps * direction) - score_at(embeds - eps * direction)) / (2 * eps)
    analytic = (ev.embedding_grad.double() * direction[:, :3].double()).sum((1, 2))
    torch.testing.assert_close(analytic, finite_diff, rtol=2e-2, atol=1e-3)


def test_gradients_touch_no_parameter(lm):
    flags = [p.requires_grad for p in lm.parameters()]
    evaluate_inputs(lm, torch.tensor([[1, 2]]), [3], score="logprob")
    assert [p.requires_grad for p in lm.parameters()] == flags
    assert all(p.grad is None for p in lm.parameters())


def test_token_scores_are_linear_in_the_gradient(lm):
    grad = torch.randn(4, 3, 16)
    weight = lm.get_input_embeddings().weight
    g = token_scores(grad, weight, VOCAB)
    torch.testing.assert_close(g, torch.einsum("blh,vh->blv", grad, weight.detach()))
    torch.testing.assert_close(token_scores(grad.mean(0), weight, VOCAB), g.mean(0), atol=1e-6, rtol=1e-5)
    assert token_scores(grad, weight, 10).shape == (4, 3, 10)


def test_eval_mode_is_used_and_restored():
    model = small_lm(5.0, dropout=0.5).train()
    x = torch.tensor([[1, 2, 3], [4, 5, 6]])
    first = target_logprob(model, x, [7])
    assert model.training  # restored
    torch.testing.assert_close(target_logprob(model, x, [7]), first)  # no dropout noise
    model.eval()
    torch.testing.assert_close(target_logprob(model, x, [7]), first)


# --------------------------------------------------------------------------------------------- log-space stats
def test_log_space_mean_and_ess():
    values = torch.tensor([0.1, 0.4, 0.2, 0.7], dtype=torch.float64)
    mean, se, log_mean = log_space_mean(values.log())
    assert mean == pytest.approx(0.35) and log_mean == pytest.approx(math.log(0.35))
    assert se == pytest.approx(statistics.stdev(values.tolist()) / 2)
    # far below float64's range: the log of the mean stays exact
    mean, se, log_mean = log_space_mean(values.log() - 2000.0)
    assert mean == 0.0 and log_mean == pytest.approx(math.log(0.35) - 2000.0)
    assert log_space_mean(torch.full((3,), -math.inf)) == (0.0, 0.0, -math.inf)
    assert effective_sample_size(torch.zeros(10)) == pytest.approx(10.0)
    assert effective_sample_size(torch.tensor([0.0, -50.0, -50.0])) == pytest.approx(1.0, abs=1e-6)


def test_estimate_report_round_trip(tmp_path):
    est = Estimate("itgis", 1e-5, 2e-6, 100, -5.0, ess=50.0, details={"temperature": 1.0})
    assert est.relative_std_error == pytest.approx(0.2)
    low, high = est.confidence_interval(0.95)
    assert low == pytest.approx(1e-5 - 1.96 * 2e-6, rel=1e-3) and high == pytest.approx(1e-5 + 1.96 * 2e-6, rel=1e-3)
    path = write_json_report(tmp_path / "r.json", {"result": est.to_dict()})
    loaded = json.loads(open(path).read())["result"]
    assert loaded["estimate"] == 1e-5 and loaded["ci95"][0] >= 0 and loaded["details"]["temperature"] == 1.0


# ------------------------------------------------------------------------------------------------- exact
def test_exact_equals_a_slow_loop_over_the_support(lm):
    dist = from_token_ids([0, 3, 8, 21], VOCAB, length=2, weights=[1.0, 2.0, 3.0, 4.0], prefix_ids=[5])
    target = [6, 2]
    exact = exact_probability(lm, dist, target, batch_size=5, show_progress=False)
    slow = 0.0
    for a, b in itertools.product([0, 3, 8, 21], repeat=2):
        d = float(dist.log_prob(torch.tensor([[a, b]])).exp())
        slow += d * math.exp(slow_logprob(lm, [5], [a, b], target))
    assert exact.estimate == pytest.approx(slow, rel=1e-4)
    assert exact.method == "exact" and exact.std_error == 0 and exact.num_samples == 16
    assert exact.log10_estimate == pytest.approx(math.log10(slow), abs=1e-4)


def test_exact_refuses_large_supports(lm):
    with pytest.raises(ValueError, match="max_support"):
        exact_probability(lm, uniform(VOCAB, 5), [1], show_progress=False)
    with pytest.raises(ValueError, match="max_support"):
        exact_probability(lm, uniform(VOCAB, 3), [1], max_support=1000, show_progress=False)


# ----------------------------------------------------------------------------------- agreement with the truth
@pytest.fixture(scope="module")
def truth(lm):
    dist = uniform(VOCAB, 3)
    return dist, exact_probability(lm, dist, [17], batch_size=4096, show_progress=False).estimate


def test_brute_force_agrees_with_exact(lm, truth):
    dist, p = truth
    est = brute_force(lm, dist, [17], num_samples=3000, batch_size=1000, seed=1, show_progress=False)
    assert est.method == "brute_force" and est.num_samples == 3000
    assert 0 < est.std_error < est.estimate
    assert within(est, p)


@pytest.mark.parametrize("score", ["logit", "logprob"])
def test_itgis_agrees_with_exact(lm, truth, score):
    dist, p = truth
    est = itgis(lm, dist, [17], 3000, batch_size=250, temperature=1.0, score=score, seed=2, show_progress=False)
    assert est.method == "itgis" and est.details["iterations"] == 12
    assert 0 < est.std_error < est.estimate
    assert within(est, p)
    assert 1 <= est.ess <= 3000


def test_mhis_agrees_with_exact(lm, truth):
    dist, p = truth
    est = mhis(lm, dist, [17], 2000, batch_size=64, temperature=1.0, burn_in=20, seed=3, show_progress=False)
    assert est.method == "mhis" and est.num_samples == 64 * 32  # ceil(2000 / 64) kept steps per chain
    assert 0 < est.std_error < est.estimate
    assert 0 < est.acceptance_rate <= 1
    assert within(est, p)
    assert len(est.details["chain_log10_estimates"]) == 64


def test_estimators_are_reproducible(lm):
    dist = uniform(VOCAB, 2)
    a = itgis(lm, dist, [3], 200, batch_size=50, seed=7, show_progress=False)
    b = itgis(lm, dist, [3], 200, batch_size=50, generator=torch.Generator().manual_seed(7), show_progress=False)
    c = itgis(lm, dist, [3], 200, batch_size=50, seed=8, show_progress=False)
    assert a.estimate == b.estimate and a.estimate != c.estimate


def test_estimate_rare_output_dispatches(lm):
    dist = uniform(VOCAB, 1)
    exact = estimate_rare_output("exact", lm, dist, [3], show_progress=False)
    assert exact.method == "exact"
    for method in ("brute_force", "itgis", "mhis"):
        est = estimate_rare_output(
            method, lm, dist, [3], num_samples=64, batch_size=16, burn_in=2, show_progress=False
        )
        assert est.method == method and within(est, exact.estimate, 4.0)
    with pytest.raises(ValueError, match="Unknown method"):
        estimate_rare_output("magic", lm, dist, [3])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_samplers_on_kit_architectures(arch):
    tokenizer = build_tokenizer()
    model = build_causal_lm(arch, tokenizer=tokenizer)
    final_norm = model.model.norm if arch == "llama" else model.transformer.ln_f
    with torch.no_grad():
        final_norm.weight.mul_(20.0)  # peakier outputs, so that P(y|x) depends on x (GPT-2's head is tied)
    dist = hex_distribution(tokenizer, length=1)
    target = target_token_ids(tokenizer, "a")
    p = exact_probability(model, dist, target, show_progress=False).estimate
    for est in (
        itgis(model, dist, target, 256, batch_size=64, temperature=5.0, seed=0, show_progress=False),
        mhis(model, dist, target, 256, batch_size=32, temperature=5.0, burn_in=5, seed=0, show_progress=False),
    ):
        assert 0 < est.std_error < est.estimate and within(est, p)
    if arch == "gpt2":  # its tied head makes "a" after "a" near-certain: at T = 1 every chain sticks to that input
        with pytest.warns(RuntimeWarning, match="changed their state in only"):
            stuck = mhis(model, dist, target, 256, batch_size=32, temperature=1.0, burn_in=5, show_progress=False)
        assert stuck.acceptance_rate > 0.9 and stuck.details["move_rate"] < 0.01


# --------------------------------------------------------------------------------------------------- ITGIS
def test_itgis_temperature_schedule():
    assert score_normaliser(0, 0.9) == 1.0  # T_0 = temperature (S_0 = 0, so q_0 = D anyway)
    assert score_normaliser(1, 0.9) == pytest.approx(1.0)
    assert score_normaliser(3, 0.9) == pytest.approx(1 + 0.9 + 0.81)
    assert score_normaliser(4, 1.0) == 4.0 and score_normaliser(4, 0.0) == 1.0
    assert itgis_temperature(2, 5.0, 0.5) == pytest.approx(7.5)
    with pytest.raises(ValueError):
        score_normaliser(-1, 0.9)


def test_itgis_weights_are_exactly_one_with_zero_scores():
    dist = from_token_ids([1, 4, 6], 8, length=3, weights=[0.2, 0.3, 0.5])
    x = dist.sample(50, torch.Generator().manual_seed(0))
    log_w = importance_log_weights(dist.log_probs, torch.zeros(3, 8, dtype=torch.float64), 2.0, x)
    assert torch.equal(log_w, torch.zeros(50, dtype=torch.float64))
    assert torch.equal(proposal_log_probs(dist.log_probs, torch.zeros(3, 8), 2.0).exp(), dist.probs)


def test_itgis_proposal_and_weights_match_their_definition():
    dist = from_token_ids([1, 4, 6], 8, length=2, weights=[0.2, 0.3, 0.5])
    scores = torch.randn(2, 8, dtype=torch.float64) * 3
    log_q = proposal_log_probs(dist.log_probs, scores, 1.5)
    q = log_q.exp()
    torch.testing.assert_close(q.sum(-1), torch.ones(2, dtype=torch.float64))
    assert (q[:, [0, 2, 3, 5, 7]] == 0).all()  # never outside D's support
    unnormalised = dist.probs * (scores / 1.5).exp()
    torch.testing.assert_close(q, unnormalised / unnormalised.sum(-1, keepdim=True))
    x = torch.tensor([[1, 6], [4, 4], [6, 1]])
    expected = dist.log_prob(x) - log_q.gather(1, x.T).sum(0)
    torch.testing.assert_close(importance_log_weights(dist.log_probs, scores, 1.5, x), expected)
    # E_q[w] = 1: the weights are exact density ratios
    all_x = torch.cat(list(dist.enumerate_support(100)))
    log_w = importance_log_weights(dist.log_probs, scores, 1.5, all_x)
    assert float((log_q.gather(1, all_x.T).sum(0) + log_w).exp().sum()) == pytest.approx(1.0)


def test_itgis_beats_brute_force_on_a_rare_target(rare_lm):
    """Per-sample standard error (SE·√n) of ITGIS < brute force's on the target least likely in expectation."""
    dist = uniform(VOCAB, 3)
    expected = [exact_probability(rare_lm, dist, [y], batch_size=4096, show_progress=False) for y in range(VOCAB)]
    target = min(range(VOCAB), key=lambda y: expected[y].estimate)
    p = expected[target].estimate
    assert p < 0.25 * max(e.estimate for e in expected)
    n, ratios = 1000, []
    for seed in range(3):
        bf = brute_force(rare_lm, dist, [target], n, batch_size=500, seed=seed, show_progress=False)
        it = itgis(rare_lm, dist, [target], n, batch_size=100, temperature=2.0, seed=seed, show_progress=False)
        assert within(it, p) and within(bf, p)
        ratios.append((bf.std_error * math.sqrt(n)) / (it.std_error * math.sqrt(n)))
    assert min(ratios) > 1.0 and statistics.median(ratios) > 1.4, ratios


# ---------------------------------------------------------------------------------------------------- MHIS
def test_mh_acceptance_formula():
    args = [torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([-2.0])]
    log_a = mh_log_acceptance(*args, torch.tensor([-0.5]), torch.tensor([-0.25]), 2.0)
    assert log_a.item() == pytest.approx((2 - 1) / 2 + (-1 + 2) + (-0.5 + 0.25))


def test_mh_proposal_tends_to_the_input_distribution_at_high_temperature():
    log_p = from_token_ids([1, 2, 5], 6, 1, weights=[1.0, 2.0, 3.0]).log_probs.expand(4, 6)
    gain = torch.randn(4, 6) * 10
    torch.testing.assert_close(mh_proposal_log_probs(log_p, gain, 1e9).exp(), log_p.exp(), atol=1e-7, rtol=0)
    tilted = mh_proposal_log_probs(log_p, gain, 1.0).exp()
    torch.testing.assert_close(tilted.sum(-1), torch.ones(4, dtype=torch.float64))
    assert (tilted[:, [0, 3, 4]] == 0).all()


def test_chain_ratio_estimate_by_hand():
    values = torch.tensor([[0.1, 0.3], [0.2, 0.2], [0.5, 0.1]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 2.0], [1.0, 1.0], [3.0, 1.0]], dtype=torch.float64)
    est, se, log_est, per_chain = chain_ratio_estimate(values.log(), weights.log())
    a, b = (values * weights).mean(1), weights.mean(1)
    ratio = float(a.sum() / b.sum())
    expected_se = math.sqrt(float(((a - ratio * b) ** 2).sum()) / (3 * 2)) / float(b.mean())
    assert est == pytest.approx(ratio) and se == pytest.approx(expected_se)
    assert log_est == pytest.approx(math.log(ratio))
    assert per_chain == pytest.approx((a / b).log().tolist())
    # shifting every log-weight by a constant changes nothing (self-normalised)
    est2, se2, _, _ = chain_ratio_estimate(values.log(), weights.log() - 800.0)
    assert est2 == pytest.approx(est) and se2 == pytest.approx(se)
    with pytest.raises(ValueError, match="at least 2 chains"):
        chain_ratio_estimate(values[:1].log(), weights[:1].log())


def test_mhis_at_high_temperature_matches_brute_force(lm):
    dist = uniform(VOCAB, 2)
    target = [11]
    hot = mhis(lm, dist, target, 1500, batch_size=50, temperature=1e6, burn_in=5, seed=4, show_progress=False)
    assert hot.acceptance_rate == pytest.approx(1.0, abs=1e-3)  # proposal ≈ D ≈ π: every move accepted
    assert hot.ess == pytest.approx(hot.num_samples, rel=1e-3)  # weights e^{-s/T} ≈ 1
    bf = brute_force(lm, dist, target, 1500, batch_size=500, seed=5, show_progress=False)
    assert abs(hot.estimate - bf.estimate) < 3 * math.hypot(hot.std_error, bf.std_error)


def test_mhis_warns_when_few_chains_carry_the_weight(rare_lm):
    with pytest.warns(RuntimeWarning, match="chains carry almost all the importance weight"):
        mhis(rare_lm, uniform(VOCAB, 2), [8], 256, batch_size=32, temperature=0.1, burn_in=10, show_progress=False)


# -------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: brute_force(m, uniform(VOCAB + 1, 2), [1], 10), "embeds only 24"),
        (lambda m: brute_force(m, uniform(VOCAB, 2), [99], 10), "outside the model's vocabulary"),
        (lambda m: brute_force(m, uniform(VOCAB, 2), [], 10), "target_ids is empty"),
        (lambda m: brute_force(m, uniform(VOCAB, 2, prefix_ids=[30]), [1], 10), "outside the model's vocabulary"),
        (lambda m: brute_force(m, uniform(VOCAB, 2), [1], 1), "num_samples"),
        (lambda m: brute_force(m, uniform(VOCAB, 2), [1], 10, batch_size=0), "batch_size"),
        (lambda m: brute_force(m, torch.zeros(2, 3), [1], 10), "InputDistribution"),
        (lambda m: itgis(m, uniform(VOCAB, 2), [1], 10, temperature=0.0), "temperature"),
        (lambda m: itgis(m, uniform(VOCAB, 2), [1], 10, decay_rate=1.5), "decay_rate"),
        (lambda m: itgis(m, uniform(VOCAB, 2), [1], 10, score="prob"), "score"),
        (lambda m: mhis(m, uniform(VOCAB, 2), [1], 10, batch_size=1), "at least 2 chains"),
        (lambda m: mhis(m, uniform(VOCAB, 2), [1], 10, burn_in=-1), "burn_in"),
        (lambda m: mhis(m, uniform(VOCAB, 2), [1], 10, temperature=float("inf")), "temperature"),
    ],
)
def test_bad_arguments_raise_clear_errors(lm, call, message):
    with pytest.raises(ValueError, match=message):
        call(lm)
