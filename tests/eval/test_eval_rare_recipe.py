"""The rare-output estimation recipe (`recipes/estimate_rare_outputs.py`): its --help, its option checks and tiny
end-to-end runs of every method on a saved tiny model (in-process, parsed exactly as from the command line)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from online_helpers import loaded_script

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "estimate_rare_outputs.py"
OPTIONS = (
    "--model_name_or_path",
    "--method",
    "--target_word",
    "--distribution",
    "--sequence_length",
    "--num_samples",
    "--batch_size",
    "--temperature",
    "--decay_rate",
    "--burn_in",
    "--seed",
    "--output_path",
    "--no_progress",
    "--prompt",
    "--bad_words",
    "--twist_path",
    "--twist_parameterization",
    "--num_particles",
    "--num_runs",
    "--resampling",
)


@pytest.fixture(scope="module")
def recipe():
    yield from loaded_script(RECIPE)


def test_help_lists_every_option():
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, timeout=120, cwd=RECIPE.parent.parent
    )
    assert proc.returncode == 0, proc.stderr
    missing = [option for option in OPTIONS if option not in proc.stdout]
    assert not missing, f"--help does not list {missing}"
    assert "{exact,brute_force,itgis,mhis,smc}" in proc.stdout


def parse(recipe, *argv):
    (args,) = recipe.make_parser().parse_args_and_config(args=list(argv))
    return args


def test_end_to_end_every_method_agrees_with_exact(recipe, tiny_llama_dir, tmp_path):
    common = ["--model_name_or_path", tiny_llama_dir, "--target_word", "a", "--distribution", "hex"]
    common += ["--sequence_length", "1", "--num_samples", "256", "--batch_size", "64", "--burn_in", "5"]
    common += ["--no_progress", "--device", "cpu"]
    reports = {}
    for method in ("exact", "brute_force", "itgis", "mhis"):
        out = tmp_path / "reports" / f"{method}.json"
        returned = recipe.main(parse(recipe, *common, "--method", method, "--output_path", str(out)))
        reports[method] = json.loads(out.read_text())
        assert reports[method]["result"] == json.loads(json.dumps(returned["result"]))
    exact = reports["exact"]["result"]
    assert exact["num_samples"] == reports["exact"]["distribution"]["support_sizes"][0] > 20
    for method in ("brute_force", "itgis", "mhis"):
        result = reports[method]["result"]
        assert result["method"] == method and result["num_samples"] == 256
        assert 0 < result["std_error"] < result["estimate"]
        assert abs(result["estimate"] - exact["estimate"]) <= 3 * result["std_error"]
    assert reports["mhis"]["result"]["acceptance_rate"] > 0
    assert reports["itgis"]["settings"]["temperature"] == 5.0 and reports["itgis"]["target_ids"] == [69]


def test_words_distribution_with_a_prefix(recipe, tiny_gpt_neox_dir, tmp_path):
    args = parse(
        recipe,
        *("--model_name_or_path", tiny_gpt_neox_dir, "--target_word", "man", "--leading_space", "true"),
        *("--distribution", "words:man,is", "--sequence_length", "2", "--prefix_ids", "2"),
        *("--method", "exact", "--no_progress", "--output_path", str(tmp_path / "r.json")),
    )
    report = recipe.main(args)
    assert report["distribution"]["prefix_ids"] == [2] and report["distribution"]["support_sizes"] == [4, 4]
    assert 0 < report["result"]["estimate"] < 1 and torch.isfinite(torch.tensor(report["result"]["log10_estimate"]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "mhis", "--batch_size", "1"], "at least 2"),
        (["--decay_rate", "2"], "decay_rate"),
        (["--temperature", "0"], "temperature"),
        (["--num_samples", "1"], "num_samples"),
        (["--sequence_length", "0"], "sequence_length"),
        (["--burn_in", "-3"], "burn_in"),
        (["--method", "smc"], "needs? --prompt|pass --prompt"),
        (["--prompt", "a", "--method", "itgis", "--max_new_tokens", "3"], "max_new_tokens 2"),
        (["--prompt", "a", "--method", "smc", "--twist_path", "x"], "go together"),
        (["--prompt", "a", "--method", "smc", "--num_runs", "1"], "num_runs"),
        (["--prompt", "a", "--method", "smc", "--proposal_mix", "1.5"], "proposal_mix"),
    ],
)
def test_option_checks(recipe, argv, message):
    with pytest.raises(ValueError, match=message):
        parse(recipe, *argv)


def test_missing_model_or_target(recipe, tiny_llama_dir):
    with pytest.raises(ValueError, match="--target_word"):
        recipe.main(parse(recipe, "--model_name_or_path", tiny_llama_dir))
    with pytest.raises(ValueError, match="--model_name_or_path"):
        recipe.main(parse(recipe, "--target_word", "a"))


# ------------------------------------------------------------------------------------------------ response mode
def test_response_mode_every_method_agrees_with_exact(recipe, tiny_llama_dir, tiny_gpt_neox_dir, tmp_path):
    """P(bad) of the tiny model's own 2-token response to "This man is a": exact enumeration, the three
    input-space estimators through the first-token reduction, and SMC with no twist, with a saved modulation twist
    and with another model as proposal all agree within 3 standard errors."""
    from trl_ext import testing as kit
    from trl_ext.models import ModulatedCausalLM, load_causal_lm

    twist_dir = tmp_path / "twist"
    base = load_causal_lm(tiny_llama_dir)
    ModulatedCausalLM.from_base(base, "linear_head", base_model_name_or_path=tiny_llama_dir).save_pretrained(twist_dir)
    common = ["--model_name_or_path", tiny_llama_dir, "--prompt", "This man is a", "--device", "cpu"]
    common += ["--bad_words", ",".join(kit.RUDE_WORDS), "--num_samples", "512", "--batch_size", "64"]
    common += ["--burn_in", "8", "--num_particles", "16", "--num_runs", "24", "--no_progress"]
    runs = {
        "exact": ["--method", "exact"],
        "brute_force": ["--method", "brute_force"],
        "itgis": ["--method", "itgis", "--temperature", "2"],
        "mhis": ["--method", "mhis", "--temperature", "2"],
        "smc": ["--method", "smc"],
        "smc_twist": ["--method", "smc", "--twist_path", str(twist_dir),
                      "--twist_parameterization", "modulation_linear_head"],
        "smc_twist_mix": ["--method", "smc", "--twist_path", str(twist_dir),
                          "--twist_parameterization", "modulation_linear_head", "--proposal_mix", "0.5"],
        "smc_proposal": ["--method", "smc", "--twist_path", tiny_gpt_neox_dir, "--twist_parameterization", "proposal"],
    }  # fmt: skip
    reports = {}
    for name, argv in runs.items():
        out = tmp_path / f"{name}.json"
        reports[name] = recipe.main(parse(recipe, *common, *argv, "--output_path", str(out)))
        assert json.loads(out.read_text())["result"]["estimate"] == pytest.approx(reports[name]["result"]["estimate"])
    exact = reports["exact"]["result"]["estimate"]
    assert reports["exact"]["question"] == "response" and len(reports["exact"]["bad_token_ids"]) >= 3
    assert 0.005 < exact < 0.5
    for name in runs:
        result = reports[name]["result"]
        if name != "exact":
            assert 0 < result["std_error"], name
            assert abs(result["estimate"] - exact) <= 3 * result["std_error"], (name, result["estimate"], exact)
        assert result["details"]["row_forwards"] > 0
    assert reports["smc"]["result"]["details"]["log_z_lower"] < math.log(exact) + 0.5
    assert reports["smc_twist"]["result"]["details"]["row_forwards"] == 24 * 16 * 2
