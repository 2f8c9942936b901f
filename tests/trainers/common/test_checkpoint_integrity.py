"""Checkpoints verify themselves: `trl_ext_manifest.json` (size and SHA-256 of every file, written last) is checked
before a run resumes, damaged files are named, a missing RNG state is an error unless ``allow_rng_reset``.

The PPO runs are tiny (2 optimizer steps, a checkpoint after each); the run is made once per module and copied into
each test's folder before it is damaged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pytest
from online_helpers import RECIPES, assert_help_lists
from test_dpo_trainer import _args as dpo_args
from test_dpo_trainer import _perturbed_llama
from test_ppo_trainer import make_trainer, ppo_args
from transformers import HfArgumentParser

from trl_ext import PPOConfig
from trl_ext.trainers.common.manifest import (
    MANIFEST_NAME,
    CheckpointIntegrityError,
    check_rng_states,
    verify_manifest,
    write_manifest,
)
from trl_ext.trainers.common.resume import ResumeConfigMixin, resolve_resume_checkpoint
from trl_ext.trainers.preference.dpo import DPOTrainer

CKPT_LOGGER = "trl_ext.trainers.common"


def _files(folder) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder).replace(os.sep, "/")] = open(path, "rb").read()
    return out


def _scramble(path) -> None:
    """Same size, other bytes (the probe: random bytes written over a weight file)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(os.urandom(size))


def _truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


# ---------------------------------------------------------------------------------------- manifest functions
def test_manifest_round_trip_and_what_verify_reports(tmp_path):
    folder = tmp_path / "checkpoint-3"
    (folder / "global_step3").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 3000)
    (folder / "global_step3" / "shard.pt").write_bytes(b"s" * 10)
    (folder / "rng_state.pth").write_bytes(b"r" * 5)
    write_manifest(str(folder), 3)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["version"] == 1 and manifest["global_step"] == 3
    assert [e["path"] for e in manifest["files"]] == ["global_step3/shard.pt", "model.safetensors", "rng_state.pth"]
    assert not [p for p in os.listdir(folder) if ".tmp" in p]  # written atomically, nothing left behind
    assert verify_manifest(str(folder)) is True
    (folder / "extra.txt").write_text("added later")  # files that are not listed are ignored
    assert verify_manifest(str(folder)) is True

    (folder / "model.safetensors").write_bytes(b"x" * 3000)  # same size, other content
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors: sha256 .*same size, different content"):
        verify_manifest(str(folder))
    (folder / "model.safetensors").write_bytes(b"w" * 3000)
    (folder / "global_step3" / "shard.pt").write_bytes(b"s" * 4)
    with pytest.raises(CheckpointIntegrityError, match=r"global_step3/shard\.pt: 4 bytes, expected 10"):
        verify_manifest(str(folder))
    (folder / "global_step3" / "shard.pt").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"global_step3/shard\.pt: missing"):
        verify_manifest(str(folder))
    (folder / "global_step3" / "shard.pt").write_bytes(b"s" * 10)
    (folder / "rng_state.pth").unlink()  # a missing RNG state is check_rng_states' business (allow_rng_reset)
    assert verify_manifest(str(folder)) is True
    (folder / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointIntegrityError, match="damaged"):
        verify_manifest(str(folder))
    (folder / MANIFEST_NAME).unlink()
    assert verify_manifest(str(folder)) is False  # no manifest: nothing to check


def test_check_rng_states(tmp_path, caplog):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    with pytest.raises(CheckpointIntegrityError, match=r"no rng_state\.pth.*allow_rng_reset=True"):
        check_rng_states(str(folder), world_size=1)
    with caplog.at_level(logging.WARNING, logger=CKPT_LOGGER):
        assert check_rng_states(str(folder), world_size=1, allow_rng_reset=True) is False
    assert "fresh RNG states" in caplog.text
    (folder / "rng_state.pth").write_bytes(b"r")
    assert check_rng_states(str(folder), world_size=1) is True
    with pytest.raises(CheckpointIntegrityError, match=r"rng_state_0\.pth, rng_state_1\.pth.*another number of"):
        check_rng_states(str(folder), world_size=2)
    (folder / "rng_state.pth").unlink()
    (folder / "rng_state_0.pth").write_bytes(b"r")
    with pytest.raises(CheckpointIntegrityError, match=r"no rng_state_1\.pth.*holds only rng_state_0\.pth"):
        check_rng_states(str(folder), world_size=2)


