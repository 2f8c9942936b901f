"""Models: shared actor-critic (value head), modulated policies, reward/critic loading, LoRA and 4-bit loading.

See docs/models.md for a runnable example of each.
"""

from .critic import default_value_head_std, get_token_values, init_value_head, load_critic
from .lora import (
    adapters_disabled,
    apply_lora,
    build_lora_config,
    count_parameters,
    find_lora_target_modules,
    find_trainable_heads,
    is_peft_model,
    reference_is_base_with_adapters_disabled,
)
from .modulated import MODULATION_KINDS, ModulatedCausalLM, ModulatedConfig, build_modulation_head
from .offload import check_offloadable, module_device, on_device
from .quantization import (
    bnb_4bit_config,
    bnb_8bit_config,
    is_bitsandbytes_available,
    is_quantized,
    keep_4bit_layers_trainable,
    load_causal_lm,
    load_model,
    load_sequence_classifier,
    resolve_dtype,
)
from .reward import (
    ValueHeadRewardModel,
    apply_reward_normalization,
    clear_reward_normalization,
    get_reward_normalization,
    get_sequence_scores,
    get_token_scores,
    load_reward_model,
    set_reward_normalization,
)
from .reward_functions import (
    CallableReward,
    ModelReward,
    RemoteReward,
    RemoteRewardError,
    RewardFunction,
    TwoTokenizerReward,
    as_reward_function,
    chat_template_markers,
    decode_token_ids,
)
from .twist import TWIST_PARAMETERIZATIONS, psi_modulation, psi_q_p_s_1_to_t, psi_q_p_s_t, psi_unnorm, twist_values
from .value_head import AutoModelForCausalLMWithValueHead, CausalLMWithValueHeadConfig, prepare_value_head_for_peft

__all__ = [
    "MODULATION_KINDS",
    "TWIST_PARAMETERIZATIONS",
    "AutoModelForCausalLMWithValueHead",
    "CallableReward",
    "CausalLMWithValueHeadConfig",
    "ModelReward",
    "ModulatedCausalLM",
    "ModulatedConfig",
    "RemoteReward",
    "RemoteRewardError",
    "RewardFunction",
    "TwoTokenizerReward",
    "ValueHeadRewardModel",
    "adapters_disabled",
    "apply_lora",
    "apply_reward_normalization",
    "as_reward_function",
    "bnb_4bit_config",
    "bnb_8bit_config",
    "build_lora_config",
    "build_modulation_head",
    "check_offloadable",
    "chat_template_markers",
    "clear_reward_normalization",
    "count_parameters",
    "decode_token_ids",
    "default_value_head_std",
    "find_lora_target_modules",
    "find_trainable_heads",
    "get_reward_normalization",
    "get_sequence_scores",
    "get_token_scores",
    "get_token_values",
    "init_value_head",
    "is_bitsandbytes_available",
    "is_peft_model",
    "is_quantized",
    "keep_4bit_layers_trainable",
    "load_causal_lm",
    "load_critic",
    "load_model",
    "load_reward_model",
    "load_sequence_classifier",
    "module_device",
    "on_device",
    "prepare_value_head_for_peft",
    "psi_modulation",
    "psi_q_p_s_1_to_t",
    "psi_q_p_s_t",
    "psi_unnorm",
    "reference_is_base_with_adapters_disabled",
    "resolve_dtype",
    "set_reward_normalization",
    "twist_values",
]
