"""What the attack recipes (``recipes/eval_gcg.py``, ``recipes/eval_beast.py``) share: their common options and the
loading of the model, the goals and the reward from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .data import load_advbench_goals, load_behaviors_csv
from .options import AttackEvalOptions
from .rules import SCENARIOS, SUCCESS_CRITERIA

__all__ = [
    "AttackScriptArguments",
    "run_attack_recipe",
    "eval_kwargs",
    "load_behaviors",
    "load_model_and_tokenizer",
    "load_reward",
    "resolve_device",
    "summary",
]

LEXICAL_BAD_REWARD = -1.0


@dataclass
class AttackScriptArguments(AttackEvalOptions):
    """Options of both attack recipes: the evaluation's (`AttackEvalOptions`, inherited) and where the model, the
    goals, the reward and the report come from.

    Parameters:
        > Model

        model_name_or_path (`str`): the attacked policy (local folder or Hub id) and its tokenizer.
        dtype (`str` or `None`): weight dtype (`None`: float32 on the CPU, the checkpoint's dtype on a GPU).
        device (`str` or `None`): `"cuda"`, `"cpu"`, ... (`None`: a GPU when there is one).

        > Goals

        behaviors_csv (`str` or `None`): a CSV with columns `goal,target`.
        advbench (`bool`): AdvBench goals from an installed `pyrit` package instead, each paired with
            `advbench_target`.
        max_targets (`int` or `None`): attack only the first N goals.
        scenario (`str`): `"behaviors"` (user message = goal + suffix) or `"strings"` (suffix only, target only).

        > Success and reward

        success_criterion (`str`): `"prefix"` (a sample without refusal phrase) or `"reward"` (a sample below τ).
        reward_model_path / reward_words: the reward, a model or a word list (at most one).
        threshold (`float`): τ; τ − 1 is reported too.
        exclude_adv_suffix (`bool`): score goal + response without the suffix.

        > Sampling and output

        samples_per_prompt, max_new_tokens, temperature, top_k, generation_batch_size, seed, output_path,
        no_progress.
    """

    model_name_or_path: str | None = field(default=None, metadata={"help": "The attacked model (folder or Hub id)."})
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "Weight dtype, e.g. float32 or bfloat16; unset: float32 on CPU, the checkpoint's dtype on GPU."
        },
    )
    device: str | None = field(
        default=None, metadata={"help": "Device, e.g. cuda or cpu; unset: cuda when a GPU is visible."}
    )
    behaviors_csv: str | None = field(
        default=None, metadata={"help": "CSV file of goals and targets, columns goal,target (or use --advbench)."}
    )
    advbench: bool = field(
        default=False,
        metadata={"help": "Use the AdvBench goals shipped by an installed `pyrit` package (not installed by us)."},
    )
    advbench_target: str = field(
        default="Sure, here is", metadata={"help": "Target paired with every AdvBench goal (pyrit has no targets)."}
    )
    max_targets: int | None = field(default=None, metadata={"help": "Attack only the first N goals."})
    reward_model_path: str | None = field(
        default=None,
        metadata={"help": "Reward model: scores token ids if it shares the policy's vocabulary, else decoded text."},
    )
    reward_words: list[str] | None = field(
        default=None,
        metadata={"help": "Lexical reward instead: -1 if a response contains one of these words (comma or space "
                  "separated), else 0."},
    )  # fmt: skip
    output_path: str | None = field(
        default=None, metadata={"help": "JSON report path; unset: outputs/eval_<attack>.json."}
    )
    no_progress: bool = field(default=False, metadata={"help": "Hide the progress bars."})

    def __post_init__(self):
        if self.scenario not in SCENARIOS:
            raise ValueError(f"--scenario must be one of {SCENARIOS}; got {self.scenario!r}.")
        if self.success_criterion not in SUCCESS_CRITERIA:
            raise ValueError(f"--success_criterion must be one of {SUCCESS_CRITERIA}; got {self.success_criterion!r}.")
        if self.behaviors_csv is not None and self.advbench:
            raise ValueError("Pass either --behaviors_csv or --advbench, not both.")
        if self.reward_words is not None:
            self.reward_words = [w.strip() for item in self.reward_words for w in item.split(",") if w.strip()]
            if not self.reward_words:
                raise ValueError("--reward_words is empty; give at least one word.")
        if self.reward_model_path is not None and self.reward_words is not None:
            raise ValueError("Pass at most one reward: --reward_model_path or --reward_words.")
        has_reward = self.reward_model_path is not None or self.reward_words is not None
        if self.success_criterion == "reward" and not has_reward:
            raise ValueError("--success_criterion reward needs --reward_model_path or --reward_words.")
        if self.exclude_adv_suffix and not has_reward:
            raise ValueError("--exclude_adv_suffix only changes reward scoring: add a reward or drop the flag.")
        if self.reward_words is not None and self.success_criterion == "reward":
            if not self.threshold > LEXICAL_BAD_REWARD:
                raise ValueError(
                    f"--reward_words scores a bad response {LEXICAL_BAD_REWARD}, so --threshold {self.threshold} "
                    "never fires; use a threshold between -1 and 0, e.g. --threshold -0.5."
                )


def load_behaviors(args: AttackScriptArguments) -> list:
    """The goals of ``--behaviors_csv`` or ``--advbench`` (first ``--max_targets``); target strings only in the
    ``strings`` scenario."""
    if args.behaviors_csv is None and not args.advbench:
        raise ValueError("Pass the goals: --behaviors_csv FILE (columns goal,target) or --advbench.")
    if args.advbench:
        goals = load_advbench_goals(args.max_targets)
        behaviors = [{"goal": g, "target": args.advbench_target} for g in goals]
    else:
        behaviors = load_behaviors_csv(args.behaviors_csv, args.max_targets)
    return [b["target"] for b in behaviors] if args.scenario == "strings" else behaviors


def resolve_device(args: AttackScriptArguments) -> str:
    """``--device``, else ``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def load_model_and_tokenizer(args: AttackScriptArguments):
    """``(model, tokenizer)`` of ``--model_name_or_path`` on ``--device`` in eval mode."""
    from transformers import AutoTokenizer

    from ...models import load_causal_lm

    if args.model_name_or_path is None:
        raise ValueError("Pass --model_name_or_path (the model to attack).")
    device = resolve_device(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = args.dtype if args.dtype is not None or device != "cpu" else None
    model = load_causal_lm(args.model_name_or_path, dtype=dtype).to(device)
    return model.eval(), tokenizer


def load_reward(args: AttackScriptArguments, tokenizer):
    """The reward: a :class:`~trl_ext.rewards.LexicalReward`, a reward model sharing the policy's vocabulary
    (scored on token ids), a ``(model, its tokenizer)`` pair (scored on decoded text), or ``None``."""
    if args.reward_words is not None:
        from ...rewards import LexicalReward

        return LexicalReward(words=args.reward_words, present_reward=LEXICAL_BAD_REWARD, absent_reward=0.0)
    if args.reward_model_path is None:
        return None
    from ...models import load_reward_model

    model, rm_tokenizer = load_reward_model(args.reward_model_path, dtype=args.dtype)
    model = model.to(resolve_device(args)).eval()
    return model if rm_tokenizer.get_vocab() == tokenizer.get_vocab() else (model, rm_tokenizer)


def eval_kwargs(args: AttackScriptArguments, attack: str) -> dict:
    """The keyword arguments of ``eval_gcg`` / ``eval_beast`` shared by both recipes: the evaluation options, the
    report's path and the progress bars."""
    return {
        "options": AttackEvalOptions.of(args),
        "output_path": args.output_path or f"outputs/eval_{attack}.json",
        "show_progress": not args.no_progress,
    }


def run_attack_recipe(evaluate, attack: str, args: AttackScriptArguments, attack_args) -> dict:
    """What both recipes' ``main`` does: load the goals, the model and the reward from ``args``, run ``evaluate``
    (``eval_gcg`` / ``eval_beast``) with the attack's own options (the dataclass ``attack_args``), print the summary
    and return the report (also written to ``--output_path``)."""
    behaviors = load_behaviors(args)
    model, tokenizer = load_model_and_tokenizer(args)
    reward = load_reward(args, tokenizer)
    report = evaluate(model, tokenizer, behaviors, reward=reward, **eval_kwargs(args, attack), **vars(attack_args))
    print(summary(report))
    return report


def summary(report: dict) -> str:
    """One line per phase: the attack success rate and its interval."""
    lines = [f"{report['attack'].upper()} on {report['num_goals']} goals ({report['config']['success_criterion']})"]
    for phase in ("before", "after"):
        asr = report["asr"][phase]
        low, high = asr["ci"]
        lines.append(
            f"  ASR {phase}: {asr['rate']:.3f} ({asr['successes']}/{asr['trials']}, 95% CI {low:.3f}-{high:.3f})"
        )
    lines.append(f"  report: {report.get('output_path')}")
    return "\n".join(lines)
