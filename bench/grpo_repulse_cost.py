"""Cost per step of `RePULSeGRPOTrainer` against plain `trl.GRPOTrainer` at a toy shape, measured side by side.

    OMP_NUM_THREADS=1 python bench/grpo_repulse_cost.py --rounds 3 --steps 8
    OMP_NUM_THREADS=1 python bench/grpo_repulse_cost.py --model smollm2 --rounds 3 --steps 2 \
        --prompts 8 --generations 16 --proposal_samples 16 --tokens 2 --output bench/results/grpo_repulse_toy.json

Both trainers run the same policy (the tiny GPT-NeoX of the offline kit, or with ``--model smollm2``
SmolLM2-135M-Instruct with the toy study's prompt "This man is a" and the offensiveness classifier as the reward:
the toy shape is 8 × 16 = 128 completions of 2 tokens per step, the proposal drawing 128 too), the same prompts,
reward and batch shape
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


def _policy_and_data(opts):
    if opts.model == "smollm2":
        from datasets import Dataset

        from trl_ext.models.smollm2 import load_smollm2
        from trl_ext.rewards import OffensivenessReward
        from trl_ext.study.toy import PROMPT

        model, tok = load_smollm2()
        scorer = OffensivenessReward(score="prompt_and_completion")

        def reward(prompts, completions, **kwargs):  # the toy study's r = log(max(1 - p_offensive, 1e-4))
            return scorer(prompts, completions).tolist()

        return model.train(), tok, reward, Dataset.from_dict({"prompt": [PROMPT] * 64})
    tok = build_tokenizer()
    return build_causal_lm("gpt_neox", tok, seed=0), tok, length_reward, prompt_dataset(n=64)


def seconds_per_step(kind: str, opts, out: str) -> float:
    model, tok, reward, dataset = _policy_and_data(opts)
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
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
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
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--output", default=None, help="write the timings and ratios to this JSON file")
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
    summary = {}
    for kind in kinds:  # the ratio within each round is steadier than a ratio of medians on a loaded machine
        med = statistics.median(times[kind])
        ratio = statistics.median(t / g for t, g in zip(times[kind], times["grpo"]))
        summary[kind] = {"seconds_per_step": times[kind], "median": med, "median_ratio_to_grpo": ratio}
        print(f"{kind:>15}: median {med * 1e3:7.1f} ms/step, median per-round ratio {ratio:.2f}x GRPO")
    if opts.output:
        import json
        import platform

        with open(opts.output, "w", encoding="utf-8") as f:
            json.dump({"options": vars(opts), "threads": torch.get_num_threads(), "machine": platform.processor(),
                       "date": time.strftime("%Y-%m-%d %H:%M"), "results": summary}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
