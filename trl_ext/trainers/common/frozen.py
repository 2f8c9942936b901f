"""Where the online trainers keep their frozen models (a separate reference, a reward model): `FrozenModelsMixin`.

``frozen_models_placement`` (`OnlineConfig`) chooses, per engine (:func:`frozen_engine`):

==========================  =====================================  ==========================================
engine                      ``"sharded"``                          ``"replicated"``
==========================  =====================================  ==========================================
DeepSpeed ZeRO-3            ``trl.models.prepare_deepspeed``       whole weights (:func:`gather_zero3_partitions`)
                            (ZeRO-3 engine, gathered module by     in a ZeRO stage-0 engine, as under ZeRO-1/2
                            module in every forward)               (:func:`replicated_deepspeed_engine`)
FSDP2                       ``fully_shard`` per transformer        moved to the device
                            block, then the root
                            (:func:`shard_with_fsdp2`)
ZeRO-1/2                    refused (nothing shards weights)       a stage-0 engine (``prepare_deepspeed``)
DDP, FSDP1, one process     refused                                moved to the device
==========================  =====================================  ==========================================

``"auto"`` (the default) is ``"sharded"`` under ZeRO-3 and ``"replicated"`` everywhere else. With ``ref_offload`` /
``reward_offload`` a model stays on the CPU instead and is moved to the accelerator for its passes (not with
``"sharded"``, refused by the config; not under DeepSpeed, refused here).

An FSDP2-sharded frozen model is a root of its own, resharded after every forward: between scoring passes each
process holds ``1/N`` of it, and a pass gathers the root's own weights (embeddings, final norm, heads) for the whole
pass and each transformer block for its own forward. Code that calls a part of it below the root runs as its
forward (`trl_ext.models.fsdp.call_as_root_forward`; see `trl_ext.rollout.fsdp`).
"""

from __future__ import annotations

import logging

from torch import nn

from ...models.offload import check_offloadable
from ...models.quantization import is_quantized

__all__ = [
    "FrozenModelsMixin",
    "frozen_engine",
    "gather_zero3_partitions",
    "replicated_deepspeed_engine",
    "resolve_frozen_placement",
    "shard_with_fsdp2",
]

logger = logging.getLogger(__name__)

_ENGINE_NAMES = {"single": "one process", "ddp": "DDP", "fsdp1": "FSDP version 1", "fsdp2": "FSDP2"}


def frozen_engine(accelerator) -> str:
    """The engine of ``accelerator`` as placement sees it: ``"zero<stage>"``, ``"fsdp1"``, ``"fsdp2"``, ``"ddp"`` or
    ``"single"``."""
    state = accelerator.state
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if deepspeed is not None:
        return f"zero{deepspeed.zero_stage}"
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None:
        return f"fsdp{getattr(fsdp, 'fsdp_version', 1)}"
    return "ddp" if accelerator.num_processes > 1 else "single"


def resolve_frozen_placement(placement: str, engine: str) -> str:
    """``"sharded"`` or ``"replicated"``: the config's ``frozen_models_placement`` under ``engine``
    (:func:`frozen_engine`). ``"sharded"`` needs an engine that shards weights (ZeRO-3 or FSDP2)."""
    if placement == "auto":
        return "sharded" if engine == "zero3" else "replicated"
    if placement == "sharded" and engine not in ("zero3", "fsdp2"):
        name = f"DeepSpeed ZeRO-{engine[4:]}" if engine.startswith("zero") else _ENGINE_NAMES.get(engine, engine)
        hint = " (set fsdp_version: 2 in the accelerate config)" if engine == "fsdp1" else ""
        raise ValueError(
            f"frozen_models_placement='sharded' needs an engine that shards weights: DeepSpeed ZeRO-3 "
            f"(accelerate_configs/deepspeed_zero3.yaml) or FSDP2 (accelerate_configs/fsdp2.yaml){hint}. This run uses "
            f"{name}, where every process keeps whole models, so there is nothing to shard them with. Launch with one "
            "of those configs, or set frozen_models_placement='auto' (or 'replicated')."
        )
    return placement


