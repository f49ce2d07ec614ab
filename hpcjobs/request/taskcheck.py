"""An entry's flags, checked before the job is queued, as its ranks would check them: the shared trainer's flags
(hpcjobs.protocol.settings.trainflags, with the request's ranks), a bundled task's own flags with the same parser the
task runs on its ranks (hpcjobs.protocol.settings.taskflags), and the trackers' packages asked of the Python the ranks
run (hpcjobs.protocol.trackerpkgs). Torch-free, like everything the CLI imports: bench/submit_time.py measured
`submit --dry-run` at 204 ms before the bundled tasks' check and after it."""

from __future__ import annotations

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.settings.helpflags import asks_help
from hpcjobs.protocol.settings.taskargs import TaskArgError
from hpcjobs.protocol.settings.taskflags import BUNDLED, task_defaults
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, check_world, parse_trainer_args, task_args_of


def check_task_flags(target: str, args: tuple[str, ...], python: str) -> None:
    """Refuse, as the ranks would, a flag of the bundled task `target` (its module's name) and a tracker whose
    package `python` lacks. A user's own task module passes: its flags are declared in the module, which the
    submit side does not import (the ranks check them before torch). A bad trainer flag was refused before this
    (check_trainer_args); `--help` is the entry's."""
    if asks_help(args):
        return
    try:
        rest = task_args_of(list(args))
        cfg, _ = parse_trainer_args(list(args), task_defaults(target, rest))
    except ConfigError:
        return  # said by check_trainer_args
    flags = BUNDLED.get(target)
    try:
        if flags is not None:
            flags.parse(rest)
        from hpcjobs.protocol.trackerpkgs import require

        require(cfg.trackers(), python)
    except (TaskArgError, ConfigError) as e:
        message, _, hint = str(e).partition(" HINT: ")
        raise UsageError(message, hint or f"`hpcjobs submit --profile local {target} --help` lists its flags.") \
            from None


def check_trainer_args(args: tuple[str, ...], ranks: int | None = None, target: str = "") -> None:
    """The shared trainer's flags among a task's arguments, checked here as the node would check them, so a bad one
    is refused before the job waits in the queue (hpcjobs.protocol.settings.trainflags, torch-free): under the settings
    bundled task `target` suggests for its flags (the lm's size preset), as the node applies them before it judges.
    The task's own flags pass. With `ranks`, a batch the flags split unevenly over the ranks or micro-batches is
    refused too (only where the flags or a bundled task decide it: a user's task's default batch is known on the
    node only)."""
    try:
        cfg, _ = parse_trainer_args(list(args), task_defaults(target, task_args_of(list(args))))
        if ranks is not None:
            check_world(cfg, ranks)
    except ConfigError as e:
        message, _, hint = str(e).partition(" HINT: ")
        raise UsageError(f"trainer flag {message}", hint or "`python -m trainers.launch --run-dir DIR --kind task "
                         "-- trainers.tasks.lm --help` lists the trainer's flags.") from None
    if ranks is not None and (cfg.global_batch_size or cfg.batch_size != TrainConfig().batch_size):
        try:
            cfg.micro_batch(ranks)
        except ValueError as e:
            raise UsageError(f"trainer flags with {ranks} rank(s): {e}; valid: a global batch that divides by the "
                             "ranks, and a per-rank batch that divides by --grad-accum.",
                             f"e.g. --global-batch-size {ranks * max(cfg.grad_accum, 1) * 4}") from None
