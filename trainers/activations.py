"""Selective activation checkpointing (--ac-mode selective): inside a checkpointed block, the outputs of the matrix
multiplications and of attention are kept and only the cheap elementwise ops (norms, activation functions, dropout,
residual adds) are recomputed in the backward. torchtitan's op-level policy
(torchtitan/distributed/activation_checkpoint.py, its `_op_sac_save_list`): on a transformer block it keeps most of
full checkpointing's saving of memory traffic-bound tensors while recomputing no FLOP-heavy op."""

from __future__ import annotations

import functools
from typing import Any

import torch

from hpcjobs.protocol.settings.trainconfig import TrainConfig


@functools.cache
def saved_ops() -> frozenset[Any]:
    """The ops whose outputs are kept: matmuls and every attention kernel this torch has (CPU and GPU variants)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> Any:
    """checkpoint's context_fn for the selective policy (a fresh pair of contexts per checkpointed call)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def checkpoint_kwargs(mode: str) -> dict[str, Any]:
    """What torch.utils.checkpoint gets beside the defaults for --ac-mode (full: nothing, it recomputes all)."""
    return {"context_fn": selective_contexts} if mode == "selective" else {}


def words(cfg: TrainConfig) -> str:
    """The start line's words for the run's checkpointing ("" without it)."""
    if not cfg.activation_checkpointing:
        return ""
    which = "every block" if cfg.ac_every == 1 else f"1 block in {cfg.ac_every}"
    return f"activation checkpointing ({cfg.ac_mode}, {which})"
