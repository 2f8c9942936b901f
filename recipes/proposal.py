"""Learn a proposal q towards σ ∝ p_ref·exp(β·R) (twist learning, trl_ext's ProposalTrainer) from the command line or a

The recipe itself is `trl_ext/recipes/proposal.py`: this file runs it, as do
`python -m trl_ext.recipes.proposal` and the `trl-ext` command. `--help` lists its options.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("trl_ext.recipes.proposal", run_name="__main__", alter_sys=True)
else:  # imported by path (tests, notebooks): the recipe's names
    from trl_ext.recipes.proposal import *  # noqa: F403
