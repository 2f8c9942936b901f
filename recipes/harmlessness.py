"""Train a policy with RePULSe or its baselines (trl_ext's HarmlessnessTrainer) from the command line or a YAML file.

The recipe itself is `trl_ext/recipes/harmlessness.py`: this file runs it, as do
`python -m trl_ext.recipes.harmlessness` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.harmlessness", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.harmlessness import *  # noqa: F403
