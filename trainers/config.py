"""The trainer's settings: one dataclass, a docstring per field, flags derived from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
LR_SCALING = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps to train in all (a resumed run continues up to this number)."""
    batch_size: int = 8
    """Samples per rank per optimizer step (per-GPU batch). Ignored when global_batch_size is set."""
    global_batch_size: int = 0
    """Samples per optimizer step across all ranks (0: batch_size × world size). Must divide by the world size."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank; gradients are only all-reduced on the last one (no_sync)."""
    lr: float = 3e-4
    """Peak learning rate before scaling with the world size."""
    lr_scaling: str = "none"
    """How the LR grows with the world size: none, linear (lr × world) or sqrt (lr × √world). Logged at start."""
    warmup_steps: int = 0
    """Linear warmup steps, then cosine decay to min_lr_ratio × lr at `steps`."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay (on matrices only, not biases or norms)."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this (0: no clipping)."""
    precision: str = "auto"
    """auto (bf16 on GPUs that have it, else fp32), fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."""
    seed: int = 0
    """Seed for weights, data order and dropout; each rank's RNG states are checkpointed for exact resume."""
    log_every: int = 10
    """Steps between log lines, metrics.jsonl records and heartbeats (the only host-device syncs)."""
    ckpt_every: int = 100
    """Steps between periodic checkpoints (0: only at the end and on a stop request)."""
    keep: int = 2
    """Finished checkpoints to keep (at least 2)."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest val_loss (RUN/checkpoints/best.json names it; never pruned)."""
    eval_every: int = 0
    """Steps between evaluations of the task's validation set, all ranks' shards averaged (0: never)."""
    stop_check_every: int = 1
    """Steps between the ranks' agreement on a stop request (one CPU all-reduce of one int, in the background:
    a stop takes effect at the check after the one that saw it)."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to RUN/tensorboard (needs the tensorboard package)."""

    def lr_factor(self, world_size: int) -> float:
        return {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[self.lr_scaling]

    def per_rank_batch(self, world_size: int) -> int:
        if self.global_batch_size:
            if self.global_batch_size % world_size:
                raise ValueError(f"global_batch_size {self.global_batch_size} does not divide by the world size "
                                 f"{world_size}")
            return self.global_batch_size // world_size
        return self.batch_size

    def micro_batch(self, world_size: int) -> int:
        per_rank = self.per_rank_batch(world_size)
        if per_rank % self.grad_accum:
            raise ValueError(f"the per-rank batch {per_rank} does not divide into grad_accum={self.grad_accum} "
                             "micro-batches")
        return per_rank // self.grad_accum

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Settings that change what training computes: a checkpoint written under other values is refused.
    RESUME_KEYS = ("batch_size", "global_batch_size", "grad_accum", "lr", "lr_scaling", "warmup_steps",
                   "min_lr_ratio", "weight_decay", "grad_clip", "precision", "seed")


def _field_docs() -> dict[str, str]:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)  # type: ignore[union-attr]
    return docs


def add_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    docs = _field_docs()
    defaults = defaults or {}
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        help_ = f"{docs.get(f.name, '')} (default: {default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        choices = {"precision": PRECISIONS, "lr_scaling": LR_SCALING}.get(f.name)
        parser.add_argument(flag, type=kind, default=default, choices=choices, help=help_)


def from_namespace(ns: argparse.Namespace) -> TrainConfig:
    cfg = TrainConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)})
    for name in ("steps", "batch_size", "grad_accum", "log_every", "stop_check_every"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: valid: 1 or more")
    if cfg.keep < 2:
        raise ValueError(f"--keep {cfg.keep}: valid: 2 or more (the newest checkpoint is never the only copy)")
    if cfg.eval_every < 0:
        raise ValueError(f"--eval-every {cfg.eval_every}: valid: 0 (never) or more")
    if cfg.keep_best and not cfg.eval_every:
        raise ValueError("--keep-best without --eval-every: valid: --keep-best --eval-every N (best by val_loss); "
                         "HINT: add --eval-every 100")
    return cfg
