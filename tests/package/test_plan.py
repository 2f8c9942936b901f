"""The memory planner (`trl_ext.plan`): parameter counts of known configs, the per-engine accounting against the
ZeRO formulas worked by hand, the byte counts of real tensors after an AdamW step (weights, gradients, optimizer
states, LoRA adapters, 8-bit Adam, 4/8-bit weights), the trainers' model roles, the CLI and its errors, and the table
of docs/distributed.md."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.plan import (
    ENGINES,
    config_shape,
    format_plan,
    lora_params,
    param_count_shape,
    peak_table,
    plan_memory,
    quantized_bytes,
    resolve_model,
)
from trl_ext.plan.__main__ import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
G = 10**9


def _nbytes(tensors) -> int:
    """Bytes of distinct storages (bitsandbytes shares its quantile maps between parameters)."""
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _adamw_step(model, optimizer_cls=torch.optim.AdamW):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_cls(params, lr=1e-3)
    ids = torch.randint(3, 200, (2, 7))
    model.train()
    model(input_ids=ids, labels=ids).loss.float().backward()
    optimizer.step()
    states = [v for state in optimizer.state.values() for v in state.values()]
    return {
        "weights": _nbytes(model.parameters()),
        "gradients": _nbytes(p.grad for p in params),
        "optimizer states": _nbytes(states),
    }


def _planned(plan, engine="ddp", model="policy") -> dict[str, int]:
    p = plan.engines[engine]
    return {c: p.get(c, model) for c in ("weights", "gradients", "optimizer states")}


# ------------------------------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize(
    ("name", "count"),
    [("smollm2-135m", 134_515_008), ("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248),
     ("HuggingFaceTB/SmolLM2-135M", 134_515_008)],
)  # fmt: skip
def test_known_models_have_their_published_parameter_counts(name, count):
    assert resolve_model(name).numel == count


def test_config_file_and_folder_give_the_real_models_shapes(tmp_path):
    model = kit.build_causal_lm("llama")
    model.config.save_pretrained(tmp_path)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        shape = resolve_model(spec)
        assert [(p.name, p.shape) for p in shape.params] == real
    critic = kit.build_sequence_classifier("llama")
    assert config_shape(critic.config, "seq_cls").numel == sum(p.numel() for p in critic.parameters())
    tied = kit.build_causal_lm("gpt2")  # tied embeddings are counted once
    assert config_shape(tied.config).numel == sum(p.numel() for p in tied.parameters())


@pytest.mark.parametrize(("text", "count"), [("135m", 135_000_000), ("1.2B", 1_200_000_000), ("8e9", 8 * G),
                                             ("8030261248", 8_030_261_248)])  # fmt: skip
def test_parameter_counts(text, count):
    shape = resolve_model(text)
    assert shape.numel == count and not shape.exact


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="Unknown model 'no-such-model'.*known models"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="without a config.json"):
        resolve_model(str(tmp_path))


# ------------------------------------------------------------------------------------------------ accounting
def test_engines_follow_the_zero_formulas():
    """Ψ = 10⁹ parameters in one tensor, N = 8, weights loaded fp32, bf16 mixed precision, AdamW (the +4 is torch's
    fp32 `step` of the one (flat) tensor). ZeRO paper: ZeRO-2 holds 2Ψ + (2 + 12)Ψ/N, ZeRO-3 16Ψ/N."""
    psi, n = 10**9, 8
    plan = plan_memory(param_count_shape(psi), trainer="dpo", num_gpus=n)
    expected = {  # weights, gradients, optimizer states, reference (frozen)
        "ddp": (4 * psi, 4 * psi, 8 * psi + 4, 4 * psi),
        "zero2": (2 * psi, 2 * psi // n, 12 * psi // n + 4, 2 * psi),
        "zero3": (2 * psi // n, 2 * psi // n, 12 * psi // n + 4, 2 * psi // n),
        "fsdp2": (4 * psi // n, 4 * psi // n, 8 * psi // n + 4, 4 * psi // n),  # DPO shards the reference
    }
    for engine, (w, g, o, ref) in expected.items():
        p = plan.engines[engine]
        assert (p.get("weights"), p.get("gradients"), p.get("optimizer states")) == (w, g, o), engine
        assert p.get("frozen weights", "reference") == ref, engine
    assert plan.engines["ddp"].get("DDP gradient buckets") == 4 * psi  # DDP's second copy of the gradients
    zero3 = plan.engines["zero3"]
    assert zero3.get("ZeRO-3 reduce bucket") == 2 * 500_000_000  # DeepSpeed's default bucket, bf16, up front
    assert zero3.persistent - zero3.get("frozen weights") - zero3.get("ZeRO-3 reduce bucket") == 16 * psi // n + 4
    # PPO's frozen models stay replicated under FSDP2; bf16 weights under plain DDP make AdamW's moments bf16 too
    ppo = plan_memory(param_count_shape(psi), "fsdp2", trainer="ppo", num_gpus=n, reward_model=None)
    assert ppo.engines["fsdp2"].get("frozen weights", "reference") == 4 * psi
    bf16 = plan_memory(param_count_shape(psi), "ddp", trainer="dpo", dtype="bfloat16")
    assert _planned(bf16, "ddp") == {"weights": 2 * psi, "gradients": 2 * psi, "optimizer states": 4 * psi + 4}
    assert "DDP gradient buckets" not in {r.component for r in bf16.engines["ddp"].rows}  # one process: no DDP


def test_sharding_rounds_up_per_flat_partition_and_per_fsdp_shard():
    shape = resolve_model("smollm2-135m")
    plan = plan_memory(shape, ("zero3", "fsdp2"), trainer="prm", num_gpus=7, bf16=False)
    assert plan.engines["zero3"].get("weights") == -(-shape.numel // 7) * 4
    fsdp = sum(-(-p.shape[0] // 7) * p.numel // p.shape[0] for p in shape.params) * 4
    assert plan.engines["fsdp2"].get("weights") == fsdp


def test_zero3_keeps_small_tensors_whole_and_reading_shapes_works_inside_a_zero3_process():
    """Under ZeRO-3 transformers would build `from_config` models under `deepspeed.zero.Init` (which fails on the
    meta device): the planner must still read shapes in a process whose DeepSpeed config is stage 3."""
    pytest.importorskip("deepspeed")
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    config = kit.build_causal_lm("llama").config
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        assert is_deepspeed_zero3_enabled()
        shape = config_shape(config)
    finally:
        unset_hf_deepspeed_config()
    del keep
    assert shape.numel == sum(p.numel() for p in kit.build_causal_lm("llama").parameters())
    plan = plan_memory(shape, "zero3", trainer="prm", num_gpus=2, zero3_param_persistence_threshold=5000)
    small = sum(p.numel for p in plan.roles[0].shape.params if p.numel < 5000)
    assert small > 0 and plan.engines["zero3"].get("ZeRO-3 persistent parameters") == 2 * small


def test_zero3_generation_gathers_the_whole_trained_module():
    n = 8
    ppo = plan_memory("smollm2-135m", "zero3", trainer="ppo", num_gpus=n)
    policy, critic = resolve_model("smollm2-135m"), resolve_model("smollm2-135m", "seq_cls")
    assert ppo.engines["zero3"].get("generation gather") == 2 * (policy.numel + critic.numel)
    assert ppo.engines["zero3"].transient == 2 * (policy.numel + critic.numel)
    off = plan_memory("smollm2-135m", "zero3", trainer="ppo", num_gpus=n, ds3_gather_for_generation=False)
    assert off.engines["zero3"].get("generation gather") == 0
    assert 0 < off.engines["zero3"].transient < ppo.engines["zero3"].transient  # one layer at a time
    dpo = plan_memory("smollm2-135m", "zero3", trainer="dpo", num_gpus=n)
    assert dpo.engines["zero3"].get("generation gather") == 0


@pytest.mark.parametrize(
    ("trainer", "options", "roles"),
    [
        ("ppo", {}, [("policy", True), ("critic", True), ("reference", False), ("reward", False)]),
        ("ppo", {"lora_r": 8}, [("policy", True), ("critic", True), ("reward", False)]),
        ("ppo", {"shared_actor_critic": True}, [("policy", True), ("reference", False), ("reward", False)]),
        ("repulse", {}, [("policy", True), ("proposal", True), ("reference", False), ("reward", False)]),
        ("repulse", {"lora_r": 8}, [("policy", True), ("proposal", True), ("reward", False)]),
        ("proposal", {}, [("proposal", True), ("reference", False), ("reward", False)]),
        ("dpo", {}, [("policy", True), ("reference", False)]),
        ("kto", {"precompute_ref_log_probs": True}, [("policy", True)]),
        ("kd", {}, [("student", True), ("teacher", False)]),
        ("prm", {}, [("model", True)]),
    ],
)
def test_trainer_roles(trainer, options, roles):
    plan = plan_memory("smollm2-135m", "ddp", trainer=trainer, **options)
    assert [(r.name, r.trained) for r in plan.roles] == roles
    if trainer == "prm":
        assert plan.roles[0].shape == resolve_model("smollm2-135m", "token_cls")
    if options.get("shared_actor_critic"):
        assert plan.engines["ddp"].get("gradients") == 4 * (plan.roles[0].shape.numel + 576 + 1)  # + value head


def test_lora_trains_only_the_adapters_and_repulse_keeps_the_proposal_base():
    shape = resolve_model("llama-3.1-8b")
    adapters = lora_params(shape, 16)  # PEFT's default targets for Llama: q_proj, v_proj
    assert sum(p.numel for p in adapters) == 32 * 16 * ((4096 + 4096) + (4096 + 1024))
    plan = plan_memory(shape, "ddp", trainer="repulse", lora_r=16, dtype="bfloat16", reward_model=None)
    for role in ("policy", "proposal"):  # each: adapters + its own frozen base
        assert plan.engines["ddp"].get("gradients", role) == 2 * sum(p.numel for p in adapters)
        assert plan.engines["ddp"].get("weights", role) == 2 * (shape.numel + sum(p.numel for p in adapters))
    qlora = plan_memory(shape, "zero3", trainer="dpo", lora_r=16, quantization="4bit", num_gpus=8)
    base = sum(quantized_bytes(p, 4, 4) for p in shape.params)
    assert qlora.engines["zero3"].get("weights") == base + 2 * -(-sum(p.numel for p in adapters) // 8)
    linear = sum(p.numel for p in shape.params if p.linear)  # per linear weight ½ B + absmax 1/64 B + 4/(64·256) B
    assert abs(base - (4 * (shape.numel - linear) + linear * (0.5 + 1 / 64 + 4 / (64 * 256)))) < 1e-6 * base


def test_lora_counts_match_peft():
    peft = pytest.importorskip("peft")
    for targets in (None, "all-linear"):
        model = kit.build_causal_lm("llama")
        shape = config_shape(model.config)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
        trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
        assert trainable == sum(p.numel for p in lora_params(shape, 4, targets)), targets


# ------------------------------------------------------------------------- planned bytes == real tensors (1 process)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_bytes_equal_real_tensors_after_an_adamw_step(dtype):
    torch.manual_seed(0)
    model = kit.build_causal_lm("llama").to(getattr(torch, dtype))
    reference = copy.deepcopy(model)
    plan = plan_memory(config_shape(model.config), "ddp", trainer="dpo", dtype=dtype)
    assert _planned(plan) == _adamw_step(model)
    assert plan.engines["ddp"].get("frozen weights", "reference") == _nbytes(reference.parameters())


def test_planned_lora_bytes_equal_real_tensors():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = kit.build_causal_lm("llama")
    shape = config_shape(model.config)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_dropout=0.0))
    plan = plan_memory(shape, "ddp", trainer="dpo", lora_r=4)
    assert [r.name for r in plan.roles] == ["policy"]  # the reference is the base with adapters disabled
    assert _planned(plan) == _adamw_step(lora)


def test_planned_8bit_adam_bytes_equal_bitsandbytes_states():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = kit.build_causal_lm("llama", hidden_size=128, intermediate_size=256)  # tensors above and below 4096
    plan = plan_memory(config_shape(model.config), "ddp", trainer="dpo", optim="adamw_8bit")
    assert _planned(plan) == _adamw_step(model, bnb.optim.AdamW8bit)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_weight_bytes_equal_bitsandbytes_storage(bits, tiny_llama_dir):
    pytest.importorskip("bitsandbytes")
    from trl_ext.models.quantization import load_causal_lm

    model = load_causal_lm(tiny_llama_dir, **{f"load_in_{bits}bit": True})
    stored = 0
    for p in model.parameters():
        stored += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if state is not None:  # 4-bit: uint8 absmax per 64 weights, fp32 absmax of those per 256
            stored += _nbytes([state.absmax, state.state2.absmax])
        if getattr(p, "SCB", None) is not None:  # 8-bit: fp32 scale per output row
            stored += _nbytes([p.SCB])
    shape = resolve_model(tiny_llama_dir)
    assert sum(quantized_bytes(p, bits, 4) for p in shape.params) == stored


# ---------------------------------------------------------------------------------------------------- errors & CLI
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"trainer": "sft"}, "Unknown trainer 'sft'; choose one of ppo, repulse"),
        ({"trainer": "dpo", "optim": "sgd"}, "Unknown optim 'sgd'"),
        ({"trainer": "dpo", "num_gpus": 0}, "at least one device"),
        ({"trainer": "dpo", "quantization": "4bit"}, "set lora_r"),
        ({"trainer": "dpo", "dtype": "int8"}, "Unknown dtype"),
        ({"trainer": "dpo", "frozen_placement": "offloaded"}, "Unknown frozen_placement"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_memory("smollm2-135m", **kwargs)


def test_unknown_engine_and_lora_on_a_bare_count_are_clear_errors():
    with pytest.raises(ValueError, match="Unknown engine 'zero1'; choose one of ddp, zero2, zero3, fsdp2"):
        plan_memory("smollm2-135m", ("ddp", "zero1"), trainer="dpo")
    with pytest.raises(ValueError, match="bare parameter count: LoRA needs"):
        plan_memory("7b", trainer="dpo", lora_r=8)


def test_cli_prints_every_engine_and_the_fit(capsys):
    text = main(["--model", "llama-3.1-8b", "--trainer", "ppo", "--num-gpus", "8"])
    assert text in capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("GB per device"))
    assert header.split()[3:] == list(ENGINES)
    fits = next(line for line in text.splitlines() if line.startswith("fits in 80 GB")).split()[-4:]
    assert fits == ["NO", "NO", "yes", "NO"]  # only ZeRO-3 holds PPO's four 8B models on 8 x 80 GB
    data = json.loads(main(["--model", "smollm2-135m", "--trainer", "dpo", "--engine", "zero2", "--format", "json"]))
    assert list(data["engines"]) == ["zero2"] and data["options"]["trainer"] == "dpo"


def test_cli_errors_name_the_fix():
    with pytest.raises(SystemExit, match="choose one of ppo"):
        main(["--model", "smollm2-135m", "--trainer", "grpo"])
    with pytest.raises(SystemExit, match="set lora_r"):
        main(["--model", "smollm2-135m", "--trainer", "dpo", "--load_in_4bit"])


def test_markdown_format_has_one_column_per_engine():
    text = format_plan(plan_memory("smollm2-135m", trainer="dpo"), "markdown")
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[0] == "| GB per device | ddp | zero2 | zero3 | fsdp2 |"
    assert all(line.count("|") == 6 for line in table)


DOC_TABLES = {  # marker in docs/distributed.md -> the peak_table call that prints it
    "plan-table": lambda: peak_table(
        {"SmolLM2-135M": "smollm2-135m", "Llama-3.2-1B": "llama-3.2-1b", "Llama-3.1-8B": "llama-3.1-8b"},
        ("ppo", "repulse", "dpo"), (1, 8, 16),
    ),
    "plan-table-lora": lambda: peak_table(
        {"Llama-3.1-8B": "llama-3.1-8b"}, ("ppo", "repulse", "dpo"), (1, 8), lora_r=16, dtype="bfloat16"
    ),
}  # fmt: skip


@pytest.mark.parametrize("marker", sorted(DOC_TABLES))
def test_docs_tables_are_the_planners_output(marker):
    """The tables of docs/distributed.md are what `peak_table` prints today (paste its output when this fails)."""
    match = re.search(rf"<!-- {marker}:start -->\n(.*?)\n<!-- {marker}:end -->", DOCS.read_text(), re.S)
    assert match, f"docs/distributed.md lost its {marker} markers"
    assert match.group(1).strip() == DOC_TABLES[marker]()


@pytest.mark.slow
def test_two_process_runs_allocate_what_the_planner_says(tmp_path):
    """`bench/plan_memory.py` on 2 CPU processes (DDP and ZeRO-3): every rank's weights, gradients and optimizer
    states equal the plan to the byte, and ZeRO-3's live tensors (its 1 GB reduce bucket included) the planned
    persistent total within 1 KB (the batch, rotary buffers)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    out = tmp_path / "plan_memory.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "plan_memory.py"
    cmd = [sys.executable, str(script), "--engines", "ddp,zero3", "--processes", "2", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())
    assert sorted((r["engine"], r["rank"]) for r in rows) == [("ddp", 0), ("ddp", 1), ("zero3", 0), ("zero3", 1)]
    for r in rows:
        for component in ("weights", "gradients", "optimizer states"):
            assert r["measured"][component] == r["planned"][component], (r["engine"], r["rank"], component)
        if r["engine"] == "zero3":
            assert 0 <= r["measured"]["live tensors"] - r["planned"]["persistent"] < 1024
