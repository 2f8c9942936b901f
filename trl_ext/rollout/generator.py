"""The rollout shared by every online trainer: sample responses, then score them with the policy, the reference, the
critic and the reward.

One rollout, for a batch of left-padded prompts:

1. repeat each prompt ``N = num_samples_per_prompt`` times (rows stay grouped prompt by prompt);
2. sample responses with the policy's own ``generate`` (plain, value-head, PEFT and modulated policies all have one)
   under `trl.models.unwrap_model_for_generation` and the accelerator's autocast (``bf16``: sampled in mixed
   precision, like the scoring and training passes), with exactly the sampling settings given (the model's saved
   generation config is swapped out meanwhile, so none of its defaults, e.g. ``top_k=50``, leak in); tokens are
   drawn by :class:`~trl_ext.rollout.sampling.SampleAndRecord`, which also records their log-probs; with
   ``shared_prefix`` each distinct prompt is prefilled once and its KV cache fanned out to its ``N`` samples
   (:mod:`.shared_prefix`: same logits, same draws);
3. cut each response after its first stop token (pad after it; the stop token itself is part of the response);
4. score ``prompt + response`` in chunks of ``forward_batch_size`` rows, with no gradient and in eval mode:
   the policy's log-probs at the *sampling temperature* (recorded during sampling in fp32; otherwise from
   :func:`forward_response`, the function the trainers use for their loss — both agree with the training-time
   log-probs to ~1e-6), the reference's log-probs (:class:`ReferencePolicy`; skipped with ``reference=None``), the
   values (when the model has a critic) and the scores (:class:`RolloutReward`); with ``shared_prefix``, in fp32, the
   reference, a separate critic and a reward model run each distinct prompt once and its responses on its cache
   (:mod:`.shared_prefix`);
5. subtract ``missing_eos_penalty`` from the scores of responses without a stop token;
6. screen the scores for NaN / ±inf (``nonfinite_rewards``: raise, or drop those samples) and for magnitudes beyond
   ``max_abs_reward`` (raise; :mod:`.finite`).

The result is a :class:`Rollout`. No maths here beyond calling :mod:`trl_ext.ops`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import CompileConfig, GenerationConfig, LogitsProcessorList

from .._deprecation import moved_names
from ..models.kv_cache import cache_kwargs
from ..models.lora import is_peft_model
from ..models.value_head import AutoModelForCausalLMWithValueHead
from ..ops.logprobs import DEFAULT_CHUNK_SIZE
from ..ops.sequences import truncate_after_stop_token
from ..utils import eval_mode
from . import reward as _reward
from .columns import repeat_columns, select_columns
from .compiled_decode import static_decode_cache
from .finite import DEFAULT_MAX_ABS_REWARD, screen_rewards
from .fsdp import call_as_root_forward, is_fsdp_sharded
from .reward_list import WeightedRewards
from .sampling import SampleAndRecord
from .scoring import forward_response as _forward_response
from .shared_prefix import prefill_prompts, shared_prompt_logprobs, shared_prompt_values
from .vision import VisionInputs, generation_inputs

if TYPE_CHECKING:
    from .reference import ReferencePolicy
    from .reward import RolloutReward

__all__ = [
    "Rollout",
    "RolloutGenerator",
    "SamplingSettings",
    "finish_responses",
    "generate_responses",
    "rollout_logprobs",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ the result
@dataclass
class Rollout:
    """Sampled responses and everything measured on them. Rows are grouped prompt by prompt (``N`` rows each).

    Shapes: ``B`` rows, ``P`` prompt tokens (left-padded), ``T`` response tokens (right-padded).
    """

    prompt_ids: torch.Tensor
    """``(B, P)`` left-padded prompt ids (each prompt repeated ``num_samples_per_prompt`` times)."""
    prompt_mask: torch.Tensor
    """``(B, P)`` 1 on real prompt tokens."""
    response_ids: torch.Tensor
    """``(B, T)`` response ids; the pad id after the first stop token."""
    response_mask: torch.Tensor
    """``(B, T)`` 1 up to and including the first stop token, 0 after it."""
    logprobs: torch.Tensor
    """``(B, T)`` fp32 log-probs of the response tokens under the sampling policy, at the sampling temperature."""
    ref_logprobs: torch.Tensor | None
    """``(B, T)`` fp32 log-probs under the reference policy (same temperature); ``None`` when the generator scores no
    reference (``reference=None``: the KL term has coefficient 0, so the reference forward pass is skipped)."""
    scores: torch.Tensor
    """``(B,)`` fp32 reward scores, ``missing_eos_penalty`` already subtracted."""
    contains_stop: torch.Tensor
    """``(B,)`` bool: the response holds a stop (EOS) token."""
    values: torch.Tensor | None = None
    """``(B, T)`` fp32 critic values ``V_t`` of the state before response token ``t`` (``None`` without critic)."""
    num_samples_per_prompt: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in ``generation`` and ``scoring``."""
    vision: VisionInputs | None = None
    """The rows' image inputs (vision-language policies, see :mod:`~trl_ext.rollout.vision`), else ``None``."""
    dropped: torch.Tensor | None = None
    """``(B,)`` bool: rows given zero weight (a non-finite reward, ``nonfinite_rewards="drop"``); ``None``: none."""
    engine_logprobs: torch.Tensor | None = None
    """``(B, T)`` fp32 log-probs of the response tokens under the vLLM engine that sampled them (``use_vllm``; for the
    importance-sampling correction, `trl_ext.ops.vllm_importance_weights`); ``None`` with ``generate``."""
    columns: dict[str, list] | None = None
    """The rows' dataset reward columns (one value per row, :mod:`.columns`) the rewards were computed with; ``None``
    without any. Not saved by :meth:`state_dict`."""
    reward_components: dict[str, torch.Tensor] | None = None
    """``{name: (B,)}`` unweighted values of each reward function of a list (:mod:`.reward_list`), before
    ``missing_eos_penalty``; ``None`` with a single reward. Not saved by :meth:`state_dict`."""

    @property
    def input_ids(self) -> torch.Tensor:
        """``(B, P + T)`` prompt and response ids."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``(B, P + T)`` attention mask of :attr:`input_ids`."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_ids.shape[1]

    def _tensor_fields(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value) or isinstance(value, VisionInputs):
                yield f.name, value

    def select(self, index: torch.Tensor | slice) -> Rollout:
        """The rows ``index`` (a slice or an index tensor); grouping by prompt is only kept by aligned slices."""
        rows = {name: value[index] for name, value in self._tensor_fields()}
        if self.reward_components is not None:
            rows["reward_components"] = {k: v[index] for k, v in self.reward_components.items()}
        return replace(self, **rows, columns=select_columns(self.columns, index))

    def split(self, size: int) -> list[Rollout]:
        """Consecutive chunks of ``size`` rows (the last may be shorter); a multiple of ``num_samples_per_prompt``
        keeps every prompt's samples together."""
        return [self.select(slice(start, start + size)) for start in range(0, self.batch_size, size)]

    def to(self, device: torch.device | str) -> Rollout:
        moved = {name: value.to(device) for name, value in self._tensor_fields()}
        if self.reward_components is not None:
            moved["reward_components"] = {k: v.to(device) for k, v in self.reward_components.items()}
        return replace(self, **moved)

    def state_dict(self) -> dict:
        """Plain dict of CPU tensors and numbers (``torch.save``-able, loadable with ``weights_only=True``)."""
        state = {k: v.state_dict() if k == "vision" else v.detach().cpu() for k, v in self._tensor_fields()}
        state.update(num_samples_per_prompt=self.num_samples_per_prompt, timings=dict(self.timings))
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> Rollout:
        vision = state.get("vision")
        state = {"ref_logprobs": None, **state}  # not saved when no reference was scored
        return cls(**{**state, "vision": VisionInputs.from_state_dict(vision) if vision is not None else None})


