"""The end of a training run: a summary table of what the log says, and the main curves as a PNG.

- :func:`summarize_log_history` / :func:`run_summary_table`: pure functions of ``trainer.state.log_history`` (plus a
  few facts: time per update, where the model went) to the first and last logged value of the reward, the KL, ``p_bad``
  and the loss (whichever of them the trainer logs, :data:`SUMMARY_METRICS`), as a `rich` table.
- :class:`RunSummaryCallback`: prints that table at the end of `train()` on the main process. Every trl_ext trainer
  adds it (:class:`RunSummaryMixin`); a recipe adds it to TRL's own trainers (SFT, reward) through
  :func:`add_run_summary`. ``trainer.print_run_summary = False`` turns it off.
- :func:`plot_log_history`: the curves of a ``log_history`` (or of the newest ``trainer_state.json`` of an output or
  checkpoint folder) against the step, written as a PNG with matplotlib's Agg backend.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from transformers import TrainerCallback

from .lifecycle import TrainLifecycle

__all__ = [
    "PLOT_METRICS",
    "SUMMARY_METRICS",
    "MetricSummary",
    "RunSummaryCallback",
    "RunSummaryMixin",
    "add_run_summary",
    "load_log_history",
    "plot_log_history",
    "run_summary_table",
    "run_summary_text",
    "summarize_log_history",
]

SUMMARY_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("base/reward", "objective/scores", "proposal/reward")),
    ("KL", ("base/kl", "objective/kl", "proposal/kl_q_ref", "kl")),
    ("p_bad", ("p_bad",)),
    ("reward margin", ("rewards/margins", "margin")),
    ("accuracy", ("rewards/accuracies", "accuracy", "mean_token_accuracy")),
    ("loss", ("loss",)),
    ("eval reward", ("eval_reward", "eval_objective/scores", "eval_proposal/reward")),
    ("eval KL", ("eval_kl",)),
    ("eval p_bad", ("eval_p_bad",)),
    ("eval loss", ("eval_loss",)),
)
"""The table's rows: ``(label, keys)``; a row shows the first of its keys that the log holds (PPO logs
``objective/*``, the harmlessness trainer ``base/*`` and ``p_bad``, the proposal trainer ``proposal/*``, DPO/KTO
``rewards/*``)."""

PLOT_METRICS = ("reward", "KL", "p_bad", "loss")
"""The rows of :data:`SUMMARY_METRICS` that :func:`plot_log_history` draws by default (those present)."""

TRAINER_STATE = "trainer_state.json"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class MetricSummary:
    """The first and last logged values of one metric (``key`` in the log, shown as ``label``)."""

    label: str
    key: str
    first_step: int
    first: float
    last_step: int
    last: float
    count: int

    @property
    def change(self) -> float:
        return self.last - self.first


def _series(log_history: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the rows that log ``key`` as a number (a row without ``step`` counts by its index)."""
    steps, values = [], []
    for index, row in enumerate(log_history):
        value = row.get(key) if isinstance(row, Mapping) else None
        if _is_number(value):
            step = row.get("step", index)
            steps.append(int(step) if _is_number(step) else index)
            values.append(float(value))
    return steps, values


def _chosen_keys(log_history: Sequence[Mapping], labels: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``(label, key)`` of each :data:`SUMMARY_METRICS` row (only ``labels``, when given) whose keys the log holds."""
    chosen = []
    for label, keys in SUMMARY_METRICS:
        if labels is not None and label not in labels:
            continue
        key = next((k for k in keys if _series(log_history, k)[0]), None)
        if key is not None:
            chosen.append((label, key))
    return chosen


def summarize_log_history(
    log_history: Sequence[Mapping] | None, keys: Sequence[str] | None = None
) -> list[MetricSummary]:
    """First and last value of each metric of :data:`SUMMARY_METRICS` that ``log_history`` holds (``keys``: these log
    keys instead, each labelled by its name; absent ones are left out). An empty or ``None`` log gives ``[]``."""
    log_history = list(log_history or [])
    pairs = [(k, k) for k in keys] if keys is not None else _chosen_keys(log_history)
    out = []
    for label, key in pairs:
        steps, values = _series(log_history, key)
        if values:
            out.append(MetricSummary(label, key, steps[0], values[0], steps[-1], values[-1], len(values)))
    return out


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return ""
    if not math.isfinite(value):
        return str(value)
    return f"{value:+.4g}" if signed else f"{value:.4g}"


def _facts(
    unit: str, updates: float | None, steps: int | None, seconds: float | None, output_dir, last_checkpoint
) -> list[str]:
    lines = []
    if updates is not None or seconds is not None:
        done = f"{updates:g} {unit}{'' if updates == 1 else 's'}" if updates is not None else "the run"
        if steps is not None and unit != "step":
            done += f" ({steps} optimizer step{'' if steps == 1 else 's'})"
        if seconds is not None:
            done += f" in {seconds:.1f} s"
            if updates:
                done += f": {seconds / updates:.3g} s per {unit}"
        lines.append(done)
    if output_dir is not None:
        lines.append(f"output_dir: {output_dir}")
    if last_checkpoint is not None or output_dir is not None:
        lines.append(f"last checkpoint: {last_checkpoint or 'none saved'}")
    return lines


def run_summary_table(
    log_history: Sequence[Mapping] | None,
    *,
    title: str = "End of run",
    unit: str = "step",
    updates: float | None = None,
    steps: int | None = None,
    seconds: float | None = None,
    output_dir: str | None = None,
    last_checkpoint: str | None = None,
    keys: Sequence[str] | None = None,
):
    """A `rich.table.Table` of :func:`summarize_log_history` (metric, log key, steps, first, last, change), with the
    facts in its caption: ``updates`` (of ``unit``, ``steps`` optimizer steps) done in ``seconds`` and so the seconds
    per ``unit``, ``output_dir`` and ``last_checkpoint``. Facts left ``None`` are not shown; a log without any of the
    metrics gives a table that says so."""
    from rich import box
    from rich.table import Table

    facts = _facts(unit, updates, steps, seconds, output_dir, last_checkpoint)
    table = Table(
        title=title,
        caption="\n".join(facts) or None,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        min_width=max((len(line) for line in facts), default=None),  # the facts on one line each, if the screen allows
    )
    for name in ("metric", "logged as", "steps", "first", "last", "change"):
        table.add_column(name, justify="left" if name in ("metric", "logged as") else "right")
    rows = summarize_log_history(log_history, keys)
    for row in rows:
        steps_text = f"{row.first_step} → {row.last_step}" if row.count > 1 else str(row.first_step)
        table.add_row(
            row.label, row.key, steps_text, _fmt(row.first), _fmt(row.last),
            _fmt(row.change, signed=True) if row.count > 1 else "",
        )  # fmt: skip
    if not rows:
        table.add_row("(no reward, KL, p_bad or loss logged)", "", "", "", "", "")
    return table


def run_summary_text(log_history: Sequence[Mapping] | None, width: int = 100, **facts) -> str:
    """:func:`run_summary_table` rendered as plain text, ``width`` characters wide (``facts``: its keywords)."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False)
    console.print(run_summary_table(log_history, **facts))
    return console.file.getvalue()


# ---------------------------------------------------------------------------------------------- the callback
class RunSummaryCallback(TrainerCallback):
    """Print :func:`run_summary_table` at the end of `train()` (on the main process only). It times `train()` from
    its start; ``unit`` is what one update is (``"PPO update"``: ``steps_per_unit`` optimizer steps), ``title``
    the table's title."""

    def __init__(self, title: str = "End of run", unit: str = "step", steps_per_unit: int = 1):
        self.title, self.unit, self.steps_per_unit = title, unit, max(1, int(steps_per_unit))
        self._start: tuple[float, int] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), state.global_step)  # after a resume: the checkpoint's step

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.console import Console

        Console(highlight=False).print(run_summary_table(state.log_history, **self.facts(args, state)))

    def facts(self, args, state) -> dict:
        """The keywords of :func:`run_summary_table` at the end of a run."""
        from transformers.trainer_utils import get_last_checkpoint

        facts = {"title": self.title, "unit": self.unit}
        if self._start is not None:
            began, first_step = self._start
            steps = state.global_step - first_step
            facts.update(steps=steps, updates=steps / self.steps_per_unit, seconds=time.perf_counter() - began)
        output_dir = getattr(args, "output_dir", None)
        if output_dir:
            facts["output_dir"] = os.path.abspath(output_dir)
            last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
            facts["last_checkpoint"] = os.path.abspath(last) if last else None
        return facts


def add_run_summary(trainer, unit: str = "step", steps_per_unit: int = 1) -> None:
    """Give ``trainer`` (any `transformers.Trainer`) a :class:`RunSummaryCallback` in place of any it had, unless
    ``trainer.print_run_summary`` is false."""
    for callback in [c for c in trainer.callback_handler.callbacks if isinstance(c, RunSummaryCallback)]:
        trainer.remove_callback(callback)
    if getattr(trainer, "print_run_summary", True):
        trainer.add_callback(RunSummaryCallback(type(trainer).__name__, unit, steps_per_unit))


class RunSummaryMixin(TrainLifecycle):
    """Trainer mixin (before TRL's trainer in the bases): `train()` prints the run summary at its end
    (:class:`RunSummaryCallback`). Set ``print_run_summary = False`` on the trainer to turn it off."""

    print_run_summary: bool = True

    def run_summary_unit(self) -> tuple[str, int]:
        """``(name, optimizer steps)`` of one update in the summary's "seconds per ..." (one optimizer step here)."""
        return "step", 1

    def _before_train(self, resume_from_checkpoint):
        add_run_summary(self, *self.run_summary_unit())
        return resume_from_checkpoint


# ------------------------------------------------------------------------------------------------ the curves
def _newest_trainer_state(folder: str) -> str:
    """The ``trainer_state.json`` of ``folder`` or of its ``checkpoint-N`` sub-folders with the highest
    ``global_step`` (the folder's own wins a tie)."""
    candidates = [os.path.join(folder, TRAINER_STATE)]
    for name in os.listdir(folder):
        if name.startswith("checkpoint-") and name.removeprefix("checkpoint-").isdigit():
            candidates.append(os.path.join(folder, name, TRAINER_STATE))
    found = []
    for order, path in enumerate(candidates):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                step = json.load(f).get("global_step", 0)
            found.append((step, -order, path))
    if not found:
        raise FileNotFoundError(
            f"No {TRAINER_STATE} in {folder!r} or in its checkpoint-N folders: pass a folder that holds one (a "
            "checkpoint, or an output_dir with checkpoints or after `trainer.save_state()`), or pass "
            "`trainer.state.log_history` itself."
        )
    return max(found)[2]


def load_log_history(source) -> list[dict]:
    """The ``log_history`` of ``source``: a list of dicts (returned as is), an object with ``log_history`` (a
    `TrainerState`), a ``trainer_state.json`` file, or a folder (:func:`_newest_trainer_state`)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = _newest_trainer_state(path)
        elif not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path!r} does not exist (expected an output / checkpoint folder or a {TRAINER_STATE})."
            )
        with open(path, encoding="utf-8") as f:
            return list(json.load(f).get("log_history", []))
    history = getattr(source, "log_history", source)
    if not isinstance(history, Sequence) or isinstance(history, (str, bytes)):
        raise TypeError(
            f"Expected a log_history (a list of dicts), a TrainerState or a folder / trainer_state.json path, got "
            f"{type(source).__name__}."
        )
    return list(history)


def plot_log_history(log_history_or_output_dir, path: str | os.PathLike | None = None, keys=None) -> str:
    """Write the training curves of a run (each metric against the step, one panel each) as a PNG; return its path.

    Args:
        log_history_or_output_dir: ``trainer.state.log_history`` (a list of dicts), a `TrainerState`, a
            ``trainer_state.json`` file, or an output / checkpoint folder (the newest ``trainer_state.json`` in it or
            its ``checkpoint-N`` folders).
        path: the PNG to write (folders are created). Default: ``training_curves.png`` in the folder given, or in
            the current folder for a list.
        keys: the log keys to draw. Default: the reward, KL, ``p_bad`` and loss, those logged (:data:`PLOT_METRICS`).

    Raises:
        FileNotFoundError: a folder without ``trainer_state.json`` (nor in its checkpoints), or a missing path.
        ValueError: nothing to draw (none of the metrics logged), or a key of ``keys`` that the log lacks.
        ImportError: matplotlib is not installed.
    """
    source = log_history_or_output_dir
    history = load_log_history(source)
    if keys is not None:
        keys = [keys] if isinstance(keys, str) else list(keys)
        missing = [k for k in keys if not _series(history, k)[0]]
        if missing:
            raise ValueError(f"plot_log_history: the log has no numeric values for {missing}.")
    else:
        keys = [key for _, key in _chosen_keys(history, PLOT_METRICS)]
        if not keys:
            raise ValueError(
                "plot_log_history: the log holds none of the reward, KL, p_bad or loss metrics (an empty log, or "
                "logging_steps larger than the run); pass keys=[...] to draw others."
            )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plot_log_history draws with matplotlib: `pip install matplotlib`.") from err
    if path is None:
        folder = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "."
        folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
        path = os.path.join(folder, "training_curves.png")
    path = os.fspath(path)
    figure = Figure(figsize=(4 * len(keys), 3.2), layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas, whatever pyplot's backend is
    for ax, key in zip(figure.subplots(1, len(keys), squeeze=False)[0], keys):
        steps, values = _series(history, key)
        ax.plot(steps, values, marker="o" if len(values) <= 20 else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
