"""Tests of the installed package itself: a silent import, optional heavy packages imported only where used, the
third-party notice filter, and the install lock (`requirements/lock.txt`, checked by `tools/check_lock.py`)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trl_ext._notices import DemoteNotice, install_notice_filters

ROOT = Path(__file__).resolve().parents[2]
HEAVY_OPTIONAL = ("deepspeed", "nanogcg", "fastapi", "uvicorn", "matplotlib", "profanity_check", "gguf", "vllm")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_importing_the_trainers_prints_nothing():
    done = _python("from trl_ext import PPOTrainer, HarmlessnessTrainer, DPOTrainer")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and done.stdout == ""


def test_optional_heavy_packages_are_imported_only_where_used():
    done = _python(
        f"""
        import importlib, pkgutil, sys
        import trl_ext
        for info in pkgutil.walk_packages(trl_ext.__path__, "trl_ext."):
            importlib.import_module(info.name)
        print(sorted(m for m in {HEAVY_OPTIONAL!r} if m in sys.modules))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"imported at module level: {done.stdout.strip()}"


def test_a_listed_notice_is_demoted_and_everything_else_passes(caplog):
    install_notice_filters()
    install_notice_filters()  # idempotent
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert sum(isinstance(f, DemoteNotice) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="bitsandbytes"):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "offline")
        logger.warning("Some other bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["Some other bitsandbytes warning"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="bitsandbytes"):  # still visible with debug logging
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "offline")
    assert [(r.levelname, r.getMessage()[:20]) for r in caplog.records] == [("DEBUG", "Failed to load CPU g")]


@pytest.mark.skipif(not (ROOT / "requirements" / "lock.txt").exists(), reason="no lock in this tree")
def test_the_lock_check_catches_an_unlocked_version(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import check_lock
    finally:
        sys.path.remove(str(ROOT / "tools"))
    lock = tmp_path / "lock.txt"
    lock.write_text("# comment\ntorch==2.13.0\nfoo-bar==1.0\nBaz_Qux==2.0 ; python_version >= '3'\n")
    pins = check_lock.read_lock(lock)
    assert pins == {"torch": "2.13.0", "foo-bar": "1.0", "baz-qux": "2.0"}
    installed = {"torch": "2.13.0+cpu", "foo-bar": "1.0", "baz-qux": "2.1", "extra": "0.1", "trl-ext": "0.1.0.dev0"}
    problems = check_lock.compare(pins, installed, ignore={"trl-ext"})
    assert problems == ["baz-qux 2.1 installed, lock says 2.0", "extra 0.1 installed, not in the lock"]
    assert check_lock.compare(pins, {"torch": "2.13.0+cpu", "foo-bar": "1.0", "baz-qux": "2.0"}, ignore=set()) == []
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():  # the venv `make setup` made: it is the lock's
        real = check_lock.compare(check_lock.read_lock(ROOT / "requirements" / "lock.txt"), check_lock.installed())
        assert real == [], real
    unexpected, accepted = check_lock.pip_check_problems(
        "nanogcg 0.3.0 has requirement transformers<=4.47.1,>=4.4, but you have transformers 5.23.0.\n"
        "nanogcg 0.3.0 requires sentencepiece, which is not installed.\n"
        "No broken requirements found.\n"
    )
    assert unexpected == ["nanogcg 0.3.0 requires sentencepiece, which is not installed."] and len(accepted) == 1
