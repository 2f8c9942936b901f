"""Chat with a causal LM in the terminal, through its chat template.

The recipe itself is `trl_ext/recipes/chat.py`: this file runs it, as do
`python -m trl_ext.recipes.chat` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.chat", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.chat import *  # noqa: F403
