"""Memory-efficient token log-probabilities, entropies and modulated distributions.

Conventions (see docs/algorithms.md §2):

- ``logits`` have shape ``(..., V)`` and ``labels`` shape ``(...)``; the log-prob of ``labels[i]`` is read from
  ``logits[i]``. Shifting (the logits at ``t − 1`` predict the token at ``t``) is the caller's job.
- Every result is computed **and returned in fp32** for fp32/bf16/fp16 inputs (fp64 for fp64 inputs): log-probs
  feed ratios, KL terms and importance weights, where bf16 rounding (≈ 3 significant digits) is not acceptable.
  Gradients flow back in the dtype of the inputs.
- ``temperature`` divides the logits before the softmax: ``log_softmax(logits / T)``.
- Labels equal to ``ignore_index`` (default ``-100``) give a log-prob of exactly ``0`` and no gradient. Any other
  label must be a valid vocabulary id, otherwise a ``ValueError`` is raised.

The chunked functions never hold more than ``chunk_size × V`` fp32 values of intermediate results, in the forward
*and* the backward pass: the forward keeps only the per-token ``logsumexp`` and the backward recomputes the softmax
chunk by chunk. :func:`logprobs_from_hidden` goes further and never materialises the ``(N, V)`` logits at all, nor
their gradient, which is where the memory goes for 50k–150k vocabularies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = [
    "logprobs_from_logits",
    "logprobs_from_hidden",
    "full_logprobs",
    "modulated_logprobs",
    "entropy_from_logits",
]

DEFAULT_CHUNK_SIZE = 1024


def _check_args(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")


class _Rows:
    """Chunks of rows of a ``(..., V)`` tensor seen as ``(N, V)``, without copying the whole tensor.

    A view is used when the leading dimensions can be merged (contiguous inputs); otherwise (e.g. ``logits[:, :-1]``)
    each chunk is gathered with advanced indexing, which copies only that chunk.
    """

    def __init__(self, x: torch.Tensor):
        self.lead_shape = x.shape[:-1]
        self.n = math.prod(self.lead_shape)
        try:
            self._flat: torch.Tensor | None = x.view(self.n, x.shape[-1])
        except RuntimeError:
            self._flat = None
        self._x = x

    def __call__(self, start: int, end: int) -> torch.Tensor:
        if self._flat is not None:
            return self._flat[start:end]
        flat_idx = torch.arange(start, end, device=self._x.device)
        return self._x[torch.unravel_index(flat_idx, self.lead_shape)]


def _prepare_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``labels``; return ``(safe_labels, valid)`` where ignored labels are replaced by ``0``."""
    flat = labels.reshape(-1).long()
    valid = flat != ignore_index
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    if flat.numel() and bool(((safe < 0) | (safe >= vocab_size)).any()):
        bad = flat[valid & ((flat < 0) | (flat >= vocab_size))][:5].tolist()
        raise ValueError(
            f"labels must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; found e.g. {bad}."
        )
    return safe, valid


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _scaled_fp32(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / T`` in fp32 or fp64 (may alias ``x`` when no cast is needed and ``T == 1``: never modify in place)."""
    x = x.to(_compute_dtype(x.dtype))
    return x if temperature == 1.0 else x / temperature


def _shifted_exp(x: torch.Tensor, shift: torch.Tensor, temperature: float, out: torch.Tensor | None = None):
    """``exp(x / T − shift)`` for a ``(n, V)`` chunk and ``(n, 1)`` shifts, in two passes and the compute dtype.

    ``torch.add(−shift, x, alpha=1/T)`` scales and shifts in one pass (no scaled copy of ``x``); ``out`` may be a
    buffer of the compute dtype to write into.
    """
    kwargs = {"out": out} if out is not None else {}
    return torch.add(-shift, x, alpha=1.0 / temperature, **kwargs).exp_()


def _lse_chunk(x: torch.Tensor, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logsumexp(x / T)`` of each row of a ``(n, V)`` chunk and, optionally, the entropy of ``softmax(x / T)``.

    ``e = exp(x/T − max/T)`` and its row sums ``s`` give ``lse = max/T + log s``. The entropy is computed in the
    shifted frame, ``H = log s − Σ_v p_v (x_v/T − max/T)``: both terms are ``≥ 0`` (``s ≥ 1``), so ``H ≥ 0`` exactly,
    where the unshifted ``lse − Σ_v p_v x_v/T`` subtracts two numbers of the size of the largest logit and came out
    slightly negative for large logits (``-5e-4`` at ``|x/T| ≈ 5000`` in fp32). A ``-inf`` logit has ``p = 0`` and a
    ``0·(−inf)`` = NaN term, which ``nansum`` drops: it contributes 0, as it should.
    """
    dtype = _compute_dtype(x.dtype)
    top = x.amax(dim=-1, keepdim=True).to(dtype) / temperature
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # an all -inf row: lse = -inf, not NaN
    if not with_entropy:
        total = _shifted_exp(x, top, temperature).sum(dim=-1)
        return top.squeeze(-1) + total.log(), None
    shifted = torch.add(-top, x, alpha=1.0 / temperature)  # x/T − max/T ≤ 0
    e = shifted.exp()
    total = e.sum(dim=-1)
    log_total = total.log()
    return top.squeeze(-1) + log_total, log_total - e.mul_(shifted).nansum(dim=-1) / total


class _ChunkedLogProbs(torch.autograd.Function):
    """``log_softmax(logits/T)[labels]`` (and, optionally, the entropies, without gradient) with O(chunk × V) extra
    memory in forward and backward."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, ignore_index, with_entropy):
        rows = _Rows(logits)
        safe, valid = _prepare_labels(labels, logits.shape[-1], ignore_index)
        out = torch.empty(rows.n, dtype=_compute_dtype(logits.dtype), device=logits.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else None
        for start in range(0, rows.n, chunk_size):
            end = min(start + chunk_size, rows.n)
            x = rows(start, end)
            lse_c, ent_c = _lse_chunk(x, temperature, with_entropy)
            lse[start:end] = lse_c
            if entropy is not None:
                entropy[start:end] = ent_c
            picked = x.gather(1, safe[start:end].unsqueeze(-1)).squeeze(-1).to(out.dtype)
            out[start:end] = picked / temperature - lse_c
        out = torch.where(valid, out, torch.zeros_like(out))
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if entropy is None:
            return out.view(rows.lead_shape)
        entropy = entropy.view(rows.lead_shape)
        ctx.mark_non_differentiable(entropy)
        return out.view(rows.lead_shape), entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *_grad_entropy):
        logits, safe, valid, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        rows = _Rows(logits)
        g = torch.where(valid, grad_out.reshape(-1).to(lse.dtype), torch.zeros((), dtype=lse.dtype, device=lse.device))
        g = g / temperature  # ∂out/∂logits = g·(onehot − softmax)/T: fold 1/T into g once
        grad = torch.empty((rows.n, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
        # Written straight into `grad` when it has the compute dtype (fp32/fp64 logits); a temporary otherwise.
        direct = grad.dtype == lse.dtype
        for start in range(0, rows.n, chunk_size):
            end = min(start + chunk_size, rows.n)
            g_c = g[start:end].unsqueeze(-1)
            chunk = _shifted_exp(
                rows(start, end), lse[start:end].unsqueeze(-1), temperature, out=grad[start:end] if direct else None
            )
            chunk.mul_(-g_c).scatter_add_(1, safe[start:end].unsqueeze(-1), g_c)
            if not direct:
                grad[start:end] = chunk
        return grad.view(logits.shape), None, None, None, None, None


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``labels``: ``out[i] = log_softmax(logits[i] / T)[labels[i]]``, computed in chunks.

    Equal to ``torch.log_softmax(logits.float() / T, -1).gather(-1, labels[..., None])[..., 0]``, but the forward pass
    stores only the per-token ``logsumexp`` (``N`` floats) and the backward pass recomputes the softmax
    ``chunk_size`` rows at a time, giving ``∂out/∂logits = g·(onehot(label) − softmax(logits/T)) / T``. Peak extra
    memory is therefore ``O(chunk_size × V)`` besides the ``(…, V)`` gradient of the logits itself (which any method
    must produce; use :func:`logprobs_from_hidden` to avoid it).

    Args:
        logits: ``(..., V)`` logits, any float dtype; need not be contiguous (``logits[:, :-1]`` is fine).
        labels: ``(...)`` integer token ids; ``ignore_index`` marks positions to skip.
        temperature: ``T > 0``.
        chunk_size: number of tokens (rows of the flattened ``(N, V)`` logits) processed at once.
        ignore_index: label value whose log-prob is set to ``0`` (with zero gradient).
        return_entropy: also return the per-token entropies of ``softmax(logits / T)`` (every position, ignored
            labels included; no gradient). They come from the same pass over the logits, which costs about a
            quarter of what a separate :func:`entropy_from_logits` call does.

    Returns:
        ``(...)`` fp32 log-probabilities; with ``return_entropy``, a ``(logprobs, entropies)`` pair.
    """
    _check_args(temperature, chunk_size)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] = {tuple(logits.shape[:-1])}."
        )
    return _ChunkedLogProbs.apply(
        logits, labels, float(temperature), int(chunk_size), int(ignore_index), bool(return_entropy)
    )


