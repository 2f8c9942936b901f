"""The toy study (`make toy-study`): every method of the paper's toy on SmolLM2-135M-Instruct, over seeds, resumable.

The recipe itself is `trl_ext/recipes/toy_study.py`: this file runs it, as do
`python -m trl_ext.recipes.toy_study` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.toy_study", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.toy_study import *  # noqa: F403
