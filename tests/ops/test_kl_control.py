"""Tests of `trl_ext.ops.kl_control`: the fixed and the adaptive (Ziegler et al. 2019) KL controllers."""

from __future__ import annotations

import pytest

from trl_ext.ops.kl_control import AdaptiveKLController, FixedKLController


def test_adaptive_controller_follows_the_proportional_rule_on_a_scripted_kl_sequence():
    """kl_coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon; target 6, horizon 100."""
    controller = AdaptiveKLController(0.1, target=6.0, horizon=100)
    script = [
        # (kl, n_steps, expected value after the update), computed by hand
        (6.0, 10, 0.1),  # on target: error 0
        (12.0, 10, 0.1 * 1.02),  # error 1 clipped to 0.2: × (1 + 0.2·10/100)
        (3.0, 10, 0.1 * 1.02 * 0.98),  # error -0.5 clipped to -0.2: × (1 − 0.02)
        (6.6, 10, 0.1 * 1.02 * 0.98 * 1.01),  # error 0.1 inside the clip: × (1 + 0.1·10/100)
        (0.0, 50, 0.1 * 1.02 * 0.98 * 1.01 * 0.9),  # error -1 clipped to -0.2, 50 responses: × (1 − 0.1)
    ]
    for kl, n_steps, expected in script:
        controller.update(kl, n_steps)
        assert controller.value == pytest.approx(expected, rel=1e-12)
    assert controller.value == pytest.approx(0.09086364, rel=1e-12)


def test_fixed_controller_never_changes_and_state_round_trips():
    fixed = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        fixed.update(kl, 64)
    assert fixed.value == 0.05
    adaptive = AdaptiveKLController(0.2, target=1.0, horizon=10)
    adaptive.update(5.0, 10)
    restored = AdaptiveKLController(0.2, target=1.0, horizon=10)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value == pytest.approx(0.24)


@pytest.mark.parametrize("target, horizon", [(0.0, 10), (-1.0, 10), (float("nan"), 10), (1.0, 0)])
def test_bad_targets_and_horizons_fail_clearly(target, horizon):
    with pytest.raises(ValueError, match="kl_target|kl_horizon"):
        AdaptiveKLController(0.1, target=target, horizon=horizon)


def test_adaptive_controller_refuses_a_horizon_below_the_batch():
    from trl_ext.ops.kl_control import AdaptiveKLController

    controller = AdaptiveKLController(0.1, target=1.0, horizon=16)
    controller.update(2.0, 16)  # at most +20%
    assert controller.value == pytest.approx(0.12)
    with pytest.raises(ValueError, match="set kl_horizon well above the responses per update"):
        controller.update(2.0, 17)