class _ChunkedHiddenLogProbs(torch.autograd.Function):
    """``log_softmax((hidden @ Wᵀ + b)/T)[labels]`` without materialising the ``(N, V)`` logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, ignore_index, with_entropy):
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        n = flat_h.shape[0]
        safe, valid = _prepare_labels(labels, weight.shape[0], ignore_index)
        out = torch.empty(
            n, dtype=_compute_dtype(torch.promote_types(hidden.dtype, weight.dtype)), device=hidden.device
        )
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else None
        # Frozen head (e.g. LoRA training), gradient only for `hidden`: ∂out_i/∂h_i = (W[y_i] − p_i W)/T does not
        # depend on the upstream gradient, so it is computed here from the chunk's softmax (one (n, V) x (V, H)
        # product, as the backward pass would) and the backward pass only scales it: no logits are recomputed.
        direction = None
        if ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3]):
            direction = torch.empty(flat_h.shape, dtype=out.dtype, device=flat_h.device)  # fp32 (fp64)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _scaled_fp32(F.linear(flat_h[start:end], weight, bias), temperature)
            if entropy is None:
                lse_c = torch.logsumexp(z, dim=-1)
            else:  # the same shifted pass as `logprobs_from_logits(..., return_entropy=True)` (T already applied)
                lse_c, entropy[start:end] = _lse_chunk(z, 1.0, True)
            lse[start:end] = lse_c
            out[start:end] = z.gather(1, safe[start:end].unsqueeze(-1)).squeeze(-1) - lse_c
            if direction is not None:
                p_w = z.sub_(lse_c.unsqueeze(-1)).exp_().to(weight.dtype) @ weight  # z is not used after this
                direction[start:end] = (weight[safe[start:end]] - p_w).to(direction.dtype) / temperature
        out = torch.where(valid, out, torch.zeros_like(out))
        ctx.direction = direction is not None
        if direction is not None:  # the hidden states and the head are not needed any more
            ctx.save_for_backward(direction, valid)
        else:
            ctx.save_for_backward(flat_h, weight, bias, safe, valid, lse)
        ctx.temperature, ctx.chunk_size, ctx.hidden_shape = temperature, chunk_size, hidden.shape
        ctx.hidden_dtype = hidden.dtype
        if entropy is None:
            return out.view(labels.shape)
        entropy = entropy.view(labels.shape)
        ctx.mark_non_differentiable(entropy)
        return out.view(labels.shape), entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *_grad_entropy):
        if ctx.direction:
            direction, valid = ctx.saved_tensors
            zero = torch.zeros((), dtype=direction.dtype, device=direction.device)
            g = torch.where(valid, grad_out.reshape(-1).to(direction.dtype), zero)
            grad_h = (g.unsqueeze(-1) * direction).to(ctx.hidden_dtype)
            return grad_h.view(ctx.hidden_shape), None, None, None, None, None, None, None
        flat_h, weight, bias, safe, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        n = flat_h.shape[0]
        g = torch.where(valid, grad_out.reshape(-1).to(lse.dtype), torch.zeros((), dtype=lse.dtype, device=lse.device))
        g = g / temperature  # G = g·(onehot − softmax)/T: fold 1/T into g once
        grad_h = torch.empty_like(flat_h) if need_h else None
        # Parameter gradients are accumulated over chunks in fp32, then cast to the parameter dtype.
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = flat_h[start:end]
            # softmax(z/T) = exp(z/T − lse) in one scaled, shifted pass, then G in place (no scaled copy of z)
            g_c = g[start:end].unsqueeze(-1)
            grad_z = _shifted_exp(F.linear(h, weight, bias), lse[start:end].unsqueeze(-1), temperature)
            grad_z.mul_(-g_c).scatter_add_(1, safe[start:end].unsqueeze(-1), g_c)
            if grad_b is not None:
                grad_b += grad_z.sum(0)
            grad_logits = grad_z.to(weight.dtype)
            if grad_h is not None:
                grad_h[start:end] = grad_logits @ weight
            if grad_w is not None:
                if weight.dtype == acc and h.dtype == acc:
                    grad_w.addmm_(grad_logits.t(), h)
                else:
                    grad_w += (grad_logits.t() @ h.to(weight.dtype)).to(acc)
        return (
            grad_h.view(ctx.hidden_shape) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``labels`` under ``softmax((hidden @ Wᵀ + b) / T)``, never building the full logits.

    ``out[i] = z_i[labels[i]] − logsumexp(z_i)`` with ``z_i = (hidden[i] @ Wᵀ + b) / T``. The projection is done
    ``chunk_size`` tokens at a time in the dtype of the inputs (as ``lm_head(hidden)`` would), then upcast to fp32.
    The backward pass recomputes each chunk's logits and accumulates ``∂/∂hidden = G W``, ``∂/∂W = Gᵀ hidden`` and
    ``∂/∂b = Σ G`` with ``G = g·(onehot − softmax)/T``; parameter gradients are accumulated in fp32. Peak extra memory
    is ``O(chunk_size × V)`` plus the gradient buffers of ``hidden``/``W`` themselves. Under DeepSpeed ZeRO-3 the
    weight must be gathered while this runs (e.g. ``deepspeed.zero.GatheredParameters``), as for any use of a
    parameter outside its module's forward. Under autocast the projection runs in the autocast dtype, forward and
    backward alike (the inputs are cast to it first, as autocast casts ``lm_head``'s inputs).

    Args:
        hidden: ``(..., H)`` final hidden states (after the final norm), e.g. ``outputs.hidden_states[-1]``.
        lm_head_weight: ``(V, H)`` output projection (``model.get_output_embeddings().weight``).
        labels: ``(...)`` token ids; ``ignore_index`` positions give ``0``.
        lm_head_bias: optional ``(V,)`` bias.
        temperature: ``T > 0``.
        chunk_size: tokens per chunk.
        ignore_index: label value to skip.
        return_entropy: also return the per-token entropies of ``softmax(z_i)`` (every position, ignored labels
            included; no gradient), computed from each chunk's logits in the same pass.

    Returns:
        ``(...)`` fp32 log-probabilities; with ``return_entropy``, a ``(logprobs, entropies)`` pair.
    """
    _check_args(temperature, chunk_size)
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}."
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight must have shape (V, {hidden.shape[-1]}), got {tuple(lm_head_weight.shape)}.")
    args = (labels, float(temperature), int(chunk_size), int(ignore_index), bool(return_entropy))
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # What autocast does to `lm_head(hidden)`: inputs cast to its dtype (the casts carry the gradients back).
        # Done explicitly, so that the recomputation in the backward pass (which runs outside autocast) matches.
        dtype = torch.get_autocast_dtype(device_type)
        cast = [None if t is None else t.to(dtype) for t in (hidden, lm_head_weight, lm_head_bias)]
        with torch.autocast(device_type, enabled=False):
            return _ChunkedHiddenLogProbs.apply(*cast, *args)
    return _ChunkedHiddenLogProbs.apply(hidden, lm_head_weight, lm_head_bias, *args)


