"""The memory planner (`python -m trl_ext.plan`) against measured allocations of 1- and 2-process CPU runs.

    python bench/plan_memory.py                       # ddp, zero2, zero3 x 1 and 2 processes, ~2 min on 2 cores
    python bench/plan_memory.py --engines ddp --processes 2

Each run is `accelerate launch` of this script (`--worker`) with an `accelerate_configs/` file on CPU processes (gloo;
DeepSpeed without its CUDA ops) and `--mixed_precision bf16`: a randomly initialised Llama (hidden 256, 4 layers,
vocabulary 4096: 5.3 M parameters, fp32 as loaded) and torch's AdamW, prepared by accelerate, two training steps.
After the second backward pass (the gradients are alive, and the Adam moments exist since the first step) every
rank counts, in bytes:

- weights: the storage of its parameters (under ZeRO-3 its partition, ``ds_tensor``);
- gradients: ``param.grad`` (DDP), DeepSpeed's partitioned gradients (ZeRO-2 ``averaged_gradients``, ZeRO-3
  ``grad_partitions_flat_buffer``), counted by the storage they live in;
- optimizer states: the optimizer's state tensors, plus DeepSpeed's fp32 master partition;
- live tensors: every distinct tensor storage the process holds (found through the garbage collector, plus the
  parameters, gradients and optimizer states), which also catches buffers the first three miss (ZeRO-3's reduce
  bucket and whole small tensors), compared with the planned persistent total;
- RSS growth: resident memory after the step minus before the model was built (allocator and library overhead too).

and prints them next to `plan_memory(..., trainer="dpo", precompute_ref_log_probs=True)` (one trained model, nothing
frozen). FSDP2 is left out: on a CPU accelerate runs an FSDP config as plain DDP. The results are written to
``bench/results/plan_memory.json`` and summarised in docs/distributed.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"ddp": "multi_gpu.yaml", "zero2": "deepspeed_zero2.yaml", "zero3": "deepspeed_zero3.yaml"}
MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=128)  # fmt: skip
COMPONENTS = ("weights", "gradients", "optimizer states")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count once)."""
    import torch

    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not torch.is_tensor(t) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _measure(model, optimizer, engine: str) -> dict[str, int]:
    import torch

    params = list(model.parameters())
    if engine == "zero3":
        weights = _storage_bytes(p.ds_tensor for p in params)
    else:
        weights = _storage_bytes(params)
    states = []
    inner = optimizer
    if engine.startswith("zero"):
        zero = model.optimizer  # DeepSpeed's ZeRO optimizer wraps the client AdamW
        inner = zero.optimizer
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
        states += list(masters)
        if engine == "zero2":  # {group: [gradient partitions]}
            grads = [g for group in zero.averaged_gradients.values() for g in group if torch.is_tensor(g)]
        else:
            grads = [zero.grad_partitions_flat_buffer]
    else:
        grads = [p.grad for p in params]
    states += [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
    measured = {"weights": weights, "gradients": _storage_bytes(grads), "optimizer states": _storage_bytes(states)}
    gc.collect()
    live = [o for o in gc.get_objects() if torch.is_tensor(o)] + params + grads + states
    measured["live tensors"] = _storage_bytes(live)
    return measured


def worker(args: argparse.Namespace) -> None:
    rss_start = _rss()
    import torch
    from accelerate import Accelerator, PartialState
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from trl_ext.plan import config_shape, plan_memory

    # As `TrainingArguments(use_cpu=True)` does: a gloo process group first, then the Accelerator (DeepSpeed or DDP).
    PartialState(cpu=True)
    accelerator = Accelerator(cpu=args.engine == "ddp")
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # no dataloader is prepared: tell DeepSpeed the batch
        plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    rss_start = _rss()
    config = LlamaConfig(**MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    for step in range(2):
        ids = torch.randint(0, MODEL["vocab_size"], (2, 16), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        if plugin is not None:
            model.backward(loss)
        else:
            accelerator.backward(loss)
        if step == 1:
            measured = _measure(model, optimizer, args.engine)
            measured["RSS growth"] = _rss() - rss_start
        if plugin is not None:
            model.step()
        else:
            optimizer.step()
            optimizer.zero_grad()
    n = accelerator.num_processes
    plan = plan_memory(config_shape(config), args.engine, trainer="dpo", precompute_ref_log_probs=True, num_gpus=n,
                       bf16=accelerator.mixed_precision == "bf16")  # fmt: skip
    planned = {c: plan.engines[args.engine].get(c) for c in COMPONENTS}
    planned["persistent"] = plan.engines[args.engine].persistent
    result = {"engine": args.engine, "processes": n, "rank": accelerator.process_index, "measured": measured,
              "mixed_precision": str(accelerator.mixed_precision), "planned": planned}  # fmt: skip
    Path(args.out, f"{args.engine}-{n}-rank{accelerator.process_index}.json").write_text(json.dumps(result))


def _launch(engine: str, processes: int, out: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" /
           CONFIGS[engine]), "--num_processes", str(processes), "--mixed_precision", "bf16", "--main_process_port",
           str(port), __file__, "--worker", "--engine", engine, "--out", out]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TRANSFORMERS_OFFLINE": "1"}
    if processes == 1 and engine == "ddp":
        cmd[cmd.index("--config_file") + 1] = str(REPO / "accelerate_configs" / "single_gpu.yaml")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} x {processes} failed:\n{proc.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--engines", default="ddp,zero2,zero3", help="comma-separated: ddp, zero2, zero3")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "plan_memory.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for engine in args.engines.split(","):
            for processes in (int(p) for p in args.processes.split(",")):
                _launch(engine, processes, out)
        for path in sorted(Path(out).glob("*.json")):
            rows.append(json.loads(path.read_text()))
    print(f"{'engine':<6} {'N':>2} {'rank':>4}  " + "  ".join(f"{c:>26}" for c in COMPONENTS) +
          f"  {'live tensors / persistent':>28} {'RSS growth':>12}")  # fmt: skip
    for r in rows:
        m, p = r["measured"], r["planned"]
        cells = [f"{m[c]:>12,} / {p[c]:>11,}" for c in COMPONENTS]
        cells.append(f"{m['live tensors']:>14,} / {p['persistent']:>11,}")
        print(f"{r['engine']:<6} {r['processes']:>2} {r['rank']:>4}  " + "  ".join(cells) + f" {m['RSS growth']:>12,}")
    print("cells: measured / planned bytes per rank")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
