"""Peak memory of the policy's response log-probs, forward+backward (training) and no-grad (scoring), at a long
sequence with a real vocabulary: SmolLM2-135M's architecture (Llama, 30 layers, hidden 576, vocabulary 49,152, tied
embeddings) built from its config with random weights (no download), 8 rows x 1,024 tokens by default.

    python bench/policy_logprobs_memory.py                  # 8 x (128 prompt + 896 response) tokens, CPU, ~30 min
    python bench/policy_logprobs_memory.py --layers 2       # the same head, a 2-layer trunk (a minute)
    python bench/policy_logprobs_memory.py --device cuda    # torch.cuda.max_memory_allocated on a GPU

Variants (each in a fresh subprocess, so none inherits another's high-water mark):

- ``trl112``: what TRL 1.12's PPO does: the full forward's logits of every position, the response positions sliced,
  divided by the temperature, ``log_softmax`` + gather (``selective_log_softmax``'s math);
- ``logits``: trl_ext before issue 17: ``logits_to_keep = T + 1`` and chunked log-probs over those logits
  (`trl_ext.ops.logprobs_from_logits`; ``forward_response(..., hidden_logprobs=False)``);
- ``hidden``: trl_ext now (``forward_response(..., hidden_logprobs=True)``, what its default picks here): the trunk's
  last hidden states and a chunked LM head + log-softmax on the response positions only
  (`trl_ext.ops.logprobs_from_hidden`): no ``(B, T, V)`` logits, in the forward or the backward pass.

Every variant returns the same log-probs (``Σ logp`` is printed) and, in training mode, the same gradients. The
training pass runs with activation checkpointing (the trainers' default) and entropies (what PPO logs); the model's
parameter gradients are allocated before the baseline, so the "peak extra" is the step's own working memory.
CPU: increase of peak RSS above the baseline (``/proc/self/clear_refs`` resets the mark); CUDA:
``max_memory_allocated − memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("trl112", "logits", "hidden")
MODES = ("train", "score")
MiB = 2**20
SMOLLM2_135M = dict(
    vocab_size=49_152, hidden_size=576, intermediate_size=1_536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8_192, rope_theta=100_000.0, tie_word_embeddings=True,
    rms_norm_eps=1e-5, attention_dropout=0.0,
)  # fmt: skip


def _worker(args: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from logprobs_memory import _cpu_baseline, _rss_peak_bytes

    from trl_ext.rollout import forward_response

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": args.layers})
    model = LlamaForCausalLM(config).to(device)
    train = args.mode == "train"
    model.train(train)
    if train and not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    P, T, temperature = args.prompt_length, args.response_length, 0.7

    def inputs(rows: int, prompt: int, response: int):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (rows, prompt + response), generator=g).to(device)
        return ids, torch.ones_like(ids)

    def step(ids, mask, response: int):
        with torch.set_grad_enabled(train):
            if args.variant == "trl112":
                out = model(input_ids=ids, attention_mask=mask, use_cache=False)
                logits = out.logits[:, -(response + 1) : -1] / temperature
                logp = torch.log_softmax(logits.float(), dim=-1)
                lp = logp.gather(-1, ids[:, -response:, None]).squeeze(-1)
                entropy = -(logp.exp() * logp).sum(-1).detach() if train else None  # what PPO logs
            else:
                res = forward_response(
                    model, ids, mask, response, temperature=temperature, return_entropy=train,
                    hidden_logprobs=args.variant == "hidden",
                )  # fmt: skip
                lp, entropy = res.logprobs, res.entropy
        if train:
            lp.sum().backward()
        return lp.detach(), entropy

    warm_ids, warm_mask = inputs(1, 8, 8)
    step(warm_ids, warm_mask, 8)  # kernels, thread pools, the split's one-time probe, parameter .grad buffers
    if train:
        model.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline for every variant
    ids, mask = inputs(args.rows, P, T)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _cpu_baseline()
    start = time.perf_counter()
    lp, _ = step(ids, mask, T)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak_extra = torch.cuda.max_memory_allocated() - base
    else:
        peak_extra = _rss_peak_bytes() - base
    seconds = time.perf_counter() - start
    grad_norm = float(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None) ** 0.5)
    return {
        "variant": args.variant,
        "mode": args.mode,
        "peak_extra": peak_extra,
        "seconds": seconds,
        "logprob_sum": float(lp.double().sum()),
        "grad_norm": grad_norm if train else None,
    }


def _spawn(args: argparse.Namespace, variant: str, mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--variant={variant}", f"--mode={mode}"]
    for name in ("rows", "prompt_length", "response_length", "layers", "device", "threads"):
        cmd.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    if args.no_checkpointing:
        cmd.append("--no-checkpointing")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}/{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--response-length", type=int, default=896)
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true", help="train without activation checkpointing")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    B, P, T, V = args.rows, args.prompt_length, args.response_length, SMOLLM2_135M["vocab_size"]
    print(
        f"SmolLM2-135M architecture ({args.layers} layers), random weights, fp32, device={args.device}; {B} rows x "
        f"({P} prompt + {T} response) tokens; (B, T, V) fp32 logits of the responses = {B * T * V * 4 / MiB:,.0f} MiB"
    )
    results = []
    for mode in args.modes.split(","):
        for variant in args.variants.split(","):
            results.append(_spawn(args, variant, mode))
            r = results[-1]
            print(
                f"{mode:<6}{variant:<8} peak extra {r['peak_extra'] / MiB:>8,.0f} MiB  {r['seconds']:>7.1f} s  "
                f"Σ logp {r['logprob_sum']:>14.3f}" + (f"  |grad| {r['grad_norm']:.6g}" if r["grad_norm"] else ""),
                flush=True,
            )
    for mode in args.modes.split(","):
        by = {r["variant"]: r for r in results if r["mode"] == mode}
        if "hidden" in by:
            for other in ("trl112", "logits"):
                if other in by:
                    ratio = by["hidden"]["peak_extra"] / max(by[other]["peak_extra"], 1)
                    print(f"ratio {mode}: hidden / {other} = {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
