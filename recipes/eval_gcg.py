"""Jailbreak a policy with GCG (through nanogcg) and measure the attack success rate before and after.

The recipe itself is `trl_ext/recipes/eval_gcg.py`: this file runs it, as do
`python -m trl_ext.recipes.eval_gcg` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.eval_gcg", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.eval_gcg import *  # noqa: F403
