"""Twisted SMC (`trl_ext.sampling.twisted_smc`) on the exact toy: a tiny GPT-NeoX over 32 tokens, one prompt,
2-token responses, bad tokens {6, 7, 28}; σ and Z = P(bad) are known by enumerating the 1024 responses.

Exactness where theory gives it (optimal twist: equal weights and Ẑ = Z; constant twist: importance sampling),
statistical checks with fixed seeds (unbiased Ẑ, E[log Ẑ] ≤ log Z ≤ E[log Ẑ_cond]) and the KV caches after
resampling (the recorded log-probs and twists equal those of a fresh forward pass over the final particles).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.eval import bad_output_probability
from trl_ext.eval.rare import short_response_target, smc_estimate, smc_log_z_upper_bound
from trl_ext.models import ModulatedCausalLM
from trl_ext.sampling import (
    FunctionTwist,
    LMTwist,
    SMCConfig,
    TokenSetPotential,
    constant_twist,
    proposal_twist,
    twisted_smc,
)

V = 32
PROMPT = [7, 9, 11, 13]
BAD = [6, 7, 28]
STOP = 3


def toy_lm(seed: int = 0, head_scale: float = 4.0):
    model = kit.build_causal_lm("gpt_neox", tokenizer=kit.build_tokenizer(), seed=seed, vocab_size=V)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    return model.eval()


@pytest.fixture(scope="module")
def p():
    return toy_lm(0)


@pytest.fixture(scope="module")
def potential():
    return TokenSetPotential(BAD)


@pytest.fixture(scope="module")
def target(p, potential):
    return short_response_target(p, PROMPT, potential)


def all_responses_logp(model, prompt=PROMPT) -> torch.Tensor:
    """``(V, V)`` float64 ``log m(s_1, s_2 | prompt)`` by one forward pass over all 1024 full sequences."""
    ids = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
    n = len(prompt)
    out = lp[:, n - 1].gather(1, ids[:, n : n + 1])[:, 0] + lp[:, n].gather(1, ids[:, n + 1 : n + 2])[:, 0]
    return out.view(V, V)


def a_twist_model(p, kind: str = "linear_head", seed: int = 1):
    """A modulated copy of ``p`` with a random (non-optimal) modulation: a mediocre learned twist."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ModulatedCausalLM.from_base(copy.deepcopy(p), kind).eval()


# ------------------------------------------------------------------------------------------------ the exact toy
def test_exact_target_matches_enumeration_and_the_analytic_value(p, target):
    m = all_responses_logp(p)
    bad = torch.zeros(V, dtype=torch.bool)
    bad[BAD] = True
    is_bad = bad[:, None] | bad[None, :]
    assert target.z == pytest.approx(float(m[is_bad].exp().sum()), rel=1e-6)
    assert target.z == pytest.approx(bad_output_probability(p, PROMPT, BAD, eos_token_id=[]).probability, rel=1e-6)
    with_stop = short_response_target(p, PROMPT, TokenSetPotential(BAD), stop_token_ids=[STOP])
    analytic = bad_output_probability(p, PROMPT, BAD, eos_token_id=[STOP]).probability
    assert with_stop.z == pytest.approx(analytic, rel=1e-6)
    assert with_stop.z < target.z  # a stop first token ends the response: its bad continuations no longer count
    assert target.row_forwards == 1 + V - len(BAD)


def test_exact_samples_follow_sigma(p, target):
    m = all_responses_logp(p)
    bad = torch.zeros(V, dtype=torch.bool)
    bad[BAD] = True
    sigma = torch.where(bad[:, None] | bad[None, :], m.exp(), torch.zeros_like(m))
    sigma = sigma / sigma.sum()
    ids, mask = target.sample(20000, torch.Generator().manual_seed(0))
    assert bool((mask == 1).all())
    freq = torch.bincount(ids[:, 0] * V + ids[:, 1], minlength=V * V).double().view(V, V) / 20000
    # E|f − σ| ≈ √(2σ(1−σ)/(πn)) per cell for a correct sampler; the sum concentrates tightly around its mean
    expected_l1 = float((2 * sigma * (1 - sigma) / (math.pi * 20000)).sqrt().sum())
    assert float((freq - sigma).abs().sum()) < 1.25 * expected_l1
    assert float(freq[~(bad[:, None] | bad[None, :])].sum()) == 0.0


