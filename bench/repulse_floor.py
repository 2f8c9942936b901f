"""Bare versions of the parts of a RePULSe / REINFORCE update, for `repulse_speed.py --floor`.

Each part of an update is timed again as the plainest code that does the same work on the same rows, with nothing of
trl_ext's around it:

- ``sampling``: prefill each distinct prompt once and copy its cache to its samples (as ours does), then ``T − 1``
  cached decode steps, each a forward of the new token and a multinomial draw at temperature 1 (a bare loop of
  cached forwards: what any sampler must do);
- ``scoring``: a no-grad forward of the other model (``p_0`` for the policy's rows, ``p_θ`` for the proposal's) on
  prompt + response, logits only at the response positions (``logits_to_keep``), and the gather of the response
  tokens' log-probs, then the reward on the decoded texts (ours also runs each prompt once here, bare does not); a
  fused RePULSe step needs only the reward for q's rows (``reward_proposal``: their ``log p_θ`` come from the
  policy step's forward over them);
- ``step``: a forward with gradient of the trained model on prompt + response (logits at the response positions
  only), the sum of the response tokens' log-probs (weighted by random constants, as a loss is) and its backward
  (only the top blocks are trainable, as in the runs); the policy's step runs on its own rows plus the proposal's in
  RePULSe;
- ``optimizer``: one AdamW step of the trainable parameters (their gradients set);
- with ``head``: q is a ``Linear(h, V)`` on the policy's trunk, so its sampling runs the policy plus the head, its
  step is the head's forward and backward on the hidden states the policy step computed (plus the LM head, no
  grad), and ``optimizer_proposal`` steps the head alone.

Every part is timed ``repeats`` times after a warm-up, and the median is kept. `floor_of` adds a method's parts up.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

__all__ = ["bare_parts", "floor_of"]


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rows(tokenizer, prompts: list[str]):
    """Left-padded ``(P, L)`` ids and mask of the distinct ``prompts`` (in order)."""
    distinct = list(dict.fromkeys(prompts))
    enc = tokenizer(distinct, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"], len(prompts) // len(distinct)


def _tilted(out, head):
    """The next-token logits of ``out``'s last position; with a ``head``, ``log_softmax(ℓ) + head(h)`` (a head
    proposal on the model's trunk)."""
    logits = out.logits[:, -1]
    if head is None:
        return logits
    return torch.log_softmax(logits.float(), -1) + head(out.hidden_states[-1][:, -1])


@torch.no_grad()
def bare_sample(
    model, ids: torch.Tensor, mask: torch.Tensor, samples: int, new_tokens: int, generator=None, head=None
):
    """``(P·samples, T)`` sampled tokens (temperature 1, no stop): a prefill of the ``P`` prompts, their cache copied
    to ``samples`` rows each, and ``T − 1`` cached decode steps; with a ``head``, from ``softmax(log p + head(h))``."""
    from transformers import DynamicCache

    from trl_ext.models.kv_cache import cache_kwargs, output_cache
    from trl_ext.ops.sequences import position_ids_from_attention_mask

    positions = position_ids_from_attention_mask(mask)
    hidden = {"output_hidden_states": True} if head is not None else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **cache_kwargs(DynamicCache(config=model.config)), **hidden)  # fmt: skip
    cache = output_cache(out)
    cache.batch_repeat_interleave(samples)
    logits = _tilted(out, head).repeat_interleave(samples, 0)
    mask, positions = mask.repeat_interleave(samples, 0), positions.repeat_interleave(samples, 0)
    tokens = []
    for step in range(new_tokens):
        probs = torch.softmax(logits.float(), -1)
        token = torch.multinomial(probs, 1, generator=generator)
        tokens.append(token)
        if step == new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
                    **cache_kwargs(cache), **hidden)  # fmt: skip
        cache, logits = output_cache(out), _tilted(out, head)
    return torch.cat(tokens, 1)


def _response_logprobs(model, ids, mask, new_tokens: int) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=new_tokens + 1).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -new_tokens:, None]).squeeze(-1)


