"""The rare-output estimation recipe (`recipes/estimate_rare_outputs.py`): its --help, its option checks and tiny
end-to-end runs of every method on a saved tiny model (in-process, parsed exactly as from the command line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from online_helpers import loaded_script

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "estimate_rare_outputs.py"
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
    assert "{exact,brute_force,itgis,mhis}" in proc.stdout


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
