"""The DPO and KTO recipes (`recipes/dpo.py`, `recipes/kto.py`) and their tiny example configs.

The documented runs go through a subprocess exactly as a user types them (`accelerate launch recipes/dpo.py --config
examples/dpo_tiny.yaml`, `python recipes/kto.py --config examples/kto_tiny.yaml`) in a scratch folder holding the
tiny inputs; the negative-data variants call the recipes' `main` in-process (same code path, no interpreter start).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from online_helpers import (
    ACCELERATE_CONFIGS,
    EXAMPLES,
    RECIPES,
    accelerate_launch,
    load_script,
    placeholder_model_folders,
    run,
)

from trl_ext import testing as kit

DPO_RECIPE, KTO_RECIPE = RECIPES / "dpo.py", RECIPES / "kto.py"
DPO_YAML, KTO_YAML = EXAMPLES / "dpo_tiny.yaml", EXAMPLES / "kto_tiny.yaml"
NEGDATA = [
    {"prompt": "This man is a", "response": " rude idiot", "reward": -3.0, "step": 1, "source": "policy"},
    {"prompt": "The weather is", "response": " awful", "reward": -5.0, "step": 2, "source": "proposal"},
]


def _changed_weights(output_dir: Path, initial_dir: Path) -> list[str]:
    """Names of the saved policy's weights that differ from the initial ones (the saved folder must load cleanly)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    initial = AutoModelForCausalLM.from_pretrained(initial_dir)
    return [n for (n, p), q in zip(model.named_parameters(), initial.parameters()) if not torch.equal(p, q)]