def full_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary log-probabilities ``log_softmax(logits / T, dim=-1)`` in fp32. Shape ``(..., V)`` → same."""
    _check_args(temperature, 1)
    return torch.log_softmax(_scaled_fp32(logits, temperature), dim=-1)


def modulated_logprobs(
    base_logits: torch.Tensor,
    modulation: torch.Tensor,
    labels: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Log-probs of the modulated ("twisted") distribution ``q ∝ p · exp(modulation)``, at temperature ``T``.

    ``log q_T = log_softmax( (log_softmax(base_logits) + modulation) / T )``, computed as
    ``log_softmax((base_logits + modulation) / T)`` (the inner normaliser is constant over the vocabulary). The
    temperature tempers the whole tilted distribution, ``q_T ∝ (p·e^m)^{1/T}``: exactly what ``generate`` samples
    from when it divides a :class:`~trl_ext.models.ModulatedCausalLM`'s logits by ``T``, so log-probs scored here match
    the sampling distribution. The research code always uses ``T = 1``.

    Args:
        base_logits: ``(..., V)`` logits of the base model.
        modulation: ``(..., V)`` (or broadcastable, e.g. ``(V,)``) unnormalised log-potentials ``log ψ``.
        labels: optional ``(...)`` token ids. When given, the result is gathered at them (chunked, see
            :func:`logprobs_from_logits`; ``ignore_index`` positions give ``0``); otherwise the full ``(..., V)``
            log-probabilities are returned.
        temperature: ``T > 0``.

    Returns:
        ``(...)`` or ``(..., V)`` fp32 tensor.
    """
    _check_args(temperature, chunk_size)
    combined = _scaled_fp32(base_logits, 1.0) + modulation  # promotes to fp32 (or fp64)
    if labels is None:
        return torch.log_softmax(combined / temperature, dim=-1)
    return logprobs_from_logits(
        combined, labels, temperature=temperature, chunk_size=chunk_size, ignore_index=ignore_index
    )


