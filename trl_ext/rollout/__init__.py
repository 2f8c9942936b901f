"""The rollout layer: prompt data, sampling, reference log-probs, scoring and vision inputs, shared by the online
trainers (`trl_ext.trainers`), held-out evaluation and attacks (`trl_ext.eval`) and batch inference
(`trl_ext.inference`). It sits below all three and imports none of them.

- `generator`: `RolloutGenerator` (generate → log-probs → reference → reward), `generate_responses`,
  `SamplingSettings`, `Rollout`;
- `scoring`: `forward_response` (the log-probs, entropies and values of responses, as the losses read them),
  `causal_lm_outputs`, `PolicyOutput`;
- `probing`: what a model's forward accepts, through its wrappers (`supports_logits_to_keep`, `prefill_module`); the
  leaf every other rollout module may import;
- `sampling`: the inverse-CDF sampler that records the log-probs it sampled from;
- `shared_prefix`: each distinct prompt run once and its KV cache fanned out to its samples (generation, reference,
  critic and reward passes);
- `compiled_decode`: a compiled per-token decode step for `generate` on a static KV cache (`compile_generation`);
- `reward`: `RolloutReward` (a reward model on the token ids, or a reward function on the decoded texts);
- `reward_list`: `WeightedRewards`, a list of rewards summed with weights (GRPO's `reward_funcs`/`reward_weights`);
- `columns`: the dataset columns that reach reward functions as keyword lists (`solution`, ...);
- `reference`: `ReferencePolicy` (a separate model, or the policy with its adapters disabled);
- `finite`: the check of every rollout's rewards for NaN / ±inf (`nonfinite_rewards`: raise, or drop the samples)
  and for magnitudes beyond `max_abs_reward`;
- `context`: the check that prompts plus the new tokens fit the policy's context (trainers and batch inference);
- `data`: prompt datasets, the left-padding collator and the rollout sampler;
- `negdata`: reading and writing negative-data JSONL;
- `vision`: image inputs of vision-language policies.

Import these names from `trl_ext.rollout`; the modules' own names stay importable from them.
"""

from .data import PromptCollator, RolloutSampler, prepare_prompt_dataset
from .generator import (
    Rollout,
    RolloutGenerator,
    SamplingSettings,
    finish_responses,
    generate_responses,
    rollout_logprobs,
)
from .probing import prefill_module, supports_logits_to_keep
from .reference import ReferencePolicy
from .reward import RolloutReward
from .reward_list import WeightedRewards
from .scoring import PolicyOutput, causal_lm_outputs, forward_response

__all__ = [
    "PolicyOutput",
    "PromptCollator",
    "ReferencePolicy",
    "Rollout",
    "RolloutGenerator",
    "RolloutReward",
    "RolloutSampler",
    "SamplingSettings",
    "WeightedRewards",
    "causal_lm_outputs",
    "finish_responses",
    "forward_response",
    "generate_responses",
    "prefill_module",
    "prepare_prompt_dataset",
    "rollout_logprobs",
    "supports_logits_to_keep",
]
