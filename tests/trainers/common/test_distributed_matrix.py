"""Every trainer's recipe on every distributed engine, on 2 CPU processes (gloo), equivalent to 1 process.

The launch matrix (issue 18): trainers PPO (policy and critic trained; reference and reward frozen), RePULSe (policy
and proposal trained), proposal, DPO, KTO, KD, PRM × engines DDP, DeepSpeed ZeRO-2, ZeRO-3, FSDP2
(`accelerate_configs/`, overridden to `--num_processes 2 --mixed_precision no`, with `--use_cpu true --ddp_backend
gloo`). Each cell runs the trainer's tiny example recipe for 2-4 optimizer steps (`distributed_helpers.TRAINERS`) and
checks that

- the run was one 2-process job on that engine (the recipe names it; FSDP2 really shards on CPU processes),
- every saved model (the consolidated weights under ZeRO-3 / FSDP2) loads with ``from_pretrained`` without missing or
  mismatched weights, and
- it is **equivalent** to a 1-process run with the same global batch and seed (per-process batch doubled): the final
  weights agree to ``1e-4 ×`` how far training moved them and the logged losses / rewards / P(bad) to ``1e-4``
  relative (`distributed_helpers.assert_equivalent`; measured differences are ~1e-8 on moves of ~1e-2). Online
  trainers sample with ``seed_per_row``, so both runs draw the same responses.

The default suite keeps one cell per trainer, covering every engine (:data:`DEFAULT_CELLS`); the other 21 are `slow`.
:func:`test_frozen_models_placement` runs the online trainers with their frozen models placed the other way
(``frozen_models_placement``): PPO under FSDP2 with ``sharded`` (default suite), RePULSe and the proposal trainer
under FSDP2 with ``sharded`` and PPO under ZeRO-3 with ``replicated`` (`slow`), each equivalent to the 1-process run
and to the same engine's run with the default placement.
The RePULSe cells also check the rank-dependent parts of the run on its negative-data JSONL (every sample is saved):
written once, by the main process, with the same rows as the 1-process run, and every prompt sampled by exactly one
process per epoch. :func:`test_processes_sample_from_their_own_random_streams` checks that, without ``seed_per_row``,
the processes do not draw the same random numbers.

``TRL_EXT_MATRIX_RECORD=<file.jsonl>`` appends each cell's time and result to that file
(`bench/distributed_matrix.py` turns it into `bench/results/distributed_matrix.md`).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
from distributed_helpers import (
    ENGINES,
    HAS_DEEPSPEED,
    RECORD_PATH,
    TRAINERS,
    assert_equivalent,
    assert_loads_with_from_pretrained,
    launch,
    record,
    run_cell,
    write_distinct_prompts,
)
from online_helpers import EXAMPLES, RECIPES, build_tiny_inputs

from trl_ext.rollout.negdata import read_negative_data

DEFAULT_CELLS = {
    ("ppo", "fsdp2"),
    ("repulse", "ddp"),
    ("proposal", "zero2"),
    ("dpo", "ddp"),
    ("kto", "zero3"),
    ("kd", "fsdp2"),
    ("prm", "zero2"),
}
"""The cells of the default suite: one per trainer (PPO, RePULSe and DPO among them), every engine at least once."""

NEEDS_DEEPSPEED = pytest.mark.skipif(
    not HAS_DEEPSPEED,
    reason='deepspeed not installed: DS_BUILD_OPS=0 pip install --no-build-isolation "deepspeed>=0.17,<0.20"',
)


def _cells():
    for name in TRAINERS:
        for engine in ENGINES:
            marks = [] if (name, engine) in DEFAULT_CELLS else [pytest.mark.slow]
            if ENGINES[engine].deepspeed:
                marks.append(NEEDS_DEEPSPEED)
            yield pytest.param(name, engine, marks=marks, id=f"{name}-{engine}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The tiny inputs of the example recipes (built once for the module) and 16 distinct prompts."""
    folder = build_tiny_inputs(tmp_path_factory.mktemp("distributed"))
    write_distinct_prompts(folder)
    return folder


@pytest.fixture(scope="module")
def one_process_runs(workdir):
    """The 1-process reference run of each trainer, made on first use and shared by the module's cells."""
    runs = {}

    def get(name: str):
        if name not in runs:
            runs[name] = run_cell(workdir, name, None, workdir / "runs" / f"{name}-1proc")
        return runs[name]

    return get


@pytest.fixture(scope="module")
def two_process_runs(workdir):
    """The 2-process runs (trainer, engine, extra recipe options), made on first use and shared by the module's
    tests."""
    runs = {}

    def get(name: str, engine: str, *extra: str):
        key = (name, engine, extra)
        if key not in runs:
            folder = "-".join([name, engine, *(a.lstrip("-") for a in extra)])
            runs[key] = run_cell(workdir, name, engine, workdir / "runs" / folder, extra)
        return runs[key]

    return get


@pytest.mark.parametrize(("name", "engine"), list(_cells()))
def test_cell_runs_saves_and_matches_one_process(name, engine, workdir, one_process_runs, two_process_runs):
    start = time.perf_counter()
    row = {"trainer": name, "engine": engine, "default": (name, engine) in DEFAULT_CELLS, "status": "fail"}
    try:
        two = two_process_runs(name, engine)
        row["seconds"] = round(two.seconds, 1)
        assert_loads_with_from_pretrained(two.output_dir, name)
        one = one_process_runs(name)
        row.update(assert_equivalent(workdir, name, one.output_dir, two.output_dir))
        if name == "repulse":
            check_negative_data(one.output_dir, two.output_dir)
        row["status"] = "pass"
    finally:
        row.setdefault("seconds", round(time.perf_counter() - start, 1))
        record(RECORD_PATH, row)


