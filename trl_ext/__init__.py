"""trl_ext: extensions to Hugging Face TRL for RLHF research on reducing the probability of undesirable outputs."""

from importlib import import_module
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

try:
    import torch  # noqa: F401
except ModuleNotFoundError:  # a plain `pip install trl_ext` into an environment without PyTorch
    raise ModuleNotFoundError(
        "trl_ext needs PyTorch, which is not installed here: install the build for your machine first "
        "(https://pytorch.org/get-started/locally/, e.g. `pip install torch`), then `pip install trl_ext`."
    ) from None

from ._notices import install_notice_filters  # noqa: E402

install_notice_filters()  # before transformers/PEFT import bitsandbytes (see trl_ext/_notices.py)

from .losses import LossOutput, available_losses, get_loss, register_loss  # noqa: E402

try:
    __version__ = _version("trl_ext")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

# Names served lazily from submodules (importing transformers/peft only when first used).
_LAZY = {
    "AutoModelForCausalLMWithValueHead": "trl_ext.models",
    "ModulatedCausalLM": "trl_ext.models",
    "apply_lora": "trl_ext.models",
    "as_reward_function": "trl_ext.models",
    "load_critic": "trl_ext.models",
    "load_reward_model": "trl_ext.models",
    "CountUpdates": "trl_ext.trainers",
    "PPOConfig": "trl_ext.trainers",
    "PPOTrainer": "trl_ext.trainers",
    "HarmlessnessConfig": "trl_ext.trainers",
    "HarmlessnessTrainer": "trl_ext.trainers",
    "ProposalConfig": "trl_ext.trainers",
    "ProposalTrainer": "trl_ext.trainers",
    "RePULSeGRPOConfig": "trl_ext.trainers",
    "RePULSeGRPOTrainer": "trl_ext.trainers",
    "DPOConfig": "trl_ext.trainers",
    "DPOTrainer": "trl_ext.trainers",
    "KTOConfig": "trl_ext.trainers",
    "KTOTrainer": "trl_ext.trainers",
    "KDConfig": "trl_ext.trainers",
    "KDTrainer": "trl_ext.trainers",
    "PRMConfig": "trl_ext.trainers",
    "PRMTrainer": "trl_ext.trainers",
    "LexicalReward": "trl_ext.rewards",
    "RewardShaping": "trl_ext.rewards",
    "bad_output_probability": "trl_ext.eval",
    "eval_heldout": "trl_ext.eval",
    "plot_frontier": "trl_ext.eval",
    "plot_log_history": "trl_ext.trainers.common.run_summary",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["LossOutput", "__version__", "available_losses", "get_loss", "register_loss", *_LAZY]
