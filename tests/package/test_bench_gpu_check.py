"""`bench/gpu_check.py run --dry-run`: the GPU check's steps (RePULSe and REINFORCE updates, the head proposal, PPO)
run end to end on a CPU with the kit's tiny models, and the summary records each step, its exit status and the
device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_gpu_check_dry_run_runs_every_step(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("gpu_check", None)
    import gpu_check

    summary = gpu_check.run(str(tmp_path), dry_run=True)
    assert summary["dry_run"] and summary["device"] == "cpu"
    assert list(summary["steps"]) == ["repulse_speed", "repulse_speed_head", "ppo_vs_trl112"]
    assert all(step["rc"] == 0 for step in summary["steps"].values())
    assert json.loads((tmp_path / "gpu_check.json").read_text())["steps"].keys() == summary["steps"].keys()
    speed = json.loads((tmp_path / "repulse_speed.json").read_text())["summary"]
    assert speed["methods"].keys() == {"REINFORCE", "RePULSe"} and speed["ratio_repulse_over_reinforce"] > 0
    head = json.loads((tmp_path / "repulse_speed_head.json").read_text())
    assert next(r for r in head["runs"] if r["method"] == "RePULSe")["options"]["parameterization"] == (
        "modulation_linear_head"
    )
    ppo = json.loads((tmp_path / "ppo_vs_trl112.json").read_text())
    assert ppo["ours"] and ppo["ours"][0]["updates_per_s"] > 0 and not ppo["peer"]


def test_the_gpu_wheels_are_the_locks_versions(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("gpu_check", None)
    import gpu_check

    pins = gpu_check.locked(gpu_check.OURS_PACKAGES)
    lock = (BENCH.parent / "requirements" / "lock.txt").read_text()
    assert len(pins) == len(gpu_check.OURS_PACKAGES) and all(f"\n{pin}" in f"\n{lock}" for pin in pins)
