"""Run a task with the shared trainer on this rank: parse the trainer's flags, load the task, join the group. Also
`task_help`, which shows the flags, and `check_task`, which says what a rank would refuse; both touch nothing."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.rejoin import generation as rejoin_gen
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.settings.helpflags import HELP_FLAGS
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args, task_args_of, trainer_help
from trainers import ranklog, watchdog
from trainers.dist import distributed
from trainers.distenv import DistEnv, from_environ
from trainers.failures import one_line, record_rank_failure
from trainers.rejoin import PeerLost, expected, next_call
from trainers.task import Task, TaskArgError, load_task
from trainers.trainer import train


def run_task(task_ref: str, args: list[str], run: RunFolder, contract: LaunchContract | None = None,
             env: DistEnv | None = None, again: Callable[[DistEnv], None] | None = None) -> int:
    """Train `task_ref` with `args` (trainer flags and the task's own, in any order); returns the exit code. Raises
    ConfigError for a trainer flag or a resume that cannot be used (the launcher refuses the start: one line, exit 2,
    nothing recorded) and TaskArgError for a task flag. `env`: the launcher's DistEnv (its job environment chosen at
    the start), else read from os.environ. Where the launcher replaces a lost rank (trainers.rejoin), this rank keeps
    its process: it joins the new generation's group and trains again from the newest step every rank has, after
    `again(env)` (the launcher's new start: its log, its record)."""
    task_args = task_args_of(args)  # judged below, under the task's defaults
    if any(a in HELP_FLAGS for a in task_args):
        return task_help(task_ref)
    task = load_task_checked(task_ref, task_args)
    cfg, _ = parse_trainer_args(args, task.defaults)  # the task's suggestions under the flags given
    env = env or from_environ(os.environ)
    gen = rejoin_gen()
    while True:
        try:
            return train_in_group(task, cfg, run, contract, env, gen)
        except PeerLost as lost:
            called = next_call(run, env, gen, lost)
            if called is None:  # the launcher starts every rank again, or ends the job: fail as before
                record_rank_failure(lost.cause, env, run)
                raise lost.cause from None
            gen, env = called[0].gen, called[1]
            if again is not None:
                again(env)


def train_in_group(task: Task, cfg: TrainConfig, run: RunFolder, contract: LaunchContract | None, env: DistEnv,
                   gen: int) -> int:
    """One generation of the rank's process group (the first, or one formed again after a replacement)."""
    with distributed(trace_prefix=run.nccl_traces / "rank-", group_of_one=cfg.strategy == "fsdp",
                     cpu_collectives=cfg.cpu_offload, env=env, again=(run, gen)) as ctx, \
            watchdog.armed(run, ctx.env, contract):
        try:
            return train(task, cfg, run, ctx, contract)
        except ConfigError:
            raise  # a refused start, not a failure
        except Exception as e:
            if expected(e):  # a peer lost: recorded only if the launcher does not replace it
                raise PeerLost(e) from e
            record_rank_failure(e, ctx.env, run)  # recorded while the group still stands, then passed on
            raise
        except BaseException as e:
            record_rank_failure(e, ctx.env, run)
            raise


def load_task_checked(task_ref: str, task_args: list[str]) -> Task:
    """load_task, where a task whose own argparse parser exits on a bad flag (a usage block and SystemExit(2), once
    per rank) raises one TaskArgError line instead; what the task printed otherwise is passed on."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            task = load_task(task_ref, task_args)
    except SystemExit as e:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        why = e.code if isinstance(e.code, str) else lines[-1] if lines else f"exit code {e.code}"
        raise TaskArgError(f"{task_ref} refused its arguments {task_args}: {why}") from None
    except BaseException:
        sys.stderr.write(said.getvalue())
        raise
    sys.stderr.write(said.getvalue())
    return task


def check_task(task_ref: str, args: list[str]) -> str | None:
    """What a rank would refuse before it builds anything, as one line, or None if it would start: the trainer's
    flags, the task's module (its own imports included: a package missing on the nodes), and the task's flags as its
    make_task reads them (e.g. a --size misspelt, or one that needs CUDA where there is none). Builds no model or
    data, joins no group, writes nothing: `hpcjobs doctor --probe` runs it on a node, where the job's Python and
    GPUs are."""
    try:
        task_args = task_args_of(args)  # judged below, under the task's defaults
        if any(a in HELP_FLAGS for a in task_args):
            return None  # a rank shows the flags
        task = load_task_checked(task_ref, task_args)
        parse_trainer_args(args, task.defaults)
    except Exception as e:  # noqa: BLE001 -- whatever make_task raises, a rank would fail at its start with it
        said = one_line(e)  # as a rank's refusal reads
        if isinstance(e, ImportError):
            return f"task {task_ref} cannot be imported ({type(e).__name__}: {said})"
        return said if isinstance(e, ValueError) else f"{task_ref} failed to load ({type(e).__name__}: {said})"
    return None


def task_help(task_ref: str) -> int:
    """The trainer's flags, then the task's own (its parser prints them for --help). Imports the task's module and
    nothing else: no run folder, no process group."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            load_task(task_ref, ["--help"])
        own = f"{task_ref} takes no flags of its own.\n"
    except SystemExit as e:
        own = out.getvalue() if e.code in (0, None) else f"{task_ref} has no --help of its own.\n"
    except TaskArgError:
        own = f"{task_ref} has no --help of its own.\n"
    except ImportError as e:
        ranklog.warn(f"hpcjobs: task {task_ref} cannot be imported ({type(e).__name__}: {e}). HINT: run from the "
                     "folder that holds it, or check its name", every_rank=True)
        return 2
    print(trainer_help(), flush=True)
    print(f"task flags ({task_ref}):\n{own}", end="", flush=True)
    return 0
