"""One policy forward per RePULSe step where it is exact (issue 35): with ``order="q_then_p"`` and dropout off, the
policy's forward with gradient over its own and the proposal's samples also gives the proposal rollout's
``log p_θ`` (the q-step's reference log-probs), so the separate no-grad pass over q's samples is gone. Same
training as the unfused step, up to rounding; the exact toy of `test_harmlessness_trainer`."""

from __future__ import annotations

import pytest
import torch
from test_harmlessness_trainer import PROMPT, toy_args, toy_trainer


def _train(tmp_path, fused: bool, **options):
    trainer = toy_trainer(toy_args(tmp_path / ("fused" if fused else "plain"), max_steps=3, **options))
    trainer.fuse_negative_forward = fused
    # q ≠ p from the start: with q = p the twist loss's gradient is rounding noise, which Adam's first step turns
    # into ±lr whichever pass computed it, so the two runs could not be compared
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trainer.proposal.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
    calls = {"grad": 0, "no_grad": 0}

    def count(module, args, output):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    handle = trainer.policy.register_forward_hook(count)
    trainer.train()
    handle.remove()
    return trainer, calls


@pytest.mark.parametrize(
    "options", [{}, {"loss_type": "neg_reinforce", "kl_coef": 0.1}], ids=["neg_training", "neg_reinforce"]
)
def test_the_fused_step_trains_as_the_unfused_one_with_one_pass_less(tmp_path, options):
    fused, fused_calls = _train(tmp_path, True, **options)
    plain, plain_calls = _train(tmp_path, False, **options)
    # Both models compute the same distributions (parameters are not compared: the attention's key bias gets an
    # exactly-zero gradient, rounding noise that Adam turns into ±lr steps either way, with no effect on outputs)
    ids = torch.tensor([PROMPT + [t, u] for t in range(2, 32, 3) for u in (9, 10, 20)])
    for model in ("policy", "proposal"):
        with torch.no_grad():
            a = torch.log_softmax(getattr(fused, model)(ids).logits, -1)
            b = torch.log_softmax(getattr(plain, model)(ids).logits, -1)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=model)
    rows = [(a, b) for a, b in zip(fused.state.log_history, plain.state.log_history) if "loss/proposal" in a]
    assert len(rows) == 3
    for a, b in rows:
        for key in ("loss/policy", "loss/proposal", "proposal/ess", "proposal/kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    # per step: the unfused step runs p_θ without gradient on q's samples (a shared-prefix pass: the prompt once,
    # then the responses on its cache, two calls); the fused one does not. One forward with gradient either way.
    assert plain_calls["grad"] == fused_calls["grad"] == 3
    assert plain_calls["no_grad"] - fused_calls["no_grad"] == 2 * 3


@pytest.mark.parametrize(
    "options",
    [{"order": "p_then_q"}, {"disable_dropout": False}, {"negative_sampler": "smc"}],
    ids=["p_then_q", "dropout", "smc"],
)
def test_steps_where_fusing_is_not_exact_keep_the_separate_pass(tmp_path, options):
    trainer = toy_trainer(toy_args(tmp_path, **options))
    assert not trainer._fuses_negative_forward()
    assert toy_trainer(toy_args(tmp_path / "default"))._fuses_negative_forward()
