"""Estimate how likely a causal LM is to output something rare: after random inputs, or as its own response.

The recipe itself is `trl_ext/recipes/estimate_rare_outputs.py`: this file runs it, as do
`python -m trl_ext.recipes.estimate_rare_outputs` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.estimate_rare_outputs", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.estimate_rare_outputs import *  # noqa: F403