# ------------------------------------------------------------------------------------------------ sampling
@dataclass
class SamplingSettings:
    """How responses are sampled. Everything ``generate`` does is set here; nothing comes from the model's saved
    generation config."""

    max_new_tokens: int
    pad_token_id: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    """Responses end at the first of these ids (kept) and are padded after it; ``None``: no stop token."""
    eos_token_id: int | None = None
    """Id that counts as "ended properly" for ``contains_stop`` when no stop token is set."""
    num_samples_per_prompt: int = 1
    do_sample: bool = True
    compile_config: CompileConfig | None = None
    """Compile ``generate``'s per-token decode step with it, on a static KV cache (:mod:`.compiled_decode`,
    :func:`~trl_ext.rollout.compiled_decode.decode_compile_config`); ``None``: eager decoding."""

    def generation_config(self) -> GenerationConfig:
        """The config ``generate`` runs with. Sampling is done by :meth:`sampler` (a logits processor), so
        ``generate`` itself runs greedily and has no temperature/top-k/top-p of its own."""
        kwargs = {"do_sample": False, "max_new_tokens": self.max_new_tokens, "use_cache": True}
        stop = list(self.stop_token_ids) if self.stop_token_ids else None
        return GenerationConfig(
            **kwargs, eos_token_id=stop, pad_token_id=self.pad_token_id, bos_token_id=None, repetition_penalty=1.0
        )

    def sampler(self, row_keys: torch.Tensor | None = None) -> SampleAndRecord | None:
        """A fresh :class:`~trl_ext.rollout.sampling.SampleAndRecord` for one ``generate`` call (``None``: greedy);
        ``row_keys``: the rows' random-stream keys (:func:`~trl_ext.rollout.sampling.row_keys`), else torch's RNG."""
        if not self.do_sample:
            return None
        return SampleAndRecord(self.temperature, self.top_k, self.top_p, row_keys=row_keys)