# ------------------------------------------------------------------------------------------ exactness results
@pytest.mark.parametrize("resampling", ["multinomial", "systematic"])
@pytest.mark.parametrize("stop", [False, True])
def test_optimal_twist_gives_equal_weights_and_the_exact_z(p, resampling, stop):
    potential = TokenSetPotential(BAD)
    stops = [STOP] if stop else []
    exact = short_response_target(p, PROMPT, potential, stop_token_ids=stops)
    source = FunctionTwist(p, exact.log_twist)  # the twist-induced proposal of ψ* is σ's own conditional
    config = SMCConfig(num_particles=16, resampling=resampling, ess_threshold=0.99, stop_token_ids=stops)
    result = twisted_smc(
        source, torch.tensor([PROMPT] * 4), potential, config, generator=torch.Generator().manual_seed(0)
    )
    # every particle's weight is Z (up to float32 log-probs), so Ẑ = Z whatever was drawn
    assert torch.allclose(result.log_weights, torch.full_like(result.log_weights, exact.log_z), atol=1e-5, rtol=0)
    assert torch.allclose(result.log_z, torch.full_like(result.log_z, exact.log_z), atol=1e-5, rtol=0)
    assert torch.allclose(result.ess, torch.full_like(result.ess, 16.0), atol=1e-6)
    assert bool((result.num_resampling == 0).all())  # equal weights: the ESS is K, nothing to resample
    assert bool((result.log_phi == 0).all())  # every particle is bad
    if stop:
        assert not bool((result.response_ids[:, 0] == STOP).any())  # σ puts no mass on a stopped good response


def test_constant_twist_is_importance_sampling(p, potential):
    """ψ ≡ 1 with a proposal q and no resampling: Ẑ = (1/K) Σ_k p(s_k)φ(s_k)/q(s_k), computed here directly."""
    q = toy_lm(5, head_scale=2.0)
    config = SMCConfig(num_particles=32, resampling="none")
    result = twisted_smc(constant_twist(p, q), torch.tensor([PROMPT] * 3), potential, config,
                         generator=torch.Generator().manual_seed(3))  # fmt: skip
    log_p, log_q = all_responses_logp(p), all_responses_logp(q)
    s1, s2 = result.response_ids[:, 0], result.response_ids[:, 1]
    log_phi = potential(result.prompt_ids, result.prompt_mask, result.response_ids, result.response_mask)
    log_w = (log_p[s1, s2] - log_q[s1, s2] + log_phi).view(3, 32)
    expected = torch.logsumexp(log_w, -1) - math.log(32)
    assert torch.allclose(result.log_z, expected, atol=1e-5, rtol=0)
    assert torch.allclose(result.log_weights, log_w, atol=1e-5, rtol=0)
    # the same with q = p: plain Monte Carlo, Ẑ = fraction of bad samples
    plain = twisted_smc(constant_twist(p), torch.tensor([PROMPT] * 3), potential, config,
                        generator=torch.Generator().manual_seed(4))  # fmt: skip
    fraction = (plain.log_phi == 0).double().view(3, 32).mean(-1)
    assert torch.allclose(plain.z, fraction, atol=1e-12, rtol=0)


def test_proposal_with_its_implied_twist_never_resamples(p, potential):
    q = toy_lm(5, head_scale=2.0)
    config = SMCConfig(num_particles=16, ess_threshold=0.99)
    result = twisted_smc(proposal_twist(q, p), torch.tensor([PROMPT] * 4), potential, config,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert bool((result.num_resampling == 0).all())  # π_t ∝ q(s_{1:t}): every weight stays 1 until φ
    assert torch.allclose(result.ess[0], torch.full((4,), 16.0, dtype=torch.float64), atol=1e-6)


# ------------------------------------------------------------------------------------------ statistical checks
def three_token_sigma(model, potential) -> tuple[torch.Tensor, torch.Tensor]:
    """All 32³ responses of 3 tokens and their exact ``log p(s)·φ(s)`` (one forward pass, no stop tokens)."""
    seqs = torch.cartesian_prod(torch.arange(V), torch.arange(V), torch.arange(V))
    ids = torch.cat([torch.tensor(PROMPT).expand(seqs.shape[0], -1), seqs], 1)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[:, len(PROMPT) - 1 : -1].double(), -1)
    log_m = lp.gather(-1, seqs[..., None])[..., 0].sum(-1)
    ones = torch.ones_like(seqs)
    return seqs, log_m + potential(ids, torch.ones_like(ids), seqs, ones)


