"""Jailbreak a policy with GCG (through nanogcg) and measure the attack success rate before and after.

    pip install --no-deps nanogcg==0.3.0 scipy                       # once (the `attacks` extra)
    python recipes/eval_gcg.py --model_name_or_path my-policy --behaviors_csv examples/behaviors_toy.csv \\
        --reward_model_path my-rm --success_criterion reward --threshold -4 --output_path outputs/gcg.json
    python recipes/eval_gcg.py --config my_gcg.yaml                  # the same options from a YAML file
    python recipes/eval_gcg.py --help                                # every option

For each goal GCG optimises a suffix so that the chat-templated `goal + suffix` makes the model start its answer
with the target; `--samples_per_prompt` responses are sampled before and after, and a goal is jailbroken when any
of them has no refusal phrase (`--success_criterion prefix`) or a reward below `--threshold` (`reward`; the
report also gives τ − 1). The JSON report has the ASR before/after with Wilson 95% intervals, the suffixes, the GCG
loss histories and the target's log-probs (see `trl_ext.eval.attacks.eval_gcg`).

Goals: `--behaviors_csv FILE` (columns goal,target) or `--advbench` (goals from an installed `pyrit` package, each
paired with `--advbench_target`); `--scenario strings` attacks the targets alone (user message = suffix only).
"""

from __future__ import annotations

from trl_ext import cli
from trl_ext.eval.attacks import GCGOptions, eval_gcg
from trl_ext.eval.attacks import cli as attack_cli

GCGArguments = GCGOptions  # the attack's options: one dataclass for the attack, its evaluation and this recipe


def main(args: attack_cli.AttackScriptArguments, gcg_args: GCGArguments) -> dict:
    """Load the model, the goals and the reward, run the evaluation, write and return the report."""
    return attack_cli.run_attack_recipe(eval_gcg, "gcg", args, gcg_args)


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (attack_cli.AttackScriptArguments, GCGArguments), "Evaluate a policy against GCG jailbreak suffixes."
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