def _generation_module(model: nn.Module) -> nn.Module:
    """The module whose ``generation_config`` ``generate`` reads (inside PEFT and value-head wrappers)."""
    while True:
        if is_peft_model(model):
            model = model.get_base_model()
        elif isinstance(model, AutoModelForCausalLMWithValueHead):
            model = model.pretrained_model
        else:
            return model


@contextlib.contextmanager
def _generation_config(model: nn.Module, config: GenerationConfig):
    target = _generation_module(model)
    saved = getattr(target, "generation_config", None)
    target.generation_config = config
    try:
        yield
    finally:
        target.generation_config = saved


def finish_responses(responses: torch.Tensor, generated: torch.Tensor, settings: SamplingSettings):
    """``(responses, mask, contains_stop)`` from ``(B, T)`` sampled ids and the ``(B, T)`` bool "was generated": cut
    after the first stop token (kept; pad after it), the mask, and whether a stop (or, without stop tokens, the eos)
    token is in the response. Shared by ``generate`` and the vLLM engine (`trl_ext.rollout.vllm`)."""
    if settings.stop_token_ids:
        responses, mask = truncate_after_stop_token(responses, settings.stop_token_ids, settings.pad_token_id)
        mask = mask * generated
    else:
        mask = generated.long()
    ended_ids = settings.stop_token_ids or ((settings.eos_token_id,) if settings.eos_token_id is not None else ())
    ended = torch.tensor(list(ended_ids), dtype=torch.long, device=responses.device)
    return responses, mask, (torch.isin(responses, ended) & (mask != 0)).any(-1)


