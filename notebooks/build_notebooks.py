"""Write the Colab demo notebooks from their cell lists, and optionally run them and keep the outputs.

The cells live as Python strings in ``notebooks/nb_sources/`` (one module per notebook), so that a review reads them
as code and a diff of a notebook's logic is a diff of a ``.py`` file. This script turns them into ``.ipynb`` files
with ``nbformat``; ``--execute`` then runs each notebook top to bottom in a Jupyter kernel of the current interpreter
(``nbclient``) and saves it with its outputs (plots, tables, timings), as committed in the repository::

    python notebooks/build_notebooks.py                                   # write the three .ipynb (no outputs)
    python notebooks/build_notebooks.py --execute                         # ... and run them with the CPU profile
    python notebooks/build_notebooks.py --refresh-text                    # new markdown, outputs of the last run kept
    TRL_EXT_NOTEBOOK_SMOKE=1 python notebooks/build_notebooks.py --execute --only ppo_quickstart

The kernel inherits this process's environment plus ``PYTHONPATH=<repo>`` and the offline Hugging Face switches, so
``TRL_EXT_NOTEBOOK_PROFILE`` / ``TRL_EXT_NOTEBOOK_SMOKE`` choose the profile and ``TRL_EXT_NOTEBOOK_OUTPUT_DIR`` the
folder for the PNG/JSON files (default here: ``outputs/notebooks``). ``tests/package/test_notebooks.py`` uses
:func:`execute_notebook` too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from nb_sources import NOTEBOOKS  # noqa: E402
from nb_sources.common import GITHUB_REPO  # noqa: E402, F401 (the badge/install owner, read by the tests)

KERNEL_NAME = "trl-ext-notebooks"
#: Environment every notebook kernel gets: the repository importable, no network, plots without a display.
KERNEL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
    "MPLBACKEND": "Agg",
}


def notebook_path(name: str) -> Path:
    """Where the notebook ``name`` is written: ``notebooks/<name>.ipynb``."""
    return HERE / f"{name}.ipynb"


def build_notebook(name: str):
    """The ``nbformat`` notebook of ``name`` (no outputs), from its cell list."""
    import nbformat

    if name not in NOTEBOOKS:
        raise ValueError(f"Unknown notebook {name!r}; choose one of {sorted(NOTEBOOKS)}.")
    cells = []
    for cell in NOTEBOOKS[name]:
        if cell.kind == "markdown":
            cells.append(nbformat.v4.new_markdown_cell(cell.source))
        else:
            metadata = {"tags": list(cell.tags)} if cell.tags else {}
            cells.append(nbformat.v4.new_code_cell(cell.source, metadata=metadata))
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata.update(
        {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
            "accelerator": "GPU",  # Colab opens it on a GPU runtime; the notebook falls back to the CPU by itself
            "colab": {"provenance": [], "gpuType": "T4"},
        }
    )
    # Deterministic cell ids keep the committed files stable between builds.
    for index, cell in enumerate(notebook.cells):
        cell["id"] = f"{name[:20]}-{index:02d}"
    return notebook


@contextmanager
def kernel_of_this_interpreter():
    """A ``KernelManager`` whose kernel runs ``sys.executable -m ipykernel_launcher``.

    The kernel spec is written to a temporary folder and only this manager reads it: nothing is installed into the
    user's or the environment's Jupyter paths, and a ``python3`` kernel registered elsewhere (another Python) is never
    picked by mistake. ipykernel must be importable by this interpreter (it is in the ``dev`` extra).
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    with tempfile.TemporaryDirectory(prefix="trl_ext_kernel_") as folder:
        spec_dir = Path(folder) / KERNEL_NAME
        spec_dir.mkdir()
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"trl_ext notebooks ({sys.executable})",
            "language": "python",
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        specs = KernelSpecManager(kernel_dirs=[folder], ensure_native_kernel=False)
        yield KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def kernel_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment + :data:`KERNEL_ENV` + ``PYTHONPATH=<repo>`` + ``extra``."""
    env = {**os.environ, **KERNEL_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def execute_notebook(notebook, *, env: dict[str, str], cwd: str | os.PathLike, timeout: int = 600):
    """Run every cell of ``notebook`` (in place) in a fresh kernel of this interpreter; the first failing cell raises
    ``nbclient.exceptions.CellExecutionError`` with its traceback. ``timeout``: seconds allowed per cell. Returns the
    executed notebook."""
    from nbclient import NotebookClient

    with kernel_of_this_interpreter() as manager:
        client = NotebookClient(
            notebook,
            km=manager,
            timeout=timeout,
            allow_errors=False,
            record_timing=False,
            resources={"metadata": {"path": os.fspath(cwd)}},
        )
        client.execute(env=env)
    return notebook


def _install_cell_unused(new, old) -> bool:
    """Whether ``new`` is the install cell and its committed run installed nothing (trl_ext was importable), so its
    source can change without running the notebook again."""
    outputs = "".join(str(o.get("text", "")) for o in old.get("outputs", []))
    return "install" in new.metadata.get("tags", []) and "nothing to install" in outputs


def scrub_paths(notebook):
    """Replace this machine's paths in the outputs (the checkout, the venv, the home folder) by placeholders, so a
    committed notebook does not carry them."""
    replacements = [(str(REPO), "<repo>"), (sys.prefix, "<venv>"), (os.path.expanduser("~"), "~")]
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if isinstance(output.get("text"), str):
                for old, new in replacements:
                    output["text"] = output["text"].replace(old, new)
            for mime, value in list(output.get("data", {}).items()):
                if isinstance(value, str) and mime.startswith("text/"):
                    for old, new in replacements:
                        value = value.replace(old, new)
                    output["data"][mime] = value
    return notebook


def refresh_text(name: str):
    """The committed (executed) notebook ``name`` with its markdown cells rewritten from the source, outputs kept.

    For text-only edits (wording, the run-time table) that do not call for a new run. Raises ``ValueError`` when a
    code cell differs from its source or the cells do not line up: then the notebook must be executed again."""
    import nbformat

    built, committed = build_notebook(name), nbformat.read(notebook_path(name), as_version=4)
    kinds = [c.cell_type for c in built.cells]
    if kinds != [c.cell_type for c in committed.cells]:
        raise ValueError(f"{name}: the cells were added, removed or reordered; run it again with --execute.")
    for new, old in zip(built.cells, committed.cells):
        if new.cell_type == "code" and new.source != old.source and not _install_cell_unused(new, old):
            raise ValueError(f"{name}: a code cell changed ({new.source[:60]!r}...); run it again with --execute.")
        if new.cell_type == "code" and new.source != old.source:  # the install cell, which installed nothing
            old.source, old.metadata = new.source, new.metadata
        if new.cell_type == "markdown":
            old.source = new.source
    return committed


def main(argv: list[str] | None = None) -> None:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--execute", action="store_true", help="run the notebooks and save them with outputs")
    parser.add_argument(
        "--refresh-text",
        action="store_true",
        help="rewrite only the markdown cells of the committed, executed notebooks (their code must be unchanged)",
    )
    parser.add_argument("--only", nargs="*", choices=sorted(NOTEBOOKS), help="build only these notebooks")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per cell with --execute")
    parser.add_argument(
        "--output-dir",
        default=str(REPO / "outputs" / "notebooks"),
        help="TRL_EXT_NOTEBOOK_OUTPUT_DIR for the executed notebooks, unless it is set already",
    )
    args = parser.parse_args(argv)
    extra = {"TRL_EXT_NOTEBOOK_OUTPUT_DIR": os.environ.get("TRL_EXT_NOTEBOOK_OUTPUT_DIR", args.output_dir)}
    if args.execute and args.refresh_text:
        parser.error("--refresh-text keeps the outputs of the last run; it cannot be combined with --execute.")
    for name in args.only or sorted(NOTEBOOKS):
        notebook = refresh_text(name) if args.refresh_text else build_notebook(name)
        if args.execute:
            start = time.perf_counter()
            execute_notebook(notebook, env=kernel_environment(extra), cwd=HERE, timeout=args.timeout)
            print(f"{name}: executed in {time.perf_counter() - start:.0f} s")
        nbformat.write(scrub_paths(notebook), notebook_path(name))
        print(f"wrote {notebook_path(name).relative_to(REPO)}")


if __name__ == "__main__":
    main()
