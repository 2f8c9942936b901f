"""RePULSe vs REINFORCE on SmolLM2-135M-Instruct, offline on a CPU: the main demo of trl_ext (`make demo`).

The recipe itself is `trl_ext/recipes/demo_repulse.py`: this file runs it, as do
`python -m trl_ext.recipes.demo_repulse` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.demo_repulse", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.demo_repulse import *  # noqa: F403
