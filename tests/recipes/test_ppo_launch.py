"""The PPO recipe under `accelerate launch` with two CPU processes: DDP on gloo, DeepSpeed ZeRO-2 and ZeRO-3.

Each test starts two training processes (~15-20 s on two cores); the ZeRO-3 one is marked `slow`. The DeepSpeed tests
need DeepSpeed, installable on a CPU machine without its CUDA kernels:
`DS_BUILD_OPS=0 pip install --no-build-isolation "deepspeed>=0.17,<0.20"`; they are skipped without it. FSDP2 and the
other trainers are in `test_distributed_matrix.py`.

Each checks that the two processes really formed one job (a silent failure mode on CPU: without `--use_cpu true`
each process finds no GPU and trains alone), and that the saved policy loads with `from_pretrained`.
"""

from __future__ import annotations

import importlib.util
import socket

import pytest
from online_helpers import ACCELERATE_CONFIGS, accelerate_launch, run
from test_ppo_recipe import assert_trained_policy_saved, recipe_command, trained_summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_cpu_processes(config: str, workdir):
    """Run the tiny example with 2 processes on the CPU; check it was one job and that its policy was saved."""
    launch = ["--config_file", str(ACCELERATE_CONFIGS / config), "--num_processes", "2", "--mixed_precision", "no"]
    launch += ["--main_process_port", str(free_port())]
    proc = run(accelerate_launch(*launch, *recipe_command("--use_cpu", "true", "--ddp_backend", "gloo")), workdir, 600)
    output = proc.stdout + proc.stderr
    # One summary line (only the main process prints) and one job: 64 episodes / (8 prompts x 2 accumulation steps
    # x 2 processes) = 2 updates of 2 optimizer steps each.
    assert trained_summary(output) == [(2, 4, 2)], output[-3000:]
    assert_trained_policy_saved(workdir / "outputs" / "ppo-tiny", workdir / "outputs" / "tiny" / "policy")


def test_recipe_ddp_two_cpu_processes(tiny_workdir):
    launch_two_cpu_processes("multi_gpu.yaml", tiny_workdir)


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason='deepspeed not installed: DS_BUILD_OPS=0 pip install --no-build-isolation "deepspeed>=0.17,<0.20"',
)
@pytest.mark.parametrize(
    "config", ["deepspeed_zero2.yaml", pytest.param("deepspeed_zero3.yaml", marks=pytest.mark.slow)]
)
def test_recipe_deepspeed_two_cpu_processes(config, tiny_workdir):
    """ZeRO-2, and ZeRO-3 (`slow`), whose save gathers the sharded weights into one loadable checkpoint."""
    launch_two_cpu_processes(config, tiny_workdir)