@torch.no_grad()
def generate_responses(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: SamplingSettings,
    batch_size: int,
    *,
    return_logprobs: bool = False,
    vision: VisionInputs | None = None,
    row_keys: torch.Tensor | None = None,
    share_prompts: bool = False,
):
    """Sample one response per row of the left-padded prompts with ``model.generate``, ``batch_size`` rows at a time.

    Returns ``(response_ids, response_mask, contains_stop)``: ``(B, T)`` ids with the pad id after the first stop
    token, the ``(B, T)`` mask (1 up to and including that token) and the ``(B,)`` bool "has a stop token";
    ``T ≤ max_new_tokens`` is the longest response. With ``return_logprobs`` a fourth item follows: the ``(B, T)``
    fp32 sampling-time log-probs ``log_softmax(logits / temperature)`` of the response tokens, zero where the mask is
    zero (``None`` when sampling greedily). The model is put in eval mode meanwhile. ``vision``: the rows' image
    inputs (vision-language models). ``row_keys``: ``(B,)`` keys of the rows' own random streams
    (:func:`~trl_ext.rollout.sampling.row_keys`); a row's response then does not depend on its batch.
    ``share_prompts``: prefill each distinct prompt of a ``generate`` call once and
    copy its KV cache to its rows (:func:`~trl_ext.rollout.shared_prefix.prefill_prompts`; text only): the same
    logits and, for a given seed, the same tokens as without. ``settings.compile_config``: decode with a compiled
    step on a static cache (:mod:`~trl_ext.rollout.compiled_decode`; text only), the same logits up to rounding.
    """
    config = settings.generation_config()
    compiled = None
    if settings.compile_config is not None and vision is None:
        compiled = copy.deepcopy(config)
        compiled.compile_config = settings.compile_config
    chunks, logprob_chunks = [], []
    # FSDP2: every step all-gathers weights, so every process keeps stepping until all are done.
    synced = {"synced_gpus": True} if is_fsdp_sharded(model) and _world_size() > 1 else {}
    with eval_mode(model), _generation_config(model, config):
        for start in range(0, prompt_ids.shape[0], batch_size):
            ids, mask = prompt_ids[start : start + batch_size], prompt_mask[start : start + batch_size]
            sampler = settings.sampler(None if row_keys is None else row_keys[start : start + batch_size])
            extra, banned = generation_inputs(
                None if vision is None else vision[start : start + batch_size], ids, sampler
            )
            processors = LogitsProcessorList(([sampler] if sampler is not None else []) + banned)
            cache = prefill_prompts(model, ids, mask) if share_prompts and vision is None else None
            static = static_decode_cache(model, ids, settings.max_new_tokens, cache) if compiled is not None else None
            if static is not None or cache is not None:
                extra.update(cache_kwargs(static if static is not None else cache))
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=compiled if static is not None else config,
                logits_processor=processors, **extra, **synced,
            )  # fmt: skip
            chunks.append(out[:, ids.shape[1] :])
            if sampler is not None:
                logprob_chunks.append(sampler.logprobs()[:, : chunks[-1].shape[1]])
    width = max(1, max(c.shape[1] for c in chunks))
    shape = (prompt_ids.shape[0], width)
    responses = torch.full(shape, settings.pad_token_id, dtype=torch.long, device=prompt_ids.device)
    generated = torch.zeros_like(responses, dtype=torch.bool)
    logprobs = torch.zeros(shape, dtype=torch.float32, device=prompt_ids.device) if logprob_chunks else None
    row = 0
    for i, chunk in enumerate(chunks):
        responses[row : row + chunk.shape[0], : chunk.shape[1]] = chunk
        generated[row : row + chunk.shape[0], : chunk.shape[1]] = True
        if logprobs is not None:
            logprobs[row : row + chunk.shape[0], : chunk.shape[1]] = logprob_chunks[i].to(logprobs.device)
        row += chunk.shape[0]
    responses, mask, contains_stop = finish_responses(responses, generated, settings)
    if not return_logprobs:
        return responses, mask, contains_stop
    if logprobs is not None:
        logprobs = torch.where(mask != 0, logprobs, torch.zeros_like(logprobs))
    return responses, mask, contains_stop, logprobs


def _world_size() -> int:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if distributed else 1


