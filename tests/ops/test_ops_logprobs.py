"""Chunked log-probs, hidden-state log-probs, modulated log-probs and entropy against naive implementations."""

import math

import pytest
import torch

from trl_ext.ops import (
    entropy_from_logits,
    full_logprobs,
    logprobs_from_hidden,
    logprobs_from_logits,
    modulated_logprobs,
)


def _naive(logits, labels, temperature=1.0):
    safe = labels.clamp(min=0)
    out = torch.log_softmax(logits / temperature, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(labels == -100, torch.zeros_like(out), out)


def _data(B=3, T=5, V=11, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, labels


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_naive_fp32(chunk_size, temperature):
    logits, labels = _data()
    out = logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    assert (out - _naive(logits, labels, temperature)).abs().max().item() < 1e-6


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 1.9])
def test_backward_matches_naive(chunk_size, temperature):
    logits, labels = _data(seed=1)
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(9))
    x1 = logits.clone().requires_grad_(True)
    (logprobs_from_logits(x1, labels, temperature=temperature, chunk_size=chunk_size) * upstream).sum().backward()
    x2 = logits.clone().requires_grad_(True)
    (_naive(x2, labels, temperature) * upstream).sum().backward()
    assert x1.grad.dtype == logits.dtype
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6, rtol=0)


def test_gradcheck_fp64():
    logits, labels = _data(B=2, T=3, V=5, seed=2, dtype=torch.float64)
    labels[1, 0] = -100
    x = logits.requires_grad_(True)
    out = logprobs_from_logits(x, labels, temperature=0.8, chunk_size=2)
    assert out.dtype == torch.float64
    assert torch.autograd.gradcheck(lambda t: logprobs_from_logits(t, labels, temperature=0.8, chunk_size=2), (x,))


def test_non_contiguous_shifted_logits():
    logits, labels = _data(T=6, seed=3)
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    shifted_labels = labels[:, 1:]
    view = x1[:, :-1]
    assert not view.is_contiguous()
    out = logprobs_from_logits(view, shifted_labels, chunk_size=4)
    ref = _naive(x2[:, :-1], shifted_labels)
    assert (out - ref).abs().max().item() < 1e-6
    out.sum().backward()
    ref.sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6)
    assert (x1.grad[:, -1] == 0).all()


def test_ignore_index_gives_zero_and_no_gradient():
    logits, labels = _data(seed=4)
    labels[0, 2] = -100
    labels[2, :] = -100
    x = logits.clone().requires_grad_(True)
    out = logprobs_from_logits(x, labels, chunk_size=2)
    assert out[0, 2].item() == 0.0 and (out[2] == 0).all()
    assert (out - _naive(logits, labels)).abs().max().item() < 1e-6
    out.sum().backward()
    assert (x.grad[0, 2] == 0).all() and (x.grad[2] == 0).all()
    assert x.grad[0, 1].abs().sum() > 0


def test_bad_arguments():
    logits, labels = _data()
    with pytest.raises(ValueError, match="labels must be in"):
        logprobs_from_logits(logits, labels.clone().fill_(11))
    with pytest.raises(ValueError, match="labels must be in"):
        logprobs_from_logits(logits, labels.clone().fill_(-1))
    with pytest.raises(ValueError, match="shape"):
        logprobs_from_logits(logits, labels[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_logits(logits, labels, chunk_size=0)


def test_bf16_input_computed_in_fp32():
    logits, labels = _data(B=4, T=8, V=64, seed=5)
    lb = logits.to(torch.bfloat16)
    x = lb.clone().requires_grad_(True)
    out = logprobs_from_logits(x, labels, chunk_size=5)
    assert out.dtype == torch.float32
    # exact w.r.t. the bf16 values upcast to fp32; loose w.r.t. the original fp32 logits
    assert (out - _naive(lb.float(), labels)).abs().max().item() < 1e-5
    assert (out - _naive(logits, labels)).abs().max().item() < 0.1
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    ref = lb.float().requires_grad_(True)
    _naive(ref, labels).sum().backward()
    assert torch.allclose(x.grad.float(), ref.grad, atol=1e-2)


def test_forward_saves_no_vocab_sized_intermediate():
    """The graph keeps only the logits (the input itself) and per-token vectors, never a softmax."""
    logits, labels = _data(B=2, T=4, V=50)
    x = logits.requires_grad_(True)
    out = logprobs_from_logits(x, labels, chunk_size=3)
    saved = out.grad_fn.saved_tensors
    n_tokens = labels.numel()
    for t in saved:
        assert t.data_ptr() == x.data_ptr() or t.numel() <= n_tokens


def test_inputs_not_modified():
    logits, labels = _data(seed=6)
    l0, y0 = logits.clone(), labels.clone()
    x = logits.requires_grad_(True)
    logprobs_from_logits(x, labels, temperature=1.0, chunk_size=2).sum().backward()
    assert torch.equal(x.detach(), l0) and torch.equal(labels, y0)


# ---------------------------------------------------------------- hidden states


def _hidden_data(B=2, T=5, H=6, V=13, seed=0, bias=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / math.sqrt(H) * 2).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, b, labels


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_hidden_matches_naive_with_gradients(chunk_size, bias, temperature):
    hidden, weight, b, labels = _hidden_data(bias=bias, seed=chunk_size)
    labels[1, 3] = -100
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    leaves1 = [t.clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, b)]
    leaves2 = [t.clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, b)]
    h1, w1, b1 = leaves1
    out = logprobs_from_hidden(h1, w1, labels, lm_head_bias=b1, temperature=temperature, chunk_size=chunk_size)
    h2, w2, b2 = leaves2
    logits = h2 @ w2.T + (b2 if b2 is not None else 0)
    ref = _naive(logits, labels, temperature)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 1e-5
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    for a, r in zip(leaves1, leaves2):
        if a is not None:
            assert torch.allclose(a.grad, r.grad, atol=1e-5), (a.grad - r.grad).abs().max()


