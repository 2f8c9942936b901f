"""`bench/repulse_speed.py --tiny --floor` runs end to end on the kit's tiny Llama (the dry run of the benchmark):
both methods' phases are reported, the bare parts are timed, and each update is compared with its floor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("shape", ["study", "toy"])
def test_the_phase_table_and_the_floor_on_a_tiny_model(tmp_path, shape, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("repulse_speed", None)
    import repulse_speed

    out = tmp_path / "speed.json"
    argv = ["--tiny", "--shape", shape, "--floor", "--floor-repeats", "1", "--rounds", "1", "--updates", "1",
            "--warmup", "0", "--prompts-per-step", "2", "--samples-per-prompt", "4", "--proposal-samples", "2",
            "--response-length", "3", "--output", str(out)]  # fmt: skip
    result = repulse_speed.main(argv)
    summary = json.loads(out.read_text())["summary"]
    assert summary["methods"].keys() == {"REINFORCE", "RePULSe"} == result["summary"]["methods"].keys()
    repulse, reinforce = summary["methods"]["RePULSe"], summary["methods"]["REINFORCE"]
    assert {"sampling_proposal", "scoring_proposal", "proposal_step", "policy_step"} <= repulse["phases_s"].keys()
    assert "proposal_step" not in reinforce["phases_s"]  # REINFORCE has no proposal: no proposal timings
    for m in (repulse, reinforce):
        assert m["floor_s"] == pytest.approx(sum(m["floor_parts_s"].values()))
        assert m["over_floor"] == pytest.approx(m["s_per_update"] / m["floor_s"]) and m["over_floor"] > 0
    assert set(summary["bare_parts_s"]) >= {"sampling_policy", "sampling_proposal", "policy_step", "optimizer"}
    runs = json.loads(out.read_text())["runs"]
    repulse_options = next(r["options"] for r in runs if r["method"] == "RePULSe")
    assert repulse_options["proposal_samples_per_prompt"] == 2 and repulse_options["response_length"] == 3


def test_the_head_proposal_is_benchmarked_with_its_own_floor(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("repulse_speed", None)
    import repulse_speed

    out = tmp_path / "speed.json"
    argv = ["--tiny", "--floor", "--floor-repeats", "1", "--rounds", "1", "--updates", "1", "--warmup", "0",
            "--prompts-per-step", "2", "--samples-per-prompt", "4", "--response-length", "3", "--proposal-head",
            "--output", str(out)]  # fmt: skip
    repulse_speed.main(argv)
    data = json.loads(out.read_text())
    repulse_options = next(r["options"] for r in data["runs"] if r["method"] == "RePULSe")
    assert repulse_options["parameterization"] == "modulation_linear_head"
    parts = data["summary"]["bare_parts_s"]
    assert parts["optimizer_proposal"] > 0  # the head's own optimizer step, not the policy's
    floor = data["summary"]["methods"]["RePULSe"]["floor_parts_s"]
    assert floor["optimizer"] == pytest.approx(parts["optimizer"] + parts["optimizer_proposal"])