def test_unbiased_and_the_two_sided_bound_on_average(p):
    """A mediocre twist (random modulation), 3-token responses (so resampling happens), σ ∝ p·exp(β·r) with
    β = −3 and a lexical reward (−1 bad, 0 else; a finite φ, so no run's log Ẑ is −∞), exact σ by enumerating the
    32³ responses: over 400 runs of K = 8, mean Ẑ is within 3.5 SE of Z, and mean log Ẑ < log Z < mean log Ẑ_cond,
    each beyond 3 SE of noise (fixed seeds)."""
    potential = TokenSetPotential(BAD, log_phi_bad=3.0, log_phi_good=0.0)
    seqs, log_sigma = three_token_sigma(p, potential)
    log_z = float(torch.logsumexp(log_sigma, 0))

    def exact_samples(n, generator):
        draws = torch.multinomial(torch.softmax(log_sigma, 0).float(), n, replacement=True, generator=generator)
        return seqs[draws], torch.ones(n, 3, dtype=torch.long)

    source = LMTwist(a_twist_model(p), "modulation_linear_head")
    config = SMCConfig(num_particles=8, max_new_tokens=3, ess_threshold=0.9)
    est = smc_estimate(source, PROMPT, potential, config, num_runs=400, seed=0)
    z = math.exp(log_z)
    assert abs(est.estimate - z) < 3.5 * est.std_error, (est.estimate, est.std_error, z)
    assert est.details["mean_resampling_count"] > 0.3  # the test exercises resampling
    lower, lower_se = est.details["log_z_lower"], est.details["log_z_lower_se"]
    upper = smc_log_z_upper_bound(source, PROMPT, potential, config, exact_samples, num_runs=400, seed=1)
    assert lower + 3 * lower_se < log_z, (lower, lower_se, log_z)
    assert upper.value - 3 * upper.std_error > log_z, (upper, log_z)
    assert est.details["row_forwards"] == 400 * 8 * 3  # one modulated model, 3 steps


