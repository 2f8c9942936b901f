r"""``P(bad)`` of a model's own response to a prompt, by every rare-output estimator.

The question: a response of at most ``T`` tokens is sampled from ``p(·|x)`` (ending at its first stop token); how
likely does it hold a bad token? :func:`estimate_bad_response` answers it with

- ``exact``: enumeration (:func:`~.short_responses.short_response_target`, ``T ≤ 2``);
- ``smc``: twisted SMC (:func:`~.smc.smc_estimate`) with a learned twist, a proposal or none (plain sampling);
- ``brute_force``, ``itgis``, ``mhis``: the input-distribution estimators, through an exact reduction for
  ``T = 2``. Write the response as ``(x, s_2)``: the first token ``x ~ p(·|prompt)`` is an *input* drawn from the
  one-position product distribution ``D = p(·|prompt)`` (:func:`first_token_distribution`), and

      P(bad) = E_{x~D}[ P(bad | x) ],   P(bad | x) = 1 (x ∈ B),  0 (x ∈ E \ B),  Σ_{b∈B} p(b | prompt, x) (else),

  which is exactly ``E_{x~D}[P(y | x)]`` for the model :class:`BadContinuationLM`: it merges the bad tokens into
  one target token ``y = b_0`` (the last position's ``B`` entries are replaced by one entry holding
  ``log Σ_{b∈B} p(b|·)``, so the distribution stays normalised) and puts ``P(y|x)`` to 1 or 0 for a bad or stop
  first token. Its score for the gradient-guided samplers is therefore ``log P(bad | x)``; its gradient does not see
  that a bad first token gives 1 (that value is set, not computed), which is the honest limit of applying an
  input-space method to outputs.

Cost: every estimate carries ``details["row_forwards"]`` (rows through a model call, the prompt pass included) and
``details["row_backwards"]`` (rows through a backward pass: the gradient-guided samplers need one per row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import nn

from ...sampling import SMCConfig, TokenSetPotential, TwistSource, constant_twist
from ...sampling.cached_lm import model_device
from ...utils import eval_mode
from .distributions import InputDistribution
from .estimate import Estimate
from .estimators import brute_force
from .itgis import itgis
from .mhis import mhis
from .short_responses import short_response_target
from .smc import smc_estimate

__all__ = [
    "RESPONSE_METHODS",
    "BadContinuationLM",
    "estimate_bad_response",
    "first_token_distribution",
]

RESPONSE_METHODS = ("exact", "brute_force", "itgis", "mhis", "smc")
_LOG10 = math.log(10.0)


class BadContinuationLM(nn.Module):
    """A causal LM whose next-token distribution at the last position gives ``P(y = b_0 | ·) = P(bad | x)``, where
    ``x`` is the last input token (module doc). Other positions are the model's own. For :mod:`.itgis` and
    :mod:`.mhis` (which read logits of ``[prompt; x]`` given as ids or as input embeddings).

    Args:
        model: the causal LM ``p``.
        bad_token_ids: ``B``; the first one is the merged target ``b_0``.
        stop_token_ids: ``E``: a stop first token ends the response (not bad unless listed in ``B``).
    """

    def __init__(self, model: nn.Module, bad_token_ids: Sequence[int], stop_token_ids: Sequence[int] = ()):
        super().__init__()
        self.model = model
        self.bad = [int(i) for i in bad_token_ids]
        if not self.bad:
            raise ValueError("bad_token_ids is empty.")
        self.stops = [int(i) for i in stop_token_ids if int(i) not in self.bad]
        self.target_id = self.bad[0]

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def _last_token_class(self, input_ids, inputs_embeds) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n,)`` bools: the last input token is bad / is a stop token."""
        if input_ids is not None:
            last = input_ids[:, -1]
            device = last.device
            return (
                torch.isin(last, torch.tensor(self.bad, device=device)),
                torch.isin(last, torch.tensor(self.stops, device=device, dtype=last.dtype)),
            )
        weight = self.get_input_embeddings().weight
        last = inputs_embeds[:, -1].detach()

        def matches(ids):
            if not ids:
                return torch.zeros(last.shape[0], dtype=torch.bool, device=last.device)
            rows = weight[torch.tensor(ids, device=weight.device)].detach().to(last)
            return (last[:, None, :] == rows[None]).all(-1).any(-1)

        return matches(self.bad), matches(self.stops)

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, logits_to_keep: int = 0, **kwargs):
        kwargs.pop("use_cache", None)
        out = self.model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            use_cache=False,
            **({"logits_to_keep": logits_to_keep} if logits_to_keep else {}),
            **kwargs,
        )
        logits = out.logits
        last = torch.log_softmax(logits[:, -1].float(), dim=-1)
        bad = torch.tensor(self.bad, device=last.device)
        merged = torch.logsumexp(last[:, bad], dim=-1)
        new_last = last.index_fill(1, bad, -math.inf)
        new_last[:, self.target_id] = merged
        first_bad, first_stop = self._last_token_class(input_ids, inputs_embeds)
        certain = torch.full_like(new_last, -math.inf)
        certain[:, self.target_id] = 0.0
        never = new_last.clone()
        never[:, self.target_id] = -math.inf
        new_last = torch.where(first_bad[:, None], certain, torch.where(first_stop[:, None], never, new_last))
        logits = torch.cat([logits[:, :-1].float(), new_last[:, None]], dim=1)
        return SimpleNamespace(logits=logits)


