"""Run a task with the shared trainer on this rank: parse the trainer's flags, load the task, join the group."""

from __future__ import annotations

import sys

from hpcjobs.contract import LaunchContract
from hpcjobs.runfolder import RunFolder
from hpcjobs.states import FinalState
from trainers.config import ConfigError, parse_trainer_args, trainer_help
from trainers.dist import distributed
from trainers.task import load_task
from trainers.trainer import train

HELP = ("-h", "--help")
BAD_FLAGS_EXIT = 2
"""Exit code of a rank refused its trainer flags: a usage error, as argparse's, not a crash."""


def run_task(task_ref: str, args: list[str], run: RunFolder, contract: LaunchContract | None = None) -> int:
    """Train `task_ref` with `args` (trainer flags and the task's own, in any order); returns the exit code."""
    try:
        _, task_args = parse_trainer_args(args)
        if any(a in HELP for a in task_args):
            return show_help(task_ref, task_args)
        task = load_task(task_ref, task_args)
        cfg, _ = parse_trainer_args(args, task.defaults)  # the task's suggestions under the flags given
    except ConfigError as e:
        print(f"hpcjobs: {e}", file=sys.stderr, flush=True)
        run.write_final(FinalState.FAILED, f"trainer flag {e}")
        return BAD_FLAGS_EXIT
    with distributed() as ctx:
        return train(task, cfg, run, ctx, contract)


def show_help(task_ref: str, task_args: list[str]) -> int:
    """The trainer's flags, then the task's own (a task whose parser handles --help prints them and exits)."""
    print(trainer_help(), flush=True)
    try:
        load_task(task_ref, task_args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    return 0
