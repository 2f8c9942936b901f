"""How RePULSe steps its two models (`trainers/common/stepping.py`): the leading model is back-propagated and
stepped alone, the closing model's loss goes through `compute_loss` and `Trainer.training_step`, and
`step_model` / `step_own_optimizer` touch exactly the parameters they name. The exact toy of
`test_harmlessness_trainer`."""

from __future__ import annotations

import pytest
import torch
from test_harmlessness_trainer import snapshot, toy_args, toy_trainer
from torch import nn
from transformers import Trainer

from trl_ext.trainers.common.stepping import step_own_optimizer
from trl_ext.trainers.harmlessness.steps import HarmlessnessStep


@pytest.mark.parametrize(
    ("options", "closing"),
    [({}, "policy"), ({"order": "p_then_q"}, "proposal"), ({"loss_type": "reinforce"}, "policy")],
    ids=["q_then_p", "p_then_q", "no-proposal"],
)
def test_the_closing_loss_goes_through_compute_loss_and_trainers_training_step(
    tmp_path, monkeypatch, options, closing
):
    trainer = toy_trainer(toy_args(tmp_path, max_steps=2, **options))
    seen, through_trainer = [], []
    compute = trainer.compute_loss

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        step = inputs["step"]
        assert isinstance(step, HarmlessnessStep)
        loss = compute(model, inputs, return_outputs, num_items_in_batch)
        seen.append((step.closing, loss.requires_grad, float(loss.detach())))
        return loss

    original = Trainer.training_step

    def trainer_step(self, *args, **kwargs):
        through_trainer.append(True)
        return original(self, *args, **kwargs)

    trainer.compute_loss = spy
    monkeypatch.setattr(Trainer, "training_step", trainer_step)
    trainer.train()
    assert len(seen) == len(through_trainer) == 2
    assert all(c == closing and grad for c, grad, _ in seen)
    if closing == "policy":  # Trainer's backward gets the policy loss scaled for accumulation (here: 1)
        history = [e["loss/policy"] for e in trainer.state.log_history if "loss/policy" in e]
        assert [v for *_, v in seen] == pytest.approx(history, rel=1e-3, abs=1e-4)


def test_step_model_steps_one_model_and_restores_the_others_gradients(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, max_grad_norm=0.5, optim="sgd", learning_rate=1.0,
                                   proposal_learning_rate=1.0))  # fmt: skip
    trainer.create_optimizer()
    policy, proposal = trainer.policy, trainer.proposal
    p0, q0 = snapshot(policy), snapshot(proposal)
    generator = torch.Generator().manual_seed(0)
    for param in [*policy.parameters(), *proposal.parameters()]:
        param.grad = torch.randn(param.shape, generator=generator)
    p_grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    q_grads = {n: p.grad.clone() for n, p in proposal.named_parameters()}
    norm = torch.cat([g.flatten() for g in q_grads.values()]).norm()
    trainer.step_model("proposal")
    factor = min(1.0, 0.5 / float(norm))
    for name, param in proposal.named_parameters():  # SGD, lr 1, no weight decay: θ ← θ − clipped gradient
        torch.testing.assert_close(param.detach(), q0[name] - factor * q_grads[name])
        assert param.grad is None
    for name, param in policy.named_parameters():  # untouched, its gradients back in place
        assert torch.equal(param.detach(), p0[name]) and torch.equal(param.grad, p_grads[name])
    assert trainer._metrics.values["grad_norm/proposal"] == [pytest.approx(float(norm), rel=1e-5)]


def test_step_own_optimizer_clips_steps_and_clears():
    layer = nn.Linear(3, 2)
    params = list(layer.parameters())
    start = [p.detach().clone() for p in params]
    grads = [torch.full_like(p, 2.0) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer = torch.optim.SGD(params, lr=0.1)

    class OneProcess:
        num_processes = 1

    norm = step_own_optimizer(OneProcess(), params, optimizer, max_grad_norm=1.0)
    expected = torch.cat([g.flatten() for g in grads]).norm()
    assert float(norm) == pytest.approx(float(expected))
    for p, p0, g in zip(params, start, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g / expected, rtol=1e-5, atol=1e-6)
        assert p.grad is None
