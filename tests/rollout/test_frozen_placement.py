"""Where the online trainers keep their frozen models: ``frozen_models_placement`` (`trl_ext.trainers.common.frozen`).

- the option: its values, its documentation in every online config, and its conflict with ``ref_offload`` /
  ``reward_offload``;
- the decision per engine (``auto`` is today's behaviour: sharded under ZeRO-3, replicated elsewhere; ``sharded`` is
  refused where nothing shards weights), checked on a trainer stand-in with the engines faked and the preparation
  functions recorded;
- FSDP2 in one process (a 1-rank gloo group, real ``fully_shard``): a sharded frozen model is sharded per transformer
  block plus its root, scores exactly as unsharded through every path the rollout uses (the reward model's backbone
  and head run as its forward, the reference through its own forward), and the shared-prefix passes, whose number of
  forward calls depends on each process's rows, step aside for it.

The 2-process runs (PPO, RePULSe and the proposal trainer under FSDP2 with ``sharded``, PPO under ZeRO-3 with
``replicated``, each equal to the replicated / 1-process run) are in `test_distributed_matrix.py`.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trl_ext import HarmlessnessConfig, PPOConfig, ProposalConfig
from trl_ext.models.fsdp import call_as_root_forward, is_fsdp_root, is_fsdp_sharded
from trl_ext.models.reward import _decoder_parts, get_sequence_scores, get_token_scores
from trl_ext.rollout import forward_response
from trl_ext.rollout.reference import ReferencePolicy
from trl_ext.rollout.reward import RolloutReward
from trl_ext.rollout.shared_prefix import prefill_prompts, shared_prompt_logprobs, shared_prompt_scores
from trl_ext.testing import build_causal_lm, build_sequence_classifier
from trl_ext.trainers.common import frozen
from trl_ext.trainers.common.online_config import FROZEN_MODEL_PLACEMENTS, OnlineConfig

CONFIGS = (OnlineConfig, PPOConfig, HarmlessnessConfig, ProposalConfig)


def config(cls=PPOConfig, **kwargs):
    return cls(output_dir="unused", report_to="none", use_cpu=True, bf16=False, **kwargs)


# ------------------------------------------------------------------------------------------------ the option
@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_option_defaults_to_auto_and_is_documented(cls):
    assert config(cls).frozen_models_placement == "auto"
    field = {f.name: f for f in dataclasses.fields(cls)}["frozen_models_placement"]
    assert field.metadata["help"] and field.metadata["choices"] == list(FROZEN_MODEL_PLACEMENTS)
    assert re.search(r"^\s+frozen_models_placement \(`str`, \*optional\*, defaults to `\"auto\"`\)", cls.__doc__, re.M)
    for value in FROZEN_MODEL_PLACEMENTS:
        assert config(cls, frozen_models_placement=value).frozen_models_placement == value


def test_unknown_value_is_refused():
    with pytest.raises(ValueError, match=r"PPOConfig: unknown frozen_models_placement 'shard'; choose one of auto"):
        config(frozen_models_placement="shard")


@pytest.mark.parametrize("offload", [{"ref_offload": True}, {"reward_offload": True}])
def test_sharded_excludes_offloading(offload):
    name = next(iter(offload))
    with pytest.raises(ValueError, match=rf"frozen_models_placement='sharded' and {name}=True contradict"):
        config(frozen_models_placement="sharded", **offload)
    for placement in ("auto", "replicated"):  # a replica can be kept on the CPU
        assert getattr(config(frozen_models_placement=placement, **offload), name)


def test_recipe_flag_parses():
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--report_to", "none", "--bf16", "false", "--frozen_models_placement", "sharded"]
    )
    assert args.frozen_models_placement == "sharded"


# ------------------------------------------------------------------------------------------- the decisions
@pytest.mark.parametrize(
    ("engine", "auto"),
    [("single", "replicated"), ("ddp", "replicated"), ("zero1", "replicated"), ("zero2", "replicated"),
     ("zero3", "sharded"), ("fsdp1", "replicated"), ("fsdp2", "replicated")],
)  # fmt: skip
def test_resolved_placement_per_engine(engine, auto):
    assert frozen.resolve_frozen_placement("auto", engine) == auto
    assert frozen.resolve_frozen_placement("replicated", engine) == "replicated"
    if engine in ("zero3", "fsdp2"):
        assert frozen.resolve_frozen_placement("sharded", engine) == "sharded"
        return
    with pytest.raises(ValueError, match=r"frozen_models_placement='sharded' needs an engine that shards") as err:
        frozen.resolve_frozen_placement("sharded", engine)
    message = str(err.value)
    assert "deepspeed_zero3.yaml" in message and "fsdp2.yaml" in message and "'auto' (or 'replicated')" in message
    assert ("fsdp_version: 2" in message) == (engine == "fsdp1")


def test_engine_of_an_accelerator():
    def accelerator(processes=1, deepspeed=None, fsdp=None):
        return SimpleNamespace(num_processes=processes, state=SimpleNamespace(deepspeed_plugin=deepspeed,
                                                                              fsdp_plugin=fsdp))  # fmt: skip

    assert frozen.frozen_engine(accelerator()) == "single"
    assert frozen.frozen_engine(accelerator(2)) == "ddp"
    assert frozen.frozen_engine(accelerator(2, deepspeed=SimpleNamespace(zero_stage=3))) == "zero3"
    assert frozen.frozen_engine(accelerator(2, deepspeed=SimpleNamespace(zero_stage=2))) == "zero2"
    assert frozen.frozen_engine(accelerator(2, fsdp=SimpleNamespace(fsdp_version=2))) == "fsdp2"
    assert frozen.frozen_engine(accelerator(2, fsdp=SimpleNamespace())) == "fsdp1"


class _Trainer(frozen.FrozenModelsMixin):
    """What `FrozenModelsMixin` reads of an online trainer."""

    def __init__(self, engine: str, placement: str, **offload):
        self.args = SimpleNamespace(frozen_models_placement=placement, ref_offload=False, reward_offload=False)
        vars(self.args).update(offload)
        self.accelerator = SimpleNamespace(device=torch.device("cpu"), engine=engine)
        self.is_deepspeed_enabled = engine.startswith("zero")
        self.ref_model, self.reward_model = nn.Linear(2, 2), nn.Linear(2, 1)
        self.reference = ReferencePolicy(self.ref_model)


@pytest.fixture
def calls(monkeypatch) -> list:
    """Each preparation as ``(function, module)``; the engine comes from the stand-in accelerator."""
    import trl.models

    log = []

    def recorder(label):
        def prepare(module, accelerator, *args):
            log.append((label, module))
            return module

        return prepare

    monkeypatch.setattr(frozen, "frozen_engine", lambda accelerator: accelerator.engine)
    monkeypatch.setattr(trl.models, "prepare_deepspeed", recorder("prepare_deepspeed"))
    monkeypatch.setattr(frozen, "replicated_deepspeed_engine", recorder("replicated_deepspeed_engine"))
    monkeypatch.setattr(frozen, "shard_with_fsdp2", recorder("shard_with_fsdp2"))
    return log


@pytest.mark.parametrize(
    ("engine", "placement", "expected", "sharded"),
    [
        ("zero3", "auto", "prepare_deepspeed", True),  # today's behaviour: a ZeRO-3 engine
        ("zero3", "sharded", "prepare_deepspeed", True),
        ("zero3", "replicated", "replicated_deepspeed_engine", False),
        ("zero2", "auto", "prepare_deepspeed", False),  # a stage-0 engine, as before
        ("zero2", "replicated", "prepare_deepspeed", False),
        ("fsdp2", "auto", None, False),  # moved to the device, as before
        ("fsdp2", "sharded", "shard_with_fsdp2", True),
        ("fsdp2", "replicated", None, False),
        ("ddp", "auto", None, False),
        ("single", "replicated", None, False),
    ],
)
def test_placement_per_engine_and_option(calls, engine, placement, expected, sharded):
    trainer = _Trainer(engine, placement)
    ref, reward = trainer.ref_model, trainer.reward_model
    trainer._place_frozen_models()
    assert calls == ([] if expected is None else [(expected, ref), (expected, reward)])
    assert trainer.reference.model is trainer.ref_model and trainer.reference.offload_device is None
    assert trainer.frozen_models_sharded is sharded


@pytest.mark.parametrize("engine", ["ddp", "zero2", "single", "fsdp1"])
def test_sharded_is_refused_at_trainer_start_where_nothing_shards(calls, engine):
    with pytest.raises(ValueError, match="frozen_models_placement='sharded' needs an engine that shards weights"):
        _Trainer(engine, "sharded")._place_frozen_models()
    assert calls == []


def test_an_offloaded_replica_stays_on_the_cpu(calls):
    trainer = _Trainer("fsdp2", "replicated", ref_offload=True)
    trainer._place_frozen_models()
    assert calls == [] and trainer.reference.offload_device == torch.device("cpu")
    assert not trainer.frozen_models_sharded


def test_nothing_to_gather_without_zero3_partitions():
    assert frozen.gather_zero3_partitions(nn.Linear(2, 2)) == 0


# ------------------------------------------------------------------------------------- FSDP2, one process
@pytest.fixture
def one_rank_group():
    """A 1-process gloo group for real ``fully_shard`` calls, destroyed afterwards."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already running")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _accelerator():
    from torch.distributed.fsdp import OffloadPolicy

    plugin = SimpleNamespace(
        cpu_offload=OffloadPolicy(), mixed_precision_policy=None, transformer_cls_names_to_wrap=None
    )
    return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), process_index=0, device=torch.device("cpu"))


