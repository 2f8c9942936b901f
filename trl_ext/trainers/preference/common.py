"""What trl_ext's `DPOTrainer` and `KTOTrainer` share: the extra-loss options, how an extra loss is called, the
reference-model check, and reading TRL's own log-prob forward passes instead of repeating them.

- :class:`ExtraLossArguments`: the config fields (``extra_loss``, ``extra_loss_coef``, ...) and their checks.
- :class:`ExtraLoss`: the resolved loss callable and the keywords it is called with.
- :class:`FusedCallRecorder`: forward hooks that keep the per-token log-probs of the ``model(..., labels=...,
  fused_lm_head=True)`` calls TRL's ``compute_loss`` makes, so an extra loss reuses them (and their autograd graph)
  instead of running the policy a second time.
- :func:`check_reference_model`, :func:`restore_native_fused_forward`: model handling before/after TRL's ``__init__``.
"""

from __future__ import annotations

import inspect
import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

from ...losses import AGGREGATIONS, LossOutput, available_losses, get_loss_spec
from ...losses.negative import unlikelihood_loss, uses_chosen
from ...models.fused_patch import is_trl_fused_forward
from ...models.lora import is_peft_model
from ...models.quantization import keep_4bit_layers_trainable
from ...ops.stats import masked_mean, masked_sum
from ..common.checks import refuse_same_object

__all__ = [
    "ExtraLoss",
    "ExtraLossArguments",
    "ExtraLossLogging",
    "FusedCallRecorder",
    "check_reference_model",
    "completion_labels",
    "restore_native_fused_forward",
    "rejected_only_losses",
]

#: Registered losses that repeat a term TRL's `loss_type` already has, by the TRL loss type they repeat.
_DUPLICATES_TRL_LOSS: dict[str, str] = {
    "dpo": "sigmoid",
    "sigmoid": "sigmoid",
    "sft_regularised": "sigmoid",
    "sft_regularized": "sigmoid",
    "ipo": "ipo",
}


def rejected_only_losses() -> list[str]:
    """Registered ``"preference"`` losses that never read the chosen completion (``negative_dpo``, ``unlikelihood``,
    ...): the extras that work on data without a chosen column and on KTO's unpaired rows."""
    return [name for name in available_losses("preference") if not uses_chosen(get_loss_spec(name).fn)]


