"""The task API: what a user gives the shared trainer. Porting a script means moving three pieces in here.

    # mytask.py
    from trainers.task import Task

    def make_task(args: list[str]) -> Task:
        return Task(
            name="mnist-mlp",
            model=lambda: MyNet(),                               # an nn.Module, built on every rank
            train_data=lambda: MyDataset("data/"),              # a map-style Dataset (sharded by the trainer)
            loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
            config={"hidden": 512},                              # what must match to resume from a checkpoint
        )

    hpcjobs submit --profile mycluster --nodes 2 --gpus 8 mytask --steps 1000 --batch-size 32
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from hpcjobs.protocol.planning.memory_plan import Plan, Setup
from hpcjobs.protocol.settings.taskargs import (
    TaskArgError as TaskArgError,  # a task's own flags: re-exported for task modules
)
from hpcjobs.protocol.settings.taskargs import TaskArgParser as TaskArgParser


@dataclass
class Task:
    name: str
    """Shown in logs and stored in checkpoints."""
    model: Callable[[], nn.Module]
    """Builds the model (on the CPU; the trainer moves it to the rank's device). Under --strategy fsdp with more
    than one rank, only rank 0 builds it for real: the others call it under `torch.device("meta")` and receive their
    shards from rank 0 (--no-meta-init: every rank builds it)."""
    train_data: Callable[[], Dataset[Any]]
    """Builds the training set: a map-style Dataset whose items the default collate can batch."""
    loss: Callable[[nn.Module, Any], torch.Tensor]
    """loss(model, batch) -> scalar tensor; batch is already on the device; runs under autocast."""
    config: dict[str, Any] = field(default_factory=dict)
    """The task's own settings; a checkpoint from different settings is refused."""
    val_data: Callable[[], Dataset[Any]] | None = None
    """Builds the validation set (optional); with --eval-every N its mean loss is logged as val_loss."""
    optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer] | None = None
    """optimizer(params, lr) -> Optimizer; default AdamW with decoupled weight decay on matrices only."""
    tokens_per_sample: int = 0
    """If > 0, logs report tokens/s as well as samples/s."""
    flops_per_sample: float = 0.0
    """Training FLOPs (forward and backward) per sample; if > 0, logs report the model FLOPs utilisation (MFU) on
    GPUs whose peak is known (trainers.perf.PEAK_TFLOPS)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Trainer settings this task suggests (e.g. lr); flags on the command line still win."""
    parallelize: Callable[[nn.Module, Any], None] | None = None
    """parallelize(model, shard): the task's own FSDP2 sharding under --strategy fsdp, calling shard(module) on the
    modules it wants sharded one by one (the trainer shards the root after). shard (trainers.sharding.Sharding)
    carries the run's mesh, mixed-precision and offload policies, and compiles the module first under --compile
    (returning the compiled wrapper the model now holds); shard.kwargs are fully_shard's keywords, for grouping
    several modules into one unit. Default: each entry of the ModuleList holding most parameters
    (trainers.strategy.units)."""
    save_frozen: bool = True
    """False: checkpoints and `hpcjobs export` hold only the parameters that train (requires_grad) and the buffers,
    e.g. a LoRA task's adapters; model() must then rebuild the frozen ones identically on every start."""
    memory_plan: Callable[[Setup], Plan] | None = None
    """memory_plan(setup): this task's peak bytes per rank under the run's settings
    (hpcjobs.protocol.planning.memory_plan), shown on the start line beside what the GPU will measure (metrics.jsonl's
    peak_mem_gib). None: not shown."""


def load_task(ref: str, args: list[str]) -> Task:
    """`module:callable` or `module` (which must define make_task(args) or a `task`)."""
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    obj = getattr(module, attr) if attr else getattr(module, "make_task", None) or getattr(module, "task", None)
    if obj is None:
        raise ValueError(f"task module {module_name!r} defines neither make_task(args) nor task; "
                         "HINT: add `def make_task(args): return Task(...)` (see trainers/task.py)")
    task = obj(args) if callable(obj) and not isinstance(obj, Task) else obj
    if not isinstance(task, Task):
        raise ValueError(f"{ref} gave a {type(task).__name__}, not a trainers.task.Task")
    return task
