"""A bundled task's own flags and the trackers its trainer flags ask for, checked before the job is queued: the
same parser the task runs on its ranks (hpcjobs.protocol.taskflags), and the trackers' packages asked of the
Python the ranks run (hpcjobs.protocol.trackerpkgs). Torch-free, like everything the CLI imports: it adds about
what the parsers cost (bench/submit_time.py measures `submit --dry-run` before and after)."""

from __future__ import annotations

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.helpflags import asks_help
from hpcjobs.protocol.taskargs import TaskArgError
from hpcjobs.protocol.taskflags import BUNDLED
from hpcjobs.protocol.trainflags import ConfigError, parse_trainer_args


def check_task_flags(target: str, args: tuple[str, ...], python: str) -> None:
    """Refuse, as the ranks would, a flag of the bundled task `target` (its module's name) and a tracker whose
    package `python` lacks. A user's own task module passes: its flags are declared in the module, which the
    submit side does not import (the ranks check them before torch). A bad trainer flag was refused before this
    (hpcjobs.spec.check_trainer_args); `--help` is the entry's."""
    if asks_help(args):
        return
    try:
        cfg, rest = parse_trainer_args(list(args))
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
