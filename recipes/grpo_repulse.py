"""Train a policy with GRPO plus RePULSe (trl_ext's RePULSeGRPOTrainer) from the command line or a YAML file.

The recipe itself is `trl_ext/recipes/grpo_repulse.py`: this file runs it, as do
`python -m trl_ext.recipes.grpo_repulse` and `trl-ext grpo-repulse`. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.grpo_repulse", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.grpo_repulse import *  # noqa: F403
