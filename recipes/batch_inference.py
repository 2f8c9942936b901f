"""Generate, best-of-N or score a whole prompt dataset into a resumable JSONL file.

The recipe itself is `trl_ext/recipes/batch_inference.py`: this file runs it, as do
`python -m trl_ext.recipes.batch_inference` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.batch_inference", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.batch_inference import *  # noqa: F403
