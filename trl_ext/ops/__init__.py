"""Pure tensor operations shared by losses and trainers (masked statistics, KL estimators, log-probs, GAE, ...)."""

from .stats import masked_mean, masked_normalize, masked_std, masked_sum, masked_var, masked_whiten

__all__ = ["masked_mean", "masked_normalize", "masked_std", "masked_sum", "masked_var", "masked_whiten"]
