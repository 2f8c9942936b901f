"""P(bad) of a model's own response by every estimator (`trl_ext.eval.rare.responses`): the first-token reduction
that lets the input-space estimators (brute force, ITGIS, MHIS) answer it, checked against exact enumeration on the
toy of tests/sampling/test_sampling_smc.py (32 tokens, 2-token responses, bad tokens {6, 7, 28}, stop token 3)."""

from __future__ import annotations

import warnings

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.eval.rare import evaluate_inputs, exact_probability, short_response_target
from trl_ext.eval.rare.responses import BadContinuationLM, estimate_bad_response, first_token_distribution
from trl_ext.sampling import TokenSetPotential

V = 32
PROMPT = [7, 9, 11, 13]
BAD = [6, 7, 28]
STOP = 3


@pytest.fixture(scope="module")
def p():
    model = kit.build_causal_lm("gpt_neox", tokenizer=kit.build_tokenizer(), seed=0, vocab_size=V)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.eval()


@pytest.mark.parametrize("stops", [[], [STOP]])
def test_the_reduction_is_exact(p, stops):
    """E_{x~p(·|prompt)}[P(b_0 | prompt, x)] under the wrapped model equals P(bad), and P(b_0|x) = P(bad|x)."""
    target = short_response_target(p, PROMPT, TokenSetPotential(BAD), stop_token_ids=stops)
    dist = first_token_distribution(p, PROMPT)
    wrapped = BadContinuationLM(p, BAD, stops)
    reduced = exact_probability(wrapped, dist, [wrapped.target_id], show_progress=False)
    assert reduced.estimate == pytest.approx(target.z, rel=1e-5)
    x = torch.arange(V)[:, None]
    ids = torch.cat([torch.tensor(PROMPT).expand(V, -1), x], 1)
    with torch.no_grad():
        by_ids = torch.log_softmax(wrapped(input_ids=ids).logits[:, -1].double(), -1)[:, wrapped.target_id].exp()
    assert torch.allclose(by_ids, target.bad_given_first(), atol=1e-5)
    assert by_ids[BAD].eq(1).all() and (by_ids[STOP] == 0 if stops else by_ids[STOP] > 0)
    # the embedding path (ITGIS/MHIS) sees the same probabilities and a finite gradient
    ev = evaluate_inputs(wrapped, x, [wrapped.target_id], "logprob", dist.prefix_ids, with_grad=True)
    assert torch.allclose(ev.target_logprob.exp(), by_ids, atol=1e-5)
    assert torch.isfinite(ev.embedding_grad).all()


@pytest.mark.parametrize("method", ["brute_force", "itgis", "mhis", "smc"])
def test_every_method_agrees_with_exact(p, method):
    exact = estimate_bad_response("exact", p, PROMPT, BAD, stop_token_ids=[STOP])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        est = estimate_bad_response(method, p, PROMPT, BAD, stop_token_ids=[STOP], num_samples=512, batch_size=64,
                                    burn_in=16, num_runs=32)  # fmt: skip
    assert abs(est.estimate - exact.estimate) < 3 * est.std_error, (est.estimate, est.std_error, exact.estimate)
    forwards, backwards = est.details["row_forwards"], est.details["row_backwards"]
    expected = {"brute_force": (513, 0), "itgis": (513, 512), "mhis": (1 + 64 * 25, 64 * 25), "smc": (32 * 16 * 2, 0)}
    assert (forwards, backwards) == expected[method]
    assert exact.details["row_forwards"] == 1 + V - len(BAD) - 1


def test_errors(p):
    with pytest.raises(ValueError, match="max_new_tokens=2"):
        estimate_bad_response("itgis", p, PROMPT, BAD, max_new_tokens=3)
    with pytest.raises(ValueError, match="Unknown method"):
        estimate_bad_response("qmc", p, PROMPT, BAD)
    with pytest.raises(ValueError, match="empty"):
        BadContinuationLM(p, [])
