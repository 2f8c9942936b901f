"""Checkpoint and resume on 2 CPU processes under every engine, after a kill in the middle of a save.

For PPO (policy + critic, a rollout in progress saved in mid-rollout checkpoints) and RePULSe (policy + proposal),
with their tiny example configs as a user runs them (AdamW, each process sampling from its own RNG, no
``seed_per_row``) and a checkpoint after every optimizer step:

1. an uninterrupted 4-step run;
2. the same run, killed (SIGKILL of the main process, `tests/fault_injection/sitecustomize.py`) halfway through
   writing its optimizer state into ``checkpoint-4``: the launch fails and ``checkpoint-4`` is left incomplete;
3. the same command with ``--resume_from_checkpoint true``: it skips the incomplete ``checkpoint-4``, resumes from
   ``checkpoint-3`` (for PPO in the middle of a rollout: the rollout is restored from the checkpoint, with each
   process's RNG state), and ends with the uninterrupted run's weights (to ``1e-6``: the same computation) and its
   logged values at step 4; the final weights load with ``from_pretrained``.

The default suite runs PPO under FSDP2; the other engines and RePULSe are `slow`. With ``TRL_EXT_MATRIX_RECORD``
each case's time and weight difference are appended to that file (`bench/distributed_matrix.py --resume`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from distributed_helpers import (
    ENGINES,
    FAULT_INJECTION,
    HAS_DEEPSPEED,
    RECORD_PATH,
    assert_loads_with_from_pretrained,
    launch,
    log_history,
    max_weight_difference,
    record,
    saved_weights,
)
from online_helpers import EXAMPLES, RECIPES, REPO, build_tiny_inputs

RESUME_ATOL = 1e-6
COMMANDS = {
    # 64 episodes on 2 processes: 2 rollouts of 2 optimizer steps each; with save_steps counting optimizer steps,
    # checkpoint-3 is in the middle of the second rollout.
    "ppo": ["ppo.py", "ppo_tiny.yaml", "--total_episodes", "64", "--step_unit", "optimizer_step"],
    "repulse": ["harmlessness.py", "harmlessness_toy.yaml", "--max_steps", "4", "--per_device_train_batch_size", "2"],
}
VOLATILE = ("timing/", "tokens_per_second", "eps", "runtime", "per_second")
"""Logged values that measure time (they differ between any two runs)."""
DEFAULT = {("ppo", "fsdp2")}


def _cases():
    for name in COMMANDS:
        for engine in ENGINES:
            marks = [] if (name, engine) in DEFAULT else [pytest.mark.slow]
            if ENGINES[engine].deepspeed:
                marks.append(pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed"))
            yield pytest.param(name, engine, marks=marks, id=f"{name}-{engine}")


def _args(name: str, output_dir: Path, *extra: str) -> list[str]:
    recipe, yaml, *options = COMMANDS[name]
    return [
        str(RECIPES / recipe), "--config", str(EXAMPLES / yaml), *options, "--output_dir", str(output_dir),
        "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(("name", "engine"), list(_cases()))
def test_resume_after_a_kill_mid_save_continues_the_uninterrupted_run(name, engine, tmp_path):
    row = {"kind": "resume", "trainer": name, "engine": engine, "default": (name, engine) in DEFAULT, "status": "fail"}
    start = time.perf_counter()
    try:
        row["weights"] = _kill_and_resume(name, engine, tmp_path)
        row["status"] = "pass"
    finally:
        row["seconds"] = round(time.perf_counter() - start, 1)
        record(RECORD_PATH, row)


def _kill_and_resume(name: str, engine: str, tmp_path: Path) -> float:
    """The three runs of the module docs; returns the largest weight difference of the resumed run."""
    workdir = build_tiny_inputs(tmp_path)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    launch(workdir, engine, _args(name, whole))

    path = os.pathsep.join(filter(None, [str(FAULT_INJECTION), str(REPO), os.environ.get("PYTHONPATH")]))
    env = {"TRL_EXT_KILL_DURING_SAVE": "checkpoint-4", "PYTHONPATH": path}
    killed = launch(workdir, engine, _args(name, broken), env=env, check=False)
    assert killed.returncode != 0, "the run was not killed"
    partial = broken / "checkpoint-4"
    assert partial.is_dir() and not (partial / "trainer_state.json").exists(), "checkpoint-4 should be incomplete"
    assert not (partial / "trl_ext_manifest.json").exists()
    assert (broken / "checkpoint-3" / "trl_ext_manifest.json").is_file()

    resumed = launch(workdir, engine, _args(name, broken, "--resume_from_checkpoint", "true"))
    output = resumed.stdout + resumed.stderr
    skipped = f"Skipping {broken / 'checkpoint-4'}: it has no trainer_state.json"
    assert skipped in output and f"Resuming from {broken / 'checkpoint-3'}" in output, output[-3000:]

    diff, where = max_weight_difference(saved_weights(whole, name), saved_weights(broken, name))
    assert diff <= RESUME_ATOL, f"resumed weights differ by {diff:.3e} at {where}"
    last_whole, last_resumed = log_history(whole)[-1], log_history(broken)[-1]
    assert last_whole["step"] == last_resumed["step"] == 4
    compared = [k for k in last_whole if k in last_resumed and not any(v in k for v in VOLATILE)]
    assert len(compared) > 5, compared
    for key in compared:
        a, b = float(last_whole[key]), float(last_resumed[key])
        assert abs(a - b) <= 1e-5 * abs(a) + 1e-7, f"step 4 {key}: {a!r} uninterrupted, {b!r} resumed"
    assert_loads_with_from_pretrained(broken, name)
    return diff