def _rows(tokenizer, n=2):
    """Left-padded prompts repeated ``n`` times (as a rollout's rows) and their responses."""
    torch.manual_seed(0)
    prompts = torch.randint(5, 200, (3, 6))
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :2] = 0
    prompts = torch.where(prompt_mask.bool(), prompts, tokenizer.pad_token_id)
    prompts, prompt_mask = prompts.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
    responses = torch.randint(5, 200, (prompts.shape[0], 4))
    response_mask = torch.ones_like(responses)
    response_mask[1, 2:] = 0
    return prompts, prompt_mask, responses, response_mask


def test_fsdp2_sharded_reward_model_scores_as_unsharded(one_rank_group, tiny_tokenizer):
    reward = build_sequence_classifier("gpt_neox", tokenizer=tiny_tokenizer).eval()
    prompts, prompt_mask, responses, response_mask = rows = _rows(tiny_tokenizer)
    ids, mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, response_mask], 1)
    with torch.no_grad():
        expected = get_sequence_scores(reward, ids, mask)
        expected_tokens = get_token_scores(reward, ids, mask)
        expected_shared = shared_prompt_scores(reward, *rows)
    assert expected_shared is not None  # unsharded: the prompts are shared
    frozen.shard_with_fsdp2(reward, _accelerator(), "reward model")
    blocks = [type(m).__name__ for m in reward.modules() if is_fsdp_root(m) and m is not reward]
    assert is_fsdp_root(reward) and blocks == ["FSDPGPTNeoXLayer"] * 2  # one unit per block, then the root
    assert not any(p.requires_grad for p in reward.parameters()) and not reward.training
    backbone, head = _decoder_parts(reward)
    with pytest.raises(RuntimeError, match="DTensor"):  # the backbone alone: the root's embeddings are shards
        backbone(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        torch.testing.assert_close(get_sequence_scores(reward, ids, mask), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(get_token_scores(reward, ids, mask), expected_tokens, rtol=0, atol=1e-6)
        assert shared_prompt_scores(reward, *rows) is None  # its calls would depend on this process's rows
    scorer = RolloutReward(reward, tiny_tokenizer)
    for share in (False, True):
        torch.testing.assert_close(scorer(*rows, share_prompts=share), expected_shared, rtol=0, atol=1e-5)


def test_fsdp2_sharded_reference_scores_and_generates_as_unsharded(one_rank_group, tiny_tokenizer):
    from trl_ext.rollout import SamplingSettings, generate_responses
    from trl_ext.rollout.sampling import row_keys

    reference = build_causal_lm("gpt_neox", tokenizer=tiny_tokenizer).eval()
    prompts, prompt_mask, responses, response_mask = rows = _rows(tiny_tokenizer)
    ids, mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, response_mask], 1)
    settings = SamplingSettings(max_new_tokens=5, pad_token_id=tiny_tokenizer.pad_token_id, temperature=1.0)
    keys = row_keys(0, 0, 0, torch.arange(prompts.shape[0]))
    with torch.no_grad():
        expected = forward_response(reference, ids, mask, responses.shape[1]).logprobs
        samples = generate_responses(reference, prompts, prompt_mask, settings, 6, row_keys=keys, share_prompts=True)
        assert prefill_prompts(reference, prompts, prompt_mask) is not None
    frozen.shard_with_fsdp2(reference, _accelerator(), "reference")
    assert is_fsdp_sharded(reference)
    with torch.no_grad():
        got = forward_response(reference, ids, mask, responses.shape[1]).logprobs  # the logits path: its forward
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        assert (
            shared_prompt_logprobs(reference, *rows) is None
            and prefill_prompts(reference, prompts, prompt_mask) is None
        )
        again = generate_responses(reference, prompts, prompt_mask, settings, 6, row_keys=keys, share_prompts=True)
    assert torch.equal(again[0], samples[0]) and torch.equal(again[1], samples[1])


def test_fsdp2_refuses_a_frozen_model_with_meta_weights(one_rank_group, tiny_tokenizer):
    reward = build_sequence_classifier("gpt_neox", tokenizer=tiny_tokenizer)
    reward.score.weight = nn.Parameter(torch.empty_like(reward.score.weight, device="meta"))
    with pytest.raises(ValueError, match=r"weights on the meta device in process 0 \(score.weight"):
        frozen.shard_with_fsdp2(reward, _accelerator(), "reward model")


def test_call_as_root_forward_is_a_plain_call_without_fsdp():
    model = nn.Linear(2, 2)
    assert call_as_root_forward(model, lambda a, b=0: a + b, 1, b=2) == 3
    assert not is_fsdp_root(model) and not is_fsdp_sharded(model)