def test_hidden_gradcheck_fp64():
    hidden, weight, b, labels = _hidden_data(B=2, T=2, H=3, V=4, dtype=torch.float64)
    labels[0, 1] = -100
    args = tuple(t.requires_grad_(True) for t in (hidden, weight, b))
    fn = lambda h, w, bb: logprobs_from_hidden(h, w, labels, bb, temperature=1.3, chunk_size=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args)


def test_hidden_frozen_head_and_non_contiguous_hidden():
    hidden, weight, _, labels = _hidden_data(T=6, bias=False, seed=7)
    h = hidden.clone().requires_grad_(True)
    out = logprobs_from_hidden(h[:, :-1], weight, labels[:, 1:], chunk_size=4)
    h_ref = hidden.clone().requires_grad_(True)
    ref = _naive(h_ref[:, :-1] @ weight.T, labels[:, 1:])
    assert (out - ref).abs().max().item() < 1e-5
    out.sum().backward()
    ref.sum().backward()
    assert torch.allclose(h.grad, h_ref.grad, atol=1e-5)
    assert weight.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_frozen_head_gradient_equals_the_trainable_head_one(dtype):
    """With a frozen head the hidden-state gradient is formed in the forward pass (no recomputed logits in the
    backward): it must equal the one the recomputing backward gives (temperature, bias, ignored labels, bf16)."""
    hidden, weight, b, labels = _hidden_data(T=7, H=16, V=40, seed=9, dtype=dtype)
    labels[0, 2] = -100
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for head_trains in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(head_trains)
        out = logprobs_from_hidden(h, w, labels, b, temperature=0.8, chunk_size=3)
        (out * upstream).sum().backward()
        grads.append(h.grad)
    assert grads[0].dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grads[0].float(), grads[1].float(), atol=tol, rtol=tol)
    args = tuple(t.double() for t in (hidden, weight, b))
    fn = lambda h: logprobs_from_hidden(h, args[1], labels, args[2], temperature=0.8, chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (args[0].requires_grad_(True),))


def test_hidden_bf16():
    hidden, weight, b, labels = _hidden_data(H=16, V=40, seed=8, dtype=torch.bfloat16)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = logprobs_from_hidden(h, w, labels, b, chunk_size=3)
    assert out.dtype == torch.float32
    # same as the naive path on the bf16 lm_head output (what ``lm_head(hidden).float()`` gives) ...
    ref = _naive(torch.nn.functional.linear(hidden, weight, b).float(), labels)
    assert (out - ref).abs().max().item() < 1e-5
    # ... and close to the fp32 computation on the same (bf16-representable) values
    assert (out - _naive(hidden.float() @ weight.float().T + b.float(), labels)).abs().max().item() < 5e-2
    out.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    hf, wf = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    _naive(hf @ wf.T + b.float(), labels).sum().backward()
    assert torch.allclose(h.grad.float(), hf.grad, atol=5e-2)
    assert torch.allclose(w.grad.float(), wf.grad, atol=5e-2)


def test_hidden_bad_weight_shape():
    hidden, weight, _, labels = _hidden_data()
    with pytest.raises(ValueError, match="lm_head_weight"):
        logprobs_from_hidden(hidden, weight.T, labels)


# ---------------------------------------------------------------- full / modulated / entropy


def test_full_logprobs():
    logits, _ = _data(seed=9)
    out = full_logprobs(logits.to(torch.bfloat16), temperature=2.0)
    assert out.dtype == torch.float32
    assert torch.allclose(out.exp().sum(-1), torch.ones(out.shape[:-1]), atol=1e-6)
    lb = logits.to(torch.bfloat16).double() / 2.0
    expected = lb - torch.log(torch.exp(lb).sum(-1, keepdim=True))
    assert torch.allclose(out.double(), expected, atol=1e-5)


