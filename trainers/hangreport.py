"""What a firing hang watchdog (trainers/watchdog.py) leaves before its rank exits with HANG_EXIT: every thread's
stack in RUN/stacks/restart-N/rank-R.txt (unless faulthandler's C timer already dumped them there), the failure's
line under them, LATE_NOTE when the hang was found late, one line on stderr naming the file, and the rank's failure
record (trainers/failures.py) that the job's recovery reads. Split from watchdog.py (354 lines, at the size cap's
edge): the watchdog decides when, this says what. Runs on a thread of its own that the watchdog waits for at most
LEAVE_WORD_S: a filesystem that hangs must not keep the rank from exiting. Torch-free.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path
from typing import IO

from hpcjobs.protocol.runfolder import RunFolder
from trainers import ranklog
from trainers.distenv import DistEnv

LATE_NOTE = ("Found at the rank's next mark, once it ran again (stopped by SIGSTOP and continued, or its watchdog "
             "thread starved): the main thread's stack is where it went on from; the step it last finished says "
             "where it stopped.\n")


def leave_word(why: str, late: bool, file: IO[str] | None, path: Path, env: DistEnv, run: RunFolder,
               step: int | None, idle_s: float | None = None) -> None:
    """The stacks and `why` into `file` (the open stack file at `path`), the stderr line, the failure record (with
    `idle_s`, the seconds since the rank's last progress: goodput's time to notice the hang)."""
    from trainers.failures import record_rank_error
    from trainers.logtee import Tee

    if file is not None:
        if os.fstat(file.fileno()).st_size == 0:  # the C timer has not dumped them
            faulthandler.dump_traceback(file, all_threads=True)
        file.write(f"\n{why}\n")
        if late:
            file.write(LATE_NOTE)
        file.flush()
    ranklog.warn(f"hpcjobs: rank {env.rank}: {why}; every thread's stack in {path}", every_rank=True)
    record_rank_error(why, env, run, step=step, stacks=str(path), **({} if idle_s is None else {"idle_s": idle_s}))
    sys.stdout.flush()
    if Tee.active is not None:
        Tee.active.log_only("")  # the pipe drained into the log before the exit
