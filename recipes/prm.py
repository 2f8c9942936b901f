"""Train a process reward model (trl_ext's PRMTrainer) on step-labelled solutions, from the command line or a YAML

The recipe itself is `trl_ext/recipes/prm.py`: this file runs it, as do
`python -m trl_ext.recipes.prm` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.prm", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.prm import *  # noqa: F403
