"""DDP's gradient buckets laid out on a resumed start as they were when the run stopped: exact resume at 4+ ranks.

Why (issue 42). torch's DDP, as scripts use it (`find_unused_parameters=False`), starts every process with all
gradients in one bucket in the parameters' definition order and, once the first backward has shown the order in which
gradients become ready, rebuilds its buckets in that order (the reverse, for a plain stack of layers). An
uninterrupted run reduces step 1's gradients in the first layout and every later step's in the rebuilt one; a resumed
process starts over with the first layout, so the first step after a resume is reduced in another layout than the
same step of the uninterrupted run. Over 2 ranks that changes nothing (an all-reduce adds one pair per element, and
a + b == b + a). Over 4 or more, gloo's ring (as NCCL's) adds up each element in an order set by the chunk of the
bucket it falls in, that is by its offset: an element that moved is summed in another order and can come out one
float32 rounding unit apart, which training then carries on. Measured here (4 gloo ranks on CPU, a 6-layer MLP with
dropout and AdamW, a fresh DDP after step 30 of 60): the final weights differed in all 6 tensors and 1 of 60 losses
(3 of 60 with 2 buckets); with the layout below, 60 of 60 losses and every tensor equal. At 2 ranks, equal either
way. The same drift was seen on the test cluster with an unchanged Lightning script at 2 nodes x 2 ranks (466 of
1000 losses equal).

So, for every DDP built in a user's script that hpcjobs launched (through the import hook, trainers/integrations:
Lightning's, accelerate's, the HF Trainer's; HPCJOBS_HOOKS=0 leaves torch as it is): rank 0 writes the rebuilt
layout to the run folder (RUN/ddp-buckets.json, keyed by the shapes and dtypes of the parameters DDP reduces) at the
first save after DDP rebuilt it, and a later start of the run builds its DDP with that layout from its first step.
DDP's own rebuild after that step finds the same ready order and lays the buckets out as they already are. Not
covered: a resume from a save made before DDP rebuilt (a stop at the first step: nothing to record yet). The shared
trainer keeps its own way (trainers/trainer.py's settle_ddp_buckets: one throwaway backward at every start, so every
real step is reduced in the rebuilt layout: `settle_ddp_buckets` below), which covers that case too: it owns its loop, a
user's script does not.
A model whose parameters differ from the saved key, a DDP built with `find_unused_parameters=True` (never rebuilt:
its first layout is every start's) and a process outside a launched rank are left as torch builds them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.runfolder import RunFolder, write_json_atomic

if TYPE_CHECKING:
    import torch

    from trainers.task import Task

Layout = list[list[int]]
"""The reducer's buckets in its own order, each the indices of its parameters in DDP's parameter list."""
_unrecorded: weakref.WeakKeyDictionary[Any, tuple[Path, str]] = weakref.WeakKeyDictionary()
"""Rank 0: each DDP built in this process whose layout the run folder does not have yet, with its file and key."""


def attach(module: ModuleType) -> None:
    """Wrap `module.DistributedDataParallel.__init__` (torch.nn.parallel.distributed; once)."""
    ddp_cls = module.DistributedDataParallel
    if getattr(ddp_cls, "_hpcjobs_buckets", False):
        return
    original = ddp_cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        path = layout_file()
        if path is None:  # not a launched rank: torch as it is
            return original(self, *args, **kwargs)
        key: list[str] = []
        saved = read(path)
        with saved_layout_applied(saved, key):
            original(self, *args, **kwargs)
        if key and key[0] not in saved and int(os.environ.get("RANK", "0")) == 0:
            _unrecorded[self] = (path, key[0])

    ddp_cls.__init__ = __init__
    ddp_cls._hpcjobs_buckets = True


def layout_file() -> Path | None:
    contract = LaunchContract.current()
    return RunFolder(contract.run_dir).ddp_buckets if contract and contract.run_dir else None


def read(path: Path) -> dict[str, Layout]:
    try:
        layouts = json.loads(path.read_text()).get("layouts", {})
    except (OSError, ValueError, AttributeError):  # none yet, or not ours: torch's own layout
        return {}
    return layouts if isinstance(layouts, dict) else {}


def key_of(parameters: list[Any]) -> str:
    """What a layout belongs to: the number, order, shapes and dtypes of the parameters DDP reduces."""
    shapes = [[list(p.shape), str(p.dtype)] for p in parameters]
    return hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]


def valid(layout: Any, count: int) -> bool:
    flat = [i for bucket in layout for i in bucket] if isinstance(layout, list) else None
    return bool(flat) and all(isinstance(i, int) for i in flat or ()) and sorted(flat or ()) == list(range(count))


@contextlib.contextmanager
def saved_layout_applied(layouts: dict[str, Layout], key: list[str]) -> Iterator[None]:
    """While DDP is built: its first bucket assignment is the saved layout for these parameters, when there is one
    (DDP reverses the assignment's bucket order into the reducer's, so it is handed over reversed); `key` gets the
    parameters' key."""
    dist: Any = sys.modules["torch.distributed"]
    assign: Callable[..., Any] = dist._compute_bucket_assignment_by_size

    def first_assignment(parameters: list[Any], *args: Any, **kwargs: Any) -> Any:
        key.append(key_of(parameters))
        layout = layouts.get(key[0])
        if layout is None or not valid(layout, len(parameters)):
            return assign(parameters, *args, **kwargs)
        return [list(b) for b in reversed(layout)], [sys.maxsize] * len(layout)

    dist._compute_bucket_assignment_by_size = first_assignment
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = assign


