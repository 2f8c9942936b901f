"""Shared pytest fixtures: the offline tiny-model kit (`trl_ext.testing`) built into the session's temp folder.

Fixtures (all offline, each build well under a second):

- `tiny_tokenizer`, `tiny_tokenizer_pad_eos`, `tiny_tokenizer_left`: a fresh tokenizer per test (the BPE training
  itself runs once per session), so a test may change padding side or special tokens freely.
- `tiny_models_root`, `tiny_model_dir_factory(arch, kind, pad_equals_eos)`: saved model folders, built once per
  session under pytest's temp folder (never in the user cache).
- `tiny_gpt_neox_dir`, `tiny_llama_dir`, `tiny_gpt2_dir`: causal LMs; `tiny_llama_pad_eos_dir`: Llama whose
  tokenizer has pad == eos; `tiny_gpt_neox_reward_dir`, `tiny_llama_reward_dir` (`tiny_reward_dir` is the
  GPT-NeoX one): `num_labels=1` sequence classifiers; `tiny_model_dirs`: dict of the five main folders.
- `tiny_prompt_dataset`, `tiny_conversational_prompt_dataset`, `tiny_preference_dataset`,
  `tiny_conversational_preference_dataset`, `tiny_unpaired_preference_dataset`, `tiny_prompt_completion_dataset`,
  `tiny_harmful_prompt_dataset`: small `datasets.Dataset`s (immutable, shared by the session).
- `tiny_workdir`: a scratch folder after `python examples/build_tiny_inputs.py` (the recipes' example inputs).

Tests live in one folder per layer of the package (ops, losses, models, rewards, data, rollout, sampling,
trainers/<algorithm>, eval, serving, recipes, study, package); the helpers shared across them stay here.

Every test also starts from seed 0 (`random`, `numpy`, `torch`), torch uses one thread (`TRL_EXT_TEST_THREADS`
changes it), the Hugging Face libraries are told to stay offline, and the kit's default cache
(`TRL_EXT_TINY_CACHE`) points at the session temp folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The tests are grouped by layer (tests/ops, tests/rollout, tests/trainers/ppo, ...) and share helpers by module name
# (`from test_ppo_trainer import make_trainer`, `online_helpers`), so tests/ and each of its test folders are
# importable whichever file pytest collects first.
_TESTS = Path(__file__).resolve().parent
for _folder in [_TESTS, *sorted({p.parent for p in _TESTS.rglob("test_*.py")})]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Before any Hugging Face import: never reach the network, keep logs quiet.
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
}.items():
    os.environ.setdefault(_name, _value)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from trl_ext import testing as kit  # noqa: E402

# One intra-op thread by default: on this 2-core shared machine a tiny-model training step took ~15 ms with one
# thread but 13 ms to 1.1 s with two whenever another process was busy (OpenMP threads waiting on each other).
# Set TRL_EXT_TEST_THREADS=2 (or more) for tests of larger models on an idle machine.
torch.set_num_threads(max(1, int(os.environ.get("TRL_EXT_TEST_THREADS", "1"))))


@pytest.fixture(autouse=True)
def _seed_everything():
    """Start every test from the same random state, whatever ran before it."""
    random.seed(0)
    torch.manual_seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover - numpy ships with torch/datasets
        pass
    yield


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory):
    """Session temp folder that holds the saved tiny models."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session", autouse=True)
