"""Evaluation: how likely a policy is to produce undesirable outputs, and how easily it can be pushed to.

- Exact P(bad) for short responses: :func:`bad_output_probability` (docs/algorithms.md §10.1; with an unbiased
  estimate of the pruned part), :func:`prompt_token_ids`; the KL of whole short responses: :func:`response_kl`;
  expectations of any score of whole short responses (a classifier's reward), the entropy and the most likely
  response: :func:`response_score_expectations`.
- Held-out sampling: :func:`eval_heldout` (mean reward/return, P̂(r < τ), CVaR_α, entropy, bootstrap and Wilson
  intervals, gathered across processes) on top of :func:`frontier_metrics`, :func:`tail_probability`, :func:`cvar`.
- Frontier plots of several runs (methods × seeds): :func:`plot_frontier` (PNG + CSV), :func:`frontier_table`.
- Negative data: :func:`eval_negative_data` (log-probability of known-bad responses, per prompt and overall).
- Jailbreak attacks: :func:`eval_gcg` (with nanogcg) and :func:`eval_beast` (beam search), in
  :mod:`trl_ext.eval.attacks`.
- Rare-output estimation: :func:`estimate_rare_output` with :func:`exact_probability`, :func:`brute_force`,
  :func:`itgis` and :func:`mhis` over an :class:`InputDistribution`, in :mod:`trl_ext.eval.rare`.
- Reports: :func:`write_json_report` (atomic), :func:`bootstrap_ci`, :func:`binomial_ci`.

See docs/evaluation.md for runnable examples and the command-line recipes.
"""

from .analytic import BadOutputProbability, ResponseKL, bad_output_probability, prompt_token_ids, response_kl
from .attacks import (
    REFUSAL_SUBSTRINGS,
    AttackResult,
    BeastResult,
    beast_attack,
    eval_beast,
    eval_gcg,
    gcg_attack,
    is_refusal,
    jailbroken_by_prefix,
    jailbroken_by_reward,
    load_advbench_goals,
    load_behaviors_csv,
    target_logprobs,
)
from .frontier import frontier_table, load_report, plot_frontier
from .heldout import eval_heldout, heldout_batches, tokenize_prompts
from .metrics import (
    FrontierMetrics,
    IntervalEstimate,
    cvar,
    frontier_metrics,
    group_logprob_summary,
    metric_key,
    num_worst,
    t_interval,
    t_quantile,
    tail_probability,
)
from .negdata import eval_negative_data, load_negative_rows, sequence_logprobs
from .rare import (
    InputDistribution,
    brute_force,
    estimate_rare_output,
    exact_probability,
    from_token_ids,
    from_words,
    hex_distribution,
    itgis,
    make_input_distribution,
    mhis,
    target_logprob,
    target_token_ids,
)
from .report import binomial_ci, bootstrap_ci, write_json_report
from .response_scores import ResponseScores, ScoreEstimate, response_score_expectations

__all__ = [
    "REFUSAL_SUBSTRINGS",
    "AttackResult",
    "bad_output_probability",
    "response_kl",
    "response_score_expectations",
    "ResponseScores",
    "ScoreEstimate",
    "BadOutputProbability",
    "ResponseKL",
    "beast_attack",
    "BeastResult",
    "binomial_ci",
    "bootstrap_ci",
    "brute_force",
    "cvar",
    "estimate_rare_output",
    "eval_beast",
    "eval_gcg",
    "eval_heldout",
    "eval_negative_data",
    "exact_probability",
    "from_token_ids",
    "from_words",
    "frontier_metrics",
    "frontier_table",
    "FrontierMetrics",
    "gcg_attack",
    "group_logprob_summary",
    "heldout_batches",
    "hex_distribution",
    "InputDistribution",
    "IntervalEstimate",
    "is_refusal",
    "itgis",
    "jailbroken_by_prefix",
    "jailbroken_by_reward",
    "load_advbench_goals",
    "load_behaviors_csv",
    "load_negative_rows",
    "load_report",
    "make_input_distribution",
    "metric_key",
    "mhis",
    "num_worst",
    "plot_frontier",
    "prompt_token_ids",
    "sequence_logprobs",
    "t_interval",
    "t_quantile",
    "tail_probability",
    "target_logprob",
    "target_logprobs",
    "target_token_ids",
    "tokenize_prompts",
    "write_json_report",
]
