"""Helpers of the distributed tests (`test_distributed_matrix.py`, `test_distributed_resume.py`) and of
`bench/distributed_matrix.py`: the tiny runs of every trainer's recipe, launched with `accelerate launch` on 1 or 2 CPU
processes under one of the engines of `accelerate_configs/`, and what is compared between runs.

- :data:`TRAINERS`: per trainer, the recipe, its tiny example YAML cut to a few optimizer steps, the per-process batch
  of a 2-process run (a 1-process run gets twice as many rows per step: the same global batch), the models it saves.
- :data:`ENGINES`: per engine, its accelerate config and the name the recipes print for it ("on 2 processes (...)").
- :func:`launch`: run one cell; it fails with the end of the output when the run fails, and checks that the run was
  one job on the expected engine (on CPU a misconfigured launch silently trains N independent copies).
- :func:`saved_weights`, :func:`log_history`, :func:`assert_equivalent`: the comparison of two runs.

Every run uses `--optim sgd`: an SGD step is linear in the gradient, so two runs that compute the same gradients end
with weights equal to float rounding (measured: ~1e-8 on moves of ~1e-2), while Adam's first steps turn rounding noise
in near-zero gradients into full ±lr steps (`bench/results/distributed_matrix.md`). Online trainers run with
``seed_per_row``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from online_helpers import ACCELERATE_CONFIGS, EXAMPLES, RECIPES, REPO, accelerate_launch, subprocess_env

FAULT_INJECTION = REPO / "tests" / "fault_injection"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# Equivalence tolerances (1 process vs 2 processes, same global batch, seed and SGD steps):
WEIGHT_RTOL = 1e-4
"""max |w₁ − w₂| over every weight ≤ WEIGHT_RTOL × max |w₁ − w_initial| (how far training moved the weights)."""
LOG_RTOL, LOG_ATOL = 1e-4, 1e-6
"""Each compared logged value: |a − b| ≤ LOG_RTOL·|a| + LOG_ATOL."""


@dataclass(frozen=True)
class Engine:
    config: str
    label: str
    """What the recipes print: "Trained ... on 2 processes (<label>)"."""
    deepspeed: bool = False


ENGINES = {
    "ddp": Engine("multi_gpu.yaml", "DDP"),
    "zero2": Engine("deepspeed_zero2.yaml", "DeepSpeed ZeRO-2", deepspeed=True),
    "zero3": Engine("deepspeed_zero3.yaml", "DeepSpeed ZeRO-3", deepspeed=True),
    "fsdp2": Engine("fsdp2.yaml", "FSDP2"),
}


@dataclass(frozen=True)
class Trainer:
    recipe: str
    yaml: str
    args: tuple[str, ...]
    per_device: int
    """Rows (prompts, pairs) per process and step in a 2-process run; a 1-process run gets twice as many."""
    steps: int
    """Optimizer steps of the run (a checkpoint is saved at the last one, for its trainer_state.json)."""
    models: dict[str, str]
    """``{subfolder of output_dir: subfolder of outputs/tiny it started from}`` of every model the recipe saves."""
    compared: tuple[str, ...]
    """Logged values that must agree between a 1-process and a 2-process run."""
    online: bool = False
    extra: dict = field(default_factory=dict)


TRAINERS = {
    # PPO: 32 prompts = one rollout (8 per process × 2 accumulation steps × 2 processes), 2 PPO epochs = 2 steps.
    "ppo": Trainer(
        "ppo.py", "ppo_tiny.yaml", ("--total_episodes", "32"), 8, 2, {"": "policy", "value_model": "reward"},
        ("loss/policy_avg", "loss/value_avg", "objective/scores", "objective/kl", "objective/rlhf_reward"),
        online=True,
    ),
    # RePULSe: one epoch of 16 distinct prompts (2 per process and step) = 4 steps, every sample saved as "negative".
    "repulse": Trainer(
        "harmlessness.py", "harmlessness_toy.yaml", ("--max_steps", "-1", "--num_train_epochs", "1"), 2, 4,
        {"": "policy", "proposal": "policy"},
        ("loss", "loss/policy", "loss/proposal", "p_bad", "base/reward", "base/kl", "proposal/reward"),
        online=True,
    ),
    # Proposal: 1 prompt × 16 samples per process and step, 2 steps.
    "proposal": Trainer(
        "proposal.py", "proposal_toy.yaml", ("--max_steps", "2", "--num_samples_per_prompt", "16"), 1, 2,
        {"": "policy"}, ("proposal/loss", "proposal/reward", "proposal/f_q", "proposal/ess"), online=True,
    ),
    "dpo": Trainer(
        "dpo.py", "dpo_tiny.yaml", ("--max_steps", "2"), 4, 2, {"": "policy"},
        ("loss", "rewards/chosen", "rewards/rejected", "loss/extra", "extra/count/rejected"),
    ),
    # KTO: TRL estimates the KL reference point `kl` from mismatched pairs *within each process's batch*, so it is
    # not compared (0.054 on 1 process vs 0.060 on 2 at step 2); the weights still agree to 6e-8.
    "kto": Trainer(
        "kto.py", "kto_tiny.yaml", ("--max_steps", "2"), 4, 2, {"": "policy"},
        ("loss", "loss/extra", "extra/count/rejected"),
    ),
    "kd": Trainer(
        "kd.py", "kd_tiny.yaml", ("--max_steps", "2"), 4, 2, {"": "policy"}, ("loss", "nll_loss", "kd_loss")
    ),
    "prm": Trainer("prm.py", "prm_tiny.yaml", ("--max_steps", "2"), 4, 2, {"": "policy"}, ("loss", "accuracy")),
}  # fmt: skip

DISTINCT_PROMPTS = "outputs/tiny/distinct_prompts.jsonl"
"""16 prompts that all differ (the RePULSe runs: each one must be sampled by exactly one process per epoch)."""


def write_distinct_prompts(workdir: Path, n: int = 16) -> Path:
    path = workdir / DISTINCT_PROMPTS
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Question {i}: what did the driver say to her sister?"}) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_args(name: str, output_dir: Path, processes: int) -> list[str]:
    """The recipe's arguments for a run of trainer ``name`` on ``processes`` processes writing to ``output_dir``."""
    trainer = TRAINERS[name]
    args = [str(RECIPES / trainer.recipe), "--config", str(EXAMPLES / trainer.yaml), *trainer.args]
    per_device = trainer.per_device * (2 if processes == 1 else 1)  # the same global batch on 1 or 2 processes
    args += ["--per_device_train_batch_size", str(per_device)]
    args += ["--optim", "sgd", "--learning_rate", "0.1", "--seed", "0", "--output_dir", str(output_dir)]
    args += ["--save_strategy", "steps", "--save_steps", str(trainer.steps)]
    if trainer.online:
        args += ["--seed_per_row", "true"]
    if name == "repulse":
        args += ["--proposal_learning_rate", "0.1", "--dataset_name", DISTINCT_PROMPTS]
        args += ["--save_negdata", str(output_dir / "negdata.jsonl"), "--save_negdata_threshold", "1e9"]
    return args


