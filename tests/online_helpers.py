"""Helpers shared by the tests of the online trainers (PPO, proposal, harmlessness) and of their recipes.

- Recipes as a user runs them: :func:`run` a command in a subprocess with :func:`subprocess_env` (offline, quiet,
  one thread, this checkout importable), :func:`accelerate_launch` for ``accelerate launch``, and
  :func:`loaded_script` to import a script of the repository (a recipe, ``examples/build_tiny_inputs.py``) in-process.
- Training runs: :class:`StopAt` (end training after a step, as if the job were killed there) and :func:`logged`.

The ``tiny_workdir`` fixture (a scratch folder after ``python examples/build_tiny_inputs.py``) is in ``conftest.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
EXAMPLES = REPO / "examples"
ACCELERATE_CONFIGS = REPO / "accelerate_configs"


# ------------------------------------------------------------------------------------------- scripts & recipes
def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for recipe subprocesses: offline, quiet, one thread per process, this checkout importable."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.update(extra)
    return env


def accelerate_launch(*launch_args: str) -> list[str]:
    """`accelerate launch <launch_args>` through this interpreter (no reliance on PATH or a user default config)."""
    return [sys.executable, "-m", "accelerate.commands.launch", *launch_args]


def run(cmd: list[str], cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `cmd` in `cwd`; fail with the end of its output when it exits non-zero."""
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    output = f"STDOUT:\n{proc.stdout[-5000:]}\nSTDERR:\n{proc.stderr[-8000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output}"
    return proc


def assert_help_lists(script: Path, options: tuple[str, ...]) -> None:
    """``python <script> --help``, run as a user runs it, names every option of ``options``."""
    proc = run([sys.executable, str(script), "--help"], timeout=120)
    missing = [option for option in options if option not in proc.stdout]
    assert not missing, f"--help does not list {missing}"


def load_script(path: Path):
    """Import a script of the repository as a module: a recipe (``recipes/<name>.py``, a thin entry point) as the
    package module it runs, ``trl_ext.recipes.<name>`` (freshly imported); any other script from its file."""
    path = Path(path)
    if path.parent.resolve() == RECIPES.resolve():
        sys.modules.pop(f"trl_ext.recipes.{path.stem}", None)
        return importlib.import_module(f"trl_ext.recipes.{path.stem}")
    spec = importlib.util.spec_from_file_location(f"_trl_ext_script_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def loaded_script(path: Path) -> Iterator:
    """Generator for a fixture: yields the imported script, then forgets it (``yield from loaded_script(path)``)."""
    module = load_script(path)
    yield module
    sys.modules.pop(module.__name__, None)


def build_tiny_inputs(workdir: Path) -> Path:
    """``python examples/build_tiny_inputs.py`` run from ``workdir`` (inputs in ``workdir/outputs/tiny``)."""
    load_script(EXAMPLES / "build_tiny_inputs.py").build(workdir / "outputs" / "tiny")
    return workdir


# ----------------------------------------------------------------------------------------------- training runs
class StopAt(TrainerCallback):
    """Ends training after ``step`` optimizer steps, as if the job had been killed right after that checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def placeholder_model_folders(workdir: Path, *folders: str) -> Path:
    """Empty ``folders`` under ``workdir`` (e.g. ``outputs/tiny/policy``): enough for a test that only parses a
    recipe's example YAML, whose model paths must exist (the recipes' parser refuses a missing local model folder)."""
    for folder in folders:
        (workdir / folder).mkdir(parents=True, exist_ok=True)
    return workdir


def logged(trainer, key) -> list[float]:
    """Every value of ``key`` in the trainer's log history, in order."""
    return [h[key] for h in trainer.state.log_history if key in h]
