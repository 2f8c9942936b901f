"""Evaluate a policy on held-out prompts: mean reward/return, P(r < τ), CVaR_α with confidence intervals (JSON report).

The recipe itself is `trl_ext/recipes/eval_heldout.py`: this file runs it, as do
`python -m trl_ext.recipes.eval_heldout` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.eval_heldout", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.eval_heldout import *  # noqa: F403