# ------------------------------------------------------------------------------------------ KV caches
def fresh_records(source_kind, q, p, prompt_ids, prompt_mask, response_ids):
    """log p, log q and log ψ_t at every response token from one forward pass over prompt + response (no cache)."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    T = response_ids.shape[1]
    with torch.no_grad():
        q_out = q(input_ids=ids, attention_mask=mask, position_ids=pos)
        rows = slice(-(T + 1), -1)
        tokens = response_ids[..., None]
        if source_kind.startswith("modulation"):
            log_q = q_out.logits[:, rows].float()
            log_p = torch.log_softmax(q_out.base_logits[:, rows].float(), -1)
            psi = q_out.modulation_logits[:, rows].float().gather(-1, tokens)[..., 0]
        else:
            raw = q_out.logits[:, rows].float()
            log_q = torch.log_softmax(raw, -1)
            log_p = torch.log_softmax(
                p(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, rows].float(), -1
            )
            step = (log_q - log_p).gather(-1, tokens)[..., 0]
            psi = {
                "policy_psi_q_p_s_t": step,
                "policy_psi_q_p_s_1_to_t": step.cumsum(-1),
                "policy_psi_unnorm": (raw - log_p).gather(-1, tokens)[..., 0],
            }[source_kind]
    return log_p.gather(-1, tokens)[..., 0], log_q.gather(-1, tokens)[..., 0], psi


@pytest.mark.parametrize(
    "parameterization",
    ["policy_psi_q_p_s_t", "policy_psi_q_p_s_1_to_t", "policy_psi_unnorm", "modulation_linear_head",
     "modulation_mlp_head", "modulation_model"],
)  # fmt: skip
def test_resampling_keeps_kv_caches_consistent(p, parameterization):
    """Left-padded prompts of two lengths, 5 tokens, resampling at every step: the log-probs and twists recorded
    along each final particle's ancestral line equal those of a fresh, uncached forward pass."""
    if parameterization.startswith("modulation"):
        kind = parameterization.removeprefix("modulation_")
        q, ref = a_twist_model(p, kind), None
    else:
        q, ref = toy_lm(9, head_scale=2.0), p
    source = LMTwist(q, parameterization, reference_model=ref)
    prompts = torch.tensor([[0, 0, 5, 9, 11], [7, 9, 11, 13, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    config = SMCConfig(num_particles=6, max_new_tokens=5, ess_threshold=1.0, resampling="multinomial")
    result = twisted_smc(source, prompts, TokenSetPotential(BAD, log_phi_good=-1.0), config, prompt_mask=mask,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert int(result.num_resampling.min()) >= 2
    lp, lq, psi = fresh_records(parameterization, q, p, result.prompt_ids, result.prompt_mask, result.response_ids)
    assert torch.allclose(result.token_log_p, lp, atol=1e-4)
    assert torch.allclose(result.token_log_q, lq, atol=1e-4)
    assert torch.allclose(result.token_log_psi[:, :-1], psi[:, :-1], atol=1e-4)


# ------------------------------------------------------------------------------------------------ errors
def test_errors(p, potential):
    with pytest.raises(ValueError, match="ModulatedCausalLM"):
        LMTwist(p, "modulation_linear_head")
    with pytest.raises(ValueError, match="reference_model"):
        LMTwist(p, "policy_psi_q_p_s_t")
    with pytest.raises(ValueError, match="modulation_\\* parameterisation|its modulation"):
        LMTwist(a_twist_model(p), "policy_psi_q_p_s_t", reference_model=p)
    with pytest.raises(ValueError, match="needs a 'mlp_head' modulation"):
        LMTwist(a_twist_model(p), "modulation_mlp_head")
    with pytest.raises(ValueError, match="no twist"):
        LMTwist(p, "policy", reference_model=p)
    with pytest.raises(ValueError, match="resampling"):
        SMCConfig(resampling="residual")
    with pytest.raises(ValueError, match="ess_threshold"):
        SMCConfig(ess_threshold=1.5)
    with pytest.raises(ValueError, match="multinomially"):
        twisted_smc(constant_twist(p), torch.tensor([PROMPT]), potential, SMCConfig(resampling="systematic"),
                    reference_ids=torch.tensor([[6, 1]]))  # fmt: skip
    with pytest.raises(ValueError, match="first stop token"):
        twisted_smc(constant_twist(p), torch.tensor([PROMPT]), potential, SMCConfig(stop_token_ids=[STOP]),
                    reference_ids=torch.tensor([[6]]))  # fmt: skip
    with pytest.raises(ValueError, match="left-padded"):
        twisted_smc(constant_twist(p), torch.tensor([PROMPT]), potential, SMCConfig(),
                    prompt_mask=torch.tensor([[1, 1, 1, 0]]))  # fmt: skip
    with pytest.raises(ValueError, match="num_runs"):
        smc_estimate(constant_twist(p), PROMPT, potential, SMCConfig(), num_runs=1)
    with pytest.raises(ValueError, match="TokenSetPotential"):
        short_response_target(p, PROMPT, lambda *a: None)


# ------------------------------------------------------------------------------------------ defensive mixture
def test_proposal_mix_one_samples_p_and_weights_are_phi(p, potential):
    """ε = 1: tokens come from p whatever the twist, and without resampling the ψ factors telescope, so each
    final log-weight is log φ of the particle's response."""
    config = SMCConfig(num_particles=16, resampling="none", proposal_mix=1.0)
    source = LMTwist(a_twist_model(p), "modulation_linear_head")
    result = twisted_smc(source, torch.tensor([PROMPT] * 2), potential, config,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.allclose(result.log_weights.view(-1), result.log_phi, atol=1e-5, rtol=0)
    assert torch.allclose(result.token_log_q, result.token_log_p, atol=0, rtol=0)


def test_proposal_mix_weights_use_the_mixture(p, potential):
    """ε = 0.3 with ψ ≡ 1, proposal q, no resampling: w = p·φ / ((1 − ε)·q + ε·p) per token, from the exact
    per-token probabilities of the sampled responses."""
    q, eps = toy_lm(5, head_scale=2.0), 0.3
    config = SMCConfig(num_particles=32, resampling="none", proposal_mix=eps)
    result = twisted_smc(constant_twist(p, q), torch.tensor([PROMPT] * 2), potential, config,
                         generator=torch.Generator().manual_seed(1))  # fmt: skip
    ids = torch.cat([result.prompt_ids, result.response_ids], 1)
    with torch.no_grad():
        lp = torch.log_softmax(p(input_ids=ids).logits[:, len(PROMPT) - 1 : -1].double(), -1)
        lq = torch.log_softmax(q(input_ids=ids).logits[:, len(PROMPT) - 1 : -1].double(), -1)
    tok = result.response_ids[..., None]
    p_t, q_t = lp.gather(-1, tok)[..., 0].exp(), lq.gather(-1, tok)[..., 0].exp()
    mix_t = (1 - eps) * q_t + eps * p_t
    expected = (p_t.log() - mix_t.log()).sum(-1) + result.log_phi
    assert torch.allclose(result.log_weights.view(-1), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="proposal_mix"):
        SMCConfig(proposal_mix=1.5)
