"""Names that moved to another module, still importable from the old one with a `DeprecationWarning`.

A module that gave up some names sets ``__getattr__ = moved_names(__name__, {"name": "new.module", ...})``: reading one
of them (``from old import name`` included) imports it from its new module, warns once per read, and returns the very
same object. A name that was renamed too is given as ``"new.module:NewName"``. Nothing is imported until a moved name
is asked for, so the old module keeps no import of the new one (no cycle). Module-level *paths* that moved are answered
by `trl_ext.trainers._aliases` instead.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

__all__ = ["REMOVAL", "moved_names"]

REMOVAL = "trl_ext 0.3"


def moved_names(module: str, moved: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` serving the names of ``moved`` (name → the module now holding it)."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, _, new_name = moved[name].partition(":")
        new_name = new_name or name
        warnings.warn(
            f"{module}.{name} moved to {new}.{new_name}; import it from there (the old path works until {REMOVAL}).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), new_name)

    return __getattr__
