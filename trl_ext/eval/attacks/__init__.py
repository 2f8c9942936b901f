"""Jailbreak attacks and their evaluation: GCG (through nanogcg) and BEAST, with before/after attack success rates.

- :func:`eval_gcg` / :func:`eval_beast`: attack every (goal, target), sample responses before and after, decide
  success by refusal phrases (``"prefix"``) or by a reward threshold (``"reward"``), report the attack success rate
  with a Wilson interval and the target's log-probs, as JSON.
- :func:`gcg_attack` / :func:`beast_attack`: the attacks alone, for one goal.
- :func:`load_behaviors_csv`, :func:`load_advbench_goals`: goals and targets (AdvBench from an installed ``pyrit``).
- :func:`is_refusal`, :func:`jailbroken_by_prefix`, :func:`jailbroken_by_reward`, :data:`REFUSAL_SUBSTRINGS`: the
  success rules; :func:`target_logprobs`: log p(target | prompt).

GCG needs ``pip install --no-deps nanogcg==0.3.0 scipy`` (imported only when GCG runs).
"""

from .beast import BeastOptions, BeastResult, beast_attack, eval_beast
from .common import (
    REFUSAL_SUBSTRINGS,
    SCENARIOS,
    SUCCESS_CRITERIA,
    AttackPrompt,
    AttackResult,
    attack_success_rate,
    build_attack_prompt,
    is_refusal,
    jailbroken_by_prefix,
    jailbroken_by_reward,
    load_advbench_goals,
    load_behaviors_csv,
    suffix_target_losses,
    target_logprobs,
)
from .gcg import GCGOptions, eval_gcg, gcg_attack
from .options import AttackEvalOptions

__all__ = [
    "AttackEvalOptions",
    "BeastOptions",
    "GCGOptions",
    "REFUSAL_SUBSTRINGS",
    "SCENARIOS",
    "SUCCESS_CRITERIA",
    "AttackPrompt",
    "AttackResult",
    "BeastResult",
    "attack_success_rate",
    "beast_attack",
    "build_attack_prompt",
    "eval_beast",
    "eval_gcg",
    "gcg_attack",
    "is_refusal",
    "jailbroken_by_prefix",
    "jailbroken_by_reward",
    "load_advbench_goals",
    "load_behaviors_csv",
    "suffix_target_losses",
    "target_logprobs",
]
