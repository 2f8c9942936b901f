"""Train a policy with DPO (trl_ext's DPOTrainer: TRL's DPO plus extra losses) from the command line or a YAML file.

The recipe itself is `trl_ext/recipes/dpo.py`: this file runs it, as do
`python -m trl_ext.recipes.dpo` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.dpo", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.dpo import *  # noqa: F403
