"""Recipe inputs that used to fail late or unclearly (issue 34), now named at once with what to change:

- model path options (`trl_ext.models.paths`): a mistyped local folder waited about a minute for the Hub and said
  "Check your internet connection" (or "Repo id must be in the form ..."); a URL said "Repo id must be in the form";
- JSON / JSON-lines data files (`trl_ext.data.files`): a torn or invalid line gave "An error occurred while generating
  the dataset" with no file or line, and non-UTF-8 bytes loaded, then failed inside pyarrow when the column was read.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import time

import pytest
from trl import ScriptArguments

import trl_ext.recipes
from trl_ext import cli
from trl_ext.data import files
from trl_ext.models.paths import check_model_path, is_model_path_field
from trl_ext.rollout.negdata import read_negative_data


def _recipe(name: str):
    return importlib.import_module(f"trl_ext.recipes.{name}")


# ------------------------------------------------------------------------------------------------ model paths
def test_a_typod_local_model_path_is_named_at_once(tmp_path, monkeypatch):
    """The input of issue 34: `outputs/<typo>` next to an existing `outputs/` folder looks like a Hub id ('org/name');
    it went to the Hub, retried ~50 s offline and said "Check your internet connection"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "sft-tiny").mkdir(parents=True)
    argv = ["--model_name_or_path", "outputs/sft-tny", "--reward_model_path", "outputs/sft-tiny",
            "--output_dir", str(tmp_path / "out")]  # fmt: skip
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"--model_name_or_path 'outputs/sft-tny': no such local folder .*"
                       r"did you mean 'outputs/sft-tiny'\?"):  # fmt: skip
        _recipe("ppo").make_parser().parse_args_and_config(argv)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    "path", ["/no/such/model", "./models/policy", "../models/policy", "~/no-such-folder-34/model", "a/b/c", "a\\b"]
)
def test_clearly_local_missing_paths_are_refused(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"--reward_model_path .*no such local folder"):
        check_model_path(path, "reward_model_path")


def test_hub_ids_and_existing_folders_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "policy").mkdir(parents=True)
    for path in ("gpt2", "EleutherAI/pythia-160m", "models/policy", "./models/policy", str(tmp_path), None):
        check_model_path(path, "model_name_or_path")


def test_a_url_as_reward_model_path_says_what_it_must_be():
    """`--reward_model_path http://...` gave huggingface_hub's "Repo id must be in the form"."""
    argv = ["--model_name_or_path", "gpt2", "--reward_model_path", "http://127.0.0.1:5000/get_reward",
            "--output_dir", "unused"]  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"--reward_model_path 'http://127.0.0.1:5000/get_reward' is a URL; it must "
        r"be a Hugging Face Hub model id .* or a local model folder\. .*serve-rm.*reward_model=",
    ):
        _recipe("harmlessness").make_parser().parse_args_and_config(argv)  # fmt: skip
    with pytest.raises(ValueError, match="--model_name_or_path 's3://bucket/model' is a URL"):
        check_model_path("s3://bucket/model", "model_name_or_path")


def test_batch_inference_still_takes_a_reward_server_url():
    argv = ["--model_name_or_path", "gpt2", "--reward_model_path", "http://127.0.0.1:5000/get_reward"]
    parsed = _recipe("batch_inference").make_parser().parse_args_and_config(argv)
    assert any(getattr(p, "reward_model_path", None) == "http://127.0.0.1:5000/get_reward" for p in parsed)


def _model_path_options():
    """(recipe, option) for every model path option of every recipe with a parser."""
    found = []
    for module in pkgutil.iter_modules(trl_ext.recipes.__path__):
        recipe = _recipe(module.name)
        if not hasattr(recipe, "make_parser"):
            continue
        for dataclass_type in recipe.make_parser().dataclass_types:
            found += [(module.name, f.name) for f in dataclasses.fields(dataclass_type) if is_model_path_field(f.name)]
    return found


# Options a recipe needs before it gets to the model paths (its own checks run while parsing).
_EXTRA = {
    "eval_heldout": ["--model_name_or_path", "gpt2", "--lexical_words", "bad", "--prompts_file", "prompts.txt"],
    "eval_negdata": ["--model_name_or_path", "gpt2", "--data_path", "x.jsonl"],
    **{name: ["--use_cpu", "true", "--bf16", "false"] for name in ("grpo_repulse", "kd", "prm", "reward", "sft")},
}


