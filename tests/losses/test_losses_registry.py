"""The loss registry's protocols: every kind fixes the call trainers make, and a loss whose signature cannot take it
is refused at registration with an error that says what to add."""

from __future__ import annotations

import inspect

import pytest
import torch

from trl_ext.losses import LOSS_KINDS, LOSS_PROTOCOLS, LossOutput, available_losses, get_loss_spec, register_loss


def test_every_kind_has_a_protocol_and_every_builtin_loss_follows_it():
    assert set(LOSS_PROTOCOLS) == set(LOSS_KINDS)
    for name in available_losses():
        spec = get_loss_spec(name)
        spec.protocol.check(spec.fn, name, spec.kind)  # raises if not
        params = inspect.signature(spec.fn).parameters
        assert all(option in params for option in spec.protocol.options), name  # named, not swallowed by **kwargs


def test_a_policy_loss_without_normalizer_is_refused_at_registration():
    with pytest.raises(TypeError, match=r"'policy' loss.*keyword\(s\) \['normalizer'\].*Add them to the signature"):

        @register_loss("_test_no_normalizer", kind="policy")
        def no_normalizer(logprobs, old_logprobs, advantages, mask, *, cliprange, dual_clip, aggregation):
            return LossOutput(logprobs.sum())

    assert "_test_no_normalizer" not in available_losses()


def test_too_few_inputs_and_missing_keyword_inputs_are_refused():
    with pytest.raises(TypeError, match=r"5 positional inputs.*it takes 3"):

        @register_loss("_test_short_twist", kind="twist")
        def short(v, log_phi, mask, *, aggregation, normalizer):
            return LossOutput(v.sum())

    with pytest.raises(TypeError, match=r"inputs \['neg_weights', 'alpha'\] \(passed by keyword\)"):

        @register_loss("_test_bad_harmlessness", kind="harmlessness")
        def bad(logprobs, rewards, mask, neg_logprobs, neg_mask, *, alpha_convention, baseline, baseline_value,
                aggregation):  # fmt: skip
            return LossOutput(logprobs.sum())


def test_kwargs_satisfy_a_protocol_and_call_passes_everything():
    seen = {}

    @register_loss("_test_kwargs_value", kind="value", overwrite=True)
    def value_loss(values, old_values, returns, mask, **kwargs):
        seen.update(kwargs)
        return LossOutput((values - returns).square().mean())

    spec = get_loss_spec("_test_kwargs_value", "value")
    assert spec.accepts("anything")
    x = torch.zeros(2, 3)
    spec.call(x, x, x + 1, torch.ones(2, 3), cliprange_value=0.2, aggregation="token-mean", normalizer=6.0)
    assert seen == {"cliprange_value": 0.2, "aggregation": "token-mean", "normalizer": 6.0}
    assert not get_loss_spec("ppo").accepts("beta") and get_loss_spec("ppo").accepts("dual_clip")
