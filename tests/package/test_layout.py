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

PACKAGE = Path(__file__).resolve().parents[2] / "trl_ext"
DATA = Path(__file__).resolve().parents[1] / "data" / "pre_layout"

# Lower numbers may be imported by higher ones, never the other way; equal numbers may not import each other.
LAYERS = {
    "trl_ext._notices": 0, "trl_ext._deprecation": 0, "trl_ext.utils": 0, "trl_ext.ops": 1, "trl_ext.losses": 2,
    "trl_ext.models": 3, "trl_ext.rewards": 4, "trl_ext.data": 4, "trl_ext.rollout": 5, "trl_ext.sampling": 6,
    "trl_ext.trainers.common": 6, "trl_ext.trainers.twist": 6.5, "trl_ext.trainers.ppo": 7,
    "trl_ext.trainers.proposal": 7, "trl_ext.trainers.preference": 7, "trl_ext.trainers.kd": 7,
    "trl_ext.trainers.prm": 7, "trl_ext.trainers.harmlessness": 8, "trl_ext.trainers": 9,
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


def _import_graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) - {_module_name(p)} for p in sorted(PACKAGE.rglob("*.py"))}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_itself_back():
    """No import cycle between modules, counting imports inside functions and a package's ``__init__``: a lazy import
    that dodges a cycle at import time is still a cycle for a reader."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


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


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("trl_ext.rollout.generator", "forward_response", "trl_ext.rollout.scoring"),
        ("trl_ext.rollout.generator", "PolicyOutput", "trl_ext.rollout.scoring"),
        ("trl_ext.rollout.generator", "causal_lm_outputs", "trl_ext.rollout.scoring"),
        ("trl_ext.rollout.generator", "supports_logits_to_keep", "trl_ext.rollout.probing"),
        ("trl_ext.rollout.generator", "ReferencePolicy", "trl_ext.rollout.reference"),
        ("trl_ext.rollout.generator", "RolloutReward", "trl_ext.rollout.reward"),
        ("trl_ext.rollout.scoring", "supports_logits_to_keep", "trl_ext.rollout.probing"),
        ("trl_ext.rollout.shared_prefix", "distinct_prompts", "trl_ext.ops.sequences"),
        ("trl_ext.losses.reinforce", "compute_baseline", "trl_ext.ops.advantages"),
        ("trl_ext.losses.reinforce", "BASELINES", "trl_ext.ops.advantages"),
        ("trl_ext.trainers.common.checkpoint", "save_policy_and_value", "trl_ext.trainers.ppo.checkpoint"),
        ("trl_ext.trainers.common.checkpoint", "VALUE_MODEL_DIR", "trl_ext.trainers.ppo.checkpoint"),
        ("trl_ext.trainers.common.checkpoint", "load_policy_and_proposal", "trl_ext.trainers.harmlessness.checkpoint"),
        ("trl_ext.trainers.common.checkpoint", "PROPOSAL_DIR", "trl_ext.trainers.harmlessness.checkpoint"),
        ("trl_ext.trainers.common.checkpoint", "resolve_resume_checkpoint", "trl_ext.trainers.common.resume"),
        ("trl_ext.trainers.common.checkpoint", "list_checkpoints", "trl_ext.trainers.common.resume"),
        ("trl_ext.trainers.common.reward_setup", "log_reward_components", "trl_ext.trainers.common.metrics"),
        ("trl_ext.trainers.common.metrics", "PPOMetrics", "trl_ext.trainers.common.metrics:OnlineMetrics"),
        ("trl_ext.cli", "check_negative_data_options", "trl_ext.recipes.preference_common"),
        ("trl_ext.cli", "load_preference_models", "trl_ext.recipes.preference_common"),
    ],
)
def test_names_that_moved_out_of_a_module_still_import_from_it(old, name, new):
    new, _, new_name = new.partition(":")
    new_name = new_name or name
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}.{name} moved to {new}.{new_name}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), new_name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


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


def test_tests_are_grouped_by_the_layer_they_test():
    """tests/ holds the shared fixtures and helpers; every test file is in the folder of the layer it tests."""
    tests = Path(__file__).resolve().parents[1]
    assert not sorted(p.name for p in tests.glob("test_*.py")), "test files at the top of tests/: move them"
    folders = {p.parent.relative_to(tests).parts[0] for p in tests.rglob("test_*.py")}
    layers = {"ops", "losses", "models", "rewards", "data", "rollout", "sampling", "trainers", "eval", "serving",
              "recipes", "study", "package", "vllm_cpu"}  # fmt: skip
    assert folders <= layers, sorted(folders - layers)
