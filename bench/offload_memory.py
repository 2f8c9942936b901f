"""Peak GPU memory of PPO with the frozen reference and reward models resident vs offloaded (``ref_offload``,
``reward_offload``), measured side by side.

    python bench/offload_memory.py                     # hidden 1024, 12 layers (~150M parameters per model), fp32
    python bench/offload_memory.py --hidden 2048 --layers 16 --updates 4

Needs CUDA: on a machine without it the script says so and exits (the CPU tests in ``tests/models/test_offload.py``
check that offloading changes no result). Each variant runs in a fresh subprocess, so neither inherits the other's
high-water mark:

- ``resident``  the default: reference and reward model on the GPU for the whole run;
- ``offload``   ``ref_offload=True, reward_offload=True``: both on the CPU, moved to the GPU for their scoring passes.

The job (identical for both): a GPT-NeoX policy, a separate critic, a reference and a reward model of the same
backbone (randomly initialised from the offline kit's tokenizer, fp32), 8 responses of 32 tokens per update, one PPO
epoch, seed 0. Printed per variant: the memory held after the models are placed (``memory_allocated``), the peak over
the training updates (``max_memory_allocated``, reset after placement) and seconds per update (the first update is a
warm-up and left out); then what offloading saves and costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("resident", "offload")
MiB = 2**20


def _worker(args: argparse.Namespace) -> dict:
    import torch
    from transformers import TrainerCallback

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from trl_ext import PPOConfig, PPOTrainer
    from trl_ext import testing as kit

    sizes = dict(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden, max_position_embeddings=512,
    )  # fmt: skip
    tokenizer = kit.build_tokenizer()
    policy = kit.build_causal_lm(tokenizer=tokenizer, seed=0, **sizes)
    ref = kit.build_causal_lm(tokenizer=tokenizer, seed=0, **sizes)
    reward = kit.build_sequence_classifier(tokenizer=tokenizer, seed=1, **sizes)
    value = kit.build_sequence_classifier(tokenizer=tokenizer, seed=2, **sizes)
    offload = args.worker == "offload"
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, gradient_accumulation_steps=1,
        num_ppo_epochs=1, num_mini_batches=1, total_episodes=8 * args.updates, response_length=32,
        stop_token="eos", learning_rate=1e-6, report_to="none", save_strategy="no", num_sample_generations=0,
        logging_steps=1, activation_checkpointing=False, bf16=False, seed=0, disable_tqdm=True,
        ref_offload=offload, reward_offload=offload,
    )  # fmt: skip
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
        value_model=value, train_dataset=kit.prompt_dataset(n=64),
    )  # fmt: skip
    torch.cuda.synchronize()
    placed = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    return {
        "variant": args.worker,
        "params_per_model": sum(p.numel() for p in ref.parameters()),
        "placed_mib": placed / MiB,
        "peak_mib": torch.cuda.max_memory_allocated() / MiB,
        "s_per_update": (ends[-1] - ends[0]) / max(len(ends) - 1, 1),
        "updates": len(ends),
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--updates", type=int, default=3, help="PPO updates per variant (the first is a warm-up)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return

    import torch

    if not torch.cuda.is_available():
        print(
            "bench/offload_memory.py measures GPU memory and needs CUDA, which this machine does not have: nothing "
            "measured. On CPU, tests/models/test_offload.py checks that ref_offload / reward_offload / "
            "teacher_offload move the frozen models as intended and change no result."
        )
        return
    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--heads", str(args.heads), "--updates", str(args.updates)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-4000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    first = results["resident"]
    print(f"{first['device']}; {first['params_per_model'] / 1e6:.0f}M parameters per model (fp32), {args.updates} "
          "PPO updates of 8 responses x 32 tokens")  # fmt: skip
    print(f"{'variant':<10} {'after placing (MiB)':>20} {'peak in training (MiB)':>23} {'s / update':>11}")
    for variant, r in results.items():
        print(f"{variant:<10} {r['placed_mib']:>20.0f} {r['peak_mib']:>23.0f} {r['s_per_update']:>11.3f}")
    resident, offload = results["resident"], results["offload"]
    print(
        f"offloading saves {resident['placed_mib'] - offload['placed_mib']:.0f} MiB held between passes and "
        f"{resident['peak_mib'] - offload['peak_mib']:.0f} MiB of peak; time per update x"
        f"{offload['s_per_update'] / max(resident['s_per_update'], 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
