"""Serve a reward model over HTTP (FastAPI + uvicorn: `pip install 'trl_ext[serve]'`).

The recipe itself is `trl_ext/recipes/serve_rm.py`: this file runs it, as do
`python -m trl_ext.recipes.serve_rm` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.serve_rm", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.serve_rm import *  # noqa: F403
