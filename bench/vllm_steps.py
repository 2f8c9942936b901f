"""Seconds per update of whole PPO and RePULSe updates with Hugging Face ``generate`` vs a colocated vLLM engine
(``use_vllm=True``), SmolLM2-135M-Instruct on CPU, in the vLLM venv:

    make setup-vllm
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_steps.py                 # 2 rounds x 3 updates each
    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_steps.py --trainers ppo --rounds 1 --updates 2

Everything else is equal between the two engines of a trainer. Every run is a fresh subprocess (a vLLM engine
holds its own copy of the weights and KV cache); runs alternate between the engines (generate first in odd rounds,
vLLM first in even ones). Update 1 of a run is a warm-up and is not counted.

- **PPO**: the job of ``bench/ppo_vs_trl112.py --model smollm2 --batch 32 --new-tokens 32`` (policy, reference,
  value and reward models all SmolLM2-135M-sized, the kit's short prompts, 32 responses of up to 32 tokens an update,
  2 PPO epochs), run by that script's worker with the vLLM venv's interpreter; vLLM side: ``use_vllm=True``,
  colocated, weights pushed after every optimizer step.
- **RePULSe**: the study's update shape (``bench/repulse_speed.py``'s RePULSe options: 8 prompts x 4 samples of 20
  tokens, CTL proposal, top 4 blocks trained) with the PPO job's reward model (a SmolLM2 trunk with a seeded
  1-output head) and prompts, so that the venv needs no extra packages; vLLM side: one engine that samples from p
  and from q, each one's weights loaded before it samples.

Reported per trainer and engine: mean seconds per update (± SE over the counted updates of all rounds), the ratio,
the phase breakdown from the trainers' ``timing/*`` metrics, peak RSS and CPU use. Results: ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path[:0] = [REPO, BENCH]

ENGINES = ("generate", "vllm")
TRAINERS = ("ppo", "repulse")
VLLM_OPTIONS = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 512,
    "vllm_gpu_memory_utilization": 0.3,
}
DEFAULT_OUTPUT = os.path.join(BENCH, "results", "vllm_steps", "cpu.json")


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return mean, se


# --------------------------------------------------------------------------------------------------- RePULSe worker
def repulse_worker(assets: dict, engine: str, updates: int) -> dict:
    """``updates`` RePULSe updates (the first a warm-up) on the PPO job's models; time each one."""
    import torch
    from datasets import Dataset
    from repulse_speed import RESPONSE_LENGTH, method_options, train_top_layers
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_ext.models import load_causal_lm, load_reward_model
    from trl_ext.trainers.harmlessness.harmlessness_config import HarmlessnessConfig
    from trl_ext.trainers.harmlessness.harmlessness_trainer import HarmlessnessTrainer

    paths = assets["paths"]
    reward_model, tokenizer = load_reward_model(paths["reward"])
    tokenizer.padding_side = "left"
    with open(paths["prompts"]) as f:
        prompts = json.load(f)
    model = load_causal_lm(paths["policy"])
    train_top_layers(model, 4)
    step_ends: list[float] = []
    logged: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs:
                logged.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    lr = 1e-4
    options = {
        "max_steps": updates, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
        "num_samples_per_prompt": 4, "response_length": RESPONSE_LENGTH, "temperature": 1.0, "kl_coef": 0.2,
        "learning_rate": lr, "lr_scheduler_type": "constant", "seed": 0, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "disable_tqdm": True, "bf16": False, "activation_checkpointing": False,
        "local_rollout_forward_batch_size": 32, "use_cpu": not torch.cuda.is_available(),
        **method_options("RePULSe", argparse.Namespace(lr=lr)),
        **(VLLM_OPTIONS if engine == "vllm" else {}),
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vllm_steps_") as output_dir:
        trainer = HarmlessnessTrainer(
            args=HarmlessnessConfig(output_dir=output_dir, **options), processing_class=tokenizer, model=model,
            reward_model=reward_model, train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[Clock()],
        )  # fmt: skip
        for quiet in (ProgressCallback, PrinterCallback):
            trainer.pop_callback(quiet)
        start, cpu = time.perf_counter(), _cpu_seconds()
        trainer.train()
        train_s, cpu_s = time.perf_counter() - start, _cpu_seconds() - cpu
    update_s = [b - a for a, b in zip(step_ends, step_ends[1:])]  # updates 2..n
    phases = {}
    for row in logged[1:]:
        for key, value in row.items():
            if key.startswith("timing/"):
                phases.setdefault(key, []).append(value)
    return {
        "update_s": update_s,
        "phase_s": {k: statistics.fmean(v) for k, v in phases.items()},
        "cpu_utilisation": cpu_s / train_s / torch.get_num_threads(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "options": options,
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _launch_repulse(ppo, assets_dir: str, engine: str, updates: int) -> dict:
    """One RePULSe run in a worker process of this script."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--assets", assets_dir]
    cmd += ["--updates", str(updates)]
    return ppo.run_json_worker(cmd, {**os.environ, "TOKENIZERS_PARALLELISM": "false"}, "RePULSe")


# --------------------------------------------------------------------------------------------------------- driver
def _ppo_run(ppo, assets_dir: str, engine: str, updates: int) -> dict:
    """One PPO run through ``bench/ppo_vs_trl112.py``'s worker, with this interpreter."""
    result = ppo._launch("ours", sys.executable, assets_dir, updates, 0, VLLM_OPTIONS if engine == "vllm" else {})
    timings = ppo._timing_breakdown(result["logs"])
    result["phase_s"] = {k: v for k, v in timings.items() if k.startswith("timing/")}
    result.pop("logs")
    return result


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for trainer in sorted({r["trainer"] for r in runs}):
        rows = {}
        for engine in ENGINES:
            mine = [r for r in runs if r["trainer"] == trainer and r["engine"] == engine]
            mean, se = mean_se([s for r in mine for s in r["update_s"]])
            phases = {}
            for key in sorted({k for r in mine for k in r["phase_s"]}):
                phases[key] = statistics.fmean(r["phase_s"][key] for r in mine if key in r["phase_s"])
            rows[engine] = {
                "s_per_update": mean, "se": se, "phases_s": phases,
                "peak_rss_mib": max(r["peak_rss_mib"] for r in mine),
                "cpu_utilisation": [round(r["cpu_utilisation"], 2) for r in mine],
            }  # fmt: skip
        rows["vllm_over_generate_time"] = rows["vllm"]["s_per_update"] / rows["generate"]["s_per_update"]
        summary[trainer] = rows
    return summary


def print_summary(summary: dict) -> None:
    for trainer, rows in summary.items():
        print(f"\n{trainer}: seconds per update (mean ± SE), phases (s per update), peak RSS")
        phases = sorted({k for e in ENGINES for k in rows[e]["phases_s"]})
        print("| engine | s/update | " + " | ".join(p.removeprefix("timing/") for p in phases) + " | peak RSS MiB |")
        print("|---|---:|" + "---:|" * len(phases) + "---:|")
        for engine in ENGINES:
            r = rows[engine]
            cells = " | ".join(f"{r['phases_s'][p]:.2f}" if p in r["phases_s"] else "-" for p in phases)
            print(f"| {engine} | {r['s_per_update']:.2f} ± {r['se']:.2f} | {cells} | {r['peak_rss_mib']:.0f} |")
        print(f"vLLM / generate time per update: {rows['vllm_over_generate_time']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--updates", type=int, default=3, help="updates per run; the first is a warm-up")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # a RePULSe run
        with open(os.path.join(args.assets, "assets.json")) as f:
            result = repulse_worker(json.load(f), args.worker, args.updates)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return

    import ppo_vs_trl112 as ppo

    wall = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="vllm_steps_assets_") as assets_dir:
        job_args = argparse.Namespace(model="smollm2", batch=32, micro_batch=8, new_tokens=32, prompt_tokens=0,
                                      samples_per_prompt=1)  # fmt: skip
        spec = ppo.job_for(job_args)
        info = ppo.build_assets(assets_dir, 64, 0, "smollm2")
        with open(os.path.join(assets_dir, "assets.json"), "w") as f:
            json.dump({**info, "job": spec}, f)
        for trainer in args.trainers:
            for r in range(args.rounds):
                for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                    if trainer == "ppo":
                        run = _ppo_run(ppo, assets_dir, engine, args.updates)
                    else:
                        run = _launch_repulse(ppo, assets_dir, engine, args.updates)
                    run.update(trainer=trainer, engine=engine, round=r + 1)
                    runs.append(run)
                    print(
                        f"{trainer} round {r + 1} {engine:<8}: {statistics.fmean(run['update_s']):.2f} s/update "
                        f"(updates {', '.join(f'{s:.2f}' for s in run['update_s'])}), CPU use "
                        f"{run['cpu_utilisation']:.2f}, load before {run['load_before']:.1f}",
                        flush=True,
                    )
    summary = summarize(runs)
    print_summary(summary)
    import torch

    result = {
        "command": shlex.join([sys.executable, *sys.argv]), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "summary": summary, "runs": runs,
        "total_s": time.perf_counter() - wall,
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(f"\nTotal {result['total_s']:.0f} s. Wrote {args.output}.")


if __name__ == "__main__":
    main()