def _block_classes(module: nn.Module, names: list[str] | None) -> tuple[type, ...]:
    """The classes of ``module``'s transformer blocks: those named in ``names`` (accelerate's
    ``fsdp_transformer_layer_cls_to_wrap``) that ``module`` has, else its own ``_no_split_modules``."""
    present = {type(m).__name__: type(m) for m in module.modules()}
    found = tuple(present[n] for n in names or () if n in present)
    if found:
        return found
    own = next((m._no_split_modules for m in module.modules() if getattr(m, "_no_split_modules", None)), ())
    return tuple(present[n] for n in own if n in present)


def shard_with_fsdp2(module: nn.Module, accelerator, name: str = "model") -> nn.Module:
    """Shard the frozen ``module`` with FSDP2 in place: ``fully_shard`` on each transformer block
    (:func:`_block_classes`), then on the whole module (the root: embeddings, final norm, heads), every unit
    resharded after its forward, with the accelerate config's offload and mixed-precision policies. Returned in eval
    mode with ``requires_grad=False``."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if isinstance(module, FSDPModule):
        return module.eval()
    if is_quantized(module):
        raise ValueError(
            f"frozen_models_placement='sharded' cannot shard the {name}: it is loaded with bitsandbytes 4-bit/8-bit "
            "weights, whose integer storage FSDP2 does not shard. Use frozen_models_placement='replicated' (or "
            "'auto') for a quantized frozen model."
        )
    meta = [n for n, p in module.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"The {name} has weights on the meta device in process {accelerator.process_index} ({', '.join(meta[:3])}"
            "...): with fsdp_cpu_ram_efficient_loading, weights that its checkpoint lacks are only created in the "
            "first process. Load a checkpoint that holds every weight of the frozen model."
        )
    plugin = accelerator.state.fsdp_plugin
    kwargs = {
        "reshard_after_forward": True,  # frozen: nothing runs backward through it, free the weights after each pass
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
    }
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        kwargs["mesh"] = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    module.requires_grad_(False)
    classes = _block_classes(module, getattr(plugin, "transformer_cls_names_to_wrap", None))
    blocks = [m for m in module.modules() if m is not module and classes and isinstance(m, classes)]
    for block in reversed(blocks):  # inner units before the ones that hold them
        if not isinstance(block, FSDPModule):
            fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    logger.info("The frozen %s is sharded with FSDP2: %d transformer blocks and the root.", name, len(blocks))
    return module.eval()


def gather_zero3_partitions(module: nn.Module) -> int:
    """Replace every ZeRO-3-partitioned parameter of ``module`` (made by ``deepspeed.zero.Init`` when the model was
    loaded in a ZeRO-3 run) by a plain parameter holding its whole tensor, gathered one parameter at a time (the same
    order in every process); tied weights stay tied. Returns how many were replaced."""
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]  # `parameters()` lists a tied one once
    if not partitioned:
        return 0
    import deepspeed

    whole = {}
    for param in partitioned:
        with deepspeed.zero.GatheredParameters([param]):
            whole[id(param)] = nn.Parameter(param.data.detach().clone(), requires_grad=False)
    for sub in module.modules():
        for key, param in list(sub._parameters.items()):
            if param is not None and id(param) in whole:
                sub._parameters[key] = whole[id(param)]
    return len(whole)


def replicated_deepspeed_engine(module: nn.Module, accelerator) -> nn.Module:
    """A whole copy of the frozen ``module`` on every process under DeepSpeed: ZeRO-3 partitions gathered
    (:func:`gather_zero3_partitions`), then a ZeRO stage-0 inference engine with the run's precision (bf16 / fp16
    cast), as `trl.models.prepare_deepspeed` makes under ZeRO-1/2."""
    import copy

    import deepspeed

    gather_zero3_partitions(module)
    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["zero_optimization"] = {"stage": 0}
    engine, *_ = deepspeed.initialize(model=module, config=config)
    engine.eval()
    return engine


def _place(module: nn.Module, accelerator, placement: str, engine: str, name: str) -> nn.Module:
    if engine.startswith("zero"):
        from trl.models import prepare_deepspeed

        if engine == "zero3" and placement == "replicated":
            return replicated_deepspeed_engine(module, accelerator)
        return prepare_deepspeed(module, accelerator)  # ZeRO-3: sharded; ZeRO-1/2: a stage-0 engine (replicated)
    if placement == "sharded":  # FSDP2 (resolve_frozen_placement refused the others)
        return shard_with_fsdp2(module, accelerator, name)
    return module.to(accelerator.device)


class FrozenModelsMixin:
    """Placement of the online trainers' frozen models (see the module docs); `OnlineTrainerMixin` calls
    :meth:`_place_frozen_models` once `Trainer.__init__` has built the accelerator."""

    def _reward_modules(self) -> list[nn.Module]:
        """The reward models (``nn.Module``, scored on the policy's token ids) of ``self.reward_model``: itself, or
        those of a list of rewards."""
        rewards = self.reward_model if isinstance(self.reward_model, list) else [self.reward_model]
        return [reward for reward in rewards if isinstance(reward, nn.Module)]

    def _frozen_modules(self) -> dict[str, nn.Module]:
        """``{attribute: module}`` of the frozen models to move next to the trained one; the reward models of a list
        of rewards are ``"reward_model.<index>"``."""
        modules = {"ref_model": self.ref_model} if self.ref_model is not None else {}
        if isinstance(self.reward_model, nn.Module):
            modules["reward_model"] = self.reward_model
        elif isinstance(self.reward_model, list):
            modules.update(
                {f"reward_model.{i}": r for i, r in enumerate(self.reward_model) if isinstance(r, nn.Module)}
            )
        return modules

    def _set_frozen_module(self, name: str, module: nn.Module) -> None:
        attribute, _, index = name.partition(".")
        if index:
            getattr(self, attribute)[int(index)] = module
        else:
            setattr(self, name, module)

    def _place_frozen_models(self) -> None:
        """Put the frozen reference and reward model where ``frozen_models_placement`` says (see the module docs).
        With ``ref_offload`` / ``reward_offload`` keep them on the CPU instead: the reference
        (``self.reference.offload_device``) and the reward (:meth:`_rollout_generator`) move them to the accelerator
        for their forward passes only (`trl_ext.models.offload`)."""
        engine = frozen_engine(self.accelerator)
        placement = resolve_frozen_placement(getattr(self.args, "frozen_models_placement", "auto"), engine)
        offloaded = self._offloaded_frozen_models()
        self.frozen_models_sharded = False  # whether a frozen model ended up sharded (the recipes' summary line)
        for name, module in self._frozen_modules().items():
            if name in offloaded:
                module = module.to("cpu")
            else:
                module = _place(module, self.accelerator, placement, engine, name.replace("_", " "))
                self.frozen_models_sharded |= placement == "sharded"
            self._set_frozen_module(name, module)
        device = self.accelerator.device
        if self.ref_model is not None:
            self.reference.model = self.ref_model
            self.reference.offload_device = device if "ref_model" in offloaded else None
        self._reward_offload_device = device if any(n.startswith("reward_model") for n in offloaded) else None
        for module in self._reward_modules():
            module.eval()

    def _offloaded_frozen_models(self) -> set[str]:
        """The attributes (``ref_model``, ``reward_model``) of the frozen models to keep on the CPU (``ref_offload``,
        ``reward_offload``), after checking that they can be."""
        options = {"ref_model": "ref_offload", "reward_model": "reward_offload"}
        wanted = {name for name, option in options.items() if getattr(self.args, option, False)}
        if not wanted:
            return set()
        if self.is_deepspeed_enabled:
            names = " and ".join(options[name] for name in sorted(wanted))
            raise ValueError(
                f"{names}=True is not supported under DeepSpeed: there the frozen models are DeepSpeed engines "
                "(trl.models.prepare_deepspeed) and ZeRO has its own offload. Set them to False and use ZeRO-3 with "
                "`offload_param: {device: cpu}` in the zero_optimization section of the DeepSpeed config instead."
            )
        frozen = self._frozen_modules()
        for name in sorted(wanted - {n.partition(".")[0] for n in frozen}):
            logger.warning(
                "%s=True does nothing here: there is no separate frozen %s to keep on the CPU (e.g. a reward function "
                "or server, or a reference that is part of the trained model).", options[name],
                name.replace("_", " "),
            )  # fmt: skip
        wanted = {name for name in frozen if name.partition(".")[0] in wanted}  # each reward model of a list
        for name in wanted:
            check_offloadable(frozen[name], options[name.partition(".")[0]])
        return wanted
