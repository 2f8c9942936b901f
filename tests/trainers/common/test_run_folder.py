"""One run per output folder (issue 34): a fresh run refuses another run's checkpoints unless told to overwrite, a
second process on the same folder fails at once naming the holder's PID, a checkpoint from another trainer or with
other settings is refused naming what differs, a checkpoint without a manifest has its weights checked for NaN, a
full disk names the folder, and a killed save's temporary folders are removed.

Each test uses the input that found the defect; the PPO runs are tiny (2 optimizer steps, a checkpoint after each).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dpo_trainer import _args as dpo_args
from test_dpo_trainer import _perturbed_llama
from test_ppo_trainer import make_trainer, ppo_args

from trl_ext.trainers.common.manifest import MANIFEST_NAME, CheckpointIntegrityError
from trl_ext.trainers.common.run_folder import (
    RUN_LOCK_NAME,
    DiskFullError,
    OutputDirInUseError,
    lock_output_dir,
    remove_stale_stages,
)
from trl_ext.trainers.common.run_record import RUN_RECORD_NAME, check_run_record
from trl_ext.trainers.preference.dpo import DPOTrainer
from trl_ext.trainers.proposal import ProposalTrainer

LOGGER = "trl_ext.trainers.common"


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    """Output folder of a 2-step PPO run with checkpoint-1 and checkpoint-2."""
    root = tmp_path_factory.mktemp("ppo_run")
    trainer = make_trainer(ppo_args(root, save_strategy="steps", save_steps=1), tiny_gpt_neox_dir, tiny_reward_dir,
                           tiny_prompt_dataset)  # fmt: skip
    trainer.train()
    del trainer
    return root / "out"


@pytest.fixture
def run_copy(ppo_run, tmp_path):
    shutil.copytree(ppo_run, tmp_path / "out", ignore=shutil.ignore_patterns(RUN_LOCK_NAME))
    return tmp_path / "out"


@pytest.fixture
def ppo(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    def build(**config):
        return make_trainer(ppo_args(tmp_path, **config), tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)

    return build


# ------------------------------------------------------------------------------- 1. an old run's output_dir
def test_a_fresh_run_refuses_an_output_dir_with_another_runs_checkpoints(run_copy, ppo):
    """Before: the new run overwrote checkpoint-1 and kept the old checkpoint-2, which `--resume_from_checkpoint
    last` then resumed, training nothing."""
    before = (run_copy / "checkpoint-2" / "model.safetensors").read_bytes()
    trainer = ppo(total_episodes=4, save_strategy="steps", save_steps=1)
    with pytest.raises(FileExistsError, match=r"checkpoint-1, checkpoint-2.*--overwrite_output_dir true"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert (run_copy / "checkpoint-2" / "model.safetensors").read_bytes() == before


def test_overwrite_output_dir_deletes_the_old_checkpoints_first(run_copy, ppo, caplog):
    trainer = ppo(total_episodes=4, save_strategy="steps", save_steps=1, overwrite_output_dir=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train()
    assert "deleting the checkpoints of an earlier run" in caplog.text
    assert sorted(p.name for p in run_copy.glob("checkpoint-*")) == ["checkpoint-1"]  # the old checkpoint-2 is gone
    assert trainer.state.global_step == 1


def test_resuming_the_last_step_of_a_finished_run_warns_that_nothing_trains(run_copy, ppo, caplog):
    trainer = ppo()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train(resume_from_checkpoint=True)
    assert "step 2 of 2" in caplog.text and "trains nothing" in caplog.text


# -------------------------------------------------------------------------------- 2. two runs at once
_HOLDER = textwrap.dedent("""
    import sys, time
    from trl_ext.trainers.common.run_folder import lock_output_dir
    lock_output_dir(sys.argv[1])
    print("locked", flush=True)
    time.sleep(120)
""")


def test_a_second_run_on_the_same_output_dir_fails_at_once_naming_the_holder(tmp_path, ppo):
    """Before: both runs exited 0 and printed "policy saved"; one run's work was silently gone."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        trainer = ppo()
        with pytest.raises(OutputDirInUseError, match=rf"in use by another run \(PID {holder.pid} on "):
            trainer.train()
        assert trainer.state.global_step == 0
    finally:
        holder.kill()  # SIGKILL: the process cannot clean up, the OS drops its lock
        holder.wait()
    assert (tmp_path / "out" / RUN_LOCK_NAME).exists()  # a stale lock file ...
    ppo().train()  # ... blocks nobody


def test_trainers_of_one_process_share_the_lock_and_release_it_when_collected(tmp_path):
    folder = str(tmp_path / "out")

    class Owner:
        pass

    first, second = Owner(), Owner()
    lock_output_dir(folder, owner=first)
    lock_output_dir(folder, owner=second)  # same process: shared
    probe = [sys.executable, "-c", "import sys; from trl_ext.trainers.common.run_folder import lock_output_dir; "
             "lock_output_dir(sys.argv[1])", folder]  # fmt: skip
    assert subprocess.run(probe, capture_output=True).returncode != 0
    del first
    assert subprocess.run(probe, capture_output=True).returncode != 0  # `second` still holds it
    del second
    assert subprocess.run(probe, capture_output=True).returncode == 0