def test_resolve_prefers_verified_checkpoints_and_accepts_manifestless_ones_with_a_warning(tmp_path, caplog):
    out = tmp_path / "out"
    for step in (1, 2, 3):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(bytes([step]) * 100)
    # Older trl_ext / plain TRL: no manifest anywhere -> the newest complete one, with a warning.
    with caplog.at_level(logging.WARNING, logger=CKPT_LOGGER):
        assert resolve_resume_checkpoint(True, str(out)) == str(out / "checkpoint-3")
    assert f"has no {MANIFEST_NAME}" in caplog.text
    for step in (1, 2):
        write_manifest(str(out / f"checkpoint-{step}"), step)
    # checkpoint-3 has none while the others do: its save was interrupted before the manifest -> skipped.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=CKPT_LOGGER):
        assert resolve_resume_checkpoint(True, str(out)) == str(out / "checkpoint-2")
    assert "Skipping" in caplog.text and "checkpoint-3" in caplog.text
    assert resolve_resume_checkpoint(str(out / "checkpoint-3"), str(out)) == str(out / "checkpoint-3")  # explicit
    _scramble(out / "checkpoint-2" / "model.safetensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=CKPT_LOGGER):
        assert resolve_resume_checkpoint(True, str(out)) == str(out / "checkpoint-1")
    assert "checkpoint-2" in caplog.text and "model.safetensors" in caplog.text
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors.*checkpoint-1, checkpoint-3"):
        resolve_resume_checkpoint(str(out / "checkpoint-2"), str(out))  # names the others to resume from
    _truncate(out / "checkpoint-1" / "model.safetensors")
    shutil.rmtree(out / "checkpoint-3")
    with pytest.raises(ValueError, match=r"No complete checkpoint.*checkpoint-2 .*checkpoint-1 .*bytes, expected"):
        resolve_resume_checkpoint(True, str(out))


def test_allow_rng_reset_is_an_option_of_every_config_and_of_the_recipes():
    from trl_ext import HarmlessnessConfig, ProposalConfig
    from trl_ext.trainers.kd import KDConfig
    from trl_ext.trainers.preference.dpo import DPOConfig
    from trl_ext.trainers.preference.kto import KTOConfig
    from trl_ext.trainers.prm import PRMConfig

    for config in (PPOConfig, ProposalConfig, HarmlessnessConfig, DPOConfig, KTOConfig, KDConfig, PRMConfig):
        assert issubclass(config, ResumeConfigMixin), config.__name__
        assert config.__dataclass_fields__["allow_rng_reset"].default is False
        assert "    allow_rng_reset (`bool`" in config.__doc__, config.__name__
        assert "--allow_rng_reset" in HfArgumentParser(config).format_help()
    assert_help_lists(RECIPES / "ppo.py", ("--allow_rng_reset",))


# ---------------------------------------------------------------------------------------------- PPO runs
@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    """Output folder of a 2-step PPO run (separate critic) with checkpoint-1 and checkpoint-2."""
    root = tmp_path_factory.mktemp("ppo_run")
    trainer = make_trainer(ppo_args(root, save_strategy="steps", save_steps=1), tiny_gpt_neox_dir, tiny_reward_dir,
                           tiny_prompt_dataset)  # fmt: skip
    trainer.train()
    return root / "out"


@pytest.fixture
def run_copy(ppo_run, tmp_path):
    """A fresh copy of the PPO run in ``tmp_path/out`` (the output folder of `ppo_args(tmp_path)`)."""
    shutil.copytree(ppo_run, tmp_path / "out")
    return tmp_path / "out"


@pytest.fixture
def resume_trainer(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    def build(**config):
        args = ppo_args(tmp_path, save_strategy="no", **config)
        return make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)

    return build


def test_every_checkpoint_gets_a_manifest_of_all_its_files(ppo_run):
    for step in (1, 2):
        folder = ppo_run / f"checkpoint-{step}"
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = _files(folder)
        del files[MANIFEST_NAME]
        assert manifest["global_step"] == step
        assert {e["path"] for e in manifest["files"]} == files.keys()
        assert {"model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json",
                "value_model/model.safetensors"} <= files.keys()  # fmt: skip
        for entry in manifest["files"]:
            content = files[entry["path"]]
            assert entry["size"] == len(content) and entry["sha256"] == hashlib.sha256(content).hexdigest()


def test_random_bytes_in_the_weights_are_refused_naming_the_file(run_copy, resume_trainer):
    _scramble(run_copy / "checkpoint-1" / "model.safetensors")
    trainer = resume_trainer()
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors: sha256 .*checkpoint-2"):
        trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    assert trainer.state.global_step == 0


def test_a_truncated_optimizer_state_is_refused_naming_the_file(run_copy, resume_trainer):
    _truncate(run_copy / "checkpoint-1" / "optimizer.pt")
    with pytest.raises(CheckpointIntegrityError, match=r"optimizer\.pt: \d+ bytes, expected \d+"):
        resume_trainer().train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))


