"""Cell lists of the Colab demo notebooks (built into ``notebooks/*.ipynb`` by ``notebooks/build_notebooks.py``)."""

from . import jailbreak_and_rare_outputs, ppo_quickstart, repulse_harmlessness

#: ``{notebook name: [Cell, ...]}`` in the order the notebooks are listed in notebooks/README.md.
NOTEBOOKS = {
    module.NAME: module.CELLS for module in (ppo_quickstart, repulse_harmlessness, jailbreak_and_rare_outputs)
}
