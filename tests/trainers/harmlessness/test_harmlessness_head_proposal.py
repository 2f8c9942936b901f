"""A RePULSe proposal that is a modulation head on the live policy (issue 35): ``q ∝ p_θ·exp(m)``, ``m`` a head on
``p_θ``'s final hidden state (``parameterization="modulation_linear_head"`` / ``"modulation_mlp_head"``).

Checked on the exact toy of `test_harmlessness_trainer`: q's log-probs are the direct formula
``log_softmax(log p_θ + m)`` with the *current* policy (so q follows p when only p moves), the σ-weights of its
samples are the softmax of ``log p_θ + β·R − log q``, the proposal's optimizer holds only the head, the q-loss sends
no gradient into the trunk, training moves both, a checkpoint holds the head alone and resumes exactly, and the
settings that cannot work are refused.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_harmlessness_proposal_samples import _logprobs, _rollouts
from test_harmlessness_trainer import PROMPT, StopAt, changed, snapshot, toy_args, toy_model, toy_trainer

from trl_ext.models import ModulatedCausalLM

HEAD = {"parameterization": "modulation_linear_head", "modulation_init_scale_divider": 0.5}


def _direct_log_q(trainer, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(log_softmax(ℓ^p) + head(h))`` from the policy's own forward (all positions)."""
    with torch.no_grad():
        out = trainer.policy(ids, output_hidden_states=True)
        m = trainer.proposal.modulation_head(out.hidden_states[-1])
        return torch.log_softmax(torch.log_softmax(out.logits, -1) + m, -1)


IDS = torch.tensor([PROMPT + [t, u] for t in range(2, 32, 5) for u in (9, 10, 20)])


@pytest.mark.parametrize("kind", ["modulation_linear_head", "modulation_mlp_head"])
def test_the_head_proposal_is_the_policy_tilted_by_the_head_and_owns_only_the_head(tmp_path, kind):
    trainer = toy_trainer(toy_args(tmp_path, parameterization=kind))
    q = trainer.proposal
    assert isinstance(q, ModulatedCausalLM) and q.live_base and q.base_lm is trainer.policy
    head_names = {n for n, _ in q.named_parameters()}
    assert head_names and all(n.startswith("modulation_head.") for n in head_names)
    assert all(p.requires_grad for p in trainer.policy.parameters())  # the policy is not frozen by its proposal
    groups = {"policy": 0, "proposal": 0}
    for group in trainer.create_optimizer().param_groups:
        groups[group["part"]] += sum(p.numel() for p in group["params"])
    assert groups["proposal"] == sum(p.numel() for p in q.parameters())
    assert groups["policy"] == sum(p.numel() for p in trainer.policy.parameters())
    with torch.no_grad(), trainer._wrapper.acting_as("proposal"):
        log_q = trainer.model(IDS, torch.ones_like(IDS)).logits
    torch.testing.assert_close(log_q, _direct_log_q(trainer, IDS), atol=1e-5, rtol=0)
    # q follows p: moving only the policy moves q by exactly the policy's change
    before = _direct_log_q(trainer, IDS)
    with torch.no_grad():
        for param in trainer.policy.parameters():
            param.add_(0.2 * torch.randn_like(param))
        moved = q(IDS).logits
    assert (moved - before).abs().max() > 1e-2
    torch.testing.assert_close(moved, _direct_log_q(trainer, IDS), atol=1e-5, rtol=0)


def test_the_head_proposals_samples_and_weights_follow_the_formula(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, num_samples_per_prompt=8, **HEAD))
    rollouts, rewards = _rollouts(trainer, prompts=2)
    q = rollouts.proposal
    log_p = _logprobs(trainer.policy, q)
    direct = _direct_log_q(trainer, q.input_ids)[:, -q.response_length - 1 : -1]
    log_q = direct.gather(-1, q.input_ids[:, -q.response_length :].unsqueeze(-1)).squeeze(-1) * q.response_mask
    torch.testing.assert_close(q.logprobs, log_q, atol=1e-5, rtol=0)  # the sampler's log-probs are q's
    torch.testing.assert_close(q.ref_logprobs, log_p, atol=1e-5, rtol=0)  # its reference: the current policy
    mask = q.response_mask.float()
    assert ((log_p - log_q) * mask).abs().sum() > 0.1  # the head tilts q away from p
    weights = trainer.neg_weights(rollouts, rewards, log_p)
    expected = torch.softmax((((log_p - log_q) * mask).sum(-1) - 10.0 * q.scores).view(2, 8).double(), dim=-1)
    torch.testing.assert_close(weights.double(), expected, atol=1e-5, rtol=0)


