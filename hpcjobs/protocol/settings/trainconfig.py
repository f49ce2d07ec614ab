"""The shared trainer's settings: one dataclass whose fields carry their schema (hpcjobs.protocol.settings.schema: what
a setting does in its docstring; its bounds or choices and its error's HINT in its metadata). Its flags, their checks,
`--help` and the table in docs/reference/trainer-flags.md are read off the fields
(hpcjobs.protocol.settings.trainflags). Shared: the ranks train with it, and the submit side checks a job's trainer
flags with the same parser before anything is queued."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
STRATEGIES = ("ddp", "fsdp")
LR_SCALING = ("none", "linear", "sqrt")
AC_MODES = ("full", "selective")
TRACKERS: dict[str, str | None] = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""--tracker's names, each with the package it needs (its pip extra of hpcjobs has the tracker's name). metrics.jsonl
(jsonl) is the Meter's own and always written; every other tracker NAME is trainers/tracking/NAME_run.py."""
PIP_NAMES: dict[str, str] = {"mlflow": "mlflow-skinny"}
"""What pip installs a tracker's package as, where that is not the package's own name (pyproject's extras)."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(default=100, metadata={"min": 1, "example": "1000"})
    """Optimizer steps to train in all (a resumed run continues up to this number)."""
    batch_size: int = field(default=8, metadata={"resume": "same", "min": 1, "example": "32"})
    """Samples per rank per optimizer step (per-GPU batch). Ignored when global_batch_size is set."""
    global_batch_size: int = field(default=0, metadata={"resume": "same", "min": 0,
                                                        "note": "0: batch size × world size", "example": "256"})
    """Samples per optimizer step across all ranks (0: batch_size × world size). Must divide by the world size."""
    grad_accum: int = field(default=1, metadata={"resume": "same", "min": 1, "example": "4"})
    """Micro-batches per optimizer step on each rank; gradients are only all-reduced on the last one (no_sync)."""
    lr: float = field(default=3e-4, metadata={"resume": "same", "min": 0, "above": True, "example": "3e-4"})
    """Peak learning rate before scaling with the world size."""
    lr_scaling: str = field(default="none", metadata={"resume": "same",
        "choices": LR_SCALING,
        "hint": "linear multiplies the LR by the world size, sqrt by its square root; none keeps it."})
    """How the LR grows with the world size: none, linear (lr × world) or sqrt (lr × √world). Logged at start."""
    warmup_steps: int = field(default=0, metadata={"resume": "same", "min": 0, "example": "100"})
    """Linear warmup steps, then cosine decay to min_lr_ratio × lr at `steps`."""
    min_lr_ratio: float = field(default=0.1, metadata={"resume": "same", "min": 0, "max": 1, "example": "0.1"})
    """Final LR as a fraction of the peak."""
    weight_decay: float = field(default=0.1, metadata={"resume": "same", "min": 0, "example": "0.1"})
    """AdamW weight decay (on matrices only, not biases or norms)."""
    grad_clip: float = field(default=1.0, metadata={"resume": "same", "min": 0, "note": "0: no clipping",
                                                     "example": "1.0"})
    """Clip the gradient norm to this (0: no clipping)."""
    precision: str = field(default="auto", metadata={"resume": "same",
        "choices": PRECISIONS,
        "hint": "auto picks bf16 on GPUs that have it and fp32 elsewhere; fp16 adds a GradScaler."})
    """auto (bf16 on GPUs that have it, else fp32), fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."""
    # The highest seed: torch's generators take < 2**64, and the sampler adds the epoch.
    seed: int = field(default=0, metadata={"resume": "same", "min": 0, "max": 2**63 - 1, "example": "0"})
    """Seed for weights, data order and dropout; each rank's RNG states are checkpointed for exact resume."""
    log_every: int = field(default=10, metadata={"min": 1, "example": "10"})
    """Steps between log lines, metrics.jsonl records and heartbeats (the only host-device syncs)."""
    ckpt_every: int = field(default=100, metadata={"min": 0, "note": "0: only at the end and on a stop",
                                                   "example": "100"})
    """Steps between periodic checkpoints (0: only at the end and on a stop request)."""
    local_ckpt_every: int | str = field(default="auto", metadata={"min": 0, "note": "0: off", "choices": ("auto",),
                                                             "example": "5"})
    """Steps between node-local checkpoints (/dev/shm, a replica on a peer node; 0: off): a fault in the allocation
    resumes from the newest step every rank has there when it is newer than the shared checkpoint. auto: the most
    frequent interval whose measured cost stays within 2 percent of the step time (first save at step 10; off, said
    in one line, where its copies do not fit the node's memory)."""
    keep: int = field(default=2, metadata={"min": 2, "note": "the newest checkpoint is never the only copy",
                                           "example": "2"})
    """Finished checkpoints to keep (at least 2)."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest val_loss (RUN/checkpoints/best.json names it; never pruned)."""
    eval_every: int = field(default=0, metadata={"min": 0, "note": "0: never", "example": "100"})
    """Steps between evaluations of the task's validation set, all ranks' shards averaged (0: never)."""
    stop_check_every: int = field(default=0, metadata={
        "min": 0, "note": "0: about once a second, from the measured step time", "example": "1"})
    """Steps between the ranks' agreement on a stop request (one CPU all-reduce of one int, in the background: a stop
    takes effect at the check after the one that saw it). 0: about once a second of training, from the step time
    measured over this start's first steps (the slowest rank's; every rank checks at the same steps)."""
    num_workers: int = field(default=0, metadata={"min": 0, "example": "4"})
    """DataLoader worker processes per rank, kept across epochs. With workers, each sample's randomness (data
    augmentation) is seeded from the seed, the epoch and its index, so results do not depend on how many workers
    there are or on where a resume began; without, it draws from the rank's checkpointed RNG (also exact, but other
    values than with workers)."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace, no TF32, deterministic SDPA):
    needed for a bit-exact resume on GPUs; slower (bench/gpu.py measures by how much)."""
    compile: bool = False
    """torch.compile the model (with fsdp: each block), off by default; the first steps take longer while it
    compiles."""
    fp8: bool = False
    """Float8 training of the linear layers (torchao's float8, dynamic scaling; with fsdp the parameters are also
    all-gathered in float8): on GPUs with float8 tensor cores (H100/H200-class, compute capability 8.9+) with torchao
    installed (pip install torchao); refused in one line elsewhere. Layers whose dimensions are not multiples
    of 16 stay in the run's precision."""
    strategy: str = field(default="ddp", metadata={
        "choices": STRATEGIES,
        "hint": "fsdp shards a model that does not fit on one GPU; ddp is faster when it fits."})
    """ddp: every rank holds the whole model, gradients are all-reduced. fsdp: FSDP2 shards parameters, gradients and
    optimizer state over the ranks (each holds 1/world; a block's parameters are gathered while it runs): for models
    whose weights, gradients and AdamW state (~16 bytes/parameter) do not fit on one GPU."""
    cpu_offload: bool = False
    """fsdp on GPUs: keep the sharded parameters, gradients and optimizer state in host memory (FSDP2's
    CPUOffloadPolicy); the optimizer step runs on the CPU."""
    meta_init: bool = True
    """fsdp with more than one rank: only rank 0 builds the model in host memory; the others build it on the meta
    device (no memory), shard it, and receive their shards and buffers from rank 0, one tensor at a time. A node
    then holds one full copy of the model while the job starts instead of one per rank (8 × 28 GB for a 7B model in
    fp32 on an 8-GPU node). The weights are the same either way. --no-meta-init builds it on every rank, for a
    task whose model() must compute with real tensors (e.g. calls .item() on one)."""
    reduce_each_micro_batch: bool = True
    """fsdp with --grad-accum above 1: reduce-scatter the gradients after every micro-batch (the default, as
    torchtitan does), so each rank only ever holds its shard of them. --no-reduce-each-micro-batch reduces once per
    step, on the last micro-batch: one collective instead of --grad-accum, but until then each rank holds an
    unsharded fp32 gradient of the whole model (4 bytes per parameter: 28 GB for a 7B model). ddp reduces once per
    step either way."""
    reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward and gather them again for its backward (FSDP2's
    reshard_after_forward). --no-reshard-after-forward keeps them gathered from the forward to the backward: one
    all-gather a block per step instead of two, for the memory of every block's whole parameters (ZeRO-2-like)."""
    replicate_degree: int = field(default=1, metadata={"min": 1, "note": "1: shard over all ranks",
                                                       "example": "2"})
    """fsdp: hybrid sharding (HSDP) over a 2-D mesh of replicate_degree × (world / replicate_degree) ranks: each
    group of world / replicate_degree consecutive ranks shards the model, and the groups hold replicas whose
    gradients are all-reduced. With the number of nodes (e.g. 2 on 2 × 8 GPUs) the sharding collectives stay inside
    a node (NVLink) and only one all-reduce of the shards crosses the slower fabric. Must divide the world size."""
    activation_checkpointing: bool = False
    """Recompute blocks' activations in the backward instead of keeping them (both strategies): less memory, more
    compute (about a third more with --ac-mode full on every block). Which blocks and which activations:
    --ac-every, --ac-mode."""
    ac_mode: str = field(default="full", metadata={
        "choices": AC_MODES,
        "hint": "full recomputes the whole block (least memory); selective keeps the matmuls' and attention's "
                "outputs and recomputes the cheap rest (norms, activations, dropout)."})
    """With --activation-checkpointing: full (keep only each checkpointed block's input, recompute the rest) or
    selective (keep the outputs of the matrix multiplications and attention, recompute the elementwise ops: most of
    the saving at a fraction of the recompute; torchtitan's op-level selective checkpointing)."""
    ac_every: int = field(default=1, metadata={"min": 1, "note": "1: every block", "example": "2"})
    """With --activation-checkpointing: checkpoint every N-th block only (the others keep their activations): a
    step between no checkpointing and all of it (torchtitan's layer-level selective checkpointing)."""
    async_save: bool = True
    """Periodic checkpoints are written in the background: training waits only while the state is copied to host
    memory. At most one save is in flight; a stop and the end of training wait for it, then save in the foreground.
    A save that has to wait for the one before it (saves come faster than one is written) says so once in the log,
    with the `--ckpt-every` that would not wait; `saves.jsonl` records the wait as `waited_s`."""
    reshard: bool = False
    """Resume a checkpoint written by another number of ranks (or the other --strategy): weights, optimizer,
    scheduler and step exactly, the data position by samples consumed; per-rank RNG streams start anew. Without it
    such a resume is refused."""
    tracker: str = field(default="jsonl", metadata={
        "choices": tuple(TRACKERS), "multiple": True,
        "hint": "metrics.jsonl is always written; e.g. --tracker wandb,tensorboard logs to those as well."})
    """Where rank 0 logs the metrics: jsonl (RUN/metrics.jsonl, always written), tensorboard (RUN/tensorboard),
    wandb (RUN/wandb; offline unless W&B credentials or WANDB_MODE say otherwise), mlflow (MLFLOW_TRACKING_URI, else
    a file store in RUN/mlruns); several joined by commas (wandb,tensorboard). A requeued or resumed run goes on
    logging into the same tracker run (RUN/tracker.json holds its id); trainers/tracking.py says more."""
    extend: bool = False
    """Resume a checkpoint written under another --steps: the LR then goes on from the value the checkpoint was saved
    with (its step k) down to min_lr_ratio × lr at the new --steps along a half cosine over steps k..steps (a
    checkpoint still in warmup simply follows the plan for the new --steps: the warmup does not depend on it).
    Without it a changed --steps is refused, since the cosine would be re-planned and the LR would jump."""

    def trackers(self) -> tuple[str, ...]:
        """--tracker's names in the order given, each once; jsonl among them or not (it is always written)."""
        return tuple(dict.fromkeys(name.strip() for name in self.tracker.split(",") if name.strip()))

    def checkpoints_every_block(self) -> bool:
        """Whether every block is checkpointed (fully or selectively): what the memory plan models as checkpointing
        (an every-N-th checkpointing is planned as none, an upper bound)."""
        return self.activation_checkpointing and self.ac_every == 1

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

    RESUME_KEYS: ClassVar[tuple[str, ...]] = ()
    """The settings that change what training computes (metadata `resume: same`): a checkpoint written under other
    values is refused. Filled in below from the fields."""


TrainConfig.RESUME_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("resume") == "same")
