"""The bundled tasks' own flags (trainers.tasks.lm, .lora, .classifier), declared without torch: each task module
parses its arguments with the parser built here, and `hpcjobs submit`/`render` run the same parser (and the checks
that need no model) before anything is queued or created. A wrong `--size`, an unknown `--foo` or `--seq-len -1`
is then one line on the login node, not a job that waits in the queue and fails on its nodes 15-21 s after it
starts (measured with the local profile before this module existed).

A user's own task module declares its flags in the module itself (it may import torch); the submit side cannot read
those without importing it, so its flags are checked by the ranks at their start, before torch (trainers.launch)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcjobs.protocol.planning.lmsizes import SIZES, size_defaults
from hpcjobs.protocol.settings.helpflags import asks_help
from hpcjobs.protocol.settings.taskargs import Number, TaskArgError, TaskArgParser

LORA_TARGETS = ("qkv", "proj", "fc", "out")
"""The Linear layers of the LM's block that LoRA can adapt (a test checks them against trainers.tasks.lm.Block)."""

DROPOUT = Number(float, low=0, high=1, below=True)
COUNT = Number(int, low=1)


def add_data_flags(p: TaskArgParser) -> None:
    """--text, --seq-len, --samples: the flags trainers.tasks.lm's datasets read (lora has them too)."""
    p.add_argument("--text", type=Path, help="train on this text file's bytes instead of synthetic tokens "
                   "(memory-mapped: the ranks of a node share one copy)")
    p.add_argument("--seq-len", type=COUNT, help="context length (default: the size's)")
    p.add_argument("--samples", type=COUNT, default=8192, help="synthetic windows in the dataset")


def lm_parser() -> TaskArgParser:
    p = TaskArgParser(prog="trainers.tasks.lm")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    add_data_flags(p)
    p.add_argument("--dropout", type=DROPOUT, default=0.0)
    return p


def lora_parser() -> TaskArgParser:
    p = TaskArgParser(prog="trainers.tasks.lora")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--base", type=Path, help="the base weights: a .pt or .safetensors file from `hpcjobs export` of "
                                             "a trainers.tasks.lm run of this --size (default: random, --base-seed)")
    p.add_argument("--base-seed", type=Number(int, low=0), default=0,
                   help="seed of the random base weights without --base")
    p.add_argument("--rank", type=COUNT, default=8, help="the adapters' rank r")
    p.add_argument("--alpha", type=Number(float), default=16.0, help="the update is scaled by alpha / rank")
    p.add_argument("--targets", default="qkv,proj",
                   help=f"comma-separated Linear layers of each block to adapt, of {','.join(LORA_TARGETS)}")
    p.add_argument("--lora-dropout", type=DROPOUT, default=0.0, help="dropout on the adapters' input")
    add_data_flags(p)
    return p


def check_lora(ns: argparse.Namespace) -> None:
    """What lora's flags must be together: known targets, and a rank no wider than the model."""
    prog, width = "trainers.tasks.lora", SIZES[ns.size].d_model
    unknown = [t for t in (t.strip() for t in ns.targets.split(",")) if t not in LORA_TARGETS]
    if unknown:
        raise TaskArgError(f"{prog}: --targets {ns.targets}: {unknown[0]!r} is not a Linear layer of a block; "
                           f"valid: comma-separated names of {', '.join(LORA_TARGETS)}. HINT: e.g. --targets "
                           f"{','.join(LORA_TARGETS)} adapts every matrix of each block")
    if not 1 <= ns.rank <= width:
        raise TaskArgError(f"{prog}: --rank {ns.rank} is out of range; valid: --rank R with 1 ≤ R ≤ {width} "
                           "(the width). HINT: 4 to 64 is usual")


def classifier_parser() -> TaskArgParser:
    p = TaskArgParser(prog="trainers.tasks.classifier")
    p.add_argument("--features", type=COUNT, default=32)
    p.add_argument("--classes", type=Number(int, low=2), default=10)
    p.add_argument("--hidden", type=COUNT, default=256)
    p.add_argument("--dropout", type=DROPOUT, default=0.1)
    p.add_argument("--samples", type=COUNT, default=8192)
    p.add_argument("--noise", type=Number(float, low=0), default=0.0,
                   help="std of Gaussian noise added to each training input")
    return p


@dataclass(frozen=True)
class TaskFlags:
    """A bundled task's flags: its parser, and the checks of flags together that need no model."""

    parser: Callable[[], TaskArgParser]
    check: Callable[[argparse.Namespace], None] | None = None
    defaults: Callable[[argparse.Namespace], dict[str, Any]] = lambda ns: {}
    """The trainer settings the task suggests for these flags (its Task.defaults: the lm's size preset), which the
    trainer's flags are judged with on both sides."""

    def parse(self, args: list[str]) -> argparse.Namespace:
        """The task's flags, checked; TaskArgError (one line) for one the task would refuse."""
        ns = self.parser().parse_args(args)
        if self.check is not None:
            self.check(ns)
        return ns


BUNDLED: dict[str, TaskFlags] = {
    "trainers.tasks.lm": TaskFlags(lm_parser, defaults=lambda ns: size_defaults(ns.size)),
    "trainers.tasks.lora": TaskFlags(lora_parser, check_lora, defaults=lambda ns: {"lr": 1e-3}),
    "trainers.tasks.classifier": TaskFlags(classifier_parser, defaults=lambda ns: {"lr": 1e-3, "batch_size": 32}),
}
"""Each bundled task module's flags, by the module's name (the entry `hpcjobs submit` resolves a task to)."""


def task_defaults(target: str, task_args: list[str]) -> dict[str, Any]:
    """The trainer settings bundled task `target` starts from with its flags `task_args` (what its make_task gives
    as Task.defaults); none for a user's task (the submit side cannot read its module) or flags it refuses (the
    task's flag check says why)."""
    flags = BUNDLED.get(target)
    if flags is None or asks_help(task_args):  # --help is the entry's: parsing it here printed the task's and exited
        return {}
    try:
        return flags.defaults(flags.parse(task_args))
    except TaskArgError:
        return {}
