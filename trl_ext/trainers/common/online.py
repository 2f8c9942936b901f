"""`OnlineTrainerMixin`: the `transformers.Trainer` plumbing that `PPOTrainer`, `ProposalTrainer` and
`HarmlessnessTrainer` share.

Each of the three trains on responses it samples itself from prompt batches, so they set up and run the same way:
check the inputs and the tokenizer, seed before building models, tokenise the prompt datasets, place the frozen
reference and reward model (sharded or replicated: ``frozen_models_placement``, `frozen.py`), build the sampling
settings and the rollout generator, hand `Trainer` a dataloader of prompt batches
(:class:`~trl_ext.rollout.data.RolloutSampler`), resolve ``resume_from_checkpoint`` to a *complete* checkpoint whose
files match its manifest (`resume.py`), keep an EMA of the trained weights (``ema_beta``, `ema.py`), skip optimizer
steps with a non-finite loss or gradient (`finite.py`), and save their models in HF format with a model card (never
with NaN weights). Those steps are written here once; each trainer keeps its own models, losses and metrics.

The mixin goes before `_BaseTrainer` in the bases (``class PPOTrainer(OnlineTrainerMixin, _BaseTrainer)``) and
expects ``self.tokenizer``, ``self.reference``, ``self.ref_model`` and ``self.reward_model`` to be set.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_utils import enable_full_determinism, set_seed
from trl.trainer import disable_dropout_in_model

from ...models.padding_free import check_padding_free
from ...models.quantization import keep_4bit_layers_trainable
from ...ops.kl_control import AdaptiveKLController, build_kl_controller
from ...ops.reward_norm import RunningMoments
from ...rollout import ReferencePolicy, RolloutGenerator, RolloutReward, SamplingSettings, generate_responses
from ...rollout.columns import ColumnCollator, reward_columns
from ...rollout.compiled_decode import decode_compile_config
from ...rollout.data import (
    PromptCollator,
    RolloutSampler,
    check_chat_template,
    check_pad_token,
    prepare_prompt_dataset,
    tokenizer_of,
)
from ...rollout.fsdp import call_as_root_forward
from ...rollout.reward_list import reward_members
from ...rollout.sampling import row_keys
from ...rollout.vision import (
    VisionPromptCollator,
    check_dataset_images,
    check_reward_images,
    prepare_vision_dataset,
    vision_setup,
)
from . import checkpoint as ckpt
from .checks import check_not_empty, check_prompts_fit_context, load_model_argument
from .distributed import CpuFsdpMixin
from .ema import EMA, EMACallback, load_ema, save_ema
from .finite import FiniteStepsMixin
from .frozen import FrozenModelsMixin
from .hub_errors import hub_push_errors
from .metrics import log_completions_table, print_completions_table
from .model_card import CompleteModelCard, write_text_atomically
from .resume import VerifiedResumeMixin
from .reward_setup import check_reward_arguments, resolve_reward_argument
from .run_summary import RunSummaryMixin
from .vllm_setup import build_vllm_engine

__all__ = ["OnlineTrainerMixin", "evaluates_with_ema", "forked_rng", "hub_push_errors"]

logger = logging.getLogger(__name__)

EVAL_STREAM = 1000
"""The sample stream of evaluation rollouts with ``seed_per_row`` (training uses small stream numbers)."""


@contextlib.contextmanager
def forked_rng() -> Iterator[None]:
    """Run the body under a copy of the CPU (and current CUDA device's) RNG state, so that sampling for evaluation or
    sample tables does not change the training run."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def evaluates_with_ema(method):
    """Decorator of an online trainer's evaluation / sample-table method: with ``eval_with_ema`` the method runs with
    the EMA weights swapped into the trained model (:meth:`OnlineTrainerMixin.ema_weights`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        swap = self.ema is not None and getattr(self.args, "eval_with_ema", False)
        with self.ema_weights() if swap else contextlib.nullcontext():
            return method(self, *args, **kwargs)

    return wrapper


class OnlineTrainerMixin(
    RunSummaryMixin, FiniteStepsMixin, CompleteModelCard, VerifiedResumeMixin, CpuFsdpMixin, FrozenModelsMixin, abc.ABC
):
    """Setup, data, resume and save steps shared by the online trainers (see the module docs)."""

    _config_class: type = object
    """The config class ``args`` must be an instance of."""
    _saved_models: str = "the policy"
    """What :meth:`save_model` writes, for its warning when ZeRO-3 weights cannot be gathered."""

    # ------------------------------------------------------------------------------------------------ setup
    def _begin_setup(
        self, args, processing_class, train_dataset, reward_model, eval_dataset=None, reward_funcs=None
    ) -> None:
        """First step of a constructor: check what every online trainer needs (before any model work: an empty
        dataset is refused here), set ``self.reward_model`` (``reward_model`` or ``reward_funcs``, one reward or a
        list, `reward_setup.resolve_reward_argument`), ``self.tokenizer`` and
        ``self.stop_token_id``, and seed (as `Trainer` does for ``model_init``) so that weights created while building
        the models (a value head, a modulation, LoRA adapters) are reproducible from ``args.seed``.

        It also sets every attribute the mixin's later steps read (``reward_model``, ``vision_spec``), so that they do
        not depend on what the subclass happened to set before calling them."""
        if not isinstance(args, self._config_class):
            raise TypeError(f"args must be a trl_ext {self._config_class.__name__}, got {type(args).__name__}.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: a dataset with a 'prompt' or an 'input_ids' column.")
        needs = "It must hold the prompts to sample responses for, in a 'prompt' or an 'input_ids' column."
        check_not_empty(train_dataset, "train_dataset", trainer=type(self).__name__, needs=needs)
        check_not_empty(eval_dataset, "eval_dataset", trainer=type(self).__name__, needs=needs)
        reward_model = resolve_reward_argument(reward_model, reward_funcs, type(self).__name__)
        if args.load_best_model_at_end:
            raise ValueError(
                f"load_best_model_at_end is not supported by {type(self).__name__} (there is no eval loss)."
            )
        self.tokenizer = tokenizer_of(processing_class)
        self._processing_class = processing_class  # a processor, for vision-language policies
        self.reward_model = reward_model  # a trainer may replace it with a prepared one; _prepare_datasets reads it
        self.vision_spec = None  # set by _prepare_datasets
        # The KL coefficient of configs with the KL-control options (fixed or adaptive, `trl_ext.ops.kl_control`);
        # None for the others.
        self.kl_controller = build_kl_controller(args)
        # The running score statistics of configs with `normalize_reward=True` (`trl_ext.ops.reward_norm`), or None.
        self.reward_normalizer = RunningMoments() if getattr(args, "normalize_reward", False) else None
        self.ema: EMA | None = None  # the EMA of the trained weights (``ema_beta``), built when training starts
        check_pad_token(self.tokenizer)
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            for key, value in dataset.items() if isinstance(dataset, dict) else [(None, dataset)]:
                label = name if key is None else f"{name}[{key!r}]"
                check_chat_template(value, self.tokenizer, label, processor=processing_class)
        self.stop_token_id = self.tokenizer.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)

    @staticmethod
    def _disable_dropout(*modules) -> None:
        for module in modules:
            for member in module if isinstance(module, list) else [module]:  # a list of rewards
                if isinstance(member, nn.Module):
                    disable_dropout_in_model(member)

    def _load_models(self, **models):
        """The ``models`` (``name=value``) with every one given as a string (a folder or Hub id) loaded as a causal
        LM, in the order given (:func:`~trl_ext.trainers.common.checks.load_model_argument`); a list of them."""
        return [load_model_argument(value, name, trainer=type(self).__name__) for name, value in models.items()]

    def _check_prompts_fit(self, args, model: nn.Module, train_dataset, eval_dataset) -> None:
        """Refuse prompt datasets whose longest prompt plus ``response_length`` exceeds the policy's context
        (:func:`~trl_ext.trainers.common.checks.check_prompts_fit_context`; not checked for image prompts, whose
        image tokens are added by the processor)."""
        if self.vision_spec is not None:
            return
        datasets = {"train_dataset": train_dataset}
        if isinstance(eval_dataset, dict):
            datasets.update({f"eval_dataset[{k!r}]": v for k, v in eval_dataset.items()})
        else:
            datasets["eval_dataset"] = eval_dataset
        for name, dataset in datasets.items():
            check_prompts_fit_context(dataset, model, args.response_length, name, trainer=type(self).__name__)

    def _prepare_datasets(self, args, train_dataset, eval_dataset, model: nn.Module | None = None):
        """Tokenise the prompts (:func:`prepare_prompt_dataset`); ``eval_dataset`` may be a dict of datasets.

        With an image column and a vision-language ``model`` (the policy), the prompts are templated instead
        (:func:`~trl_ext.rollout.vision.prepare_vision_dataset`) and ``self.vision_spec`` is set (``None``
        otherwise); a trainer that passes no ``model`` takes no images."""
        self.vision_spec = vision_setup(self._processing_class, model, train_dataset, trainer=type(self).__name__)
        for reward in reward_members(self.reward_model):
            check_reward_images(self.vision_spec, reward, args.reward_uses_images)
        image_column = self.vision_spec.image_column if self.vision_spec is not None else None
        check_reward_arguments(type(self).__name__, self.reward_model, args, train_dataset, eval_dataset, image_column)
        prepare = self._prepare_prompts
        train_dataset = prepare(train_dataset, "train_dataset", args.dataset_num_proc)
        if isinstance(eval_dataset, dict):
            eval_dataset = {
                k: prepare(v, f"eval_dataset[{k}]", args.dataset_num_proc) for k, v in eval_dataset.items()
            }
        elif eval_dataset is not None:
            eval_dataset = prepare(eval_dataset, "eval_dataset", args.dataset_num_proc)
        return train_dataset, eval_dataset

    def _prepare_prompts(self, dataset, name: str, num_proc: int | None = None):
        """The prompts tokenised (or templated, with images), with their reward columns (`rollout.columns`)."""
        spec = check_dataset_images(self.vision_spec, dataset, name)
        if spec is None:
            return prepare_prompt_dataset(dataset, self.tokenizer, num_proc=num_proc, name=name, keep_columns=True)
        keep = reward_columns(dataset, exclude=(spec.image_column,))
        return prepare_vision_dataset(
            dataset, self._processing_class, spec.image_column, num_proc=num_proc, name=name, keep=keep
        )

    def _default_collator(self, collator=None):
        """``collator`` (default: left-padded prompts; with images, the processor's batch and its image inputs,
        ``vision``) with the rows' reward columns passed around it (:class:`ColumnCollator`)."""
        spec = self.vision_spec
        if collator is None and spec is not None:
            collator = VisionPromptCollator(self._processing_class, spec)
        collator = collator if collator is not None else PromptCollator(self.tokenizer.pad_token_id)
        return ColumnCollator(collator, exclude=(spec.image_column,) if spec is not None else ())

    def _init_trainer(self, model: nn.Module, tagged: nn.Module, args, data_collator=None, **kwargs) -> None:
        """`Trainer.__init__` on the trained module ``model`` (default collator: left-padded prompts), with the model
        card tags on ``tagged``; then place the frozen models (``frozen_models_placement``, `frozen.py`)."""
        if hasattr(tagged, "add_model_tags"):
            tagged.add_model_tags(self._tag_names)
        data_collator = self._default_collator(data_collator)
        keep_4bit_layers_trainable(model)  # a QLoRA policy/critic alternates eval-mode sampling and training
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self._place_frozen_models()

    def _sampling_settings(self, args) -> SamplingSettings:
        return SamplingSettings(
            max_new_tokens=args.response_length,
            pad_token_id=self.tokenizer.pad_token_id,
            temperature=args.temperature,
            top_k=getattr(args, "top_k", None),
            top_p=getattr(args, "top_p", 1.0),
            stop_token_ids=(self.stop_token_id,) if self.stop_token_id is not None else None,
            eos_token_id=self.tokenizer.eos_token_id,
            num_samples_per_prompt=args.num_samples_per_prompt,
            compile_config=decode_compile_config(args.torch_compile_backend, args.torch_compile_mode)
            if getattr(args, "compile_generation", False) else None,
        )  # fmt: skip

    @property
    def kl_is_off(self) -> bool:
        """Whether the KL penalty is off for the whole run: a fixed ``kl_coef == 0`` (no adaptive ``kl_target``).
        Rollouts then skip the reference forward pass (``Rollout.ref_logprobs`` is ``None``) and the KL metrics are
        not logged (the KL to the reference is not computed)."""
        controller = self.kl_controller
        return controller is not None and not isinstance(controller, AdaptiveKLController) and controller.value == 0

    def _check_padding_free(self, args, **models: nn.Module | None) -> None:
        """With ``padding_free``: refuse image inputs and models that do not keep packed rows apart
        (`trl_ext.models.padding_free.check_padding_free`, a tiny forward of each named model)."""
        if not getattr(args, "padding_free", False):
            return
        if self.vision_spec is not None:
            raise ValueError("padding_free=True does not support image inputs; set padding_free=False.")
        for name, model in models.items():
            if model is not None:
                check_padding_free(model, name)

    def _build_vllm(self, models: list[nn.Module], always_sync: bool = False) -> None:
        """With ``use_vllm``: ``self._vllm``, the engine ``models`` sample from (`vllm_setup.build_vllm_engine`). Their
        weights are loaded into it when ``global_step`` (the optimizer steps) changed since the last load, or every
        time with ``always_sync`` (a trainer that also steps outside `Trainer`'s count)."""
        version_fn = None if always_sync else (lambda: self.state.global_step)
        self._vllm = build_vllm_engine(self.args, models, self.accelerator, type(self).__name__, version_fn)

    def _rollout_generator(
        self,
        reward: RolloutReward,
        reference: ReferencePolicy | None,
        settings: SamplingSettings | None = None,
        **kwargs,
    ) -> RolloutGenerator:
        """A :class:`RolloutGenerator` with ``settings`` (default ``self._sampling``) and the config's rollout options
        (and the vLLM engine of :meth:`_build_vllm`, if any); ``kwargs`` (e.g. ``policy_of``) are passed on.
        ``reference=None``: rollouts score no reference (see :attr:`kl_is_off`)."""
        args = self.args
        for part in getattr(reward, "parts", [reward]):  # reward_offload (the reward models of a list too)
            if getattr(part, "model", None) is not None and any(part.model is m for m in self._reward_modules()):
                part.offload_device = getattr(self, "_reward_offload_device", None)
        return RolloutGenerator(
            self._sampling if settings is None else settings, reward, reference,
            forward_batch_size=args.local_rollout_forward_batch_size, accelerator=self.accelerator,
            missing_eos_penalty=args.missing_eos_penalty, gather_deepspeed3_params=args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=args.activation_checkpointing_kwargs,
            nonfinite_rewards=args.nonfinite_rewards, max_abs_reward=args.max_abs_reward,
            engine=getattr(self, "_vllm", None),
            shared_prefix=args.shared_prefix_rollouts, **kwargs,
        )  # fmt: skip

    def _sum_over_processes(self):
        """A function that sums a tensor over the processes (for statistics of every process's rows, e.g.
        `masked_whiten(..., reduce=)`); ``None`` with one process."""
        if self.accelerator.num_processes == 1:
            return None
        return lambda tensor: self.accelerator.reduce(tensor, reduction="sum")

    def _gather_object(self):
        """`accelerate.utils.gather_object` with several processes (metrics of every process), else ``None``."""
        if self.accelerator.num_processes == 1:
            return None
        from accelerate.utils import gather_object

        return gather_object

    def rollout_row_keys(
        self, num_prompts: int, rollout: int, stream: int = 0, samples_per_prompt: int | None = None
    ) -> torch.Tensor | None:
        """With ``seed_per_row``: the ``(num_prompts · N,)`` random-stream keys of this process's rows in rollout
        number ``rollout`` (counted over the run, the same on every process) of sample stream ``stream`` (e.g. 0 for
        the policy's samples, 1 for the proposal's), keyed by the rows' *global* index ``(process_index · num_prompts
        + prompt) · N + sample`` (:func:`~trl_ext.rollout.sampling.row_keys`); ``None`` without it (each process
        samples from its own RNG). ``samples_per_prompt``: ``N`` (default ``num_samples_per_prompt``)."""
        if not getattr(self.args, "seed_per_row", False):
            return None
        override = self.__dict__.get("_row_key_override")
        if override is not None:  # inside `evaluation_row_keys`
            stream, rollout = override
        n = self.args.num_samples_per_prompt if samples_per_prompt is None else samples_per_prompt
        rows = num_prompts * n
        first = self.accelerator.process_index * rows
        return row_keys(self.args.seed, stream, rollout, torch.arange(first, first + rows))

    @contextlib.contextmanager
    def evaluation_row_keys(self, batch: int) -> Iterator[None]:
        """With ``seed_per_row``, the rollouts of the block (eval batch number ``batch`` of this process) sample from
        streams of their own (stream ``EVAL_STREAM``, rollout ``batch``), so that eval batches never share the
        training rollouts' streams or each other's."""
        saved = self.__dict__.get("_row_key_override")
        self._row_key_override = (EVAL_STREAM, batch)
        try:
            yield
        finally:
            self._row_key_override = saved

    # ------------------------------------------------------------------------------------- Trainer plumbing
    def _prompt_dataloader(self, prompts_per_process: int, repeat: int = 1) -> DataLoader:
        """Batches of ``prompts_per_process`` prompts per process, each yielded ``repeat`` times in a row, in an order
        fixed by the seed and the epoch (:class:`RolloutSampler`)."""
        args = self.args
        sampler = RolloutSampler(
            len(self.train_dataset),
            prompts_per_process * args.world_size,
            repeat=repeat,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        loader = DataLoader(
            self.train_dataset,
            batch_size=prompts_per_process,
            sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
        )
        return self.accelerator.prepare(loader)

    def get_train_dataloader(self) -> DataLoader:
        """``per_device_train_batch_size`` prompts per process and micro-step, reshuffled every epoch
        (:class:`RolloutSampler`)."""
        return self._prompt_dataloader(self.args.per_device_train_batch_size)

    def _eval_prompts(self, dataset=None):
        """The prompts to evaluate or sample on: ``dataset`` (tokenised here), else the trainer's eval set; of a dict
        of datasets, the first. ``None`` when there is none."""
        given = dataset is not None
        dataset = dataset if given else self.eval_dataset
        if isinstance(dataset, dict):
            dataset = next(iter(dataset.values()), None)
        if given and dataset is not None:
            dataset = self._prepare_prompts(dataset, "dataset")
        return dataset

    def _eval_dataloader(self, dataset, collate_fn=None) -> DataLoader:
        """``per_device_eval_batch_size`` left-padded prompts per batch, in order."""
        collate_fn = collate_fn if collate_fn is not None else self._default_collator()
        loader = DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=collate_fn)
        return self.accelerator.prepare(loader)

    def _before_train(self, resume_from_checkpoint):
        """Before `Trainer.train` (`trl_ext.trainers.common.lifecycle`): ``resume_from_checkpoint=True`` picks the
        newest *complete* checkpoint whose files match its manifest, and a checkpoint without RNG states is refused
        unless ``allow_rng_reset`` (`VerifiedResumeMixin.verified_resume_checkpoint`); then the sampling seeds, the
        KL controller, the reward normaliser and the EMA start (fresh, or from the checkpoint)."""
        if not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(
                "No trainable parameter: every weight of the trained model(s) has requires_grad=False (frozen before "
                "it was passed in, e.g. by `model.requires_grad_(False)` or a loaded eval copy). Unfreeze what should "
                "train (`model.requires_grad_(True)`, or the top blocks only), or pass peft_config to train adapters."
            )
        resume_from_checkpoint = self.verified_resume_checkpoint(resume_from_checkpoint)
        if resume_from_checkpoint is None:
            # Each process samples with its own seed (the same seed would draw the same random numbers everywhere).
            torch.manual_seed(self.args.seed + 100003 * self.accelerator.process_index)
        if self.kl_controller is not None:  # a fresh run starts from kl_coef; a resumed one from the checkpoint's
            self.kl_controller = build_kl_controller(self.args)
            if resume_from_checkpoint is not None:
                ckpt.load_kl_controller(self.kl_controller, resume_from_checkpoint)
        if self.reward_normalizer is not None:  # fresh statistics; a resumed run continues the checkpoint's
            self.reward_normalizer = RunningMoments()
            if resume_from_checkpoint is not None:
                ckpt.load_reward_normalizer(self.reward_normalizer, resume_from_checkpoint)
        self._start_ema(resume_from_checkpoint)
        self._start_training(resume_from_checkpoint)
        return resume_from_checkpoint

    # ---------------------------------------------------------------------------------- reward normalisation
    def _update_reward_normalizer(self, scores: torch.Tensor, dropped: torch.Tensor | None = None) -> None:
        """With ``normalize_reward``: add one rollout's ``scores`` of every process (gathered, so the statistics are
        the same everywhere) to the running statistics, leaving out the ``dropped`` rows (``(B,)`` bool, the samples
        of ``nonfinite_rewards="drop"``). Called once per rollout, before its rewards are built."""
        if self.reward_normalizer is None:
            return
        scores = self.accelerator.gather(scores.detach().float().contiguous())
        if dropped is not None:
            scores = scores[~self.accelerator.gather(dropped.contiguous()).bool()]
        self.reward_normalizer.update(scores)

    def normalized_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """``(scores − mean) / max(std, 1e-8)`` with the running statistics of ``normalize_reward`` (this rollout's
        scores included, :class:`~trl_ext.ops.reward_norm.RunningMoments`); ``scores`` unchanged
        without it."""
        if self.reward_normalizer is None:
            return scores
        return self.reward_normalizer.normalize(scores)

    def _start_training(self, resume_from_checkpoint: str | None) -> None:
        """Reset the trainer's own step state before `Trainer.train` (the checkpoint resumed from, or ``None``).
        Nothing to reset by default."""
        return None

    # ---------------------------------------------------------------------------------------------------- EMA
    def _ema_module(self) -> nn.Module:
        """The (unwrapped) model whose trainable weights ``ema_beta`` averages: the trained module by default; PPO and
        the harmlessness trainer average their policy."""
        return self.accelerator.unwrap_model(self.model)

    def _start_ema(self, resume_from_checkpoint: str | None) -> None:
        """With ``ema_beta``: a fresh :class:`~trl_ext.trainers.common.ema.EMA` of :meth:`_ema_module` (from its
        current weights, or from the checkpoint's ``ema.safetensors`` when resuming) and the callback that updates it
        after every optimizer step."""
        self.ema = None
        self.callback_handler.remove_callback(EMACallback)
        if not getattr(self.args, "ema_beta", None):
            return
        if self.is_fsdp_enabled:
            raise ValueError("ema_beta is not supported under FSDP; use DDP or DeepSpeed (ZeRO-3 included).")
        self.ema = EMA(self._ema_module(), self.args.ema_beta, offload=self.args.ema_offload)
        if resume_from_checkpoint is not None:
            load_ema(self.ema, resume_from_checkpoint)
        self.add_callback(EMACallback(self.ema, self._ema_module))

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[nn.Module]:
        """Run the block with the EMA weights in the averaged model (:meth:`_ema_module`, yielded) and put the live
        weights back afterwards. Needs ``ema_beta`` and a started training run."""
        if self.ema is None:
            raise ValueError("There is no EMA of the weights: set ema_beta in the config and train first.")
        with self.ema.swapped_in(self._ema_module()) as module:
            yield module

    def _ema_prefix(self) -> str:
        """Prefix of :meth:`_ema_module`'s parameter names in the trained module's state dict."""
        module, root = self._ema_module(), self.accelerator.unwrap_model(self.model)
        for name, sub in root.named_modules():
            if sub is module:
                return f"{name}." if name else ""
        raise ValueError(f"{type(module).__name__} is not part of the trained module.")

    def _write_ema_models(self, output_dir: str, state_dict: dict | None) -> None:
        """:meth:`_write_models` with the averaged model's live weights replaced by the EMA (``save_ema_model``)."""
        if state_dict is not None:  # gathered (DeepSpeed): overlay the gathered weights, nothing to swap
            state_dict = self.ema.overlay(state_dict, self._ema_module(), self._ema_prefix())
            self._write_models(output_dir, state_dict)
            return
        with self.ema_weights():
            self._write_models(output_dir, None)

    # ----------------------------------------------------------------------------------------------- saving
    def _write_saved_model(self, output_dir: str | None, _internal_call: bool) -> None:
        """What `save_model` writes (`trl_ext.trainers.common.lifecycle`): the trained model(s) at ``output_dir`` in HF
        format (a PEFT model saves its adapter) with the tokenizer and the training arguments (:meth:`_write_models`);
        outside checkpoints, also the model card, and push with ``push_to_hub``.

        With ``ema_beta``, a checkpoint also holds the EMA (``ema.safetensors``); with ``save_ema_model`` every save
        that is not a checkpoint (the final model, the Hub upload) writes the EMA weights in place of the live ones
        of the averaged model (the policy; the proposal for `ProposalTrainer`)."""
        output_dir = os.path.normpath(output_dir if output_dir is not None else self.args.output_dir)
        is_checkpoint = _internal_call and output_dir != os.path.normpath(self.args.output_dir)
        state_dict, gathered = self._gathered_state_dict()
        self.check_finite_weights(state_dict)  # a model with NaN weights is never saved
        if self.args.should_save and gathered:
            if self.ema is not None and getattr(self.args, "save_ema_model", False) and not is_checkpoint:
                self._write_ema_models(output_dir, state_dict)
            else:
                self._write_models(output_dir, state_dict)
        if is_checkpoint:
            if self.args.should_save and self.kl_controller is not None:  # read back by `train(resume_from_...)`
                ckpt.save_kl_controller(self.kl_controller, output_dir)
            if self.args.should_save and self.reward_normalizer is not None:  # normalize_reward's statistics
                ckpt.save_reward_normalizer(self.reward_normalizer, output_dir)
            if self.args.should_save and self.ema is not None:  # read back by `train(resume_from_...)`
                save_ema(self.ema, output_dir)
            self._write_checkpoint_card(output_dir)  # a checkpoint: before `Trainer` writes trainer_state.json
        if not _internal_call:
            self.create_model_card(model_name=self._card_model_name())
            if self.args.push_to_hub:  # a clear error when the Hub cannot be reached: see push_to_hub
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def init_hf_repo(self, token: str | None = None, **kwargs) -> None:
        """`Trainer.init_hf_repo` (creates the Hub repository when ``push_to_hub``), with a clear error when the Hub
        cannot be reached (:func:`hub_push_errors`)."""
        with hub_push_errors(self, creating=True):
            return super().init_hf_repo(token=token, **kwargs)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """`Trainer.push_to_hub`, with a clear error when the Hub cannot be reached (:func:`hub_push_errors`)."""
        with hub_push_errors(self):
            return super().push_to_hub(commit_message, blocking, **kwargs)

    def _card_model_name(self) -> str:
        hub_id = self.args.hub_model_id
        return hub_id.split("/")[-1] if hub_id else os.path.basename(os.path.normpath(self.args.output_dir))

    def _write_checkpoint_card(self, checkpoint_dir: str) -> None:
        """The model card of a checkpoint (TRL ≤ 1.12 wrote one at every save): ``output_dir/README.md`` as
        :meth:`create_model_card` writes it, and a copy in the checkpoint folder."""
        self.create_model_card(model_name=self._card_model_name())
        if self.is_world_process_zero() and os.path.isdir(checkpoint_dir):
            with open(os.path.join(self.args.output_dir, "README.md"), encoding="utf-8") as f:
                write_text_atomically(os.path.join(checkpoint_dir, "README.md"), f.read())

    def _gathered_state_dict(self) -> tuple[dict | None, bool]:
        """``(state_dict, ok)``: the full state dict of the trained module under DeepSpeed / FSDP (``None``
        otherwise; each model then saves its own weights); ``ok=False`` when the weights could not be gathered."""
        if not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            return None, True
        engine = self.deepspeed if self.is_deepspeed_enabled else self.model
        try:
            state_dict = self.accelerator.get_state_dict(engine)
        except ValueError:
            logger.warning(
                "Could not gather the full weights (ZeRO-3 without stage3_gather_16bit_weights_on_model_save): "
                "nothing is written in HF format for %s; the DeepSpeed engine checkpoint holds the weights.",
                self._saved_models,
            )
            return None, False
        return state_dict, state_dict is not None

    @abc.abstractmethod
    def _write_models(self, output_dir: str, state_dict: dict | None) -> None:
        """Write the trained model(s) to ``output_dir`` (``state_dict``: the gathered weights, or ``None``)."""

    # ---------------------------------------------------------------------------------------- sample tables
    @torch.no_grad()
    def _completion_rows(
        self, ids: torch.Tensor, mask: torch.Tensor, settings: SamplingSettings, column: str, vision=None, columns=None
    ):
        """One response per left-padded prompt of the model being trained (sampled with ``settings``), scored by the
        reward: rows ``{"query", column, "score"}``. ``vision``: the prompts' image inputs; ``columns``: their
        reward columns (`rollout.columns`)."""
        generator = self.rollout_generator
        with generator.generation_model(self.model_wrapped) as policy:
            responses, response_mask, _ = call_as_root_forward(
                self.accelerator.unwrap_model(self.model), generate_responses, policy, ids, mask, settings,
                self.args.local_rollout_forward_batch_size, vision=vision,
            )  # fmt: skip
        scores = generator.reward(ids, mask, responses, response_mask, vision, columns=columns)
        prompts = self.tokenizer.batch_decode([r[m != 0] for r, m in zip(ids, mask)], skip_special_tokens=True)
        texts = self.tokenizer.batch_decode([r[m != 0] for r, m in zip(responses, response_mask)])
        return [{"query": p, column: t, "score": s} for p, t, s in zip(prompts, texts, scores.tolist())]

    def _publish_completions(self, rows: list[dict], title: str) -> list[dict]:
        """Gather the rows of every process; the main one prints them and logs them to the trackers."""
        from accelerate.utils import gather_object

        rows = gather_object(rows)
        if self.accelerator.is_main_process:
            print_completions_table(rows, title=f"{title} at step {self.state.global_step}")
            log_completions_table(rows, self.args.report_to)
        return rows
