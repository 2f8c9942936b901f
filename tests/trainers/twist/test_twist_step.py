"""`trl_ext.trainers.twist.twist_step.twist_loss`: the twist step shared by the proposal and harmlessness trainers.

- CTL on ``policy_psi_q_p_s_t`` has the gradient of its formula computed by hand from an independent forward pass
  (σ-weighted maximum likelihood of q minus the per-step control variate); ``ctl_no_second_term`` and DPG have exactly
  the gradient of σ-weighted maximum likelihood;
- every allowed parameterisation × loss combination gives a finite loss, gradients on q's trainable parameters and
  none on the reference (or on a modulated model's frozen base);
- exact SIXO's base samples (other prompt/response widths) go through the same forward pass and give the loss computed
  from separate forward passes;
- the combinations that cannot work raise a `ValueError` saying what to change.
"""

from __future__ import annotations

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.losses import get_loss
from trl_ext.models import ModulatedCausalLM
from trl_ext.rollout import forward_response
from trl_ext.trainers.twist.twist_step import (
    TwistLossOutput,
    twist_loss,
    twist_loss_requirements,
    validate_twist_setup,
)

V = 32  # a small vocabulary keeps the all-vocabulary (DPG) tensors tiny
P, N, T = 2, 3, 4
POLICY = ("policy_psi_q_p_s_t", "policy_psi_q_p_s_1_to_t", "policy_psi_unnorm")
MODULATION = {"modulation_model": "model", "modulation_linear_head": "linear_head", "modulation_mlp_head": "mlp_head"}


def tiny_lm(seed: int = 0):
    return kit.build_causal_lm("gpt_neox", tokenizer=kit.build_tokenizer(), seed=seed, vocab_size=V)


