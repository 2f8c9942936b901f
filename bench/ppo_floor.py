"""How close is a trl_ext PPO update to the compute its models need on their own?

    python bench/ppo_floor.py              # ~40 s on 2 CPU cores, same job as bench/ppo_vs_trl112.py
    python bench/ppo_floor.py --rounds 24  # more A/B rounds per comparison
    python bench/ppo_floor.py --model smollm2 --batch 8 --new-tokens 16 --rounds 6   # SmolLM2-135M, short prompts
    python bench/ppo_floor.py --model smollm2 --prompt-tokens 128 --samples-per-prompt 4 --rounds 6

The job options (`--model`, `--batch`, `--micro-batch`, `--new-tokens`, `--prompt-tokens`, `--samples-per-prompt`)
are those of `ppo_vs_trl112.py`.

`ppo_vs_trl112.py` says how fast our PPO is next to TRL 1.12's; this script says how much of our time is the models'
own work, which no PPO trainer can avoid. On the job of `ppo_vs_trl112.py` (same models, prompts and config) it
compares, each as an interleaved A/B of medians:

1. **a training micro-step**: `PPOTrainer.compute_loss` + backward on a real micro-batch (policy and critic forward,
   fused log-probs/entropies, PPO and value losses, metrics) against a bare forward + backward of the same two models
   on the same rows with a trivial loss (with `shared_prefix_training` on, as at `--samples-per-prompt 4`, the bare
   side also runs each distinct prompt once: the floor of the same work);
2. **generation**: `generate_responses` (`transformers`' `generate` with our sampler, which also records the
   log-probs) against a bare loop of cached forward passes of the policy picking the argmax;
3. **scoring**: the rollout's no-grad passes (`RolloutGenerator` with the sampled responses given: reference
   log-probs, critic values, reward scores; with `--samples-per-prompt > 1` each distinct prompt runs once,
   `shared_prefix_rollouts`) against bare forwards of the three models on the whole `prompt + response` rows;
4. **matrix multiplications**: a `torch.profiler` trace of training micro-steps gives the share of CPU time spent in
   `mm`/`addmm`/`bmm` and the GFLOP/s they reach, next to a large square matmul on the same cores (the practical peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppo_vs_trl112 as peer_bench  # noqa: E402  (the shared job and assets)

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def ab_medians(run_a, run_b, rounds: int, warmup: int = 2) -> tuple[float, float]:
    """Median seconds of `run_a` and `run_b`, interleaved A/B then B/A so a slow spell of the machine hits both."""
    for _ in range(warmup):
        run_a(), run_b()
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(rounds):
        order = ((run_a, times[0]), (run_b, times[1]))
        for run, bucket in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            run()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _trainer_and_micro_batch(paths: dict, output_dir: str, spec: dict):
    """Our PPOTrainer on the benchmark job, after one update, with the first micro-batch it trained on."""
    job = {**spec["job"], **spec["side_job"]["ours"], "total_episodes": spec["batch"]}
    trainer = peer_bench._build_ours(paths, job, output_dir, {}, spec["samples_per_prompt"])
    seen = {}
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, *args, **kwargs):
        seen.setdefault("model", model)
        seen.setdefault("inputs", inputs)
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording_compute_loss
    trainer.train()
    trainer.compute_loss = compute_loss
    return trainer, seen["model"], seen["inputs"]


def training_step_vs_bare(trainer, model, inputs, rounds: int) -> dict:
    import torch

    from trl_ext.models.critic import get_token_values
    from trl_ext.models.reward import _decoder_parts
    from trl_ext.ops.sequences import position_ids_from_attention_mask
    from trl_ext.rollout.shared_prefix import hidden_with_shared_prompt

    model.train()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    width = inputs["response_mask"].shape[1]

    def ours():
        trainer._position = 0  # metrics bookkeeping of the first micro-step of a rollout
        trainer.compute_loss(model, inputs).backward()

    def bare():
        logits = model.policy(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_attention_mask(mask),
            logits_to_keep=width + 1, use_cache=False,
        ).logits  # fmt: skip
        values = get_token_values(model.value_model, ids, mask)
        (logits.logsumexp(-1).mean() + values.mean()).backward()

    def bare_shared():
        """The same two models with each distinct prompt run once (what ``shared_prefix_training`` computes)."""
        P = ids.shape[1] - width
        split = model.lm_head_split()
        logits = split.head(hidden_with_shared_prompt(split.backbone, ids, mask, P))
        backbone, head = _decoder_parts(model.value_model)
        values = head(hidden_with_shared_prompt(backbone, ids, mask, P))
        (logits.logsumexp(-1).mean() + values.mean()).backward()

    shared = getattr(trainer, "_group_size", 1) > 1
    ours_s, bare_s = ab_medians(ours, bare_shared if shared else bare, rounds)
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(with_flops=True) as prof:
        for _ in range(4):
            ours()
    model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    matmul = [e for e in events if e.key in MATMULS]
    matmul_us = sum(e.self_cpu_time_total for e in matmul)
    flops = sum(e.flops for e in matmul)
    return {
        "rows x width": f"{ids.shape[0]} x {ids.shape[1]}",
        "bare": "shared prompt (each distinct prompt once)" if shared else "whole rows",
        "ours_s": ours_s,
        "bare_s": bare_s,
        "matmul_share": matmul_us / total_us,
        "matmul_gflops": flops / (matmul_us * 1e-6) / 1e9 if matmul_us else 0.0,
    }


def _prompt_batch(paths: dict, spec: dict):
    """The first ``batch / N`` prompts, left-padded, and ``(tokenizer, N)``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["reward"], padding_side="left")
    n = spec["samples_per_prompt"]
    with open(paths["prompts"]) as f:
        prompts = json.load(f)[: spec["batch"] // n]
    return tokenizer(prompts, return_tensors="pt", padding=True), tokenizer, n


def scoring_vs_bare(trainer, paths: dict, spec: dict, rounds: int) -> dict:
    """The rollout's scoring passes on fixed responses against bare forwards of the reference, critic and reward."""
    import torch

    import trl_ext.rollout.generator as generator_module
    from trl_ext.models import get_sequence_scores, get_token_values
    from trl_ext.ops.sequences import position_ids_from_attention_mask
    from trl_ext.rollout import generate_responses

    batch, _, n = _prompt_batch(paths, spec)
    generator, model = trainer.rollout_generator, trainer.model
    ids, mask = batch.input_ids.repeat_interleave(n, 0), batch.attention_mask.repeat_interleave(n, 0)
    with torch.no_grad():
        sampled = generate_responses(model.policy, ids, mask, generator.settings, len(ids), return_logprobs=True)
    T = sampled[0].shape[1]
    full_ids, full_mask = torch.cat([ids, sampled[0]], 1), torch.cat([mask, sampled[1]], 1)
    real = generator_module.generate_responses

    def ours():
        generator_module.generate_responses = lambda *a, **k: sampled
        try:
            generator(model, batch.input_ids, batch.attention_mask)
        finally:
            generator_module.generate_responses = real

    @torch.no_grad()
    def bare():
        positions = position_ids_from_attention_mask(full_mask)
        trainer.ref_model(
            input_ids=full_ids, attention_mask=full_mask, position_ids=positions, logits_to_keep=T + 1, use_cache=False
        )
        get_token_values(model.value_model, full_ids, full_mask)
        get_sequence_scores(trainer.reward_model, full_ids, full_mask)

    ours_s, bare_s = ab_medians(ours, bare, rounds)
    return {"rows x tokens": f"{full_ids.shape[0]} x {full_ids.shape[1]}", "ours_s": ours_s, "bare_s": bare_s}


def generation_vs_bare(paths: dict, spec: dict, rounds: int) -> dict:
    import torch
    from transformers import DynamicCache

    from trl_ext.models import load_causal_lm
    from trl_ext.models.kv_cache import cache_kwargs
    from trl_ext.ops.sequences import position_ids_from_attention_mask
    from trl_ext.rollout import SamplingSettings, generate_responses

    job = spec["job"]
    policy = load_causal_lm(paths["policy"]).eval()
    batch, tokenizer, n = _prompt_batch(paths, spec)
    batch = {k: v.repeat_interleave(n, 0) for k, v in batch.items()}
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    steps = job["response_length"]
    settings = SamplingSettings(
        max_new_tokens=steps, pad_token_id=tokenizer.pad_token_id, temperature=job["temperature"],
        stop_token_ids=None, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip

    @torch.no_grad()
    def ours():
        generate_responses(
            policy, input_ids, attention_mask, settings, len(input_ids), return_logprobs=True, share_prompts=n > 1
        )

    @torch.no_grad()
    def bare():
        mask = attention_mask
        positions = position_ids_from_attention_mask(mask)
        cache = DynamicCache(config=policy.config)
        out = policy(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache),
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        for _ in range(steps - 1):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            out = policy(input_ids=token, attention_mask=mask, position_ids=positions, **cache_kwargs(cache))

    ours_s, bare_s = ab_medians(ours, bare, rounds)
    return {"rows x tokens": f"{len(input_ids)} x {steps}", "ours_s": ours_s, "bare_s": bare_s}


def large_matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12, help="A/B rounds per comparison")
    peer_bench.add_job_arguments(parser)
    args = parser.parse_args()
    spec = peer_bench.job_for(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    with tempfile.TemporaryDirectory(prefix="ppo_floor_") as tmp:
        assets = os.path.join(tmp, "assets")
        info = peer_bench.build_assets(assets, max(64, 2 * args.batch), args.prompt_tokens, args.model)
        paths = info["paths"]
        trainer, model, inputs = _trainer_and_micro_batch(paths, os.path.join(tmp, "out"), spec)
        train = training_step_vs_bare(trainer, model, inputs, args.rounds)
        scoring = scoring_vs_bare(trainer, paths, spec, args.rounds)
        del trainer, model, inputs
        generation = generation_vs_bare(paths, spec, args.rounds)
    peak = large_matmul_gflops()
    print(f"\n{args.model}, {torch.get_num_threads()} torch threads, load before: {os.getloadavg()[0]:.1f}")
    print(f"{'':<28}{'trl_ext s':>11}{'bare models s':>15}{'ours/bare':>11}")
    rows = (
        (f"training micro-step ({train['rows x width']})", train),
        (f"generation ({generation['rows x tokens']})", generation),
        (f"scoring ({scoring['rows x tokens']})", scoring),
    )
    for name, result in rows:
        ratio = result["ours_s"] / result["bare_s"]
        print(f"{name:<28}{result['ours_s']:>11.4f}{result['bare_s']:>15.4f}{ratio:>11.3f}")
    print(
        f"\ntraining micro-step: {100 * train['matmul_share']:.0f}% of CPU time in matrix multiplications, at "
        f"{train['matmul_gflops']:.0f} GFLOP/s; a 2048^3 matmul on these cores: {peak:.0f} GFLOP/s"
    )


if __name__ == "__main__":
    main()
