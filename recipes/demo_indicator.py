"""The earlier demo design (`make demo DEMO_ARGS="--design indicator"`): a 0/−1 word reward and the indicator target.

The recipe itself is `trl_ext/recipes/demo_indicator.py`: this file runs it, as do
`python -m trl_ext.recipes.demo_indicator` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.demo_indicator", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.demo_indicator import *  # noqa: F403
