"""Running a part of an FSDP2-sharded model outside its ``forward``: generation, critic values, a PEFT reference, a
sharded frozen reward model (implemented in `trl_ext.models.fsdp`, re-exported here).

Under FSDP2 (``fully_shard``, `accelerate_configs/fsdp2.yaml`) the trained module is sharded in place: each
transformer block all-gathers its own weights in a forward pre-hook and frees them afterwards, and the root module's
weights (embeddings, final norm, LM head, a value head...) are all-gathered in the *root's* forward pre-hook, which
also decides, on the first forward it sees, which module is the root. A rollout calls ``policy.generate`` or the
critic directly, below the root: the root's weights would still be shards (``aten.embedding got mixed torch.Tensor
and DTensor``), and the first block to run would wrongly become the root.

:func:`call_as_root_forward` runs a callable between the root's pre- and post-forward hooks, through PyTorch's public
`torch.distributed.fsdp.register_fsdp_forward_method`; the blocks below still gather their weights one module at a
time. :func:`is_fsdp_sharded` tells generation to keep every process stepping until all are done (``synced_gpus``),
since each step's all-gathers need every process.

Frozen models sharded with ``frozen_models_placement="sharded"`` (`trl_ext.trainers.common.frozen`) are FSDP2 roots
of their own: the reference is always run through its own forward (:func:`~trl_ext.models.lm_head.split_lm_head`
refuses ``DTensor`` weights, so the scoring takes the logits path), a reward model's backbone-then-head scoring runs
as the reward model's forward (:func:`~trl_ext.models.reward.get_sequence_scores`), and the shared-prefix passes
(:mod:`.shared_prefix`), whose number of forward calls depends on each process's rows, are not used on them (every
process must make the same calls, since each one all-gathers).
"""

from __future__ import annotations

from ..models.fsdp import call_as_root_forward, is_fsdp_root, is_fsdp_sharded

__all__ = ["call_as_root_forward", "is_fsdp_root", "is_fsdp_sharded"]
