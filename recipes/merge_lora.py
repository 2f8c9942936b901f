"""Merge a LoRA adapter into its base model (causal LM or reward model) and save a plain checkpoint.

The recipe itself is `trl_ext/recipes/merge_lora.py`: this file runs it, as do
`python -m trl_ext.recipes.merge_lora` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.merge_lora", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.merge_lora import *  # noqa: F403
