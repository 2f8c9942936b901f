"""Jailbreak a policy with BEAST (beam-search suffixes sampled from the model) and measure the attack success rate
before and after.

    python recipes/eval_beast.py --model_name_or_path my-policy --behaviors_csv examples/behaviors_toy.csv \\
        --reward_model_path my-rm --success_criterion reward --threshold -4 --output_path outputs/beast.json
    python recipes/eval_beast.py --config my_beast.yaml              # the same options from a YAML file
    python recipes/eval_beast.py --help                              # every option

BEAST (Sadasivan et al. 2024) grows the suffix token by token: each of `--beam_width` beams samples `--candidates`
distinct next tokens from the model itself (`--attack_temperature`, `--attack_top_p`), every candidate is scored
by the target's negative log-likelihood, and the best `--beam_width` are kept until `--suffix_length` tokens. The
evaluation, success criteria and JSON report are those of `recipes/eval_gcg.py` (see
`trl_ext.eval.attacks.eval_beast`).
"""

from __future__ import annotations

from trl_ext import cli
from trl_ext.eval.attacks import BeastOptions, eval_beast
from trl_ext.eval.attacks import cli as attack_cli

BeastArguments = BeastOptions  # the attack's options: one dataclass for the attack, its evaluation and this recipe


def main(args: attack_cli.AttackScriptArguments, beast_args: BeastArguments) -> dict:
    """Load the model, the goals and the reward, run the evaluation, write and return the report."""
    return attack_cli.run_attack_recipe(eval_beast, "beast", args, beast_args)


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (attack_cli.AttackScriptArguments, BeastArguments), "Evaluate a policy against BEAST jailbreak suffixes."
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