# ------------------------------------------------------------------------------------------------------ config
@dataclass
class ExtraLossArguments:
    """Config fields of an extra loss added to TRL's DPO/KTO loss (mixed into trl_ext's `DPOConfig`/`KTOConfig`)."""

    extra_loss: str | None = field(
        default=None,
        metadata={
            "help": "Name of a registered 'preference' loss from `trl_ext.losses` added to TRL's loss: "
            "'negative_dpo' (push rejected completions below the reference), 'unlikelihood' (lower the "
            "probability of each rejected token), 'sft_regularised' (DPO + sft_coef x NLL of the chosen), or any "
            "other registered preference loss such as 'ipo'. None: TRL's loss only."
        },
    )
    extra_loss_coef: float = field(
        default=1.0, metadata={"help": "Weight of the extra loss: total = TRL loss + extra_loss_coef x extra loss."}
    )
    extra_loss_beta: float | None = field(
        default=None,
        metadata={"help": "β passed to the extra loss (negative_dpo, sft_regularised, ipo, ...). None: `beta`."},
    )
    sft_coef: float = field(
        default=1.0,
        metadata={"help": "Weight of the chosen completion's NLL (token mean) in extra_loss='sft_regularised'."},
    )
    unlikelihood_eps: float = field(
        default=1e-6,
        metadata={
            "help": "extra_loss='unlikelihood': lower clamp of 1 − π(token), so a token the policy is sure of "
            "adds at most −log(eps) instead of an infinite loss."
        },
    )
    unlikelihood_aggregation: str = field(
        default="seq-mean-token-sum",
        metadata={
            "help": "extra_loss='unlikelihood': how token terms are reduced. 'seq-mean-token-sum' (sum over each "
            "completion's tokens, mean over completions), 'seq-mean-token-mean' or 'token-mean'.",
            "choices": list(AGGREGATIONS),
        },
    )
    extra_loss_average_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Pass per-token averaged instead of summed completion log-probs to the extra loss (TRL's "
            "convention for IPO). Token-level inputs (unlikelihood, the NLL of sft_regularised) are unaffected."
        },
    )
    extra_loss_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Further keyword arguments of the extra loss, as a dict (a JSON string on the command line), "
            "e.g. '{\"label_smoothing\": 0.1}' for extra_loss='dpo'."
        },
    )

    def _check_extra_loss(self, *, needs_rejected_only: bool, trainer: str) -> None:
        """Check the extra-loss options; ``needs_rejected_only`` for trainers whose rows are unpaired (KTO)."""
        if isinstance(self.extra_loss_kwargs, str):
            try:
                self.extra_loss_kwargs = json.loads(self.extra_loss_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"extra_loss_kwargs={self.extra_loss_kwargs!r} is not valid JSON; pass a JSON object such as "
                    "'{\"label_smoothing\": 0.1}'."
                ) from err
        if self.extra_loss_kwargs is not None and not isinstance(self.extra_loss_kwargs, dict):
            raise ValueError(f"extra_loss_kwargs must be a dict (JSON object), got {self.extra_loss_kwargs!r}.")
        if self.extra_loss in (None, "", "none", "None"):
            self.extra_loss = None
            if self.extra_loss_kwargs:
                raise ValueError("extra_loss_kwargs is set but extra_loss is None: name the extra loss to use.")
            return
        try:
            spec = get_loss_spec(self.extra_loss, "preference")
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"extra_loss={self.extra_loss!r} is not a registered 'preference' loss. Choose one of "
                f"{', '.join(available_losses('preference'))} (or register yours with "
                "`trl_ext.losses.register_loss(name, kind='preference')`)."
            ) from err
        if needs_rejected_only and uses_chosen(spec.fn):
            raise ValueError(
                f"{trainer} trains on unpaired rows, but extra_loss={self.extra_loss!r} needs (chosen, rejected) "
                f"pairs. Use one that reads only the undesirable completions: {', '.join(rejected_only_losses())}."
            )
        if self.extra_loss_coef < 0:
            raise ValueError(f"extra_loss_coef={self.extra_loss_coef}: set it >= 0.")
        if self.extra_loss_beta is not None and not self.extra_loss_beta > 0:
            raise ValueError(f"extra_loss_beta={self.extra_loss_beta}: set it > 0 (or None to use `beta`).")
        if self.sft_coef < 0:
            raise ValueError(f"sft_coef={self.sft_coef}: set it >= 0.")
        if not 0.0 < self.unlikelihood_eps < 1.0:
            raise ValueError(f"unlikelihood_eps={self.unlikelihood_eps}: set it in (0, 1), e.g. 1e-6.")
        if self.unlikelihood_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"unlikelihood_aggregation={self.unlikelihood_aggregation!r}: choose one of {', '.join(AGGREGATIONS)}."
            )


