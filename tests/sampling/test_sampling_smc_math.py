"""The arithmetic of SMC (`trl_ext.sampling.smc_math`) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trl_ext.sampling import (
    conditional_multinomial_resample,
    effective_sample_size,
    incremental_log_weight,
    log_mean_exp,
    multinomial_resample,
    normalized_weights,
    resample,
    systematic_resample,
)

INF = math.inf


def test_normalized_weights_and_ess_by_hand():
    w = torch.tensor([[1.0, 1.0, 2.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    lw = w.log()
    assert torch.allclose(normalized_weights(lw), w / w.sum(-1, keepdim=True))
    # (Σw)²/Σw²: 16/6 and 9/9
    assert torch.allclose(effective_sample_size(lw), torch.tensor([16 / 6, 1.0], dtype=torch.float64))
    # shifting a group's log-weights changes nothing
    assert torch.allclose(effective_sample_size(lw + 50.0), effective_sample_size(lw))
    dead = torch.full((1, 3), -INF, dtype=torch.float64)
    assert effective_sample_size(dead).item() == 0.0
    assert normalized_weights(dead).abs().sum().item() == 0.0


def test_log_mean_exp():
    x = torch.tensor([[0.0, math.log(3.0)], [-INF, -INF]], dtype=torch.float64)
    out = log_mean_exp(x)
    assert out[0].item() == pytest.approx(math.log(2.0))
    assert out[1].item() == -INF
    tiny = torch.tensor([-1000.0, -1000.0], dtype=torch.float64)
    assert log_mean_exp(tiny).item() == pytest.approx(-1000.0)


def test_incremental_log_weight_formula_and_zero_weights():
    lp, lq = torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -3.0])
    psi, prev = torch.tensor([0.3, -INF]), torch.tensor([0.1, -INF])
    out = incremental_log_weight(lp, lq, psi, prev)
    assert out[0].item() == pytest.approx(-1.0 + 0.3 + 0.5 - 0.1)
    assert out[1].item() == -INF  # ψ_t = 0 after ψ_{t-1} = 0: weight 0, not nan
    assert out.dtype == torch.float64


def test_systematic_resampling_copies_each_particle_floor_or_ceil_times():
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([[0.05, 0.4, 0.15, 0.4]], dtype=torch.float64)
    for _ in range(50):
        index = systematic_resample(w.log(), g)
        counts = torch.bincount(index[0], minlength=4).double()
        expected = 4 * w[0]
        assert bool(((counts == expected.floor()) | (counts == expected.ceil())).all()), counts
        assert bool((index[0][1:] >= index[0][:-1]).all())  # sorted


def test_multinomial_resampling_frequencies():
    g = torch.Generator().manual_seed(1)
    w = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    lw = w.log().expand(2000, -1).contiguous()
    counts = torch.bincount(multinomial_resample(lw, g).flatten(), minlength=3).double()
    freq = counts / counts.sum()
    # 6000 draws: 4 standard errors of a proportion ≈ 0.025
    assert torch.allclose(freq, w, atol=0.025), freq


def test_conditional_resampling_keeps_the_reference():
    g = torch.Generator().manual_seed(2)
    lw = torch.tensor([[-INF, 0.0, 0.0, 0.0]] * 20, dtype=torch.float64)
    index = conditional_multinomial_resample(lw, g)
    assert bool((index[:, 0] == 0).all())
    assert bool((index[:, 1:] > 0).all())  # the zero-weight reference is never drawn for the others


def test_resampling_errors():
    lw = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="multinomial"):
        resample(lw, "systematic", conditional=True)
    with pytest.raises(ValueError, match="Unknown resampling"):
        resample(lw, "stratified")
    with pytest.raises(ValueError, match="no particle of positive weight"):
        multinomial_resample(torch.tensor([[-INF, -INF]], dtype=torch.float64))
    with pytest.raises(ValueError, match="nan"):
        effective_sample_size(torch.tensor([[0.0, math.nan]]))
    with pytest.raises(ValueError, match="groups, particles"):
        effective_sample_size(torch.zeros(3))
