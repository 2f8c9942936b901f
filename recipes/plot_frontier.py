"""Plot the reward (or return) vs P(r < τ) and vs CVaR_α frontier of several methods from their held-out reports.

The recipe itself is `trl_ext/recipes/plot_frontier.py`: this file runs it, as do
`python -m trl_ext.recipes.plot_frontier` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.plot_frontier", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.plot_frontier import *  # noqa: F403