def test_the_proposal_loss_trains_the_head_and_leaves_the_trunk_alone(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, **HEAD))
    rollouts, rewards = _rollouts(trainer)
    trainer.model.zero_grad()
    out = trainer.compute_proposal_loss(trainer.model, rollouts.proposal, rewards.proposal_log_phi)
    out.loss.loss.backward()
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.proposal.parameters())


def test_training_with_a_head_proposal_moves_both_and_resumes_exactly(tmp_path):
    kwargs = dict(max_steps=2, save_strategy="steps", save_steps=1, **HEAD)
    straight = toy_trainer(toy_args(tmp_path / "straight", **kwargs))
    policy, head = snapshot(straight.policy), snapshot(straight.proposal)
    straight.train()
    assert changed(straight.policy, policy) and changed(straight.proposal, head)
    rows = [r for r in straight.state.log_history if "loss/proposal" in r]
    assert len(rows) == 2 and all(abs(r["proposal/logprob_diff"]) < 1e-4 for r in rows)
    killed = toy_args(tmp_path / "killed", **kwargs)
    toy_trainer(killed, callbacks=[StopAt(1)]).train()
    checkpoint = os.path.join(killed.output_dir, "checkpoint-1")
    from safetensors.torch import load_file

    saved = load_file(os.path.join(checkpoint, "proposal", "model.safetensors"))
    assert saved and all(k.startswith("modulation_head.") for k in saved)  # the head only, not the trunk again
    resumed = toy_trainer(toy_args(tmp_path / "killed", **kwargs))
    resumed.train(resume_from_checkpoint=checkpoint)
    for name in ("policy", "proposal"):
        a, b = snapshot(getattr(resumed, name)), snapshot(getattr(straight, name))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=f"{name}.{key}")


def test_the_head_starts_from_the_seed(tmp_path):
    a = toy_trainer(toy_args(tmp_path / "a", **HEAD)).proposal
    b = toy_trainer(toy_args(tmp_path / "b", **HEAD)).proposal
    c = toy_trainer(toy_args(tmp_path / "c", seed=1, **HEAD)).proposal
    weight = "modulation_head.weight"
    assert torch.equal(a.state_dict()[weight], b.state_dict()[weight])
    assert not torch.equal(a.state_dict()[weight], c.state_dict()[weight])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"parameterization": "modulation_model"}, "second copy of the transformer"),
        ({"parameterization": "modulation_linear_head", "proposal_loss_type": "ctl_no_second_term"}, "second term"),
        ({"parameterization": "modulation_mlp_head", "modulation_init_head_from_base": True}, "head_from_base"),
        ({"parameterization": "modulation_linear_head", "modulation_init_scale_divider": 0.0}, "positive divider"),
        ({"parameterization": "modulation_linear_head", "use_vllm": True}, "vLLM engine"),
    ],
)
def test_head_settings_that_cannot_work_are_refused(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        toy_args(tmp_path, **extra)


def test_a_proposal_model_with_a_head_parameterization_is_refused(tmp_path):
    with pytest.raises(ValueError, match="head on the policy's trunk; pass proposal_model=None"):
        toy_trainer(toy_args(tmp_path, **HEAD), proposal_model=toy_model(1))


def test_a_fused_step_gives_the_head_the_policy_forwards_hidden_states_instead_of_a_trunk_pass(tmp_path):
    """With the policy's LM head frozen (so its training forward scores from hidden states, as with the top blocks
    trained), the q-step reads the hidden states of q's samples from the policy step's forward: one no-grad trunk
    pass per step fewer, the same training up to rounding."""

    def run(share: bool):
        trainer = toy_trainer(toy_args(tmp_path / str(share), max_steps=3, **HEAD))
        trainer.policy.get_output_embeddings().requires_grad_(False)
        if not share:
            trainer._is_head_proposal = lambda: False
        calls = {"grad": 0, "no_grad": 0}

        def count(module, args, output):
            calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1

        handle = trainer.policy.gpt_neox.register_forward_hook(count)
        trainer.train()
        handle.remove()
        return trainer, calls

    shared, shared_calls = run(True)
    plain, plain_calls = run(False)
    assert shared_calls["grad"] == plain_calls["grad"] == 3  # the policy step's forward, once a step
    assert plain_calls["no_grad"] - shared_calls["no_grad"] == 3  # the q-step's trunk pass, gone
    for model in ("policy", "proposal"):
        with torch.no_grad():
            a, b = getattr(shared, model)(IDS).logits, getattr(plain, model)(IDS).logits
        torch.testing.assert_close(torch.log_softmax(a, -1), torch.log_softmax(b, -1), atol=1e-4, rtol=0)
    rows = [(a, b) for a, b in zip(shared.state.log_history, plain.state.log_history) if "loss/proposal" in a]
    assert len(rows) == 3
    for a, b in rows:
        for key in ("loss/policy", "loss/proposal", "proposal/ess"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