# ------------------------------------------------------------------------------------------------ extra loss
class ExtraLoss:
    """A registered preference loss, called with the keywords it declares.

    Every call passes the four sequence log-prob tensors positionally; the keywords below go to the loss only if its
    signature names them: ``beta``, ``sft_coef``, ``chosen_token_logps``/``chosen_mask``,
    ``rejected_token_logps``/``rejected_mask``; ``eps``/``aggregation`` go to ``unlikelihood`` only;
    ``extra_loss_kwargs`` are passed as given (a wrong name is the loss's own ``TypeError``).
    """

    def __init__(self, args: ExtraLossArguments, beta: float):
        spec = get_loss_spec(args.extra_loss, "preference")
        self.spec, self.name, self.fn = spec, spec.name, spec.fn
        self.coef = float(args.extra_loss_coef)
        self.uses_chosen = uses_chosen(spec.fn)
        self.average_log_probs = bool(args.extra_loss_average_log_probs)
        options = {"beta": args.extra_loss_beta or beta, "sft_coef": args.sft_coef}
        if spec.fn is unlikelihood_loss:
            options.update(eps=args.unlikelihood_eps, aggregation=args.unlikelihood_aggregation)
        self._options = {k: v for k, v in options.items() if spec.accepts(k)}
        self._options.update(args.extra_loss_kwargs or {})

    def needs(self, name: str) -> bool:
        """Whether the loss declares the keyword ``name`` (e.g. ``"rejected_token_logps"``)."""
        return name in self._params

    def sequence_logps(self, token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token log-probs → ``(B,)``: their masked sum, or mean with ``extra_loss_average_log_probs``."""
        if self.average_log_probs:
            return masked_mean(token_logps, mask, dim=-1)
        return masked_sum(token_logps, mask, dim=-1)

    def __call__(
        self,
        chosen_logps: torch.Tensor | None,
        rejected_logps: torch.Tensor,
        ref_chosen_logps: torch.Tensor | None,
        ref_rejected_logps: torch.Tensor,
        **token_inputs: torch.Tensor | None,
    ) -> LossOutput:
        """Call the loss; ``token_inputs`` are ``chosen_token_logps``, ``chosen_mask``, ``rejected_token_logps``,
        ``rejected_mask`` (passed where declared)."""
        kwargs = {k: v for k, v in token_inputs.items() if v is not None and self.spec.accepts(k)}
        kwargs.update(self._options)
        return self.fn(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, **kwargs)


# -------------------------------------------------------------------------------------------------- models
def _is_transformers_class(model: nn.Module) -> bool:
    return getattr(transformers, type(model).__name__, None) is type(model)


def _fsdp_requested(args) -> bool:
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_reference_model(model, ref_model, args, peft_config, trainer: str) -> None:
    """Refuse ``ref_model is model`` (the reference would train along), and ``ref_model=None`` where TRL would have
    to rebuild the reference from ``config._name_or_path`` and cannot: a model built from a config (no path), or a
    trl_ext model class (TRL would load a plain ``transformers`` class from the path, silently dropping the
    modulation or value head).

    Nothing is required with PEFT (the reference is the model with its adapters disabled) or with
    ``precompute_ref_log_probs=True`` outside FSDP (TRL then scores the reference with the initial model itself).
    """
    refuse_same_object(model, ref_model, trainer=trainer)
    if ref_model is not None or peft_config is not None or isinstance(model, str) or is_peft_model(model):
        return
    if args.precompute_ref_log_probs and not _fsdp_requested(args):
        return
    config = getattr(model, "config", None)
    path = getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "") or ""
    fix = (
        "Pass the reference explicitly: `ref_model=copy.deepcopy(model)` (a frozen copy of the initial policy, made "
        "before training) or a model loaded from a checkpoint; or train LoRA adapters (`peft_config=...`: the "
        "reference is then the model with its adapters disabled); or set `precompute_ref_log_probs=True`."
    )
    if not path:
        raise ValueError(
            f"{trainer}: ref_model is None and `model` was built from a config (its `config._name_or_path` is "
            f"empty), so there is no checkpoint to load the reference model from. {fix}"
        )
    if not _is_transformers_class(model):
        raise ValueError(
            f"{trainer}: ref_model is None and `model` is a {type(model).__name__}; TRL would rebuild the reference "
            f"from {path!r} as a plain transformers model, not a {type(model).__name__}, so the reference would not "
            f"be the initial policy. {fix}"
        )


def restore_native_fused_forward(module: nn.Module | None) -> bool:
    """Undo TRL's ``add_fused_lm_head`` patch on a model whose own ``forward`` implements ``fused_lm_head=True``.

    trl_ext's models refuse that patch themselves (`trl_ext.models.fused_patch.RefusesTrlForwardPatch`); this also
    covers third-party models that implement the protocol without the mixin. Returns whether a patch was removed.
    """
    if module is None:
        return False
    inner = module.get_base_model() if is_peft_model(module) else module
    patched = inner.__dict__.get("forward")
    if patched is None or not is_trl_fused_forward(patched):
        return False
    try:
        own = inspect.signature(type(inner).forward).parameters
    except (TypeError, ValueError):
        return False
    if "fused_lm_head" not in own:
        return False
    del inner.__dict__["forward"]
    return True


# --------------------------------------------------------------------------------------------- fused calls
def completion_labels(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """The labels TRL's DPO/KTO pass with ``fused_lm_head=True``: the input ids, ``-100`` outside the completion."""
    return input_ids.masked_fill(completion_mask == 0, -100)


@dataclass
class _FusedCall:
    source: str
    labels: torch.Tensor
    log_probs: torch.Tensor
    grad_enabled: bool


class FusedCallRecorder:
    """Context manager recording every ``fused_lm_head=True`` call of the policy and the reference model.

    TRL's ``compute_loss`` runs these forwards itself but returns only the loss; the per-token ``log_probs`` it
    computed are read here through forward hooks (public PyTorch API), so an extra loss can use them, gradient
    included, without a second forward pass.

    Args:
        policy: the unwrapped policy (a DDP/DeepSpeed wrapper calls it, so its hooks fire).
        reference: the reference model, or ``None`` (PEFT: the reference pass is a policy call with adapters
            disabled; precomputed reference log-probs: no pass at all).
    """

    def __init__(self, policy: nn.Module, reference: nn.Module | None = None):
        self._modules = [("policy", policy)]
        if reference is not None and reference is not policy:
            self._modules.append(("reference", reference))
        self.calls: list[_FusedCall] = []
        self._handles: list = []

    def _hook(self, source: str) -> Callable:
        def hook(module, args, kwargs, output):
            if not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
                return
            log_probs = getattr(output, "log_probs", None)
            if log_probs is None:
                raise RuntimeError(
                    f"{type(module).__name__}(..., fused_lm_head=True) returned no `log_probs`; the extra loss needs "
                    "TRL's fused LM-head output (`trl.trainer.utils.FusedCausalLMOutput`)."
                )
            self.calls.append(_FusedCall(source, kwargs["labels"], log_probs, torch.is_grad_enabled()))

        return hook

    def __enter__(self) -> FusedCallRecorder:
        self.calls.clear()
        for source, module in self._modules:
            self._handles.append(module.register_forward_hook(self._hook(source), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def _matches(call: _FusedCall, labels: torch.Tensor) -> bool:
        return call.labels.shape == labels.shape and torch.equal(call.labels.to(labels.device), labels)

    def _find(self, labels: torch.Tensor, calls: Iterable[tuple[int, _FusedCall]]) -> tuple[int, _FusedCall] | None:
        return next(((i, c) for i, c in calls if self._matches(c, labels)), None)

    def policy_log_probs(self, labels: torch.Tensor) -> tuple[int, torch.Tensor]:
        """``(index, (B, T−1) log-probs)`` of the policy call on ``labels``: the first one made with gradients when
        gradients are on (TRL's no-grad passes, e.g. KTO's KL pass, are skipped), else the first one."""
        policy_calls = [(i, c) for i, c in enumerate(self.calls) if c.source == "policy"]
        found = None
        if torch.is_grad_enabled():
            found = self._find(labels, ((i, c) for i, c in policy_calls if c.grad_enabled))
        found = found or self._find(labels, policy_calls)
        if found is None:
            raise RuntimeError(
                "Could not find the policy's fused log-prob pass among the forward calls of TRL's compute_loss; "
                "the extra loss cannot be computed. Was the model wrapped in a way that bypasses its forward hooks?"
            )
        return found[0], found[1].log_probs

    def reference_log_probs(self, labels: torch.Tensor, after: int) -> torch.Tensor | None:
        """``(B, T−1)`` reference log-probs on ``labels``: from the reference model's call, else (PEFT) from the first
        no-grad policy call after index ``after``; ``None`` when there was no reference pass."""
        found = self._find(labels, ((i, c) for i, c in enumerate(self.calls) if c.source == "reference"))
        if found is None:
            later = ((i, c) for i, c in enumerate(self.calls) if i > after and c.source == "policy")
            found = self._find(labels, ((i, c) for i, c in later if not c.grad_enabled))
        return None if found is None else found[1].log_probs.detach()


# ----------------------------------------------------------------------------------------------- logging
class ExtraLossLogging:
    """Mixin for TRL's DPO/KTO trainers: what both subclasses do the same way.

    - :meth:`finish_setup` after TRL's ``__init__``: take TRL's fused LM-head patch off the policy and the reference
      (trl_ext models run their own forward), keep a 4-bit policy trainable, attach the extra loss, start metrics.
    - :meth:`loss_with_extra_term`: TRL's loss with the policy/reference token log-probs recorded on the way, plus
      ``extra_loss_coef ×`` the subclass's ``_extra_term``.
    - metrics of the extra loss, averaged over the batches since the last ``log`` call and added to TRL's logs
      (``eval_``-prefixed in evaluation), gathered over processes like TRL's own metrics.
    """

    def finish_setup(self, extra: ExtraLoss | None) -> None:
        restore_native_fused_forward(self.model)
        restore_native_fused_forward(self.ref_model)
        keep_4bit_layers_trainable(self.model)  # a QLoRA policy: TRL's evaluation runs it in eval mode
        self.extra_loss = extra
        self.init_extra_metrics()

    def loss_with_extra_term(self, model, inputs, return_outputs, num_items_in_batch, base_name: str):
        """TRL's ``compute_loss`` + ``extra_loss.coef × self._extra_term(inputs, token_logps, ref_token_logps)``;
        TRL's own loss is logged as ``base_name``."""
        recorder = FusedCallRecorder(self.accelerator.unwrap_model(model), self.ref_model)
        with recorder:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        base_loss, outputs = result if return_outputs else (result, None)
        labels = completion_labels(inputs["input_ids"], inputs["completion_mask"])
        index, token_logps = recorder.policy_log_probs(labels)
        ref_token_logps = None if self.precompute_ref_logps else recorder.reference_log_probs(labels, after=index)
        extra = self._extra_term(inputs, token_logps, ref_token_logps)
        loss = base_loss + self.extra_loss.coef * extra.loss
        self._record(base_name, base_loss)
        return (loss, outputs) if return_outputs else loss

    def init_extra_metrics(self) -> None:
        self._extra_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _record(self, name: str, value) -> None:
        """Log a scalar: averaged over processes, or summed for a count (``.../count/...``: the rows of every
        process)."""
        value = torch.as_tensor(value).detach().float().reshape(1).to(self.accelerator.device)
        gathered = self.accelerator.gather_for_metrics(value)
        total = "count/" in name
        self._extra_metrics[self._mode()][name].append((gathered.sum() if total else gathered.mean()).item())

    def _record_rows(self, name: str, values: torch.Tensor) -> None:
        """Log the mean of per-row values over every process's rows."""
        gathered = self.accelerator.gather(values.detach().float())
        if gathered.numel():
            self._extra_metrics[self._mode()][name].append(gathered.mean().item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The trainer's logging, plus the extra-loss metrics averaged since the last log."""
        mode = self._mode()
        store = getattr(self, "_extra_metrics", {}).get(mode, {})
        prefix = "eval_" if mode == "eval" else ""
        logs.update({f"{prefix}{key}": sum(vals) / len(vals) for key, vals in store.items() if vals})
        if store:
            store.clear()
        super().log(logs, start_time)