def first_token_distribution(model: nn.Module, prompt_ids: Sequence[int]) -> InputDistribution:
    """``D = p(· | prompt)`` as a one-position :class:`~.distributions.InputDistribution` with the prompt as its
    prefix (one forward pass)."""
    prompt = torch.as_tensor(list(prompt_ids)).long()
    device = model_device(model)
    with torch.no_grad(), eval_mode(model):
        logits = model(input_ids=prompt[None].to(device), attention_mask=torch.ones_like(prompt[None]).to(device))
    log_p = torch.log_softmax(logits.logits[0, -1].double(), -1).cpu()
    return InputDistribution(log_p[None], prefix_ids=prompt.tolist(), name="first_response_token")


def _with_cost(est: Estimate, forwards: int, backwards: int) -> Estimate:
    est.details["row_forwards"] = int(forwards)
    est.details["row_backwards"] = int(backwards)
    return est


def estimate_bad_response(
    method: str,
    model: nn.Module,
    prompt_ids: Sequence[int],
    bad_token_ids: Sequence[int],
    *,
    stop_token_ids: Sequence[int] = (),
    max_new_tokens: int = 2,
    num_samples: int = 1024,
    batch_size: int = 256,
    temperature: float = 1.0,
    decay_rate: float = 0.9,
    burn_in: int = 64,
    score: str = "logprob",
    twist: TwistSource | None = None,
    smc_config: SMCConfig | None = None,
    num_runs: int = 16,
    seed: int = 0,
    show_progress: bool = False,
) -> Estimate:
    """``P(bad)`` of the model's response to ``prompt_ids`` by ``method`` (one of :data:`RESPONSE_METHODS`).

    Args:
        method: ``exact``, ``brute_force``, ``itgis``, ``mhis`` (``max_new_tokens = 2``) or ``smc`` (any length).
        model: the causal LM ``p`` whose responses are studied.
        prompt_ids: one unpadded prompt.
        bad_token_ids, stop_token_ids: ``B`` and ``E``.
        max_new_tokens: ``T``.
        num_samples, batch_size, temperature, decay_rate, burn_in, score, seed: as for the input estimators
            (``num_samples`` first tokens; ``mhis`` runs ``batch_size`` chains for ``burn_in`` steps before keeping).
        twist: ``smc`` only: the twist source (default :func:`~trl_ext.sampling.constant_twist` of ``p``: plain
            sampling with a standard error over runs).
        smc_config: ``smc`` only: the sampler settings (default ``K = 16``; ``max_new_tokens`` and the stop tokens
            are taken from the arguments above).
        num_runs: ``smc`` only: independent runs.
    """
    potential = TokenSetPotential(bad_token_ids)
    stops = [int(i) for i in stop_token_ids]
    if method == "exact":
        target = short_response_target(model, prompt_ids, potential, max_new_tokens=max_new_tokens,
                                       stop_token_ids=stops, batch_size=batch_size)  # fmt: skip
        est = Estimate(method="exact", estimate=target.z, std_error=0.0, num_samples=target.row_forwards,
                       log10_estimate=target.log_z / _LOG10, diagnostics={"exact": True})  # fmt: skip
        return _with_cost(est, target.row_forwards, 0)
    if method == "smc":
        base = smc_config or SMCConfig()
        config = SMCConfig(
            num_particles=base.num_particles, max_new_tokens=max_new_tokens, resampling=base.resampling,
            ess_threshold=base.ess_threshold, stop_token_ids=stops, pad_token_id=base.pad_token_id,
        )  # fmt: skip
        source = twist if twist is not None else constant_twist(model)
        est = smc_estimate(source, prompt_ids, potential, config, num_runs=num_runs, seed=seed)
        return _with_cost(est, est.details["row_forwards"], 0)
    if method not in RESPONSE_METHODS:
        raise ValueError(f"Unknown method {method!r}; choose one of {RESPONSE_METHODS}.")
    if max_new_tokens != 2:
        raise ValueError(
            f"method={method!r} reaches responses through their first token, which needs max_new_tokens=2 (got "
            f"{max_new_tokens}); use method='smc' (any length) or 'exact' (1 or 2 tokens)."
        )
    dist = first_token_distribution(model, prompt_ids)
    wrapped = BadContinuationLM(model, bad_token_ids, stops)
    target = [wrapped.target_id]
    common = {"num_samples": num_samples, "batch_size": batch_size, "seed": seed, "show_progress": show_progress}
    if method == "brute_force":
        est = brute_force(wrapped, dist, target, **common)
        return _with_cost(est, 1 + num_samples, 0)
    if method == "itgis":
        est = itgis(wrapped, dist, target, temperature=temperature, decay_rate=decay_rate, score=score, **common)
        return _with_cost(est, 1 + num_samples, num_samples)
    est = mhis(wrapped, dist, target, temperature=temperature, burn_in=burn_in, score=score, **common)
    steps = 1 + burn_in + est.details["kept_steps"]
    return _with_cost(est, 1 + est.details["num_chains"] * steps, est.details["num_chains"] * steps)
