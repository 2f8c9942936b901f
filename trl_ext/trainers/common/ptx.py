"""The pretraining (ptx) loss: a language-modelling loss on a separate text dataset mixed into each policy update.

InstructGPT's PPO-ptx (Ouyang et al. 2022, eq. 2) maximises ``E[r − β·KL] + γ·E_{x∼D_pretrain}[log π(x)]``: the
policy keeps modelling the pretraining distribution while it is fine-tuned, which limits the "alignment tax". Here
``γ`` is ``ptx_coef`` and the trainers add ``ptx_coef × mean NLL`` of one micro-batch of ``ptx_batch_size`` texts
to the loss of every policy micro-step (see `PPOTrainer.compute_loss` and `HarmlessnessTrainer`).

- :class:`PtxBatches` reads the texts: micro-batch ``k`` of process ``r`` is a pure function of ``(seed, k, r)``
  (random access: a resumed run draws the same texts as an uninterrupted one, with no iterator state to save, and
  the global RNG is never touched). Rows are drawn without replacement within an epoch of the dataset (one fresh
  permutation per epoch), tokenised on demand and truncated to ``ptx_max_length`` tokens.
- :class:`PtxLoss` runs the policy on a micro-batch and returns the mean token NLL
  (:func:`trl_ext.losses.supervised.gpt_lm_loss`, the causal-LM loss, at temperature 1).
- :func:`build_ptx` checks the trainer's options and data and returns a :class:`PtxLoss`, or ``None`` when
  ``ptx_coef == 0`` (the data is then never read, so training is bit-identical to a run without it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from ...losses import LossOutput
from ...losses.supervised import gpt_lm_loss
from ...models.lora import is_peft_model
from ...models.value_head import AutoModelForCausalLMWithValueHead
from ...ops.sequences import position_ids_from_attention_mask

__all__ = ["PtxBatches", "PtxLoss", "build_ptx"]

logger = logging.getLogger(__name__)

_MIX = 1_000_003  # a prime for mixing integers into generator seeds


class PtxBatches:
    """Random-access micro-batches of a text dataset for the ptx loss.

    Args:
        dataset: a `datasets.Dataset` (or any sequence of mappings, or of strings) with a text column.
        tokenizer: the policy's tokenizer (it needs a pad token).
        batch_size: rows per micro-batch.
        max_length: texts are truncated to this many tokens.
        text_column: the column holding the text (ignored for a sequence of strings).
        seed: with ``(index, rank)``, fixes which rows a micro-batch holds.

    The ``i``-th row of micro-batch ``k`` on process ``r`` of ``W`` is element ``p = (k·W + r)·batch_size + i`` of an
    endless stream that visits the dataset in a fresh random order each epoch: row ``perm_e[p mod n]`` with
    ``e = ⌊p / n⌋`` and ``perm_e`` a permutation drawn from a `torch.Generator` seeded with ``(seed, e)``.
    """

    def __init__(self, dataset, tokenizer, *, batch_size: int, max_length: int, text_column: str = "text", seed=0):
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"ptx batch_size={batch_size} must be >= 1 and max_length={max_length} >= 2.")
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("The ptx loss pads its texts: the tokenizer needs a pad token.")
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                f"pretrain_dataset must be a map-style dataset (with len() and indexing), got {type(dataset).__name__}"
                " (a streaming IterableDataset cannot be read at random: load it without streaming)."
            )
        if len(dataset) == 0:
            raise ValueError("pretrain_dataset is empty: the ptx loss needs at least one text.")
        self.dataset, self.tokenizer, self.text_column = dataset, tokenizer, text_column
        self.batch_size, self.max_length, self.seed = int(batch_size), int(max_length), int(seed)
        self._check_column()
        self._permutation: tuple[int, torch.Tensor] | None = None  # (epoch, permutation): the last one used

    def __len__(self) -> int:
        return len(self.dataset)

    def _check_column(self) -> None:
        columns = getattr(self.dataset, "column_names", None)
        if columns is None:
            first = self.dataset[0]
            if isinstance(first, str):
                return
            columns = list(first) if isinstance(first, Mapping) else []
        if self.text_column not in columns:
            raise ValueError(
                f"pretrain_dataset has no {self.text_column!r} column (its columns: {list(columns)}); set "
                "pretrain_text_column to the column holding the text."
            )

    def _text(self, row: int) -> str:
        item = self.dataset[row]
        text = item if isinstance(item, str) else item[self.text_column]
        if not isinstance(text, str):
            raise ValueError(
                f"pretrain_dataset[{row}][{self.text_column!r}] is a {type(text).__name__}, not a string: the ptx "
                "loss needs plain text."
            )
        return text

    def _epoch_permutation(self, epoch: int) -> torch.Tensor:
        if self._permutation is None or self._permutation[0] != epoch:
            generator = torch.Generator().manual_seed((self.seed * _MIX + epoch) % (2**63))
            self._permutation = (epoch, torch.randperm(len(self), generator=generator))
        return self._permutation[1]

    def rows(self, index: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """The dataset rows of micro-batch ``index`` on process ``rank`` of ``world_size`` (see the class docs)."""
        n, start = len(self), (int(index) * world_size + rank) * self.batch_size
        return [int(self._epoch_permutation(p // n)[p % n]) for p in range(start, start + self.batch_size)]

    def batch(self, index: int, rank: int = 0, world_size: int = 1, device=None) -> dict[str, torch.Tensor]:
        """Micro-batch ``index`` for process ``rank``: right-padded ``input_ids``, ``attention_mask`` and ``labels``
        (the input ids, ``-100`` on padding), all ``(batch_size, L)`` with ``L <= max_length``."""
        texts = [self._text(row) for row in self.rows(index, rank, world_size)]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        width = max(1, max(len(ids) for ids in encoded))
        input_ids = torch.full((len(encoded), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for i, ids in enumerate(encoded):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def _forward_kwargs(model: nn.Module) -> dict:
    """A value-head policy is asked for its logits only."""
    inner = model.get_base_model() if is_peft_model(model) else model
    return {"return_values": False} if isinstance(inner, AutoModelForCausalLMWithValueHead) else {}


class PtxLoss:
    """The ptx term of a trainer: its data (:class:`PtxBatches`) and ``coef`` (``ptx_coef``)."""

    def __init__(self, batches: PtxBatches, coef: float):
        self.batches, self.coef = batches, float(coef)
        self._step: int | None = None
        self._micro = 0

    def next_index(self, global_step: int, accumulation_steps: int) -> int:
        """The micro-batch index of the next micro-step of optimizer step ``global_step`` (for trainers that do not
        count micro-steps): ``global_step × accumulation_steps + j`` at its ``j``-th call with that step (a resumed
        run starts a step at ``j = 0``, as the interrupted run did)."""
        if self._step != global_step:
            self._step, self._micro = global_step, 0
        else:
            self._micro += 1
        return global_step * accumulation_steps + self._micro

    def __call__(self, policy: nn.Module, index: int, rank: int = 0, world_size: int = 1, device=None) -> LossOutput:
        """The mean token NLL ``−(1/N)·Σ_{b,t} log π(x_{b,t+1} | x_{b,≤t})`` of ``policy`` over the ``N`` predicted
        tokens of micro-batch ``index`` (:func:`~trl_ext.losses.supervised.gpt_lm_loss`, ``"token-mean"``; not
        multiplied by ``coef``). ``policy``: the causal LM itself (unwrapped); its ``logits`` may be log-probs
        (a modulated policy's ``log q``), which the softmax leaves unchanged."""
        batch = self.batches.batch(index, rank, world_size, device)
        out = policy(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
            position_ids=position_ids_from_attention_mask(batch["attention_mask"]), **_forward_kwargs(policy),
        )  # fmt: skip
        return gpt_lm_loss(out.logits, batch["labels"])


def build_ptx(args, pretrain_dataset, tokenizer, trainer: str) -> PtxLoss | None:
    """The ptx term for ``args`` (``ptx_coef``, ``ptx_batch_size``, ``ptx_max_length``, ``pretrain_text_column``,
    ``pretrain_split``, ``seed``), or ``None`` when ``ptx_coef == 0`` (a given dataset is then ignored with a
    warning). A dataset dict is read at its ``pretrain_split``."""
    if not args.ptx_coef:
        if pretrain_dataset is not None:
            logger.warning(
                "%s: pretrain_dataset is given but ptx_coef=0, so it is not used; set ptx_coef > 0.", trainer
            )
        return None
    if pretrain_dataset is None:
        where = f" (pretrain_data={args.pretrain_data!r} is read by the recipes only)" if args.pretrain_data else ""
        raise ValueError(
            f"{trainer}: ptx_coef={args.ptx_coef} > 0 but no pretrain_dataset was passed{where}: pass "
            f"pretrain_dataset=<a dataset with a {args.pretrain_text_column!r} column>, or set ptx_coef=0."
        )
    if isinstance(pretrain_dataset, Mapping):  # e.g. a DatasetDict
        if args.pretrain_split not in pretrain_dataset:
            raise ValueError(
                f"{trainer}: pretrain_dataset has no split {args.pretrain_split!r} (its splits: "
                f"{list(pretrain_dataset)}); set pretrain_split."
            )
        pretrain_dataset = pretrain_dataset[args.pretrain_split]
    batches = PtxBatches(
        pretrain_dataset, tokenizer, batch_size=args.ptx_batch_size, max_length=args.ptx_max_length,
        text_column=args.pretrain_text_column, seed=args.seed,
    )  # fmt: skip
    return PtxLoss(batches, args.ptx_coef)
