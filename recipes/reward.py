"""Train a reward model (TRL's RewardTrainer) on preference pairs, from the command line or a YAML file.

The recipe itself is `trl_ext/recipes/reward.py`: this file runs it, as do
`python -m trl_ext.recipes.reward` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.reward", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.reward import *  # noqa: F403