# ------------------------------------------------------------------------------------------ frozen-model placement
FROZEN_PLACEMENT_CELLS = [
    pytest.param("ppo", "fsdp2", "sharded", id="ppo-fsdp2-sharded"),
    pytest.param("repulse", "fsdp2", "sharded", marks=pytest.mark.slow, id="repulse-fsdp2-sharded"),
    pytest.param("proposal", "fsdp2", "sharded", marks=pytest.mark.slow, id="proposal-fsdp2-sharded"),
    pytest.param("ppo", "zero3", "replicated", marks=[pytest.mark.slow, NEEDS_DEEPSPEED], id="ppo-zero3-replicated"),
]


@pytest.mark.parametrize(("name", "engine", "placement"), FROZEN_PLACEMENT_CELLS)
def test_frozen_models_placement(name, engine, placement, workdir, one_process_runs, two_process_runs):
    """The online trainer ``name`` with ``--frozen_models_placement placement`` on 2 processes under ``engine``: its
    frozen models are placed that way (the recipe says whether they ended up sharded), it trains, saves models that
    load, and ends with the weights and logs of the 1-process run and of the same engine's run with the default
    placement (replicated under FSDP2, sharded under ZeRO-3), within the cells' tolerances. PPO's frozen models are a
    reference and a reward model (scored through its backbone and head); RePULSe's and the proposal trainer's the
    reference ``p_0`` (their toy rewards are lexical)."""
    run = two_process_runs(name, engine, "--frozen_models_placement", placement)
    assert ("frozen models sharded" in run.output) == (placement == "sharded"), run.output[-3000:]
    assert_loads_with_from_pretrained(run.output_dir, name)
    assert_equivalent(workdir, name, one_process_runs(name).output_dir, run.output_dir)
    default = two_process_runs(name, engine)
    assert ("frozen models sharded" in default.output) == (engine == "zero3")
    assert_equivalent(workdir, name, default.output_dir, run.output_dir)


# ------------------------------------------------------------------------------------------- rank-dependent parts
def _negative_rows(output_dir: Path) -> list[dict]:
    return read_negative_data(str(output_dir / "negdata.jsonl"))  # without the header (its run id differs per run)


def check_negative_data(one: Path, two: Path) -> None:
    """RePULSe saved every sample (threshold 1e9) of one epoch over 16 distinct prompts: the 2-process file holds each
    sample once (written by the main process only, gathered from both), row for row the 1-process file, and each
    prompt was sampled by exactly one process (the second half of every step's rows of a source is process 1's)."""
    rows_one, rows_two = _negative_rows(one), _negative_rows(two)
    trainer = TRAINERS["repulse"]
    samples = 4  # num_samples_per_prompt of harmlessness_toy.yaml
    expected = 16 * samples * 2  # every prompt once per epoch, policy and proposal samples
    assert len(rows_two) == expected, f"{len(rows_two)} rows written, {expected} samples drawn"
    assert rows_two == rows_one, "the 2-process run saved other samples than the 1-process run"
    policy = [r for r in rows_two if r["source"] == "policy"]
    prompts = collections.Counter(r["prompt"] for r in policy)
    assert len(prompts) == 16 and set(prompts.values()) == {samples}, prompts  # each prompt once in the epoch
    seen = {0: set(), 1: set()}
    per_step = trainer.per_device * samples  # rows of one process in one step
    for step in sorted({r["step"] for r in policy}):
        rows = [r for r in policy if r["step"] == step]
        assert len(rows) == 2 * per_step
        seen[0] |= {r["prompt"] for r in rows[:per_step]}
        seen[1] |= {r["prompt"] for r in rows[per_step:]}
    assert not seen[0] & seen[1], f"prompts sampled by both processes: {seen[0] & seen[1]}"
    assert len(seen[0]) == len(seen[1]) == 8


def test_processes_sample_from_their_own_random_streams(workdir):
    """Without ``seed_per_row``, each process samples from its own RNG stream (seeded ``seed + 100003 × rank``):
    given the same prompt (the toy prompt "This man is a" on both), the two processes draw different responses;
    every sample is written once to the negative-data file."""
    out = workdir / "runs" / "rng-per-rank"
    args = [
        str(RECIPES / "harmlessness.py"), "--config", str(EXAMPLES / "harmlessness_toy.yaml"),
        "--dataset_name", "outputs/tiny/toy_prompts.jsonl", "--loss_type", "reinforce", "--max_steps", "1",
        "--per_device_train_batch_size", "1", "--num_samples_per_prompt", "8", "--response_length", "6",
        "--output_dir", str(out), "--save_negdata", str(out / "negdata.jsonl"), "--save_negdata_threshold", "1e9",
    ]  # fmt: skip
    launch(workdir, "ddp", args)
    rows = _negative_rows(out)
    assert len(rows) == 16 and {r["prompt"] for r in rows} == {"This man is a"}
    first, second = [r["response"] for r in rows[:8]], [r["response"] for r in rows[8:]]
    assert first != second, "both processes drew the same responses: their RNG streams are not per rank"
