"""The rollout layer: prompt data, sampling, reference log-probs, scoring and vision inputs, shared by the online
trainers (`trl_ext.trainers`), held-out evaluation and attacks (`trl_ext.eval`) and batch inference
(`trl_ext.inference`). It sits below all three and imports none of them.

- `generator`: `RolloutGenerator` (generate → log-probs → reference → reward), `generate_responses`,
  `forward_response`, `RolloutReward`, `SamplingSettings`;
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
"""

from .data import PromptCollator, RolloutSampler, prepare_prompt_dataset
from .generator import (
    PolicyOutput,
    Rollout,
    RolloutGenerator,
    RolloutReward,
    SamplingSettings,
    forward_response,
    generate_responses,
)
from .reference import ReferencePolicy

__all__ = [
    "PolicyOutput",
    "PromptCollator",
    "ReferencePolicy",
    "Rollout",
    "RolloutGenerator",
    "RolloutReward",
    "RolloutSampler",
    "SamplingSettings",
    "forward_response",
    "generate_responses",
    "prepare_prompt_dataset",
]
