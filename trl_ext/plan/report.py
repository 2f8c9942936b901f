"""Printing a :class:`~trl_ext.plan.memory.MemoryPlan`: a per-component table (text, Markdown or JSON) and a
Markdown table of peaks over several models, trainers and device counts (the one in ``docs/distributed.md``)."""

from __future__ import annotations

import json

from .memory import ENGINES, MemoryPlan, Row, plan_memory

__all__ = ["format_plan", "peak_table", "plan_dict"]

GB, MB = 10**9, 10**6
FORMATS = ("text", "markdown", "json")


def _label(row: Row) -> str:
    if row.transient:
        return f"{row.component} (transient)"
    if row.component == "frozen weights":
        return f"{row.model} (frozen)"
    if row.component in ("DDP gradient buckets", "ZeRO-3 reduce bucket"):
        return row.component
    return f"{row.model} {row.component}"


def _table(plan: MemoryPlan) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Row labels in order of appearance and ``{label: {engine: bytes}}``."""
    labels: list[str] = []
    values: dict[str, dict[str, int]] = {}
    for engine, engine_plan in plan.engines.items():
        for row in engine_plan.rows:
            label = _label(row)
            if label not in values:
                labels.append(label)
                values[label] = {}
            values[label][engine] = values[label].get(engine, 0) + row.bytes
    return labels, values


def _describe(plan: MemoryPlan) -> list[str]:
    o = plan.options
    training = "full training" if o.lora_r is None else f"LoRA r={o.lora_r}"
    if o.quantization:
        training += f" on a {o.quantization} base"
    precision = "bf16 mixed precision" if o.bf16 else "no mixed precision"
    models = ", ".join(
        f"{r.name} ({'trained' if r.trained else 'frozen'}, {r.shape.numel / 1e9:.3g} B)" for r in plan.roles
    )
    devices = f"{o.num_gpus} device{'s' if o.num_gpus > 1 else ''}"
    return [
        f"Memory plan: {o.trainer} on {devices}, model {plan.roles[0].shape.name}",
        f"{precision}, weights loaded as {o.dtype}, {o.optim}, {training}",
        f"models: {models}",
    ]


def plan_dict(plan: MemoryPlan) -> dict:
    """The plan as plain data (bytes): options, models and per engine its rows and totals."""
    o = plan.options
    return {
        "options": {k: getattr(o, k) for k in o.__dataclass_fields__},
        "models": [
            {"name": r.name, "model": r.shape.name, "params": r.shape.numel, "trained": r.trained, "lora": r.adapters}
            for r in plan.roles
        ],  # fmt: skip
        "engines": {
            engine: {
                "rows": [
                    dict(component=r.component, model=r.model, bytes=r.bytes, transient=r.transient) for r in p.rows
                ],  # fmt: skip
                "persistent": p.persistent,
                "transient": p.transient,
                "peak": p.peak,
            }
            for engine, p in plan.engines.items()
        },
    }


def format_plan(plan: MemoryPlan, fmt: str = "text", gpu_memory_gb: float = 80.0) -> str:
    """The plan as a table with one column per engine: every component, the persistent total, the transients and
    the peak (no activations), and whether the peak fits in ``gpu_memory_gb`` (GB = 10⁹ bytes)."""
    if fmt not in FORMATS:
        raise ValueError(f"Unknown format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    if fmt == "json":
        return json.dumps(plan_dict(plan), indent=2)
    engines = list(plan.engines)
    labels, values = _table(plan)
    peak = max(p.peak for p in plan.engines.values())
    unit, scale = ("GB", GB) if peak >= GB else ("MB", MB)
    body: list[tuple[str, list[str]]] = []

    def add(label: str, numbers: dict[str, int]) -> None:
        body.append((label, [f"{numbers[e] / scale:.2f}" if e in numbers else "-" for e in engines]))

    persistent_labels = [lab for lab in labels if "(transient)" not in lab]
    for label in persistent_labels:
        add(label, values[label])
    add("= persistent total", {e: p.persistent for e, p in plan.engines.items()})
    for label in labels:
        if label not in persistent_labels:
            add(label, values[label])
    add("= peak without activations", {e: p.peak for e, p in plan.engines.items()})
    limit = gpu_memory_gb * GB
    body.append((f"fits in {gpu_memory_gb:g} GB", ["yes" if p.peak <= limit else "NO" for p in plan.engines.values()]))
    header = [f"{unit} per device", *engines]
    notes = "Not counted: activations, the KV cache of generation, CUDA context and allocator overhead."
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(engines) + "|"]
        lines += ["| " + " | ".join([label, *cells]) + " |" for label, cells in body]
        return "\n".join([*(f"{line}  " for line in _describe(plan)), "", *lines, "", notes])
    width = max(len(label) for label, _ in body + [(header[0], [])])
    cell = max(9, *(len(c) + 2 for _, cells in body for c in cells))
    lines = [header[0].ljust(width) + "".join(e.rjust(cell) for e in engines)]
    lines += [label.ljust(width) + "".join(c.rjust(cell) for c in cells) for label, cells in body]
    return "\n".join([*_describe(plan), "", *lines, "", notes])


def peak_table(
    models: dict[str, str],
    trainers: tuple[str, ...],
    gpu_counts: tuple[int, ...],
    engines: tuple[str, ...] = ENGINES,
    gpu_memory_gb: float = 80.0,
    **options,
) -> str:
    """A Markdown table of peak GB per device (persistent + largest transient, no activations): one row per
    ``(model, trainer, device count)``, one column per engine; peaks above ``gpu_memory_gb`` are marked ✗.
    ``models``: ``{label: spec}``; ``options``: the other :class:`~trl_ext.plan.memory.PlanOptions`."""
    lines = [
        "| model | trainer | GPUs | " + " | ".join(engines) + " |",
        "|---|---|---:" + "|---:" * len(engines) + "|",
    ]
    for label, spec in models.items():
        for trainer in trainers:
            for n in gpu_counts:
                plan = plan_memory(spec, engines, trainer=trainer, num_gpus=n, **options)
                cells = []
                for engine in engines:
                    peak = plan.engines[engine].peak / GB
                    cells.append(f"{peak:.1f}" + (" ✗" if peak > gpu_memory_gb else ""))
                lines.append(f"| {label} | {trainer} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