def bare_parts(
    policy,
    tokenizer,
    reward,
    prompts: list[str],
    *,
    samples: int,
    proposal_samples: int,
    new_tokens: int,
    trainable_layers: int,
    with_reference: bool,
    repeats: int = 3,
    head: bool = False,
) -> dict[str, float]:
    """Median seconds of each bare part on the shape of one update (``prompts`` × ``samples`` policy rows and
    ``prompts`` × ``proposal_samples`` proposal rows of ``new_tokens`` tokens). ``policy`` is copied three times
    (policy and proposal trained on their top ``trainable_layers`` blocks, a frozen reference);
    ``with_reference=False`` (``kl_coef = 0``): the policy's rows are not scored by ``p_0``, as in the trainer.
    ``head``: the proposal is a linear head on the policy's trunk (``parameterization="modulation_linear_head"``):
    it samples with the policy plus the head, its step is a no-grad forward of the policy and the head's forward and
    backward, and its optimizer steps the head alone."""
    from trl_ext.models.freeze import train_top_layers

    models = {name: copy.deepcopy(policy).eval() for name in ("policy", "proposal", "reference")}
    for name in ("policy", "proposal"):
        train_top_layers(models[name], trainable_layers)
    models["reference"].requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    ids, mask, repeat = _rows(tokenizer, prompts)  # distinct prompts; each appears `repeat` times in `prompts`
    full = {}
    hidden_size, vocab = policy.config.hidden_size, policy.get_output_embeddings().weight.shape[0]
    tilt = torch.nn.Linear(hidden_size, vocab) if head else None
    for part, per_prompt in (("policy", samples), ("proposal", proposal_samples)):
        n = per_prompt * repeat
        sampler = models["policy" if head else part]
        part_head = tilt if part == "proposal" else None
        out[f"sampling_{part}"] = _median_seconds(
            lambda sampler=sampler, n=n, h=part_head: bare_sample(sampler, ids, mask, n, new_tokens, generator, h),
            repeats,
        )
        responses = bare_sample(sampler, ids, mask, n, new_tokens, generator, part_head)
        rows_ids, rows_mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        full[part] = (torch.cat([rows_ids, responses], 1), torch.cat([rows_mask, torch.ones_like(responses)], 1))
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        prompt_texts = tokenizer.batch_decode(rows_ids, skip_special_tokens=True)
        other = models["reference" if part == "policy" else "policy"]

        forward = part == "proposal" or with_reference  # the proposal's rows always get log p_θ (the weights)

        def score(part=part, other=other, texts=texts, prompt_texts=prompt_texts, forward=forward):
            if forward:
                with torch.no_grad():
                    _response_logprobs(other, *full[part], new_tokens)
            reward(prompt_texts, texts)

        out[f"scoring_{part}"] = _median_seconds(score, repeats)
        if part == "proposal":  # the reward alone: a fused step takes q's log p_θ from the policy step's forward
            out["reward_proposal"] = _median_seconds(lambda t=texts, p=prompt_texts: reward(p, t), repeats)

    def step(model, parts):
        ids = torch.cat([full[p][0] for p in parts]) if len(parts) > 1 else full[parts[0]][0]
        mask = torch.cat([full[p][1] for p in parts]) if len(parts) > 1 else full[parts[0]][1]
        weights = torch.randn(ids.shape[0], new_tokens, generator=generator)

        def run():
            model.zero_grad(set_to_none=True)
            (weights * _response_logprobs(model, ids, mask, new_tokens)).mean().backward()

        return run

    out["policy_step_reinforce"] = _median_seconds(step(models["policy"], ["policy"]), repeats)
    out["policy_step"] = _median_seconds(step(models["policy"], ["policy", "proposal"]), repeats)
    out["proposal_step"] = _median_seconds(step(models["proposal"], ["proposal"]), repeats)
    trainable = [p for p in models["policy"].parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6)
    step(models["policy"], ["policy"])()  # gradients to step with
    out["optimizer"] = _median_seconds(optimizer.step, repeats)
    if head:
        q_ids, q_mask = full["proposal"]
        weights = torch.randn(q_ids.shape[0], new_tokens, generator=generator)

        with torch.no_grad():  # the policy step's forward computes these hidden states anyway (shared, not timed)
            hidden = models["policy"](input_ids=q_ids, attention_mask=q_mask, output_hidden_states=True)
            hidden = hidden.hidden_states[-1][:, -new_tokens - 1 : -1]
        lm_head = models["policy"].get_output_embeddings()

        def head_step():
            tilt.zero_grad(set_to_none=True)
            with torch.no_grad():
                log_p = torch.log_softmax(lm_head(hidden).float(), -1)
            log_q = torch.log_softmax(log_p + tilt(hidden), -1)
            (weights * log_q.gather(-1, q_ids[:, -new_tokens:, None]).squeeze(-1)).mean().backward()

        out["proposal_step"] = _median_seconds(head_step, repeats)
        head_step()
        head_optimizer = torch.optim.AdamW(tilt.parameters(), lr=1e-6)
        out["optimizer_proposal"] = _median_seconds(head_optimizer.step, repeats)
    return out


def floor_of(method: str, parts: dict[str, float], reuse: int = 1, fused: bool = True) -> dict[str, float]:
    """The bare parts of one ``method``'s update (``"REINFORCE"`` or ``"RePULSe"``), by the trainer's phase names;
    their sum is the update's floor. ``reuse``: RePULSe's ``proposal_reuse_steps`` (the proposal's parts then run
    once every ``reuse`` updates: their mean share). ``fused``: q's samples get their ``log p_θ`` from the policy
    step's forward over them (which ``policy_step`` already counts), so scoring them is the reward alone; ``False``
    (``--no-fuse``): a no-grad ``p_θ`` pass too."""
    if method == "REINFORCE":
        return {
            "sampling_policy": parts["sampling_policy"],
            "scoring_policy": parts["scoring_policy"],
            "policy_step": parts["policy_step_reinforce"],
            "optimizer": parts["optimizer"],
        }
    return {
        "sampling_policy": parts["sampling_policy"],
        "scoring_policy": parts["scoring_policy"],
        "sampling_proposal": parts["sampling_proposal"] / reuse,
        # the negatives are scored every update (reused ones too); fused: their log p_θ come from the policy step
        "scoring_proposal": parts["reward_proposal"] / reuse if fused else parts["scoring_proposal"],
        "proposal_step": parts["proposal_step"] / reuse,
        "policy_step": parts["policy_step"],
        "optimizer": parts["optimizer"] + parts.get("optimizer_proposal", parts["optimizer"]) / reuse,
    }
