"""Compare RePULSe, REINFORCE, PPO and the p-as-proposal ablation on RealToxicityPrompts, offline (`make study`).

The recipe itself is `trl_ext/recipes/study.py`: this file runs it, as do
`python -m trl_ext.recipes.study` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.study", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.study import *  # noqa: F403
