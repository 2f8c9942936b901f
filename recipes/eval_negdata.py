"""Log-probability a policy puts on known-bad responses (negative data), per response, per prompt and overall.

The recipe itself is `trl_ext/recipes/eval_negdata.py`: this file runs it, as do
`python -m trl_ext.recipes.eval_negdata` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.eval_negdata", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.eval_negdata import *  # noqa: F403
