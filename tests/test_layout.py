"""The package layout: layers only import downwards, the trainers' sub-packages have no cycle, the flat module paths
of earlier releases still import (the same module objects), and `training_args.bin` pickles written before the layout
change (tests/data/pre_layout, saved by trl_ext 0.1 with `torch.save(args)` as `Trainer` does) still load."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch

from trl_ext.trainers import _aliases

PACKAGE = Path(__file__).resolve().parents[1] / "trl_ext"
DATA = Path(__file__).resolve().parent / "data" / "pre_layout"

# Lower numbers may be imported by higher ones, never the other way; equal numbers may not import each other.
LAYERS = {
    "trl_ext._notices": 0, "trl_ext.utils": 0, "trl_ext.ops": 1, "trl_ext.losses": 2, "trl_ext.models": 3,
    "trl_ext.rewards": 4, "trl_ext.data": 4, "trl_ext.rollout": 5, "trl_ext.sampling": 6, "trl_ext.trainers.common": 6,
    "trl_ext.trainers.ppo": 7, "trl_ext.trainers.proposal": 7, "trl_ext.trainers.preference": 7,
    "trl_ext.trainers.kd": 7, "trl_ext.trainers.prm": 7, "trl_ext.trainers.harmlessness": 8, "trl_ext.trainers": 9,
    "trl_ext.eval": 10, "trl_ext.inference": 10, "trl_ext.plan": 10, "trl_ext.serving": 10, "trl_ext.testing": 10,
    "trl_ext.cli": 11, "trl_ext.study": 11, "trl_ext": 12,
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """trl_ext modules imported by one file, at any depth (function-level imports count too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("trl_ext"):
                for alias in node.names:  # `from pkg import submodule` imports the submodule, not pkg's names
                    sub = f"{target}.{alias.name}"
                    found.add(sub if _is_module(sub) else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("trl_ext"))
    return found


def _layer(module: str) -> str:
    """The longest key of LAYERS that ``module`` is in."""
    candidates = [k for k in LAYERS if module == k or module.startswith(k + ".")]
    return max(candidates, key=len)


def test_layers_only_import_downwards():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _layer(_module_name(path))
        for target in _imports(path):
            layer = _layer(target)
            if layer != source and LAYERS[layer] >= LAYERS[source]:
                upward.append(f"{_module_name(path)} -> {target}")
    assert not upward, "imports that go up or sideways:\n" + "\n".join(sorted(set(upward)))


def test_the_rollout_layer_sits_below_trainers_eval_and_inference():
    for path in (PACKAGE / "rollout").rglob("*.py"):
        bad = [t for t in _imports(path) if t.startswith(("trl_ext.trainers", "trl_ext.eval", "trl_ext.inference"))]
        assert not bad, f"{path.name} imports {bad}"
    for path in [*(PACKAGE / "eval").rglob("*.py"), *(PACKAGE / "inference").rglob("*.py")]:
        bad = [t for t in _imports(path) if t.startswith("trl_ext.trainers")]
        assert not bad, f"{_module_name(path)} takes the rollout from the trainers: {bad}"


@pytest.mark.parametrize(("old", "new"), sorted(_aliases.MOVED_MODULES.items()))
def test_old_module_paths_import_the_new_modules(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_from_old_path_import_names():
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("trl_ext.trainers.rollout", None)
        from trl_ext.trainers.rollout import RolloutGenerator
    from trl_ext.rollout import RolloutGenerator as new

    assert RolloutGenerator is new


@pytest.mark.parametrize(
    ("name", "cls_path"),
    [
        ("ppo", "trl_ext.trainers.ppo.ppo_config.PPOConfig"),
        ("harmlessness", "trl_ext.trainers.harmlessness.harmlessness_config.HarmlessnessConfig"),
        ("proposal", "trl_ext.trainers.proposal.proposal_config.ProposalConfig"),
    ],
)
def test_training_args_pickled_before_the_move_still_load(name, cls_path):
    raw = (DATA / f"{name}_training_args.bin").read_bytes()
    assert f"trl_ext.trainers.{name}_config".encode() in raw  # written with the old module path
    module, _, cls = cls_path.rpartition(".")
    args = torch.load(DATA / f"{name}_training_args.bin", weights_only=False)
    assert type(args) is getattr(importlib.import_module(module), cls)
    assert args.seed == 7 and args.learning_rate == 3e-5 and args.output_dir == "out"
