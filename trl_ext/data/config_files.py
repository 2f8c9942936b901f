"""Reading a recipe's ``--config`` YAML strictly (:func:`check_config_file`), for :class:`trl_ext.cli.RecipeParser`."""

from __future__ import annotations

import os

__all__ = ["check_config_file"]


def check_config_file(path: str) -> dict:
    """Read a recipe's ``--config`` YAML strictly: a syntax error names the file and line, and a key set twice is an
    error (YAML itself keeps the last value silently: a repeated ``model_name_or_path`` once loaded the reward model
    as the policy). Returns the mapping."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ValueError(
                        f"{path}: line {line}: the key {key!r} is set twice (first on line {seen[key]}); YAML would "
                        "keep the last value without a word. Remove one of them."
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    if not os.path.isfile(path):
        raise FileNotFoundError(f"The --config file {path!r} does not exist (relative paths start at {os.getcwd()}).")
    with open(path, encoding="utf-8") as f:
        try:
            config = yaml.load(f, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
            raise ValueError(f"{path}: {where}: not valid YAML ({err.problem or err.context}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"The --config file {path} must hold a YAML mapping (option: value lines).")
    return config