def make_batch(q, p, *, prompt_widths=(3, 2), seed=0) -> dict:
    """``P·N`` rows: left-padded prompts of different lengths, right-padded responses of different lengths; old
    log-probs from ``q``, reference log-probs from ``p`` (as a rollout would store them), random ``log φ``."""
    g = torch.Generator().manual_seed(seed)
    width = max(prompt_widths)
    ids = torch.zeros(P * N, width + T, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row in range(P * N):
        length = prompt_widths[row // N]
        ids[row, width - length : width] = torch.randint(5, V, (length,), generator=g)
        attention[row, width - length : width] = 1
    response_mask = torch.ones(P * N, T, dtype=torch.long)
    response_mask[1, 2:] = 0
    response_mask[4, 1:] = 0
    ids[:, width:] = torch.randint(5, V, (P * N, T), generator=g) * response_mask + (1 - response_mask)
    attention[:, width:] = response_mask
    with torch.no_grad():
        old = forward_response(q, ids, attention, T).logprobs
        ref = forward_response(p, ids, attention, T).logprobs
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "response_mask": response_mask,
        "old_logprobs": old,
        "ref_logprobs": ref,
        "log_phi": 2.0 * torch.randn(P * N, generator=g),
    }


def reference_token_logprobs(model, batch) -> torch.Tensor:
    """``log q(s_t|s_<t)`` from a plain full forward pass (explicit positions, no logits_to_keep), ``(B, T)``."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
    logp = torch.log_softmax(logits[:, -T - 1 : -1], dim=-1)
    return logp.gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1) * batch["response_mask"]


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def assert_same_grads(a, b, atol=1e-6, rtol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


@pytest.fixture
def models():
    return tiny_lm(0), tiny_lm(1)


# ------------------------------------------------------------------------------------------------ gradients by hand
def test_ctl_gradient_matches_the_formula_computed_by_hand(models):
    q, p = models
    batch = make_batch(q, p)
    out = twist_loss(q, batch, num_samples_per_prompt=N, parameterization="policy_psi_q_p_s_t", loss_type="ctl")
    assert isinstance(out, TwistLossOutput)
    out.loss.loss.backward()
    got = grads(q)
    q.zero_grad()

    # By hand: w_i = softmax_i(Σ m log p + log φ − Σ m log q_old); u_{i,t} = softmax over the samples valid at t of
    # Σ_{k≤t} m (log p − log q_old) + v_t with v_t = log q − log p; ℓ = −(w_i − u_{i,t}) v_{i,t}; mean over
    # sequences of the token mean.
    m = batch["response_mask"].float()
    ref, old, phi = batch["ref_logprobs"], batch["old_logprobs"], batch["log_phi"]
    log_q = reference_token_logprobs(q, batch)
    v = (log_q - ref) * m
    log_w = ((ref - old) * m).sum(-1) + phi
    w = torch.softmax(log_w.view(P, N), -1).reshape(-1)
    log_u = torch.cumsum((ref - old) * m, -1) + v.detach()
    log_u = log_u.masked_fill(m == 0, float("-inf")).view(P, N, T)
    u = torch.nan_to_num(torch.softmax(log_u, dim=1)).reshape(P * N, T)
    per_token = -(w[:, None] - u) * v
    loss = ((per_token * m).sum(-1) / m.sum(-1)).mean()
    loss.backward()
    assert_same_grads(got, grads(q))
    assert torch.isclose(out.loss.loss, loss, atol=1e-6)


@pytest.mark.parametrize(
    "loss_type,parameterization",
    [
        ("ctl_no_second_term", "policy_psi_q_p_s_t"),
        ("dpg", "policy_psi_q_p_s_t"),
        ("dpg", "policy_psi_q_p_s_1_to_t"),
        ("dpg", "policy_psi_unnorm"),
    ],
)
def test_gradient_is_sigma_weighted_maximum_likelihood(models, loss_type, parameterization):
    """Without the per-step term, and for DPG on every policy parameterisation (``p·ψ ∝ q`` there, so the expected
    twist has zero gradient and prefix sums cancel), the gradient is that of
    ``−mean_i w_i · (Σ_t m log q(s_t)) / Σ_t m``: σ-weighted maximum likelihood, i.e. forward KL(σ‖q)."""
    q, p = models
    batch = make_batch(q, p, seed=1)
    out = twist_loss(
        q, batch, num_samples_per_prompt=N, parameterization=parameterization, loss_type=loss_type, reference_model=p
    )
    out.loss.loss.backward()
    got = grads(q)
    q.zero_grad()
    m = batch["response_mask"].float()
    log_w = ((batch["ref_logprobs"] - batch["old_logprobs"]) * m).sum(-1) + batch["log_phi"]
    w = torch.softmax(log_w.view(P, N), -1).reshape(-1)
    mle = -(w * (reference_token_logprobs(q, batch) * m).sum(-1) / m.sum(-1)).mean()
    mle.backward()
    assert_same_grads(got, grads(q))
    assert all(x.grad is None for x in p.parameters())


def test_q_logprobs_and_entropy_match_the_rollout_scoring(models):
    q, p = models
    batch = make_batch(q, p)
    out = twist_loss(q, batch, num_samples_per_prompt=N, parameterization="policy_psi_q_p_s_t", loss_type="ctl")
    scored = forward_response(q, batch["input_ids"], batch["attention_mask"], T, return_entropy=True)
    torch.testing.assert_close(out.q_logprobs, scored.logprobs.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.entropy, scored.entropy, atol=1e-6, rtol=0)
    assert not out.q_logprobs.requires_grad and out.v.shape == (P * N, T)
    assert (out.v[batch["response_mask"] == 0] == 0).all()


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
def test_split_by_prompts_with_a_normalizer_gives_the_full_batch_gradient(models, aggregation):
    """The σ-weights are per prompt, so micro-batches of whole prompts whose losses are normalised by the full batch's
    count (sequences, or tokens for token-mean) sum to the full batch's loss and gradient (QUALITY_BARS item 11)."""
    q, p = models
    batch = make_batch(q, p)
    kw = {"parameterization": "policy_psi_q_p_s_t", "loss_type": "ctl", "aggregation": aggregation}
    full = twist_loss(q, batch, num_samples_per_prompt=N, **kw).loss.loss
    full.backward()
    expected = grads(q)
    q.zero_grad()
    count = float(batch["response_mask"].sum()) if aggregation == "token-mean" else float(P * N)
    total = 0.0
    for prompt in range(P):
        rows = slice(prompt * N, (prompt + 1) * N)
        part = {k: v[rows] for k, v in batch.items()}
        loss = twist_loss(q, part, num_samples_per_prompt=N, normalizer=count, **kw).loss.loss
        loss.backward()
        total += float(loss)
    assert total == pytest.approx(float(full), abs=1e-6)
    assert_same_grads(grads(q), expected)


# ------------------------------------------------------------------------------------------ allowed combinations
ALLOWED = [(par, loss) for par in POLICY for loss in ("ctl", "dpg")]
ALLOWED += [("policy_psi_q_p_s_t", "ctl_no_second_term"), ("policy_psi_q_p_s_1_to_t", "ctl_no_second_term")]
ALLOWED += [(par, loss) for par in MODULATION for loss in ("ctl", "dpg", "sixo", "sixo_approx")]


def base_samples(prompt_batch: dict, seed: int = 5) -> dict:
    """Fresh "base" samples for the same prompts: one prompt token fewer, responses of 2 tokens (other widths)."""
    g = torch.Generator().manual_seed(seed)
    width = prompt_batch["input_ids"].shape[1] - T
    prompt_ids = prompt_batch["input_ids"][:, 1:width]
    prompt_mask = prompt_batch["attention_mask"][:, 1:width]
    responses = torch.randint(5, V, (P * N, 2), generator=g)
    response_mask = torch.ones_like(responses)
    response_mask[0, 1] = 0
    return {
        "input_ids": torch.cat([prompt_ids, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        "response_mask": response_mask,
    }


@pytest.mark.parametrize("parameterization,loss_type", ALLOWED)
def test_allowed_combinations_train_q_only(parameterization, loss_type):
    p = tiny_lm(1)
    if parameterization in MODULATION:
        q = ModulatedCausalLM.from_base(tiny_lm(0), MODULATION[parameterization])
        trainable = q.modulation_parameters()
        frozen = list(q.base_lm.parameters()) + list(p.parameters())
    else:
        q = tiny_lm(0)
        trainable, frozen = list(q.parameters()), list(p.parameters())
    batch = make_batch(q, p)
    out = twist_loss(
        q,
        batch,
        num_samples_per_prompt=N,
        parameterization=parameterization,
        loss_type=loss_type,
        reference_model=p if loss_type == "dpg" else None,
        base_batch=base_samples(batch) if loss_type == "sixo" else None,
    )
    assert torch.isfinite(out.loss.loss) and out.loss.loss.requires_grad
    assert all(torch.isfinite(v) for v in out.loss.metrics.values())
    out.loss.loss.backward()
    norms = [float(x.grad.abs().sum()) for x in trainable if x.grad is not None]
    assert norms and sum(norms) > 0
    assert all(x.grad is None for x in frozen)


def test_exact_sixo_base_samples_share_the_forward_pass():
    q = ModulatedCausalLM.from_base(tiny_lm(0), "linear_head")
    batch = make_batch(q, tiny_lm(1))
    base = base_samples(batch)
    out = twist_loss(
        q, batch, num_samples_per_prompt=N, parameterization="modulation_linear_head", loss_type="sixo",
        base_batch=base,
    )  # fmt: skip

    def modulation_at_tokens(b):  # a separate forward pass per batch
        width = b["response_mask"].shape[1]
        positions = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        mod = q(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=positions)
        m = mod.modulation_logits[:, -width - 1 : -1]
        return m.gather(-1, b["input_ids"][:, -width:].unsqueeze(-1)).squeeze(-1) * b["response_mask"]

    with torch.no_grad():
        v, base_v = modulation_at_tokens(batch), modulation_at_tokens(base)
        expected = get_loss("sixo", "twist")(
            v.view(P, N, T), batch["log_phi"].view(P, N), batch["response_mask"].view(P, N, T),
            batch["old_logprobs"].view(P, N, T), batch["ref_logprobs"].view(P, N, T),
            base_v=base_v.view(P, N, 2), base_mask=base["response_mask"].view(P, N, 2),
        )  # fmt: skip
    torch.testing.assert_close(out.loss.loss.detach(), expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss.metrics["neg_term"], expected.metrics["neg_term"], atol=1e-5, rtol=1e-5)


def test_requirements_of_the_builtin_losses():
    assert twist_loss_requirements("dpg").all_vocab and not twist_loss_requirements("ctl").all_vocab
    assert twist_loss_requirements("sixo").base_samples and not twist_loss_requirements("sixo_approx").base_samples
    assert twist_loss_requirements("sixo_approxneg").classifier and not twist_loss_requirements("ctl").classifier


# ----------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "parameterization,loss_type,match",
    [
        ("policy_psi_q_p_s_t", "sixo", "classifier"),
        ("policy_psi_unnorm", "sixo_approx", "classifier"),
        ("policy_psi_unnorm", "ctl_no_second_term", "loss_type='ctl'"),
        ("modulation_linear_head", "ctl_nosecondterm", "loss_type='ctl'"),
        ("policy", "ctl", "has no twist"),
        ("psi_something", "ctl", "Unknown parameterization"),
        ("policy_psi_q_p_s_t", "nope", "No loss named"),
        ("policy_psi_q_p_s_t", "ppo", "'policy' loss"),
        ("policy_psi_q_p_s_t", "mixed_ctl_value", "requires values"),
    ],
)
def test_setup_errors(parameterization, loss_type, match):
    with pytest.raises(ValueError, match=match):
        validate_twist_setup(parameterization, loss_type)


def test_model_and_input_errors(models):
    q, p = models
    batch = make_batch(q, p)
    kw = {"num_samples_per_prompt": N}
    with pytest.raises(ValueError, match=r"ModulatedCausalLM.from_base\(model, 'linear_head'\)"):
        twist_loss(q, batch, parameterization="modulation_linear_head", loss_type="ctl", **kw)
    modulated = ModulatedCausalLM.from_base(tiny_lm(0), "mlp_head")
    with pytest.raises(ValueError, match="modulation_\\* parameterisation of its kind"):
        twist_loss(modulated, batch, parameterization="policy_psi_q_p_s_t", loss_type="ctl", **kw)
    with pytest.raises(ValueError, match="needs a 'linear_head' modulation"):
        twist_loss(modulated, batch, parameterization="modulation_linear_head", loss_type="ctl", **kw)
    with pytest.raises(ValueError, match="pass reference_model"):
        twist_loss(q, batch, parameterization="policy_psi_q_p_s_t", loss_type="dpg", **kw)
    with pytest.raises(ValueError, match="pass base_batch"):
        twist_loss(modulated, batch, parameterization="modulation_mlp_head", loss_type="sixo", **kw)
    with pytest.raises(ValueError, match="only used by exact SIXO"):
        twist_loss(q, batch, parameterization="policy_psi_q_p_s_t", loss_type="ctl", base_batch=batch, **kw)
    with pytest.raises(ValueError, match="num_samples_per_prompt=4"):
        twist_loss(q, batch, parameterization="policy_psi_q_p_s_t", loss_type="ctl", num_samples_per_prompt=4)
    with pytest.raises(ValueError, match="missing log_phi"):
        bad = {k: v for k, v in batch.items() if k != "log_phi"}
        twist_loss(q, bad, parameterization="policy_psi_q_p_s_t", loss_type="ctl", **kw)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        twist_loss(
            q, {**batch, "old_logprobs": batch["old_logprobs"][:, :2]}, parameterization="policy_psi_q_p_s_t",
            loss_type="ctl", **kw,
        )  # fmt: skip