@dataclass
class Run:
    output_dir: Path
    output: str
    seconds: float


def launch(
    workdir: Path,
    engine: str | None,
    args: list[str],
    processes: int = 2,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``args`` (a recipe and its options) from ``workdir``: on ``processes`` CPU processes
    (gloo) under ``engine`` (a key of :data:`ENGINES`), or on one process with ``engine=None``. With ``check`` it
    fails with the end of the output when the run fails."""
    if engine is None:
        launch_args = ["--config_file", str(ACCELERATE_CONFIGS / "single_gpu.yaml"), "--num_processes", "1"]
        extra = []
    else:
        launch_args = ["--config_file", str(ACCELERATE_CONFIGS / ENGINES[engine].config)]
        launch_args += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
        extra = ["--use_cpu", "true", "--ddp_backend", "gloo"]
    launch_args += ["--mixed_precision", "no"]
    proc = subprocess.run(
        accelerate_launch(*launch_args, *args, *extra), cwd=workdir, env=subprocess_env(**(env or {})),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if check:
        output = f"STDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-8000:]}"
        assert proc.returncode == 0, f"exit {proc.returncode}\n{output}"
    return proc


def run_cell(workdir: Path, name: str, engine: str | None, output_dir: Path, extra: tuple[str, ...] = ()) -> Run:
    """One run of trainer ``name`` (2 processes under ``engine``, or 1 process with ``engine=None``), with the recipe
    options ``extra`` added; checks that it ran as one job on that engine."""
    start = time.perf_counter()
    proc = launch(workdir, engine, [*recipe_args(name, output_dir, 1 if engine is None else 2), *extra])
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    expected = "on 1 process" if engine is None else f"on 2 processes ({ENGINES[engine].label})"
    assert expected in output, f"the recipe did not report running {expected!r}:\n{output[-3000:]}"
    return Run(output_dir, output, seconds)


# ---------------------------------------------------------------------------------------------------- comparing
def saved_weights(output_dir: Path, name: str) -> dict[str, torch.Tensor]:
    """Every weight of every model trainer ``name`` saved in ``output_dir`` (keys ``subfolder:weight``)."""
    from safetensors.torch import load_file

    weights = {}
    for sub in TRAINERS[name].models:
        folder = output_dir / sub
        files = sorted(folder.glob("*.safetensors"))
        assert files, f"no safetensors weights in {folder}"
        for path in files:
            weights.update({f"{sub}:{k}": v.float() for k, v in load_file(path).items()})
    return weights


def initial_weights(workdir: Path, name: str) -> dict[str, torch.Tensor]:
    """The weights the models of trainer ``name`` started from (keys as :func:`saved_weights`)."""
    from safetensors.torch import load_file

    weights = {}
    for sub, start in TRAINERS[name].models.items():
        for path in sorted((workdir / "outputs" / "tiny" / start).glob("*.safetensors")):
            weights.update({f"{sub}:{k}": v.float() for k, v in load_file(path).items()})
    return weights


def assert_loads_with_from_pretrained(output_dir: Path, name: str) -> None:
    """Every model of trainer ``name`` in ``output_dir`` loads with ``<its architecture>.from_pretrained`` without
    missing, unexpected or mismatched weights (the consolidated weights of DeepSpeed / FSDP included)."""
    import transformers

    for sub in TRAINERS[name].models:
        folder = output_dir / sub
        architecture = transformers.AutoConfig.from_pretrained(folder).architectures[0]
        _, info = getattr(transformers, architecture).from_pretrained(folder, output_loading_info=True)
        problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
        assert not problems, f"{folder} ({architecture}): {problems}"


def log_history(output_dir: Path) -> list[dict]:
    """The training log rows (those with a ``step``, without the final summary) of the newest checkpoint."""
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoints, f"no checkpoint in {output_dir}"
    with open(checkpoints[-1] / "trainer_state.json", encoding="utf-8") as f:
        history = json.load(f)["log_history"]
    return [row for row in history if "train_runtime" not in row]


def max_weight_difference(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(((a[k] - b[k]).abs().max().item(), k) for k in a)


def assert_equivalent(workdir: Path, name: str, one: Path, two: Path) -> dict[str, float]:
    """The 1-process run in ``one`` and the 2-process run in ``two`` of trainer ``name`` end with the same weights
    and logged the same values (:data:`WEIGHT_RTOL`, :data:`LOG_RTOL`). Returns the measured differences."""
    w1, w2 = saved_weights(one, name), saved_weights(two, name)
    initial = initial_weights(workdir, name)
    moved = max((w1[k] - initial[k]).abs().max().item() for k in w1 if k in initial)
    assert moved > 1e-5, f"{name}: the weights hardly moved ({moved:.2e}); nothing is compared"
    diff, where = max_weight_difference(w1, w2)
    assert diff <= WEIGHT_RTOL * moved, f"{name}: weights differ by {diff:.3e} at {where} (moved {moved:.3e})"
    h1, h2 = log_history(one), log_history(two)
    assert [r["step"] for r in h1] == [r["step"] for r in h2], (h1, h2)
    worst = 0.0
    for r1, r2 in zip(h1, h2):
        for key in TRAINERS[name].compared:
            assert key in r1 and key in r2, f"{name}: {key!r} not logged at step {r1['step']}: {sorted(r1)}"
            a, b = float(r1[key]), float(r2[key])
            assert abs(a - b) <= LOG_RTOL * abs(a) + LOG_ATOL, f"{name} step {r1['step']} {key}: {a!r} vs {b!r}"
            worst = max(worst, abs(a - b))
    return {"weights": diff, "moved": moved, "logs": worst}


def record(path: str | None, row: dict) -> None:
    """Append ``row`` to the JSONL file ``path`` (``TRL_EXT_MATRIX_RECORD``, read by bench/distributed_matrix.py)."""
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


RECORD_PATH = os.environ.get("TRL_EXT_MATRIX_RECORD")