def test_without_a_manifest_load_errors_still_name_the_file(run_copy, resume_trainer):
    """A checkpoint from an older trl_ext (no manifest): the loaders name the file they fail on."""
    folder = run_copy / "checkpoint-1"
    (folder / MANIFEST_NAME).unlink()
    _truncate(folder / "value_model" / "model.safetensors")
    with pytest.raises(CheckpointIntegrityError, match=r"value_model/model\.safetensors"):
        resume_trainer().train(resume_from_checkpoint=str(folder))
    shutil.copy(run_copy / "checkpoint-2" / "value_model" / "model.safetensors", folder / "value_model")
    _truncate(folder / "optimizer.pt")
    with pytest.raises(CheckpointIntegrityError, match=r"checkpoint-1/optimizer\.pt: RuntimeError"):
        resume_trainer().train(resume_from_checkpoint=str(folder))


def test_a_missing_rng_state_is_an_error_unless_allow_rng_reset(run_copy, resume_trainer, caplog):
    os.remove(run_copy / "checkpoint-1" / "rng_state.pth")
    with pytest.raises(CheckpointIntegrityError, match="allow_rng_reset"):
        resume_trainer().train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    trainer = resume_trainer(allow_rng_reset=True)
    with caplog.at_level(logging.WARNING, logger=CKPT_LOGGER):
        trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    assert trainer.state.global_step == 2
    assert "fresh RNG states" in caplog.text


def test_resume_true_skips_a_corrupted_newest_checkpoint(run_copy, resume_trainer, caplog):
    _scramble(run_copy / "checkpoint-2" / "model.safetensors")
    trainer = resume_trainer()
    with caplog.at_level(logging.WARNING, logger=CKPT_LOGGER):
        trainer.train(resume_from_checkpoint=True)
    assert "Skipping" in caplog.text and "checkpoint-2" in caplog.text and "model.safetensors" in caplog.text
    assert trainer.state.global_step == 2 and len([h for h in trainer.state.log_history if "loss" in h]) == 2


def test_a_checkpoint_without_manifest_resumes_with_a_warning(run_copy, resume_trainer, caplog):
    for step in (1, 2):
        os.remove(run_copy / f"checkpoint-{step}" / MANIFEST_NAME)
    trainer = resume_trainer()
    with caplog.at_level(logging.WARNING, logger=CKPT_LOGGER):
        trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    assert trainer.state.global_step == 2
    assert f"has no {MANIFEST_NAME}" in caplog.text


# ---------------------------------------------------------------------------------------------------- DPO
def test_dpo_checkpoints_get_a_manifest_and_are_verified_on_resume(tiny_tokenizer, tiny_preference_dataset, tmp_path):
    def trainer(out, **kwargs):
        model, reference = _perturbed_llama(tiny_tokenizer)
        args = dpo_args(out, **kwargs)
        return DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=tiny_preference_dataset,
                          processing_class=tiny_tokenizer)  # fmt: skip

    trainer(tmp_path / "run", save_strategy="steps", save_steps=1).train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert verify_manifest(str(checkpoint)) is True
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
    _scramble(checkpoint / "model.safetensors")
    with pytest.raises(CheckpointIntegrityError, match=r"model\.safetensors: sha256"):
        trainer(tmp_path / "again").train(resume_from_checkpoint=str(checkpoint))