@pytest.fixture
def workdir(tiny_workdir) -> Path:
    """The tiny inputs plus the data files the example YAMLs name (the commands in their headers)."""
    tiny = tiny_workdir / "outputs" / "tiny"
    kit.preference_dataset(n=64).to_json(str(tiny / "preferences.jsonl"))
    kit.unpaired_preference_dataset(n=64).to_json(str(tiny / "unpaired.jsonl"))
    (tiny / "negdata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in NEGDATA * 4))
    (tiny / "good.jsonl").write_text(json.dumps({"prompt": "Hello", "completion": " there, friend."}) + "\n")
    return tiny_workdir


@pytest.mark.parametrize("recipe", [DPO_RECIPE, KTO_RECIPE], ids=["dpo", "kto"])
def test_recipe_help_lists_the_options(recipe):
    """`--help` text of the recipe's parser (built in-process: the subprocess runs below start the scripts, and each
    interpreter start costs ~10 s of imports on a small machine)."""
    text = load_script(recipe).make_parser().format_help()
    options = (
        "--config", "--model_name_or_path", "--ref_model_name_or_path", "--dataset_name", "--negative_data_path",
        "--extra_loss", "--extra_loss_coef", "--unlikelihood_eps", "--beta", "--loss_type", "--use_peft",
        "--push_to_hub",
    )  # fmt: skip
    assert [option for option in options if option not in text] == []
    assert ("--sample_chosen" in text) is (recipe == DPO_RECIPE)
    assert ("--desirable_data_path" in text) is (recipe == KTO_RECIPE)


def test_yaml_values_are_overridden_by_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(placeholder_model_folders(tmp_path, "outputs/tiny/policy"))
    module = load_script(DPO_RECIPE)
    script_args, training_args, model_args = module.make_parser().parse_args_and_config(
        ["--config", str(DPO_YAML), "--output_dir", str(tmp_path), "--extra_loss", "unlikelihood"]
    )
    assert training_args.extra_loss == "unlikelihood" and training_args.extra_loss_coef == 0.5  # flag, YAML
    assert training_args.bf16 is False and training_args.loss_type == ["sigmoid"]
    assert model_args.model_name_or_path == "outputs/tiny/policy" and script_args.negative_data_path is None
    kto_args = load_script(KTO_RECIPE).make_parser().parse_args_and_config(["--config", str(KTO_YAML)])[1]
    assert kto_args.extra_loss == "unlikelihood" and kto_args.per_device_train_batch_size == 8


def test_dpo_recipe_trains_and_saves_with_accelerate_launch(workdir):
    launch = ["--config_file", str(ACCELERATE_CONFIGS / "single_gpu.yaml"), "--mixed_precision", "no"]
    proc = run(accelerate_launch(*launch, str(DPO_RECIPE), "--config", str(DPO_YAML)), cwd=workdir)
    assert "Trained 4 DPO steps (extra loss: negative_dpo) on 1 process" in proc.stdout + proc.stderr
    assert _changed_weights(workdir / "outputs" / "dpo-tiny", workdir / "outputs" / "tiny" / "policy")


def test_kto_recipe_trains_and_saves_in_process(workdir, monkeypatch, capsys):
    """The documented KTO run, unchanged, through the recipe's `main` (the subprocess variant is marked slow)."""
    monkeypatch.chdir(workdir)
    module = load_script(KTO_RECIPE)
    module.main(*module.make_parser().parse_args_and_config(["--config", str(KTO_YAML)]))
    assert "Trained 4 KTO steps (extra loss: unlikelihood) on 1 process" in capsys.readouterr().out
    assert _changed_weights(workdir / "outputs" / "kto-tiny", workdir / "outputs" / "tiny" / "policy")


@pytest.mark.slow
def test_kto_recipe_trains_and_saves_as_a_script(workdir):
    proc = run([sys.executable, str(KTO_RECIPE), "--config", str(KTO_YAML)], cwd=workdir)
    assert "Trained 4 KTO steps (extra loss: unlikelihood) on 1 process" in proc.stdout + proc.stderr
    assert _changed_weights(workdir / "outputs" / "kto-tiny", workdir / "outputs" / "tiny" / "policy")


def _run_in_process(recipe: Path, yaml: Path, workdir: Path, *flags: str):
    module = load_script(recipe)
    tiny = workdir / "outputs" / "tiny"
    argv = ["--config", str(yaml), "--model_name_or_path", str(tiny / "policy"), "--max_steps", "2", *flags]
    module.main(*module.make_parser().parse_args_and_config(argv))


@pytest.mark.parametrize(
    "flags",
    [
        ("--extra_loss", "negative_dpo"),
        ("--extra_loss", "negative_dpo", "--sample_chosen", "true", "--chosen_max_new_tokens", "4"),
    ],
    ids=["negative-only", "sampled-chosen"],
)
def test_dpo_recipe_on_negative_data(flags, workdir, tmp_path):
    out = tmp_path / "dpo-neg"
    negdata = str(workdir / "outputs" / "tiny" / "negdata.jsonl")
    _run_in_process(DPO_RECIPE, DPO_YAML, workdir, "--negative_data_path", negdata, "--output_dir", str(out),
                    "--per_device_train_batch_size", "4", *flags)  # fmt: skip
    assert _changed_weights(out, workdir / "outputs" / "tiny" / "policy")


def test_kto_recipe_on_negative_and_desirable_data(workdir, tmp_path):
    out = tmp_path / "kto-neg"
    tiny = workdir / "outputs" / "tiny"
    _run_in_process(KTO_RECIPE, KTO_YAML, workdir, "--negative_data_path", str(tiny / "negdata.jsonl"),
                    "--desirable_data_path", str(tiny / "good.jsonl"), "--output_dir", str(out))  # fmt: skip
    assert _changed_weights(out, tiny / "policy")


def test_recipes_refuse_negative_data_options_without_the_data(workdir):
    with pytest.raises(ValueError, match="--negative_data_path"):
        _run_in_process(DPO_RECIPE, DPO_YAML, workdir, "--sample_chosen", "true")
    with pytest.raises(ValueError, match="--negative_data_path"):
        _run_in_process(KTO_RECIPE, KTO_YAML, workdir, "--desirable_data_path", "x.jsonl")
