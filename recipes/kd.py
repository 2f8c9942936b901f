"""Knowledge distillation (trl_ext's KDTrainer: SFT plus a KL term towards a frozen teacher) from the command line

The recipe itself is `trl_ext/recipes/kd.py`: this file runs it, as do
`python -m trl_ext.recipes.kd` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.kd", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.kd import *  # noqa: F403
