"""The command-line recipes, inside the package so that ``pip install trl_ext`` has them: each module is one recipe,
run as ``trl-ext <command>`` (:mod:`trl_ext.commands`), ``python -m trl_ext.recipes.<name>`` or
``accelerate launch -m trl_ext.recipes.<name>``. The repository's ``recipes/<name>.py`` files are thin entry points to
these modules (``python recipes/ppo.py`` and ``accelerate launch recipes/ppo.py`` work as before).
"""