def record() -> None:
    """Rank 0, where a save begins (trainers.checkpoint.begin, integrations.marks.mark_pending; the main thread, so
    no reducer is running): the layout of each DDP built in this process that has rebuilt its buckets since, once.
    A resume comes from a save, so a layout recorded at every save is there for every resume; a save before DDP's
    rebuild (at the first step) has none to record."""
    for ddp, (path, key) in list(_unrecorded.items()):
        data = ddp._get_ddp_logging_data()
        if getattr(ddp, "_has_rebuilt_buckets", False) and not data.get("has_rebuilt_buckets"):
            # DDP logs its runtime data before it rebuilds, in the same forward: after the second step the rebuild
            # is done but not yet logged (a save there had no layout, and a 2 x 2 job stopped at step 2 drifted).
            # Logging again now is what the third forward's start would do.
            with contextlib.suppress(Exception):  # private API: a torch that has it otherwise records nothing here
                ddp.logger.set_runtime_stats_and_log()
                data = ddp._get_ddp_logging_data()
        text = data.get("rebuilt_per_bucket_param_indices") if data.get("has_rebuilt_buckets") else None
        if not text:
            continue
        del _unrecorded[ddp]
        layout = [[int(i) for i in bucket.split()] for bucket in str(text).split(",")]
        with contextlib.suppress(OSError):  # a read-only run folder: later starts build DDP as torch does
            write_json_atomic(path, {"layouts": {**read(path), key: layout}})


def settle_ddp_buckets(net: torch.nn.Module, task: Task, dataset: Any, micro: int, device: torch.device,
                       autocast: Any, optimizer: torch.optim.Optimizer) -> None:
    """The shared trainer's way. DDP regroups its gradient buckets after the first backward, and the all-reduce sums
    each element in an order that depends on that grouping (gloo's ring with more than two ranks). A run resumed at
    step k would reduce step k+1 with the first grouping while the uninterrupted run used the regrouped one, and the
    weights would drift by a few ULPs. So every run, fresh or resumed, does one throwaway backward first (RNG states
    restored, gradients dropped): every real step then reduces with the settled grouping. (Imports torch when
    called: this module is also loaded by the import hook, before a user's script has imported torch.)"""
    from torch.utils.data import DataLoader

    from trainers.checkpoint.state import rng_state, set_rng_state
    from trainers.data import to_device

    saved = rng_state(device)
    batch = to_device(next(iter(DataLoader(dataset, batch_size=micro))), device)
    net.eval()  # no running-statistics updates; the graph (and so the bucket order) is the same
    with autocast:
        loss = task.loss(net, batch)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    net.train()
    set_rng_state(saved, device)
