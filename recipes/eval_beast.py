"""Jailbreak a policy with BEAST (beam-search suffixes sampled from the model) and measure the attack success rate

The recipe itself is `trl_ext/recipes/eval_beast.py`: this file runs it, as do
`python -m trl_ext.recipes.eval_beast` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.eval_beast", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.eval_beast import *  # noqa: F403
