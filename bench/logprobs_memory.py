"""Peak memory of chunked vs naive token log-probs, forward and forward+backward, measured side by side.

    python bench/logprobs_memory.py                      # vocab 50,000, 8,192 tokens, CPU
    python bench/logprobs_memory.py --device cuda        # same on a GPU (torch.cuda.max_memory_allocated)

Variants (each runs in a fresh subprocess, so one cannot inherit another's high-water mark):

- ``naive``          ``torch.log_softmax(logits, -1).gather(-1, labels)``
- ``chunked``        ``trl_ext.ops.logprobs_from_logits`` (stores only a logsumexp per token, chunked backward)
- ``naive_hidden``   ``log_softmax(hidden @ Wᵀ).gather(...)``: the lm_head projection included
- ``chunked_hidden`` ``trl_ext.ops.logprobs_from_hidden`` (never builds the (N, V) logits)

"Peak extra" is the peak memory above a baseline taken after the inputs (logits or hidden + W, labels) are
allocated and the kernels warmed up on a tiny input. On CPU it is the increase of the process's peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, after resetting the mark to the current RSS through
``/proc/self/clear_refs`` where Linux allows it); on CUDA, ``max_memory_allocated − memory_allocated``. In
forward+backward the gradient of the inputs is part of the peak for every variant: for the logits variants that is
an unavoidable (N, V) buffer, printed as "input grad" for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("naive", "chunked", "naive_hidden", "chunked_hidden")
MODES = ("fwd", "fwd+bwd")
MiB = 2**20


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _cpu_baseline() -> int:
    """Reset the peak-RSS mark to the current RSS where Linux allows it; return the baseline in bytes.

    Without the reset, a transient peak from before the baseline (e.g. while building the inputs) would hide the
    first part of the measured step's memory under the old high-water mark.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (and ru_maxrss) to the current RSS
        with open("/proc/self/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss_kib * 1024
    except (OSError, StopIteration):
        return _rss_peak_bytes()


def _worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from trl_ext.ops import logprobs_from_hidden, logprobs_from_logits

    torch.manual_seed(0)
    device = torch.device(args.device)
    N, V, H = args.tokens, args.vocab, args.hidden
    backward = args.mode == "fwd+bwd"
    hidden_path = args.variant.endswith("hidden")

    def run(inputs, labels):
        if args.variant == "naive":
            (logits,) = inputs
            return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        if args.variant == "chunked":
            return logprobs_from_logits(inputs[0], labels, chunk_size=args.chunk_size)
        hidden, weight = inputs
        if args.variant == "naive_hidden":
            return torch.log_softmax(F.linear(hidden, weight), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return logprobs_from_hidden(hidden, weight, labels, chunk_size=args.chunk_size)

    def make_inputs(n):
        g = torch.Generator(device=device).manual_seed(1)
        labels = torch.randint(0, V, (n,), device=device, generator=g)
        if hidden_path:
            hidden = torch.randn(n, H, device=device, generator=g)
            weight = torch.randn(V, H, device=device, generator=g).mul_(H**-0.5)  # in place: no transient copy
            inputs = [hidden, weight]
        else:
            inputs = [torch.randn(n, V, device=device, generator=g).mul_(2.0)]
        return [t.requires_grad_(backward) for t in inputs], labels

    def step(inputs, labels):
        if backward:
            out = run(inputs, labels)
            out.sum().backward()
        else:
            with torch.no_grad():
                out = run(inputs, labels)
        return out.detach()

    # warm-up on a tiny batch (kernels, thread pools), then the real inputs and the baseline
    small_inputs, small_labels = make_inputs(4)
    step(small_inputs, small_labels)
    del small_inputs, small_labels
    inputs, labels = make_inputs(N)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _cpu_baseline()
    t0 = time.perf_counter()
    out = step(inputs, labels)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak_extra = torch.cuda.max_memory_allocated() - base
    else:
        peak_extra = _rss_peak_bytes() - base
    seconds = time.perf_counter() - t0
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in inputs if t.grad is not None)
    return {
        "variant": args.variant,
        "mode": args.mode,
        "peak_extra": peak_extra,
        "seconds": seconds,
        "input_grad": grad_bytes,
        "logprob_sum": float(out.double().sum()),
        "grad_sum": float(sum(t.grad.double().abs().sum() for t in inputs if t.grad is not None)),
    }


def _spawn(args: argparse.Namespace, variant: str, mode: str) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        f"--variant={variant}",
        f"--mode={mode}",
        f"--vocab={args.vocab}",
        f"--tokens={args.tokens}",
        f"--hidden={args.hidden}",
        f"--chunk-size={args.chunk_size}",
        f"--device={args.device}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}/{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--tokens", type=int, default=8_192, help="B·T, the number of tokens")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size for the *_hidden variants")
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return

    variants = [v for v in args.variants.split(",") if v]
    print(
        f"device={args.device} vocab={args.vocab:,} tokens={args.tokens:,} hidden={args.hidden} "
        f"chunk_size={args.chunk_size}; fp32; (N, V) fp32 tensor = {args.tokens * args.vocab * 4 / MiB:,.0f} MiB"
    )
    results = {}
    for mode in MODES:
        for variant in variants:
            results[variant, mode] = _spawn(args, variant, mode)
    header = (
        f"{'variant':<16}{'mode':<9}{'peak extra MiB':>16}{'input grad MiB':>16}{'extra − grad':>14}"
        f"{'time s':>9}{'Σ logp':>16}"
    )
    print(header)
    print("-" * len(header))
    for (variant, mode), r in results.items():
        print(
            f"{variant:<16}{mode:<9}{r['peak_extra'] / MiB:>16,.0f}{r['input_grad'] / MiB:>16,.0f}"
            f"{(r['peak_extra'] - r['input_grad']) / MiB:>14,.0f}{r['seconds']:>9.2f}{r['logprob_sum']:>16.2f}"
        )
    print()
    for mode in MODES:
        pairs = [("chunked", "naive"), ("chunked_hidden", "naive_hidden"), ("chunked_hidden", "naive")]
        for a, b in pairs:
            if (a, mode) in results and (b, mode) in results:
                ra, rb = results[a, mode], results[b, mode]
                ratio = ra["peak_extra"] / max(rb["peak_extra"], 1)
                line = f"ratio {mode:<8} {a} / {b}: {ratio:.3f}"
                if mode == "fwd+bwd" and a == "chunked" and b == "naive":
                    no_grad = (ra["peak_extra"] - ra["input_grad"]) / max(rb["peak_extra"] - rb["input_grad"], 1)
                    line += f"   (not counting the (N, V) logits gradient both must return: {no_grad:.3f})"
                print(line)


if __name__ == "__main__":
    main()