# ------------------------------------------------------------------ resume: another config, another trainer
def test_resuming_with_other_settings_names_them_unless_allowed(run_copy, ppo, caplog):
    record = (run_copy / "checkpoint-1" / RUN_RECORD_NAME).read_text()
    assert '"trainer": "PPOTrainer"' in record
    with pytest.raises(
        ValueError, match=r"learning_rate: 0\.001 -> 0\.002; num_ppo_epochs: 1 -> 2.*allow_config_change"
    ):
        ppo(learning_rate=2e-3, num_ppo_epochs=2).train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    # where to write, logging and saving may change: no error
    ppo(logging_steps=5, save_strategy="steps", save_steps=7).train(
        resume_from_checkpoint=str(run_copy / "checkpoint-1")
    )
    trainer = ppo(learning_rate=2e-3, allow_config_change=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))
    assert "learning_rate: 0.001 -> 0.002" in caplog.text and trainer.state.global_step == 2


def test_dpo_resuming_a_ppo_checkpoint_names_both_trainers(
    run_copy, tiny_tokenizer, tiny_preference_dataset, tmp_path
):
    """Before: "Could not load ... If the file is damaged (truncated or overwritten), resume from an earlier one"."""
    model, reference = _perturbed_llama(tiny_tokenizer)
    trainer = DPOTrainer(model=model, ref_model=reference, args=dpo_args(tmp_path / "dpo"),
                         train_dataset=tiny_preference_dataset, processing_class=tiny_tokenizer)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"written by PPOTrainer \(PPOConfig\), not by a DPOTrainer: its files are intact"
    ):
        trainer.train(resume_from_checkpoint=str(run_copy / "checkpoint-1"))


def test_the_proposal_trainer_refuses_a_ppo_checkpoint(run_copy):
    proposal = object.__new__(ProposalTrainer)  # the check reads only the trainer's class
    with pytest.raises(ValueError, match="written by PPOTrainer .* not by a ProposalTrainer"):
        check_run_record(str(run_copy / "checkpoint-1"), proposal, args=None)


# ----------------------------------------------------------------------------- 6. a NaN manifest-less checkpoint
def test_a_checkpoint_without_manifest_whose_weights_are_nan_is_refused(run_copy, ppo):
    """Before: it resumed after a warning, every step was skipped, and the run ended in "Training diverged"."""
    folder = run_copy / "checkpoint-1"
    (folder / MANIFEST_NAME).unlink()
    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    trainer = ppo()
    with pytest.raises(CheckpointIntegrityError, match=rf"NaN or inf \(model\.safetensors: {name}\)"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.state.global_step == 0


# ------------------------------------------------------------------------------------------------ disk full
def test_a_full_disk_while_saving_a_checkpoint_names_the_folder(tmp_path, ppo, monkeypatch):
    """Before: "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"."""
    trainer = ppo(save_strategy="steps", save_steps=1)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        DiskFullError, match=r"out: a write failed, most likely because the disk is full \(\d+ MiB free"
    ):
        trainer.train()
    assert not (tmp_path / "out" / "checkpoint-1").exists()  # the partial checkpoint is removed


def test_a_full_disk_in_the_final_save_names_the_folder(tmp_path, ppo, monkeypatch):
    trainer = ppo()
    trainer.train()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.nn.Module, "state_dict", full_disk)
    with pytest.raises(DiskFullError, match="disk is full"):
        trainer.save_model(str(tmp_path / "final"))


# ------------------------------------------------------------------------------- temporary folders of saves
def test_a_killed_saves_temporary_folders_are_removed(tmp_path, ppo):
    """Before: hidden `.ppo-save-*` folders were left in output_dir after a kill."""
    out = tmp_path / "out"
    out.mkdir()
    killed = ("import os, sys, tempfile; from trl_ext.trainers.common.run_folder import stage_prefix; "
              "tempfile.mkdtemp(prefix=stage_prefix('ppo'), dir=sys.argv[1]); os._exit(9)")  # fmt: skip
    subprocess.run([sys.executable, "-c", killed, str(out)], check=False)
    (out / ".ppo-save-k2j4x8q1").mkdir()  # an older trl_ext's stage (no PID)
    (out / f"value_model.trl-ext-old-{os.getpid()}").mkdir()  # a live process's swap: kept
    assert len(list(out.glob(".ppo-save-*"))) == 2
    trainer = ppo()
    trainer.train()
    trainer.save_model()
    assert not list(out.glob(".ppo-save-*"))
    assert (out / f"value_model.trl-ext-old-{os.getpid()}").exists()
    (out / f"value_model.trl-ext-old-{os.getpid()}").rmdir()
    assert remove_stale_stages(str(out)) == []
