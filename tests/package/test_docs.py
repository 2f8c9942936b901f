"""Every ```python block of the user docs (docs/*.md) runs, top to bottom, as one script per page.

A page's blocks share one namespace, like cells of a notebook. Blocks fenced as ```python no-run are skipped (for
snippets that need a GPU or the Hub); every other block must run offline on CPU in seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _blocks(page: Path) -> list[str]:
    return [code for flags, code in BLOCK.findall(page.read_text()) if "no-run" not in flags]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_doc_examples_run(page, tmp_path, monkeypatch):
    blocks = _blocks(page)
    assert blocks, f"{page.name} has no runnable python example"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_example__"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the failure message is the point
            raise AssertionError(f"{page.name}: block {i} failed: {exc!r}\n---\n{code}") from exc
