"""Cost per step of `RePULSeGRPOTrainer` against plain `trl.GRPOTrainer` at a toy shape, measured side by side.

    OMP_NUM_THREADS=1 python bench/grpo_repulse_cost.py --rounds 3 --steps 8

Both trainers run the same tiny GPT-NeoX policy (offline kit), the same prompts, reward and batch shape
(`--prompts` prompts × `--generations` completions of `--tokens` tokens per step; the proposal draws
`--proposal_samples` per prompt). Rounds alternate GRPO, RePULSe(α>0), RePULSe(α=0), so a load change on the machine
hits all three alike. Per round it prints the seconds per optimizer step of each (train() wall time over the steps,
after a one-step warm-up run that is not counted), then the medians and the median per-round ratios to GRPO.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from trl_ext import RePULSeGRPOConfig, RePULSeGRPOTrainer
from trl_ext.testing import build_causal_lm, build_tokenizer, prompt_dataset


def length_reward(completions, **kwargs):
    return [len(c) / 10.0 for c in completions]


def seconds_per_step(kind: str, opts, out: str) -> float:
    tok = build_tokenizer()
    model = build_causal_lm("gpt_neox", tok, seed=0)
    common = dict(
        output_dir=out, per_device_train_batch_size=opts.prompts * opts.generations, num_generations=opts.generations,
        max_completion_length=opts.tokens, max_steps=opts.steps, learning_rate=1e-4, bf16=False, use_cpu=True,
        report_to=[], logging_steps=10**6, save_strategy="no", seed=0, gradient_checkpointing=False,
        disable_tqdm=True,
    )  # fmt: skip
    if kind == "grpo":
        args, cls = GRPOConfig(**common), GRPOTrainer
    else:
        alpha = 0.1 if kind == "repulse" else 0.0
        args = RePULSeGRPOConfig(**common, alpha=alpha, proposal_samples_per_prompt=opts.proposal_samples)
        cls = RePULSeGRPOTrainer
    trainer = cls(model=model, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset(n=64),
                  processing_class=tok)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # (no log lines between the timings)
    start = time.perf_counter()
    trainer.train()
    return (time.perf_counter() - start) / opts.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--proposal_samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    kinds = ("grpo", "repulse", "repulse_alpha0")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:  # warm-up (imports, first-call overheads), not counted
            seconds_per_step(kind, argparse.Namespace(**{**vars(opts), "steps": 1}), f"{tmp}/warm-{kind}")
        for r in range(opts.rounds):
            for kind in kinds:
                times[kind].append(seconds_per_step(kind, opts, f"{tmp}/{kind}-{r}"))
            print(f"round {r}: " + ", ".join(f"{k} {times[k][-1] * 1e3:.1f} ms/step" for k in kinds), flush=True)
    for kind in kinds:  # the ratio within each round is steadier than a ratio of medians on a loaded machine
        med = statistics.median(times[kind])
        ratio = statistics.median(t / g for t, g in zip(times[kind], times["grpo"]))
        print(f"{kind:>15}: median {med * 1e3:7.1f} ms/step, median per-round ratio {ratio:.2f}x GRPO")


if __name__ == "__main__":
    main()
