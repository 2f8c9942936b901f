"""Generation throughput of a rollout: Hugging Face ``generate`` (our sampler) vs vLLM, on SmolLM2-135M-Instruct.

    make bench-generation                                   # in the vLLM venv (make setup-vllm)
    .venv-vllm/bin/python bench/generation.py --batch-sizes 8 32 128 256 --new-tokens 64
    .venv-vllm/bin/python bench/generation.py --smoke      # one tiny batch each, to check that it runs

For each batch size ``B`` it samples ``B`` responses of exactly ``--new-tokens`` tokens (no stop token, so both
engines do the same work) to ``B`` distinct chat prompts, with the same sampling settings (temperature 1, no
top-k/top-p), through the code the trainers use: `trl_ext.rollout.generator.generate_responses` (``B`` rows per
``generate`` call, i.e. ``local_rollout_forward_batch_size = B``) and
`trl_ext.rollout.vllm.VLLMRolloutEngine` on a colocated engine (weights loaded from the trained model, as in
training; the load is timed separately). Each measurement is the median of ``--rounds`` runs after one warm-up;
tokens/s counts generated tokens only. Results go to ``bench/results/generation/<device>.json`` and a Markdown table
on stdout. The engine start-up (import + build) is reported once.

On a GPU machine the same script measures the GPU (``--device cuda``; add ``--model-dir`` for a 0.5–1B model).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

if __name__ == "__main__":  # vLLM may spawn workers: everything runs under the main guard
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [
    "Write a short poem about the sea.", "What is the capital of France?", "Explain photosynthesis simply.",
    "Give me three tips for studying.", "Describe a cat to a child.", "Why is the sky blue?",
    "Tell me a fun fact about space.", "How do I boil an egg?",
]  # fmt: skip


class _Accelerator:
    def __init__(self, device):
        self.device, self.process_index, self.num_processes, self.is_main_process = device, 0, 1, True


def prompt_batch(tokenizer, batch: int, device):
    """``batch`` left-padded chat prompts (the 8 questions above, each with a distinct numbered prefix)."""
    texts = [f"({i}) {PROMPTS[i % len(PROMPTS)]}" for i in range(batch)]
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    rows = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]
    width = max(map(len, rows))
    ids = [[tokenizer.pad_token_id] * (width - len(r)) + list(r) for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    import torch

    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def median_seconds(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu")
    parser.add_argument("--model-dir", default=None, help="a model folder (default: SmolLM2-135M-Instruct, fp32)")
    parser.add_argument("--skip-hf", action="store_true", help="measure vLLM only")
    parser.add_argument("--smoke", action="store_true", help="batch 4, 8 new tokens, 1 round: a check that it runs")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.batch_sizes, args.new_tokens, args.rounds = [4], 8, 1

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext.models.smollm2 import smollm2_path
    from trl_ext.rollout import SamplingSettings, generate_responses
    from trl_ext.trainers.common.vllm_setup import build_vllm_engine
    from trl_ext.trainers.ppo.ppo_config import PPOConfig

    device = torch.device(args.device)
    model_dir = args.model_dir or smollm2_path()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    start = time.perf_counter()
    config = PPOConfig(output_dir="/tmp/unused", report_to="none", use_vllm=True, seed=0,
                       vllm_max_model_length=512, vllm_gpu_memory_utilization=0.5)  # fmt: skip
    engine = build_vllm_engine(config, [model], _Accelerator(device), "bench")
    startup = time.perf_counter() - start
    start = time.perf_counter()
    engine.sync_weights(model)
    sync = time.perf_counter() - start
    rows = []
    for batch in args.batch_sizes:
        ids, mask = prompt_batch(tokenizer, batch, device)
        settings = SamplingSettings(max_new_tokens=args.new_tokens, pad_token_id=tokenizer.pad_token_id)
        tokens = batch * args.new_tokens
        row = {"batch": batch, "new_tokens": args.new_tokens}
        run_hf = functools.partial(generate_responses, model, ids, mask, settings, batch)
        run_vllm = functools.partial(engine.generate, model, ids, mask, settings)
        if not args.skip_hf:
            row["hf_tokens_per_s"] = tokens / median_seconds(run_hf, args.rounds)
        vl = median_seconds(run_vllm, args.rounds)
        row["vllm_tokens_per_s"] = tokens / vl
        if "hf_tokens_per_s" in row:
            row["vllm_over_hf"] = row["vllm_tokens_per_s"] / row["hf_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "device": args.device, "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "model": os.path.basename(model_dir.rstrip("/")),
        "dtype": str(dtype), "engine_startup_s": startup, "weight_sync_s": sync, "rows": rows,
    }  # fmt: skip
    print("\n| batch | HF generate tok/s | vLLM tok/s | vLLM / HF |\n|---:|---:|---:|---:|")
    for r in rows:
        hf = f"{r['hf_tokens_per_s']:.0f}" if "hf_tokens_per_s" in r else "-"
        ratio = f"{r['vllm_over_hf']:.2f}" if "vllm_over_hf" in r else "-"
        print(f"| {r['batch']} | {hf} | {r['vllm_tokens_per_s']:.0f} | {ratio} |")
    print(f"\nengine start-up {startup:.1f} s, weight sync {sync:.2f} s")
    if not args.smoke:
        out = args.output or os.path.join(os.path.dirname(__file__), "results", "generation", f"{args.device}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