def _modulated_reference(base, mod, temperature):
    """q_T(v) = (p(v)·exp(mod(v)))^(1/T) / Σ_u (p(u)·exp(mod(u)))^(1/T), p = softmax(base), fp64 explicit sums."""
    p = torch.exp(base.double())
    p = p / p.sum(-1, keepdim=True)
    q = (p * torch.exp(mod.double())) ** (1.0 / temperature)
    return torch.log(q / q.sum(-1, keepdim=True))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_modulated_logprobs_full_and_gathered(temperature):
    base, labels = _data(seed=10)
    mod = torch.randn(base.shape, generator=torch.Generator().manual_seed(11))
    expected = _modulated_reference(base, mod, temperature)
    full = modulated_logprobs(base, mod, temperature=temperature)
    assert full.shape == base.shape and full.dtype == torch.float32
    assert torch.allclose(full.double(), expected, atol=1e-5)
    gathered = modulated_logprobs(base, mod, labels=labels, temperature=temperature, chunk_size=4)
    assert torch.allclose(gathered.double(), expected.gather(-1, labels.unsqueeze(-1)).squeeze(-1), atol=1e-5)


def test_modulated_zero_modulation_and_broadcast_and_gradient():
    base, labels = _data(seed=12)
    zero = torch.zeros(base.shape[-1])
    assert torch.allclose(modulated_logprobs(base, zero, temperature=0.5), torch.log_softmax(base / 0.5, -1))
    # the temperature tempers the tilted distribution as a whole
    mod_v = torch.randn(base.shape[-1], generator=torch.Generator().manual_seed(13), requires_grad=True)
    out = modulated_logprobs(base, mod_v, labels=labels, temperature=3.0)
    expected = _modulated_reference(base, mod_v.detach().expand_as(base), 3.0)
    assert torch.allclose(out.double(), expected.gather(-1, labels.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    out.sum().backward()
    # d/dm Σ_i log q_i(y_i) = Σ_i (onehot(y_i) − q_i) / T
    q = expected.exp()
    grad_ref = (torch.nn.functional.one_hot(labels, base.shape[-1]).double() - q).sum((0, 1)) / 3.0
    assert torch.allclose(mod_v.grad.double(), grad_ref, atol=1e-5)


def _entropy_reference(logits, temperature=1.0):
    out = torch.zeros(logits.shape[:-1], dtype=torch.float64)
    flat = logits.double().reshape(-1, logits.shape[-1]) / temperature
    for i, row in enumerate(flat):
        p = torch.exp(row - row.max())
        p = p / p.sum()
        out.view(-1)[i] = -sum(pi * math.log(pi) for pi in p.tolist() if pi > 0)
    return out


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_entropy_matches_loop(chunk_size):
    logits, _ = _data(seed=14)
    out = entropy_from_logits(logits, chunk_size=chunk_size, temperature=1.5)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), _entropy_reference(logits, 1.5), atol=1e-5)


def test_entropy_mask_uniform_inf_and_non_contiguous():
    V = 16
    logits = torch.zeros(2, 3, V)
    logits[1, 0, 4:] = float("-inf")  # uniform over 4 tokens
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = entropy_from_logits(logits, mask=mask, chunk_size=2)
    assert out[0, 0].item() == pytest.approx(math.log(V), abs=1e-6)
    assert out[0, 2].item() == 0.0
    assert out[1, 0].item() == pytest.approx(math.log(4), abs=1e-6)
    x = torch.randn(2, 5, V, generator=torch.Generator().manual_seed(15), requires_grad=True)
    ent = entropy_from_logits(x[:, 1:], chunk_size=3)
    assert torch.allclose(ent.double(), _entropy_reference(x.detach()[:, 1:]), atol=1e-5)
    ent.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[:, 0] == 0).all()
    y = logits.clone().requires_grad_(True)
    entropy_from_logits(y).sum().backward()
    assert torch.isfinite(y.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_return_entropy_same_pass(dtype, temperature):
    logits, labels = _data(seed=21, dtype=dtype)
    logits[0, 1, 3:] = float("-inf")  # p = 0 entries contribute nothing (no NaN)
    labels[0, 1], labels[2, 4] = 1, -100
    x = logits.clone().requires_grad_(True)
    logprobs, ent = logprobs_from_logits(x, labels, temperature=temperature, chunk_size=2, return_entropy=True)
    assert not ent.requires_grad and ent.dtype == logprobs.dtype == _compute_dtype_of(dtype)
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(ent.double(), _entropy_reference(logits, temperature), atol=atol)
    assert torch.allclose(logprobs, logprobs_from_logits(logits, labels, temperature=temperature), atol=0, rtol=0)
    logprobs.sum().backward()  # the entropy output does not disturb the log-prob gradient
    y = logits.clone().requires_grad_(True)
    logprobs_from_logits(y, labels, temperature=temperature).sum().backward()
    assert torch.equal(x.grad, y.grad)


def _compute_dtype_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def test_entropy_no_grad_path_equals_graph_path():
    logits, _ = _data(seed=22)
    logits[1, 2, :5] = float("-inf")
    fast = entropy_from_logits(logits, temperature=0.8, chunk_size=4)
    slow = entropy_from_logits(logits.clone().requires_grad_(True), temperature=0.8, chunk_size=4)
    assert slow.requires_grad and not fast.requires_grad
    assert torch.allclose(fast, slow.detach(), atol=1e-5)
