"""Every launch configuration of `accelerate_configs/` parses, is consistent in itself (process counts, engine
sections, precision, FSDP version, DeepSpeed keys the trainers rely on being absent), matches its single-node twin
when it is a multi-node one, and is consistent with the recipes' options: the trainers' defaults that the configs
assume, and the example recipe YAMLs use no option that a trainer refuses under DeepSpeed or FSDP. The SLURM example
starts one `accelerate launch` per node with the right rank and rendezvous address (run with stubs for `srun`,
`scontrol` and `accelerate`). `tests/recipes/test_ppo_recipe.py` additionally runs each YAML through `accelerate
launch`'s own validation."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import subprocess

import pytest
import yaml
from online_helpers import ACCELERATE_CONFIGS, EXAMPLES, REPO

CONFIGS = sorted(ACCELERATE_CONFIGS.glob("*.yaml"))
GPUS_PER_NODE = 8  # every multi-GPU config is written for 8 GPUs per node (README: override with --num_processes)
MULTINODE = re.compile(r"_(\d+)x(\d+)$")  # deepspeed_zero3_2x8: 2 nodes x 8 GPUs
SLURM = REPO / "examples" / "slurm" / "multinode_2x8.sbatch"
DOCS = REPO / "docs" / "distributed.md"

# Options each trainer refuses under an engine (their __init__ raises), as `{option: (engines, refused(value))}`.
REFUSED = {
    "ref_offload": (("DEEPSPEED",), bool),
    "reward_offload": (("DEEPSPEED",), bool),
    "teacher_offload": (("DEEPSPEED", "FSDP"), bool),
    "freezing_actor_steps": (("DEEPSPEED",), lambda v: bool(v)),
    "order": (("DEEPSPEED",), lambda v: v == "p_then_q"),
    "q_steps_per_p_step": (("DEEPSPEED",), lambda v: v > 1),
    "ema_beta": (("FSDP",), lambda v: bool(v)),
}
EXAMPLE_RECIPE_YAMLS = {  # example -> the config class its recipe parses
    "ppo_tiny.yaml": "PPOConfig", "harmlessness_toy.yaml": "HarmlessnessConfig",
    "harmlessness_smollm.yaml": "HarmlessnessConfig", "proposal_toy.yaml": "ProposalConfig",
    "dpo_tiny.yaml": "DPOConfig", "kto_tiny.yaml": "KTOConfig", "kd_tiny.yaml": "KDConfig",
    "prm_tiny.yaml": "PRMConfig",
}  # fmt: skip


def _load(path) -> dict:
    return yaml.safe_load(path.read_text())


def _config_class(name: str):
    import trl_ext

    return getattr(trl_ext, name)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_as_an_accelerate_cluster_config(path):
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))  # unknown keys are a TypeError
    assert config.compute_environment.value == "LOCAL_MACHINE"
    assert config.use_cpu is False  # `use_cpu: true` makes `accelerate launch` start a single process


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_process_counts(path):
    config = _load(path)
    machines, processes = config["num_machines"], config["num_processes"]
    assert config["machine_rank"] == 0  # each node overrides it on the command line (--machine_rank)
    if config["distributed_type"] == "NO":
        assert (machines, processes) == (1, 1)
        return
    match = MULTINODE.search(path.stem)
    nodes, gpus = (int(match.group(1)), int(match.group(2))) if match else (1, GPUS_PER_NODE)
    assert machines == nodes and processes == nodes * gpus, f"{path.name}: num_processes = num_machines x GPUs/node"
    if machines > 1:
        assert config["rdzv_backend"] == "static"
        assert "main_process_ip" not in config  # it comes from the launch command (SLURM: the first node)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_engine_section_matches_the_distributed_type(path):
    config = _load(path)
    kind = config["distributed_type"]
    assert kind in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP")
    assert ("deepspeed_config" in config) == (kind == "DEEPSPEED")
    assert ("fsdp_config" in config) == (kind == "FSDP")
    assert config["mixed_precision"] == "bf16"  # README: every config asks for bf16 (--mixed_precision no on CPU)
    assert config["downcast_bf16"] == "no"


@pytest.mark.parametrize("path", [p for p in CONFIGS if "fsdp_config" in _load(p)], ids=lambda p: p.stem)
def test_fsdp_configs_are_fsdp2_without_their_own_activation_checkpointing(path):
    fsdp = _load(path)["fsdp_config"]
    assert fsdp["fsdp_version"] == 2
    assert "fsdp_sharding_strategy" not in fsdp  # FSDP1's key; v2 says fsdp_reshard_after_forward
    assert isinstance(fsdp["fsdp_reshard_after_forward"], bool)
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # the final save loads with from_pretrained
    # The trainers checkpoint activations themselves by default; transformers refuses FSDP's on top of that.
    assert fsdp["fsdp_activation_checkpointing"] is False


@pytest.mark.parametrize("path", [p for p in CONFIGS if "deepspeed_config" in _load(p)], ids=lambda p: p.stem)
def test_deepspeed_configs_leave_batch_and_clipping_to_the_recipe(path):
    ds = _load(path)["deepspeed_config"]
    assert ds["zero_stage"] in (2, 3)
    # A value here overrides the recipe's and DeepSpeed then rejects any run that differs (README).
    for key in ("gradient_accumulation_steps", "gradient_clipping", "deepspeed_config_file"):
        assert key not in ds, f"{path.name} sets {key}"
    assert ds["deepspeed_multinode_launcher"] == "standard"  # no pdsh / hostfile
    assert ds["offload_optimizer_device"] in ("none", "cpu", "nvme")
    assert ds["offload_param_device"] in ("none", "cpu", "nvme")
    if ds["zero_stage"] == 3:  # save_model gathers one 16-bit checkpoint that from_pretrained loads
        assert ds["zero3_save_16bit_model"] is True and ds["zero3_init_flag"] is True
    else:
        assert not ds.get("zero3_save_16bit_model") and not ds.get("zero3_init_flag")


@pytest.mark.parametrize("path", [p for p in CONFIGS if MULTINODE.search(p.stem)], ids=lambda p: p.stem)
def test_multinode_config_equals_its_single_node_twin_but_for_the_counts(path):
    twin = ACCELERATE_CONFIGS / f"{MULTINODE.sub('', path.stem)}.yaml"
    assert twin.is_file(), f"{path.name} has no single-node twin {twin.name}"
    config, single = _load(path), _load(twin)
    for key in ("num_machines", "num_processes"):
        config.pop(key), single.pop(key)
    assert config == single


def test_the_trainers_defaults_the_configs_assume():
    """FSDP configs leave activation checkpointing to the trainers (on by default in every config class), and the
    ZeRO-3 configs rely on the online trainers gathering the policy for generation by default."""
    for name in sorted(set(EXAMPLE_RECIPE_YAMLS.values())):
        args = _config_class(name)(output_dir="unused", bf16=False, report_to=[])
        assert args.activation_checkpointing is True, name
        if name in ("PPOConfig", "HarmlessnessConfig", "ProposalConfig"):
            assert args.ds3_gather_for_generation is True, name
    assert "ds3_gather_for_generation" in (ACCELERATE_CONFIGS / "deepspeed_zero3.yaml").read_text()


@pytest.mark.parametrize("example", sorted(EXAMPLE_RECIPE_YAMLS))
def test_example_recipes_use_no_option_an_engine_refuses(example):
    """Each example YAML runs under every config of accelerate_configs/: it sets none of the options a trainer
    refuses under DeepSpeed or FSDP. The options checked are real fields of the recipe's config class."""
    fields = {f.name for f in dataclasses.fields(_config_class(EXAMPLE_RECIPE_YAMLS[example]))}
    values = _load(EXAMPLES / example)
    for option, (engines, refused) in REFUSED.items():
        if option in values:
            assert option in fields, f"{example}: {option} is not an option of its recipe"
            assert not refused(values[option]), f"{example}: {option}={values[option]!r} is refused under {engines}"
    for option in REFUSED:  # the table above names options that exist somewhere
        assert any(
            option in {f.name for f in dataclasses.fields(_config_class(c))} for c in EXAMPLE_RECIPE_YAMLS.values()
        )


