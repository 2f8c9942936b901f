"""``push_to_hub`` through the real upload path of `huggingface_hub`, against a mock Hub on 127.0.0.1.

`trl_ext.testing.mock_hub.MockHub` answers the endpoints `huggingface_hub` calls (repository creation, preupload,
NDJSON commit, repository info, file tree, downloads) and keeps the repositories in memory; `use_hub` points
`huggingface_hub` and `transformers` at it with a fake token (``HF_TOKEN``). Nothing is monkeypatched on the trainer
side: `Trainer.__init__` creates the repository, `save_model` writes the model card and `Trainer.push_to_hub`
uploads the output folder. What was uploaded is checked in the mock's store, through `huggingface_hub`'s own
`list_repo_files` / `model_info`, and by loading the pushed models back with ``from_pretrained``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError
from test_harmlessness_trainer import toy_args, toy_trainer
from test_ppo_trainer import make_trainer, ppo_args
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trl_ext.testing.mock_hub import MockHub, use_hub
from trl_ext.trainers.common.run_folder import RUN_LOCK_NAME

PPO_REPO = "user/tiny-ppo"


@pytest.fixture
def hub():
    """A running mock Hub, with `huggingface_hub` and `transformers` pointed at it (token: ``HF_TOKEN``)."""
    with MockHub(lifetime_s=120) as mock, use_hub(mock.url, token=mock.token):
        yield mock


def tiny_ppo(tmp_path, policy_dir, reward_dir, dataset, **kwargs):
    """A PPOTrainer that pushes to PPO_REPO: one update of 4 responses."""
    args = ppo_args(tmp_path, total_episodes=4, push_to_hub=True, hub_model_id=PPO_REPO, **kwargs)
    return make_trainer(args, policy_dir, reward_dir, dataset)


def card_tags(card: str) -> list[str]:
    """The ``tags:`` list of a model card's YAML metadata."""
    metadata = card.split("---")[1]
    block = metadata.split("tags:")[1]
    return [line.strip()[2:] for line in block.splitlines()[1:] if line.startswith(("- ", "  - "))]


