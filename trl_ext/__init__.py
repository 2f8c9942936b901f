"""trl_ext: extensions to Hugging Face TRL for RLHF research on reducing the probability of undesirable outputs."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .losses import LossOutput, available_losses, get_loss, register_loss

try:
    __version__ = _version("trl_ext")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

__all__ = ["LossOutput", "__version__", "available_losses", "get_loss", "register_loss"]