# ----------------------------------------------------------------------------------------------------- SLURM
def _stub(folder, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_starts_one_launch_per_node(tmp_path):
    """`sbatch examples/slurm/multinode_2x8.sbatch` on 2 nodes, with `srun` running its command once per node
    (SLURM_NODEID 0 and 1), `scontrol` naming the nodes and `accelerate` recording its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "launches.txt"
    _stub(bin_dir, "scontrol", 'printf "gpu-node-17\\ngpu-node-18\\n"\n')
    _stub(
        bin_dir,
        "srun",
        'while [[ "$1" == -* ]]; do shift; done\n'
        'for node in 0 1; do SLURM_NODEID=$node SLURMD_NODENAME=gpu-node-$((17 + node)) "$@"; done\n',
    )
    _stub(bin_dir, "accelerate", f'echo "node=$SLURM_NODEID $*" >> {log}\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-node-[17-18]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "42", "RECIPE_ARGS": "--config my_run.yaml"}  # fmt: skip
    subprocess.run(["bash", str(SLURM)], cwd=REPO, env=env, check=True, capture_output=True, text=True, timeout=60)
    launches = log.read_text().splitlines()
    assert len(launches) == 2
    for node, line in enumerate(launches):
        args = line.split()
        assert args[0] == f"node={node}" and args[1] == "launch"
        opts = dict(zip(args[2::2], args[3::2]))
        assert opts["--config_file"] == "accelerate_configs/deepspeed_zero3_2x8.yaml"
        assert (opts["--num_machines"], opts["--num_processes"], opts["--machine_rank"]) == ("2", "16", str(node))
        assert opts["--main_process_ip"] == "gpu-node-17"  # the first node hosts the rendezvous
        assert "recipes/ppo.py --config my_run.yaml" in line
    assert (REPO / _load_default(SLURM, "CONFIG")).is_file() and (REPO / _load_default(SLURM, "RECIPE")).is_file()


def _load_default(script, variable: str) -> str:
    match = re.search(rf"^{variable}=\$\{{{variable}:-([^}}]+)\}}", script.read_text(), re.M)
    assert match, f"{script.name} has no default for {variable}"
    return match.group(1)


def test_docs_name_every_config_and_the_slurm_script():
    text = DOCS.read_text()
    for path in CONFIGS:
        assert path.name in text, f"docs/distributed.md does not mention {path.name}"
    assert "examples/slurm/multinode_2x8.sbatch" in text and "python -m trl_ext.plan" in text
    readme = (ACCELERATE_CONFIGS / "README.md").read_text()
    assert all(path.name in readme for path in CONFIGS)
