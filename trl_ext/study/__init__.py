"""Method comparisons on a realistic task, run offline and resumably (``recipes/study.py``, ``make study``).

- :mod:`~trl_ext.study.config`: the study file (shared settings, methods, profiles) and run identities;
- :mod:`~trl_ext.study.runner`: train each run with the public trainers, evaluate on held-out prompts, cache;
- :mod:`~trl_ext.study.report`: frontier points with seed-level intervals, CSV, figure, table.
"""

from .config import MethodSpec, RunSpec, StudyConfig, load_study_config
from .report import format_table, frontier_rows, plot_study, write_csv
from .runner import run_study, summary_path

__all__ = [
    "MethodSpec",
    "RunSpec",
    "StudyConfig",
    "format_table",
    "frontier_rows",
    "load_study_config",
    "plot_study",
    "run_study",
    "summary_path",
    "write_csv",
]
