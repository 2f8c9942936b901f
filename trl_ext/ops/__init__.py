"""Pure tensor operations shared by losses and trainers (masked statistics, KL estimators, log-probs, GAE, ...)."""

from .advantages import (
    BASELINES,
    compute_baseline,
    discounted_returns,
    gae_advantages,
    importance_corrected_advantages,
    sequence_advantages,
)
from .importance import IS_MODES, vllm_importance_weights
from .kl import KL_ESTIMATORS, full_kl, kl_estimate, kl_k1, kl_k2, kl_k3
from .logprobs import (
    entropy_from_logits,
    full_logprobs,
    logprobs_from_hidden,
    logprobs_from_logits,
    modulated_logprobs,
)
from .packing import (
    cu_seqlens_from_lengths,
    lengths_from_cu_seqlens,
    pack_padded,
    pack_sequences,
    packed_position_ids,
    unpack_values,
)
from .rewards import TokenRewards, assemble_token_rewards, clamp_scores
from .sequences import (
    TruncatedResponses,
    extend_mask_past_last,
    first_true_index,
    group_rows,
    last_token_index,
    position_ids_from_attention_mask,
    response_mask_from_eos,
    truncate_after_stop_token,
)
from .stats import masked_mean, masked_normalize, masked_std, masked_sum, masked_var, masked_whiten

__all__ = [
    "IS_MODES",
    "vllm_importance_weights",
    "extend_mask_past_last",
    "group_rows",
    # stats
    "masked_mean",
    "masked_normalize",
    "masked_std",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    # kl
    "KL_ESTIMATORS",
    "full_kl",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    # logprobs
    "entropy_from_logits",
    "full_logprobs",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "modulated_logprobs",
    # rewards
    "TokenRewards",
    "assemble_token_rewards",
    "clamp_scores",
    # advantages
    "BASELINES",
    "compute_baseline",
    "discounted_returns",
    "gae_advantages",
    "importance_corrected_advantages",
    "sequence_advantages",
    # sequences
    "TruncatedResponses",
    "first_true_index",
    "last_token_index",
    "position_ids_from_attention_mask",
    "response_mask_from_eos",
    "truncate_after_stop_token",
    # packing
    "cu_seqlens_from_lengths",
    "lengths_from_cu_seqlens",
    "pack_padded",
    "pack_sequences",
    "packed_position_ids",
    "unpack_values",
]