@pytest.mark.parametrize(("recipe", "option"), _model_path_options())
def test_every_model_path_option_of_every_recipe_is_checked(recipe, option, tmp_path):
    extra = _EXTRA.get(recipe, [])
    if (recipe, option) == ("eval_heldout", "reward_model_path"):  # a reward model instead of the word list
        extra = extra[:2] + extra[4:]
    argv = [*extra, f"--{option}", "./no/such/model"]
    fields = {f.name for t in _recipe(recipe).make_parser().dataclass_types for f in dataclasses.fields(t)}
    if "output_dir" in fields:
        argv += ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(FileNotFoundError, match=rf"--{option} './no/such/model': no such local folder"):
        _recipe(recipe).make_parser().parse_args_and_config(argv)


def test_the_options_found_cover_the_training_recipes():
    options = set(_model_path_options())
    expected = {("ppo", "model_name_or_path"), ("ppo", "sft_model_path"), ("ppo", "reward_model_path"),
                ("ppo", "value_model_path"), ("harmlessness", "proposal_model_path"), ("proposal", "ref_model_path"),
                ("dpo", "ref_model_name_or_path"), ("kd", "teacher_model_name_or_path"),
                ("merge_lora", "adapter_path"), ("serve_rm", "lora_path")}  # fmt: skip
    assert expected <= options


# ------------------------------------------------------------------------------------------------- data files
def _load(path):
    return cli.load_prompts(ScriptArguments(dataset_name=str(path)))


def test_a_torn_last_line_names_the_file_and_line(tmp_path):
    """Issue 34: a JSONL cut off mid-line gave "An error occurred while generating the dataset"."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n{"prompt": "tor')
    with pytest.raises(ValueError, match=r"prompts.jsonl: line 3: not valid JSON .*'\{\"prompt\": \"tor'; the file "
                       r"ends in the middle of this line"):  # fmt: skip
        _load(path)


def test_an_invalid_middle_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b",}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl: line 2: not valid JSON .*fix or remove this line"):
        _load(path)
    path.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(ValueError, match=r"line 2: a JSON list, not an object"):
        _load(path)


def test_non_utf8_bytes_name_the_line_and_byte_offset(tmp_path):
    """Issue 34: a Latin-1 line loaded, then failed with a UnicodeDecodeError from pyarrow when the column was read."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "hello"}\n' * 3 + '{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(
        ValueError, match=r"latin1.jsonl: line 4, byte offset 75: not UTF-8 .*re-save the file as UTF-8"
    ):
        _load(path)
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes('{"prompt": "hello"}\n'.encode("utf-16"))
    with pytest.raises(ValueError, match=r"line 1, byte offset 0: not UTF-8 .*UTF-16 byte-order mark"):
        _load(utf16)


def test_a_folder_of_data_files_is_checked_too(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"train.jsonl: line 2: not valid JSON"):
        _load(folder)


def test_utf8_check_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_CHUNK", 3)
    path = tmp_path / "x.jsonl"
    path.write_bytes("ab\né\nc\n".encode() + b"\n\xe9z\n")  # é is 2 bytes and spans a chunk boundary
    with pytest.raises(ValueError, match=r"line 5, byte offset 9"):
        files.check_utf8(str(path))
    path.write_bytes("ab\né\n".encode() + "\xe9".encode()[:1])  # ends inside a character
    with pytest.raises(ValueError, match=r"line 3, byte offset 6"):
        files.check_utf8(str(path))
    path.write_text("é" * 10 + "\n", encoding="utf-8")
    files.check_utf8(str(path))


def test_valid_files_load_as_before(tmp_path):
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert _load(lines)["train"]["prompt"] == ["a", "b"]
    document = tmp_path / "prompts.json"
    document.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=1))
    assert _load(document)["train"]["prompt"] == ["a", "b"]


def test_negative_data_files_get_the_same_errors(tmp_path):
    path = tmp_path / "negdata.jsonl"
    path.write_text('{"prompt": "p", "response": "r", "reward": -1, "step": 0, "source": "policy"}\n{"prompt": "p", ')
    with pytest.raises(ValueError, match=r"negdata.jsonl: line 2: not valid JSON"):
        read_negative_data(str(path))