# ------------------------------------------------------------------------------------------------ scoring
@torch.no_grad()
def rollout_logprobs(model: nn.Module, rollout: Rollout, batch_size: int, temperature: float) -> torch.Tensor:
    """``(B, T)`` fp32 log-probs of ``model`` at the responses of ``rollout`` (:func:`forward_response`, no gradient,
    ``batch_size`` rows per pass). The caller sets the model's mode and any autocast."""
    parts = []
    for chunk in rollout.split(batch_size):
        out = _forward_response(
            model, chunk.input_ids, chunk.attention_mask, chunk.response_length, temperature=temperature,
            vision=chunk.vision,
        )  # fmt: skip
        parts.append(out.logprobs.float())
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------------ the rollout
class RolloutGenerator:
    """Makes :class:`Rollout` s. Configure once, call per prompt batch: ``rollout = generator(model, ids, mask)``.

    Args:
        settings: the sampling settings (temperature, stop tokens, N samples per prompt, ...).
        reward: a :class:`RolloutReward`.
        reference: a :class:`ReferencePolicy`, or ``None`` to skip the reference forward pass (``ref_logprobs`` is
            then ``None``; trainers do this when the KL coefficient is 0 and not adaptive).
        forward_batch_size: rows per ``generate`` call and per scoring forward pass.
        accelerator: the trainer's `accelerate.Accelerator` (generation unwraps the model through it; generation and
            scoring run under its autocast, as the training forward does); ``None`` for a plain module.
        missing_eos_penalty: subtracted from the scores of responses without a stop token.
        policy_of: maps the unwrapped trainable model to the policy that generates (e.g. ``lambda m: m.policy``).
        with_values: read the critic's values (``model(...)`` must return ``value``).
        gather_deepspeed3_params: passed to `trl.models.unwrap_model_for_generation`.
        gradient_checkpointing_kwargs: passed to it too (it re-enables checkpointing after generation).
        chunk_size: tokens per chunk of the log-prob computation.
        logprobs_from_generation: take the policy's sampling-time log-probs from ``generate`` itself (recorded by
            :class:`~trl_ext.rollout.sampling.SampleAndRecord`) instead of a separate forward pass. Only used when
            the policy computes in fp32 without mixed precision: in 16-bit, cached decoding and a full forward pass
            differ by more than the PPO ratio tolerates, so the forward pass is kept there.
        nonfinite_rewards: ``"error"`` raises on a NaN / ±inf score, ``"drop"`` gives those samples zero weight
            (:func:`~trl_ext.rollout.finite.screen_rewards`).
        max_abs_reward: a finite score beyond ``±max_abs_reward`` raises, naming the sample (``None``: no limit).
        engine: a :class:`~trl_ext.rollout.vllm.VLLMRolloutEngine` that samples instead of ``generate`` (the policy's
            log-probs then come from a forward pass; the engine's are kept in ``Rollout.engine_logprobs``).
        shared_prefix: with ``num_samples_per_prompt > 1``, run each distinct prompt once and fan its KV cache out
            to its samples (:mod:`~trl_ext.rollout.shared_prefix`): in ``generate`` always (same logits, same draws),
            in the reference / separate-critic / reward-model passes when that model computes in fp32 without mixed
            precision (in 16-bit they run the rows whole, as the policy's log-probs do, so that old and new values
            and a policy equal to its reference agree as before). Text rows only.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        reward: RolloutReward,
        reference: ReferencePolicy | None,
        forward_batch_size: int,
        accelerator=None,
        missing_eos_penalty: float | None = None,
        policy_of: Callable[[nn.Module], nn.Module] = lambda model: model,
        with_values: bool = False,
        gather_deepspeed3_params: bool = True,
        gradient_checkpointing_kwargs: dict | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        logprobs_from_generation: bool = True,
        nonfinite_rewards: str = "error",
        max_abs_reward: float | None = DEFAULT_MAX_ABS_REWARD,
        engine=None,
        shared_prefix: bool = True,
    ):
        self.engine = engine
        self.settings, self.reward, self.reference = settings, reward, reference
        self.logprobs_from_generation, self.nonfinite_rewards = logprobs_from_generation, nonfinite_rewards
        self.max_abs_reward = max_abs_reward
        self.forward_batch_size, self.accelerator = int(forward_batch_size), accelerator
        self.missing_eos_penalty, self.policy_of, self.with_values = missing_eos_penalty, policy_of, with_values
        self.gather_deepspeed3_params = gather_deepspeed3_params
        self.gradient_checkpointing_kwargs, self.chunk_size = gradient_checkpointing_kwargs, chunk_size
        self.shared_prefix = shared_prefix

    def _unwrapped(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model) if self.accelerator is not None else model

    @contextlib.contextmanager
    def generation_model(self, model: nn.Module) -> Iterator[nn.Module]:
        """The policy of the (possibly DDP/DeepSpeed/FSDP-wrapped) trained ``model``, ready to ``generate``: unwrapped,
        with ZeRO-3 weights gathered for the block when asked (`trl.models.unwrap_model_for_generation`), and the
        block run under the accelerator's autocast (mixed precision): the unwrapped policy's own ``forward`` is not
        the autocast-wrapped one of the trained module, so without it ``bf16=True`` would sample in fp32."""
        if self.accelerator is None:
            yield self.policy_of(model)
            return
        from trl.models import unwrap_model_for_generation

        with (
            unwrap_model_for_generation(
                model,
                self.accelerator,
                gather_deepspeed3_params=self.gather_deepspeed3_params,
                gradient_checkpointing_kwargs=self.gradient_checkpointing_kwargs,
            ) as unwrapped,
            self._autocast(),
        ):
            yield self.policy_of(unwrapped)

    @contextlib.contextmanager
    def _reference(self, model: nn.Module) -> Iterator[nn.Module | None]:
        """The reference module to score with, or ``None`` when no reference is scored."""
        if self.reference is None:
            yield None
            return
        with self.reference.module(self.policy_of(self._unwrapped(model))) as reference:
            yield reference

    def _autocast(self):
        return self.accelerator.autocast() if self.accelerator is not None else contextlib.nullcontext()

    def _full_precision(self, policy: nn.Module) -> bool:
        if self.accelerator is not None and str(self.accelerator.mixed_precision) != "no":
            return False
        param = next(policy.parameters(), None)
        return param is None or param.dtype == torch.float32

    def _values(self, model: nn.Module, ids, mask, T: int, vision=None, share: bool = False) -> torch.Tensor:
        """Critic values without the policy's log-probs: through ``critic_values`` when the module has it (e.g.
        :class:`~trl_ext.trainers.ppo.policy_value.PolicyAndValueModel`, which then skips the policy when the critic is
        a separate model), else through :func:`forward_response`. ``share``: a separate fp32 critic (``value_model``)
        runs each distinct prompt once."""
        critic = getattr(self._unwrapped(model), "value_model", None) if share else None
        if critic is not None and self._full_precision(critic):
            P = ids.shape[1] - T
            values = shared_prompt_values(critic, ids[:, :P], mask[:, :P], ids[:, P:], mask[:, P:])
            if values is not None:
                return values
        critic_values = getattr(self._unwrapped(model), "critic_values", None)
        if critic_values is not None:  # below the root module: under FSDP2, run as its forward
            return call_as_root_forward(self._unwrapped(model), critic_values, ids, mask, T, vision=vision)
        out = _forward_response(
            model, ids, mask, T, temperature=self.settings.temperature, return_values=True, vision=vision
        )
        return out.values

    def __call__(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        vision: VisionInputs | None = None,
        row_keys: torch.Tensor | None = None,
        columns: dict[str, list] | None = None,
    ) -> Rollout:
        """Sample and score responses for left-padded ``prompt_ids``/``prompt_mask`` ``(B_p, P)``.

        ``model`` is the trainable module as the trainer holds it (possibly DDP/DeepSpeed/FSDP-wrapped); its forward
        gives the policy's logits (and ``value`` with ``with_values``). ``vision``: the prompts' image inputs.
        ``row_keys``: ``(B_p · N,)`` keys of the sampled rows' random streams (see :func:`generate_responses`).
        ``columns``: the prompts' dataset reward columns (``{name: B_p values}``), each value repeated for the
        prompt's ``N`` samples and passed to the reward (:mod:`.columns`).
        """
        n = self.settings.num_samples_per_prompt
        # FSDP2: submodules run only as the root's forward, so every pass keeps its whole rows there
        share = self.shared_prefix and n > 1 and vision is None and not is_fsdp_sharded(self._unwrapped(model))
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        vision = vision.repeat_interleave(n) if vision is not None else None
        columns = repeat_columns(columns, n)
        start = time.perf_counter()
        engine_logprobs = None
        if self.engine is not None:  # vLLM: weights loaded into the engine when stale, then sampled there
            policy = self.policy_of(self._unwrapped(model))
            responses, response_mask, contains_stop, engine_logprobs = self.engine.generate(
                policy, prompt_ids, prompt_mask, self.settings
            )
            sampled_logprobs = None
        else:
            with self.generation_model(model) as policy:
                responses, response_mask, contains_stop, sampled_logprobs = call_as_root_forward(
                    self._unwrapped(model), generate_responses, policy, prompt_ids, prompt_mask, self.settings,
                    self.forward_batch_size, return_logprobs=True, vision=vision, row_keys=row_keys,
                    share_prompts=share,
                )  # fmt: skip
                if not (self.logprobs_from_generation and self._full_precision(policy)):
                    sampled_logprobs = None
        generation_time = time.perf_counter() - start
        start = time.perf_counter()
        ids = torch.cat([prompt_ids, responses], 1)
        mask = torch.cat([prompt_mask, response_mask], 1)
        T = responses.shape[1]
        parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "ref_logprobs": [], "values": [], "scores": []}
        chunks = [slice(s, s + self.forward_batch_size) for s in range(0, ids.shape[0], self.forward_batch_size)]

        def rows_vision(rows: slice):
            return vision[rows] if vision is not None else None

        # One pass per model over the chunks, so that an offloaded reference / reward model (`ref_offload`,
        # `reward_offload`) is moved to the accelerator once per rollout; every chunk is scored as it would be alone.
        with eval_mode(model):
            with torch.no_grad(), self._autocast():
                for rows in chunks:
                    if sampled_logprobs is not None:
                        parts["logprobs"].append(sampled_logprobs[rows])
                        if self.with_values:
                            values = self._values(model, ids[rows], mask[rows], T, rows_vision(rows), share)
                            parts["values"].append(values)
                    else:
                        out = _forward_response(
                            model, ids[rows], mask[rows], T, temperature=self.settings.temperature,
                            return_values=self.with_values, chunk_size=self.chunk_size, vision=rows_vision(rows),
                        )  # fmt: skip
                        parts["logprobs"].append(out.logprobs)
                        if out.values is not None:
                            parts["values"].append(out.values)
                with self._reference(model) as reference:
                    share_ref = share and reference is not None and self._full_precision(reference)
                    for rows in chunks if reference is not None else ():
                        ref = shared_prompt_logprobs(
                            reference, prompt_ids[rows], prompt_mask[rows], responses[rows], response_mask[rows],
                            temperature=self.settings.temperature, chunk_size=self.chunk_size,
                        ) if share_ref else None  # fmt: skip
                        if ref is None:  # a PEFT reference is the policy, below an FSDP2 root: run as its forward
                            ref = call_as_root_forward(
                                self._unwrapped(model), _forward_response, reference, ids[rows], mask[rows], T,
                                temperature=self.settings.temperature, chunk_size=self.chunk_size,
                                vision=rows_vision(rows),
                            ).logprobs  # fmt: skip
                        parts["ref_logprobs"].append(ref)
                reward_model = getattr(self.reward, "model", None)
                share_reward = share and isinstance(self.reward, _reward.RolloutReward) and reward_model is not None
                share_reward = {"share_prompts": True} if share_reward and self._full_precision(reward_model) else {}
                weighted = isinstance(self.reward, WeightedRewards)
                extra = {"return_components": True} if weighted else {}
                with getattr(self.reward, "placed", contextlib.nullcontext)():
                    for rows in chunks:
                        batch = (prompt_ids[rows], prompt_mask[rows], responses[rows], response_mask[rows])
                        if columns is not None:
                            extra["columns"] = select_columns(columns, rows)
                        parts["scores"].append(self.reward(*batch, rows_vision(rows), **share_reward, **extra))
        components = None
        if weighted:  # (scores, {name: values}) per chunk
            parts["scores"], chunk_components = zip(*parts["scores"])
            components = {k: torch.cat([c[k] for c in chunk_components]) for k in chunk_components[0]}
        scores = torch.cat(parts["scores"])
        if self.missing_eos_penalty is not None:
            scores = torch.where(contains_stop, scores, scores - self.missing_eos_penalty)
        rollout = Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=responses,
            response_mask=response_mask,
            logprobs=torch.cat(parts["logprobs"]),
            ref_logprobs=torch.cat(parts["ref_logprobs"]) if self.reference is not None else None,
            scores=scores,
            contains_stop=contains_stop,
            values=torch.cat(parts["values"]) if parts["values"] else None,
            num_samples_per_prompt=n,
            timings={"generation": generation_time, "scoring": time.perf_counter() - start},
            vision=vision,
            engine_logprobs=engine_logprobs,
            columns=columns,
            reward_components=components,
        )
        many = self.accelerator is not None and self.accelerator.num_processes > 1
        reduce = (lambda count: self.accelerator.reduce(count, reduction="sum")) if many else None
        tokenizer = getattr(self.reward, "tokenizer", None)
        return screen_rewards(rollout, self.nonfinite_rewards, tokenizer, reduce, self.max_abs_reward)


# Names this module used to re-export: import them from `trl_ext.rollout` (or their own modules).
_MOVED = {"trl_ext.rollout.scoring": ("PolicyOutput", "causal_lm_outputs", "forward_response"),
          "trl_ext.rollout.probing": ("supports_logits_to_keep",), "trl_ext.rollout.reference": ("ReferencePolicy",),
          "trl_ext.rollout.reward": ("RolloutReward",)}  # fmt: skip
__getattr__ = moved_names(__name__, {name: module for module, names in _MOVED.items() for name in names})