def _hermetic_tiny_cache(tiny_models_root):
    """Point the kit's default cache at the session temp folder, so no test writes to the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kit.CACHE_ENV_VAR, str(tiny_models_root))
        yield


# ----------------------------------------------------------------------------------------------------- tokenizers
@pytest.fixture
def tiny_tokenizer():
    """Tiny tokenizer with distinct pad / eos / bos tokens, right padding."""
    return kit.build_tokenizer()


@pytest.fixture
def tiny_tokenizer_pad_eos():
    """Tiny tokenizer whose pad token is the eos token."""
    return kit.build_tokenizer(pad_equals_eos=True)


@pytest.fixture
def tiny_tokenizer_left():
    """Tiny tokenizer with left padding (for generation)."""
    return kit.build_tokenizer(padding_side="left")


# ----------------------------------------------------------------------------------------------------- model dirs
@pytest.fixture(scope="session")
def tiny_model_dir_factory(tiny_models_root):
    """`factory(arch="gpt_neox", kind="causal_lm", pad_equals_eos=False) -> str`, cached for the session."""

    def factory(arch: str = "gpt_neox", kind: str = "causal_lm", pad_equals_eos: bool = False) -> str:
        return kit.tiny_model_dir(arch, kind, root=tiny_models_root, pad_equals_eos=pad_equals_eos)

    return factory


@pytest.fixture(scope="session")
def tiny_gpt_neox_dir(tiny_model_dir_factory):
    """Saved tiny `GPTNeoXForCausalLM` + tokenizer."""
    return tiny_model_dir_factory("gpt_neox")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir_factory):
    """Saved tiny `LlamaForCausalLM` + tokenizer."""
    return tiny_model_dir_factory("llama")


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tiny_model_dir_factory):
    """Saved tiny `GPT2LMHeadModel` + tokenizer."""
    return tiny_model_dir_factory("gpt2")


@pytest.fixture(scope="session")
def tiny_llama_pad_eos_dir(tiny_model_dir_factory):
    """Saved tiny `LlamaForCausalLM` + the tokenizer variant with pad == eos."""
    return tiny_model_dir_factory("llama", pad_equals_eos=True)


@pytest.fixture(scope="session")
def tiny_gpt_neox_reward_dir(tiny_model_dir_factory):
    """Saved tiny `GPTNeoXForSequenceClassification` (`num_labels=1`) + tokenizer."""
    return tiny_model_dir_factory("gpt_neox", "seq_cls")


@pytest.fixture(scope="session")
def tiny_llama_reward_dir(tiny_model_dir_factory):
    """Saved tiny `LlamaForSequenceClassification` (`num_labels=1`) + tokenizer."""
    return tiny_model_dir_factory("llama", "seq_cls")


@pytest.fixture(scope="session")
def tiny_reward_dir(tiny_gpt_neox_reward_dir):
    """The default tiny reward model folder (GPT-NeoX backbone)."""
    return tiny_gpt_neox_reward_dir


@pytest.fixture(scope="session")
def tiny_model_dirs(
    tiny_gpt_neox_dir, tiny_llama_dir, tiny_gpt2_dir, tiny_gpt_neox_reward_dir, tiny_llama_reward_dir
) -> dict[str, str]:
    """The five main tiny model folders by name: three causal LMs and two reward models."""
    return {
        "gpt_neox": tiny_gpt_neox_dir,
        "llama": tiny_llama_dir,
        "gpt2": tiny_gpt2_dir,
        "gpt_neox_reward": tiny_gpt_neox_reward_dir,
        "llama_reward": tiny_llama_reward_dir,
    }


# ------------------------------------------------------------------------------------------------------- datasets
@pytest.fixture(scope="session")
def tiny_prompt_dataset():
    """32 plain-text prompts (`prompt`)."""
    return kit.prompt_dataset()


@pytest.fixture(scope="session")
def tiny_conversational_prompt_dataset():
    """32 prompts as one-message user conversations (`prompt`)."""
    return kit.prompt_dataset(conversational=True)


@pytest.fixture(scope="session")
def tiny_preference_dataset():
    """32 plain-text preference rows (`prompt`, `chosen`, `rejected`)."""
    return kit.preference_dataset()


@pytest.fixture(scope="session")
def tiny_conversational_preference_dataset():
    """32 conversational preference rows (`prompt`, `chosen`, `rejected`)."""
    return kit.preference_dataset(conversational=True)


@pytest.fixture(scope="session")
def tiny_unpaired_preference_dataset():
    """32 plain-text KTO rows (`prompt`, `completion`, `label`)."""
    return kit.unpaired_preference_dataset()


@pytest.fixture(scope="session")
def tiny_prompt_completion_dataset():
    """32 plain-text SFT rows (`prompt`, `completion`)."""
    return kit.prompt_completion_dataset()


@pytest.fixture(scope="session")
def tiny_harmful_prompt_dataset():
    """16 copies of the toy harmful prompt "This man is a" (`prompt`)."""
    return kit.harmful_prompt_dataset()


# ------------------------------------------------------------------------------------------------------- recipes
@pytest.fixture
def tiny_workdir(tmp_path):
    """A scratch working folder after `python examples/build_tiny_inputs.py` (inputs in outputs/tiny/), the inputs of
    the example YAMLs of the recipes."""
    from online_helpers import build_tiny_inputs

    return build_tiny_inputs(tmp_path)