def _entropy_with_graph(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """Differentiable entropies of a ``(n, V)`` chunk (keeps its log-softmax for the backward pass)."""
    logp = torch.log_softmax(_scaled_fp32(x, temperature), dim=-1)
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


def entropy_from_logits(
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Per-token Shannon entropy (nats) ``H_i = −Σ_v p_iv log p_iv`` with ``p_i = softmax(logits_i / T)``, chunked.

    Computed in fp32, ``chunk_size`` tokens at a time (like ``trl.trainer.utils.entropy_from_logits``, plus fp32,
    temperature and a mask). Vocabulary entries with ``p = 0`` (e.g. ``-inf`` logits) contribute ``0``. Differentiable,
    but the backward pass keeps each chunk's log-softmax: intended for logging or small entropy bonuses.

    Args:
        logits: ``(..., V)``.
        mask: optional ``(...)``; positions where it is zero give ``0``.
        temperature: ``T > 0``.
        chunk_size: tokens per chunk.

    Returns:
        ``(...)`` fp32 entropies.
    """
    _check_args(temperature, chunk_size)
    rows = _Rows(logits)
    # Without a graph to keep, the fused in-place pass of the log-prob function (about 4x cheaper).
    fast = not (torch.is_grad_enabled() and logits.requires_grad)
    parts = []
    for start in range(0, rows.n, chunk_size):
        chunk = rows(start, min(start + chunk_size, rows.n))
        parts.append(_lse_chunk(chunk, temperature, True)[1] if fast else _entropy_with_graph(chunk, temperature))
    ent = torch.cat(parts) if parts else logits.new_zeros(0, dtype=_compute_dtype(logits.dtype))
    ent = ent.view(rows.lead_shape)
    if mask is not None:
        ent = torch.where(mask != 0, ent, torch.zeros_like(ent))
    return ent