# ------------------------------------------------------------------------------------------------------- PPO
def test_ppo_push_uploads_policy_value_model_and_card(
    hub, tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    """Train one update with push_to_hub=True, save: the repo is created (public) at construction, and the upload
    holds the policy, the critic in value_model/, the tokenizer and a model card with trl_ext's tags; both models
    load back from the Hub with the trained weights."""
    assert HfApi().whoami()["name"] == hub.user  # the fake token is the one sent
    trainer = tiny_ppo(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    assert hub.repo(PPO_REPO).private is False and set(hub.repo(PPO_REPO).files) == {".gitattributes"}
    trainer.train()
    trainer.save_model(trainer.args.output_dir)  # what the recipes do (`cli.train_and_save`)

    repo = hub.repo(PPO_REPO)
    files = set(HfApi().list_repo_files(PPO_REPO))
    assert files == set(repo.files)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "training_args.bin",
                 "value_model/model.safetensors", "value_model/config.json"):  # fmt: skip
        assert name in files, (name, sorted(files))
    assert not any(name.startswith("checkpoint-") for name in files)
    with open(f"{trainer.args.output_dir}/model.safetensors", "rb") as f:
        assert repo.files["model.safetensors"] == f.read()  # byte for byte what was saved

    card = repo.files["README.md"].decode()
    assert {"trl", "trl-ext", "ppo"} <= set(card_tags(card))
    assert PPO_REPO in card
    assert {"trl", "trl-ext", "ppo"} <= set(HfApi().model_info(PPO_REPO).tags)
    assert [c.message for c in repo.history] == ["initial commit", "Model save"]

    cache = tmp_path / "download_cache"
    policy = AutoModelForCausalLM.from_pretrained(PPO_REPO, cache_dir=cache)
    value = AutoModelForSequenceClassification.from_pretrained(PPO_REPO, subfolder="value_model", cache_dir=cache)
    for loaded, trained in ((policy, trainer.model.policy), (value, trainer.model.value_model)):
        expected = trained.state_dict()
        for name, tensor in loaded.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_private_repo(hub, tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    """hub_private_repo=True creates a private repository: the upload is there with the token, hidden without."""
    trainer = tiny_ppo(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, hub_private_repo=True)
    trainer.save_model()
    assert hub.repo(PPO_REPO).private is True
    assert HfApi().model_info(PPO_REPO).private is True
    assert "value_model/model.safetensors" in HfApi().list_repo_files(PPO_REPO)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=False).list_repo_files(PPO_REPO)


def test_hf_endpoint_environment_variable_reaches_the_mock(hub, tmp_path, tiny_gpt_neox_dir, tiny_reward_dir,
                                                            tiny_prompt_dataset):  # fmt: skip
    """A new process configured only by the environment (HF_ENDPOINT, HF_TOKEN) sees what a trainer pushed, with
    `hf_xet` disabled (the upload path of an install without it) as well as with it (the other tests)."""
    with use_hub(hub.url, token=hub.token, disable_xet=True):
        tiny_ppo(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset).save_model()
    code = f"from huggingface_hub import list_repo_files; print(sorted(list_repo_files({PPO_REPO!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "'model.safetensors'" in out.stdout and "'value_model/model.safetensors'" in out.stdout
    assert out.stdout.strip() == str(sorted(hub.repo(PPO_REPO).files))


def test_wrong_token_is_refused_before_training(hub, tmp_path, tiny_gpt_neox_dir, tiny_reward_dir,
                                               tiny_prompt_dataset, monkeypatch):  # fmt: skip
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HfHubHTTPError, match="401") as error:
        tiny_ppo(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    assert "Invalid credentials" in str(error.value)
    assert hub.repos == {}


# ------------------------------------------------------------------------------------------- the Hub unreachable
@pytest.mark.parametrize("outage", ["connection-refused", "offline-mode"])
def test_push_to_an_unreachable_hub_fails_clearly(hub, tmp_path, tiny_gpt_neox_dir, tiny_reward_dir,
                                                  tiny_prompt_dataset, outage):  # fmt: skip
    """The Hub goes away between the start of training and the final push: `save_model` still saves the model
    locally, then raises a ConnectionError that names the repository, the cause and how to upload later."""
    trainer = tiny_ppo(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    if outage == "connection-refused":
        hub.stop()
    else:
        constants.HF_HUB_OFFLINE = True  # restored by use_hub (the fixture)
    with pytest.raises(ConnectionError) as error:
        trainer.save_model()  # the upload's first request (the model card's metadata check) is not retried
    message = str(error.value)
    assert f"Could not push to the Hub repository '{PPO_REPO}'" in message
    assert f"hf upload {PPO_REPO} {trainer.args.output_dir}" in message
    assert ("HF_HUB_OFFLINE=1" if outage == "offline-mode" else "ConnectError") in message
    assert (tmp_path / "out" / "model.safetensors").is_file()  # the model is saved whatever happens to the push
    assert (tmp_path / "out" / "value_model" / "model.safetensors").is_file()
    assert set(hub.repo(PPO_REPO).files) == {".gitattributes"}  # nothing was uploaded


@pytest.mark.parametrize("outage", ["connection-refused", "offline-mode"])
def test_an_unreachable_hub_refuses_push_to_hub_at_construction(hub, tmp_path, tiny_gpt_neox_dir, tiny_reward_dir,
                                                                tiny_prompt_dataset, monkeypatch, outage):  # fmt: skip
    """With the Hub unreachable (or HF_HUB_OFFLINE=1, the test suite's default), a trainer with push_to_hub=True
    fails before training, when `Trainer` creates the repository, with a ConnectionError saying what to change."""
    if outage == "connection-refused":
        hub.stop()
    else:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError) as error:
        tiny_ppo(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    message = str(error.value)
    assert f"Could not create the Hub repository '{PPO_REPO}'" in message and "push_to_hub=False" in message
    cause = OfflineModeIsEnabled if outage == "offline-mode" else Exception
    assert isinstance(error.value.__cause__, cause)


# ------------------------------------------------------------------------------------------------ RePULSe
@pytest.mark.parametrize("push_proposal", [False, True])
def test_harmlessness_push_uploads_the_proposal_only_when_asked(hub, tmp_path, push_proposal):
    repo_id = f"user/tiny-repulse-{push_proposal}"
    args = toy_args(tmp_path, max_steps=1, push_to_hub=True, hub_model_id=repo_id, push_proposal_to_hub=push_proposal)
    trainer = toy_trainer(args)
    trainer.train()
    trainer.save_model(args.output_dir)
    files = set(HfApi().list_repo_files(repo_id))
    assert {"model.safetensors", "config.json", "README.md"} <= files
    assert ("proposal/model.safetensors" in files) is push_proposal
    assert any(name.startswith("proposal/") for name in files) is push_proposal
    assert {"trl-ext", "repulse", "harmlessness"} <= set(card_tags(hub.repo(repo_id).files["README.md"].decode()))
    assert (tmp_path / "out" / "proposal" / "model.safetensors").is_file()  # kept locally either way
    assert not any(p.name.startswith("_") and p.name != RUN_LOCK_NAME for p in (tmp_path / "out").iterdir())
